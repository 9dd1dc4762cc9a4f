"""Time the gated RMS norm kernel (mamba_annotated.gated_norm) beside its peers in one run.

Shapes: a Mamba-2 block's norm at d_model 768 (d_inner 1536, one group and eight), 16384 rows
(batch 8 x 2048), x and z bfloat16, the weight float32; forward, and forward + backward.
    ours            the Triton kernel, ``rmsnorm_fn``
    torch float32   :func:`mamba_annotated.gated_norm.rmsnorm_ref`, the same formula in torch ops
    mamba_ssm       mamba_ssm 2.3.2.post1's ``rmsnorm_fn`` (ops/triton/layernorm_gated.py)
% of floor: the bytes that must move (forward: read x, z, write out; backward: read x, z, dy,
write dx, dz) over the measured copy bandwidth. On a GPU each row also gives ``kernel_ms``, the GPU
time of the kernels one call launches (PyTorch's profiler, ``bench.kernel_times``), and the floor
against it: at this size a forward and backward call through autograd can take the host longer than
its kernels take the GPU, and then ``ms`` times the host (the README gives a run).

Usage: python benchmarks/bench_gated_norm.py [--json book/data/gated_norm_bench.json]
"""
import argparse
import json
import pathlib
import sys

from mamba_annotated import bench  # first: decides interpreter or GPU before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import mamba_ssm_module  # noqa: E402

from mamba_annotated.gated_norm import rmsnorm_fn, rmsnorm_ref  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name, size  # noqa: E402

ROWS, WIDTH = size(gpu=(16384, 1536), cpu=(64, 96))


def implementations():
    impls = {"ours": lambda x, w, z, group, before: rmsnorm_fn(x, w, None, z, 1e-5, group, before),
             "torch float32": lambda x, w, z, group, before: rmsnorm_ref(x, w, None, z, 1e-5, group, before)}
    peer = mamba_ssm_module("mamba_ssm.ops.triton.layernorm_gated")
    if peer is not None:
        impls["mamba_ssm"] = lambda x, w, z, group, before: peer.rmsnorm_fn(x, w, None, z, 1e-5, group, before)
    return impls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    rows, impls = [], implementations()
    for groups in (1, 8):
        for before in (False, True):
            x = torch.randn(ROWS, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            z = torch.randn(ROWS, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            w = (1 + 0.1 * torch.randn(WIDTH, device=DEVICE)).requires_grad_()
            dy = torch.randn(ROWS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
            size_ = x.numel() * x.element_size()
            for name, norm in impls.items():
                run = lambda: norm(x, w, z, WIDTH // groups, before)  # noqa: E731
                steps = (("fwd", lambda: run(), 3 * size_),
                         ("fwd+bwd", lambda: torch.autograd.grad(run(), [x, w, z], dy), 8 * size_))
                for pass_, step, nbytes in steps:
                    ms, floor = bench.median_ms(step), bench.memory_floor_ms(nbytes)
                    row = dict(impl=name, groups=groups, norm_before_gate=before, pass_=pass_, ms=ms,
                               GBps=bench.gbps(nbytes, ms), pct_floor=100 * floor / ms)
                    if DEVICE.type == "cuda":  # the interpreter launches no kernel to profile
                        row["kernel_ms"] = sum(stage["ms"] for stage in bench.kernel_times(step))
                        row["pct_floor_kernels"] = 100 * floor / row["kernel_ms"]
                    rows.append(row)
            bench.print_table([r for r in rows if r["groups"] == groups and r["norm_before_gate"] == before])
    if args.json:
        args.json.write_text(json.dumps(dict(device=device_name(), rows=ROWS, width=WIDTH, dtype="bfloat16",
                                             copy_GBps=bench.copy_bandwidth_gbps(), results=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
