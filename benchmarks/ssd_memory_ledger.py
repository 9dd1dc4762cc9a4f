"""Where the SSD forward pass's peak memory goes: ours beside mamba_ssm's, tensor by tensor, on a CPU.

bench_ssd.py measures each forward pass's peak on a GPU (``torch.cuda.max_memory_allocated`` above
the inputs, under ``torch.no_grad``). This script explains that number without a GPU: it runs both
forward passes on CPU tensors of the benchmark's shapes with every Triton launch replaced by
nothing and prints the tensors alive at the peak, by the function that allocated them
(memory_ledger.py says what that counts):

    python benchmarks/ssd_memory_ledger.py

mamba_ssm's Triton kernels come from its installed wheel (peers.py); without it, ours alone.
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_ssd import CHUNK, SHAPES, make_inputs  # noqa: E402  the benchmark's shapes, chunk and inputs
from memory_ledger import MiB, Ledger, launches_stubbed, print_ledger  # noqa: E402
from mamba_annotated import runtime, ssd_chunk_scan  # noqa: E402
from peers import mamba_ssm_module  # noqa: E402


def forward_ledger(fn, inp) -> Ledger:
    """The ledger of one forward pass of ``fn`` (ours or the peer's, one signature) on bench_ssd.py's
    inputs ``inp``, called as it calls them."""
    ledger = Ledger()
    with torch.no_grad(), launches_stubbed(), ledger:
        fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=CHUNK, D=inp["D"],
           dt_bias=inp["dt_bias"], dt_softplus=True)
    return ledger


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                        help="batch,L,heads,headdim,dstate ...")
    args = parser.parse_args()
    if not runtime.INTERPRETED:
        sys.exit("ssd_memory_ledger: needs Triton's interpreter (TRITON_INTERPRET=1, or a machine without a GPU)")
    combined = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    impls = {"ours": ssd_chunk_scan}
    if combined is not None:
        impls["mamba_ssm"] = combined.mamba_chunk_scan_combined
    for text in args.shapes:
        shape = tuple(int(v) for v in text.split(","))
        inp = make_inputs(*shape)
        print(f"== {shape}, chunk {CHUNK}, bfloat16, D, dt_bias, softplus, forward under no_grad")
        peaks = {}
        for name, fn in impls.items():
            ledger = forward_ledger(fn, inp)
            print_ledger(name, ledger)
            peaks[name] = ledger.peak_bytes
        if len(peaks) == 2:
            print(f"ours - mamba_ssm: {(peaks['ours'] - peaks['mamba_ssm']) / MiB:+.2f} MiB "
                  f"({peaks['ours'] / peaks['mamba_ssm']:.3f}x)")


if __name__ == "__main__":
    main()
