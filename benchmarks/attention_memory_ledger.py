"""Where attention's forward and backward peak memory goes, tensor by tensor, on a CPU; and the least
peak any implementation can have under the benchmark's measurement.

bench_attention.py measures the peak of ``torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)``
on a GPU, above q, k, v and grad_out, at its longest sequence (batch 4, 16 heads, N 16384,
bfloat16). This script runs our default (``split``) backward the same way on CPU tensors of that
shape with the launches stubbed (memory_ledger.py) and prints what is alive at the peak. The output
and the three gradients are alive together whatever the implementation: the caller holds the
output until ``grad`` returns, and ``grad`` returns all three gradients. Their bytes are therefore
a floor for every implementation, SDPA's backends included; the script sets it, and our ledger,
against SDPA flash's stored GPU peak (``book/data/attention_bench.json``):

    python benchmarks/attention_memory_ledger.py
"""
import json
import pathlib
import sys

import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from bench_attention import BATCH, HEADS  # noqa: E402  the benchmark's batch and heads
from memory_ledger import MiB, Ledger, launches_stubbed, print_ledger  # noqa: E402
from mamba_annotated import runtime  # noqa: E402
from mamba_annotated.attention.teaching import attention_variant  # noqa: E402  what the benchmark calls

STORED_RUN = BENCHMARKS.parent / "book" / "data" / "attention_bench.json"


def forward_backward_ledger(seqlen, head_dim, causal, batch=BATCH, heads=HEADS) -> tuple:
    """(ledger, floor in bytes) of forward and backward as bench_attention.py measures it."""
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.empty(shape, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad_out = torch.empty(shape, dtype=torch.bfloat16)
    ledger = Ledger()
    with launches_stubbed(), ledger:
        torch.autograd.grad(attention_variant(q, k, v, causal, backward="split"), (q, k, v), grad_out)
    floor = grad_out.nbytes + q.nbytes + k.nbytes + v.nbytes  # the output, dq, dk and dv
    return ledger, floor


def stored_peak(impl, head_dim, seqlen, causal):
    """The GPU peak (MiB) the stored run measured for ``impl``, or None."""
    for row in json.loads(STORED_RUN.read_text())["rows"]:
        if (row["impl"], row["d"], row["N"], row["causal"]) == (impl, head_dim, seqlen, causal):
            return row["peak_mib"]
    return None


def main():
    if not runtime.INTERPRETED:
        sys.exit("attention_memory_ledger: needs Triton's interpreter (TRITON_INTERPRET=1, or a machine without a GPU)")
    seqlen = 16384
    for head_dim in (64, 128):
        for causal in (False, True):
            ledger, floor = forward_backward_ledger(seqlen, head_dim, causal)
            print_ledger(f"== ours (split), d {head_dim}, N {seqlen}, {'causal' if causal else 'full'}", ledger)
            flash, ours_gpu = (stored_peak(impl, head_dim, seqlen, causal) for impl in ("sdpa flash", "ours (split)"))
            print(f"floor (the output and three gradients): {floor / MiB:.2f} MiB; "
                  f"ours here {ledger.peak_bytes / MiB:.2f} MiB, on the GPU {ours_gpu:.2f} MiB; "
                  f"SDPA flash on the GPU {flash:.2f} MiB: ours {ledger.peak_bytes / MiB / flash:.3f}x, "
                  f"the floor {floor / MiB / flash:.3f}x of flash's")


if __name__ == "__main__":
    main()
