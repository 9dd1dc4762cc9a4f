"""selective_scan against mamba_ssm's CUDA selective scan, the kernel Mamba-1 users run, in one run.

The peer is mamba_ssm 2.3.2.post1's ``selective_scan_fn`` over its compiled ``selective_scan_cuda``
(build it with build_selective_scan_cuda.py and put its folder on PYTHONPATH, or set
SELECTIVE_SCAN_CUDA_DIR for scripts/gpu_benchmarks.sh). Both get the same tensors in the same
layout, (batch, dim, L) and B, C (batch, N, L), and the same flags.

Cases: two shapes (batch, dim, N, L), a long one and a Mamba-130M training shape; bfloat16 and
float32 inputs (A, D, delta_bias float32, as in the module); the bare scan, and the module's call
(z, D, delta_bias with softplus); forward (no autograd) and forward+backward (autograd, the
upstream gradient given). Each time is the median of ``triton.testing.do_bench``; the speedup is
the peer's time over ours (above 1: ours is faster). Before timing, each case checks that the
two outputs agree (relative difference printed).

    python benchmarks/bench_selective_scan_cuda.py --json book/data/selective_scan_cuda_bench.json
"""
import argparse
import json
import pathlib
import sys

import torch

from mamba_annotated import runtime
from mamba_annotated.bench import median_ms, print_table
from mamba_annotated.scan.api import selective_scan
from mamba_annotated.testing import randn, uniform

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import mamba_ssm_selective_scan  # noqa: E402

SHAPES = {"long": runtime.size(gpu=(8, 2048, 16, 4096), cpu=(1, 8, 4, 64)),
          "Mamba-130M training": runtime.size(gpu=(16, 1536, 16, 2048), cpu=(2, 8, 4, 48))}
VARIANTS = {"bare": False, "z, D, delta_bias, softplus": True}


def make_inputs(batch, dim, dstate, length, dtype, full):
    inputs = dict(u=randn(batch, dim, length, dtype=dtype),
                  delta=uniform(batch, dim, length, low=-3.0, high=0.0, dtype=dtype) if full
                  else uniform(batch, dim, length, low=0.01, high=0.2, dtype=dtype),
                  A=-uniform(dim, dstate, low=0.5, high=16.0),
                  B=randn(batch, dstate, length, dtype=dtype), C=randn(batch, dstate, length, dtype=dtype))
    flags = {}
    if full:
        inputs.update(D=randn(dim), z=randn(batch, dim, length, dtype=dtype), delta_bias=uniform(dim, low=-1.0, high=0.5))
        flags["delta_softplus"] = True
    return inputs, flags


def time_pass(fn, inputs, flags, grad_y, backward):
    if not backward:
        with torch.no_grad():
            return median_ms(lambda: fn(**inputs, **flags))
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}

    def run():
        torch.autograd.grad(fn(**leaves, **flags), list(leaves.values()), grad_y)
    return median_ms(run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    interface, compiled = mamba_ssm_selective_scan()
    if not compiled:
        print("mamba_ssm's selective_scan_cuda is not importable: build it with "
              "benchmarks/build_selective_scan_cuda.py and put its folder on PYTHONPATH; nothing timed")
        return 0
    peer = interface.selective_scan_fn
    rows = []
    for shape_name, (batch, dim, dstate, length) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            for variant, full in VARIANTS.items():
                inputs, flags = make_inputs(batch, dim, dstate, length, dtype, full)
                with torch.no_grad():
                    ours_y, peer_y = selective_scan(**inputs, **flags).float(), peer(**inputs, **flags).float()
                agreement = ((ours_y - peer_y).norm() / peer_y.norm()).item()
                del ours_y, peer_y
                grad_y = randn(batch, dim, length, dtype=dtype)
                for pass_name, backward in (("forward", False), ("forward+backward", True)):
                    ours_ms = time_pass(selective_scan, inputs, flags, grad_y, backward)
                    peer_ms = time_pass(peer, inputs, flags, grad_y, backward)
                    rows.append(dict(shape=f"{shape_name} {(batch, dim, dstate, length)}",
                                     dtype=str(dtype).removeprefix("torch."), variant=variant, passes=pass_name,
                                     ours_ms=ours_ms, cuda_ms=peer_ms, speedup=peer_ms / ours_ms,
                                     rel_diff_y=agreement))
                if runtime.DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"device: {runtime.device_name()}; ours against mamba_ssm selective_scan_fn (CUDA); "
          f"speedup = CUDA time / ours (>= 1: ours at least as fast)")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(dict(device=runtime.device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
