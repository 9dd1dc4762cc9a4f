"""benchmarks/attention_memory_ledger.py: attention's forward and backward, measured as the benchmark
measures its peak, hold the output, the three gradients and three float32 rows per query at the
peak, nothing more; the output and the gradients are the floor no implementation goes under."""
import pathlib
import sys

import pytest
import torch

from mamba_annotated import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention_memory_ledger as ledger_script  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
def test_the_peak_is_the_floor_and_three_rows_per_query(causal):
    """lse (saved by the forward pass), delta and lse in base 2 (the backward's preprocess) are the
    only tensors beside the output and dq, dk, dv: a float32 dq accumulator, or any other buffer of
    the inputs' size, would show here."""
    assert runtime.INTERPRETED
    batch, seqlen, heads, head_dim = 2, 96, 3, 32
    ledger, floor = ledger_script.forward_backward_ledger(seqlen, head_dim, causal, batch=batch, heads=heads)
    tensor_bytes = batch * seqlen * heads * head_dim * 2  # bfloat16
    row_bytes = batch * heads * seqlen * 4  # float32, one per query
    assert floor == 4 * tensor_bytes
    assert ledger.peak_bytes == floor + 3 * row_bytes
    alive = sorted(nbytes for nbytes, *_ in ledger.at_peak.values())
    assert alive == [row_bytes] * 3 + [tensor_bytes] * 4


def test_the_stored_run_has_the_peaks_the_script_compares():
    """The script reads SDPA flash's and our GPU peaks at N 16384 from the stored run."""
    for head_dim in (64, 128):
        for impl in ("sdpa flash", "ours (split)"):
            assert ledger_script.stored_peak(impl, head_dim, 16384, False) > 0
