"""Time selective_scan beside its peers, forward and forward+backward, in one run.

Peers (each where installed; the GPU box gets them from .whl):
  - mamba.py (mambapy 1.2.0): ``mambapy.pscan.pscan`` fed the discretized deltaA, deltaB*u in its
    layout (batch, L, dim, N), then the C contraction and D skip, as mambapy's selective_scan does;
  - mamba_ssm's CUDA kernel ``selective_scan_fn`` (what Mamba-1 users run), where its extension
    ``selective_scan_cuda`` is built (benchmarks/build_selective_scan_cuda.py, on PYTHONPATH);
  - mamba_ssm's PyTorch reference ``selective_scan_ref`` (a Python loop over time), which needs no
    extension (peers.mamba_ssm_selective_scan).

The floor is the larger of (a) the bytes that must move over the measured copy bandwidth and
(b) the arithmetic over the chip's rates: one exp per (batch, dim, N, L) element on the special
function units (16 per clock per SM on Hopper) and the FMAs (x = delta*u*B, h = a*h + x, y += C*h)
on the float32 units (128 per clock per SM). The backward pass needs at least the same again.

    python benchmarks/bench_selective_scan.py --json results.json
"""
import argparse
import json
import pathlib
import sys
import time

import torch

from mamba_annotated import runtime
from mamba_annotated.bench import copy_bandwidth_gbps, gbps, median_ms, print_table
from mamba_annotated.scan.api import selective_scan
from mamba_annotated.testing import randn, uniform

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import mamba_ssm_selective_scan, peer  # noqa: E402

SFU_PER_CLOCK_PER_SM = 16     # exp2 results per clock per SM (Hopper special function units)
FMA_PER_CLOCK_PER_SM = 128    # float32 fused multiply-adds per clock per SM
BOOST_CLOCK_HZ = 1.98e9       # H100 SXM / H200 boost clock
FMAS_PER_ELEMENT = 3


def mambapy_selective_scan(pscan):
    """mambapy's MambaBlock.selective_scan, on inputs in our layout transposed to its own (untimed)."""
    def run(x, delta, A, B, C, D):
        # x, delta: (batch, L, dim); B, C: (batch, L, N)
        deltaA = torch.exp(delta.unsqueeze(-1) * A)
        deltaB_u = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        hs = pscan(deltaA, deltaB_u)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + D * x
    return run


def floor_ms(nbytes, elements, passes):
    sms = torch.cuda.get_device_properties(0).multi_processor_count if runtime.DEVICE.type == "cuda" else 1
    exp_ms = passes * elements / (SFU_PER_CLOCK_PER_SM * sms * BOOST_CLOCK_HZ) * 1e3
    fma_ms = passes * FMAS_PER_ELEMENT * elements / (FMA_PER_CLOCK_PER_SM * sms * BOOST_CLOCK_HZ) * 1e3
    memory_ms = nbytes / (copy_bandwidth_gbps() * 1e9) * 1e3
    return dict(memory_ms=memory_ms, exp_ms=exp_ms, fma_ms=fma_ms, floor_ms=max(memory_ms, exp_ms, fma_ms))


def single_run_ms(fn):
    """One timed call, for a peer too slow to repeat (mamba_ssm's loop backward takes tens of seconds)."""
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def forward_backward(fn, inputs, grad_y):
    leaves = [x for x in inputs if x.requires_grad]

    def run():
        y = fn(*inputs)
        torch.autograd.grad(y, leaves, grad_y.to(y.dtype))
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=runtime.size(gpu=8, cpu=1))
    parser.add_argument("--dim", type=int, default=runtime.size(gpu=2048, cpu=8))
    parser.add_argument("--dstate", type=int, default=16)
    parser.add_argument("--length", type=int, default=runtime.size(gpu=4096, cpu=64))
    parser.add_argument("--skip-mamba-ssm-ref", action="store_true", help="its Python loop takes seconds")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    batch, dim, dstate, length = args.batch, args.dim, args.dstate, args.length
    dtype = torch.bfloat16

    u = randn(batch, dim, length, dtype=dtype)
    delta = uniform(batch, dim, length, low=0.01, high=0.2, dtype=dtype)   # after softplus, as mambapy takes it
    A = -uniform(dim, dstate, low=0.5, high=16.0)
    B, C = randn(batch, dstate, length, dtype=dtype), randn(batch, dstate, length, dtype=dtype)
    D = randn(dim)
    grad_y = randn(batch, dim, length, dtype=dtype)
    ours = (u, delta, A, B, C, D)
    theirs = (u.transpose(1, 2).contiguous(), delta.transpose(1, 2).contiguous(), A,
              B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), D)   # mambapy's (batch, L, ...)

    # name -> (function, inputs, upstream gradient, timer for the backward pass)
    implementations = {"selective_scan (ours)": (lambda *x: selective_scan(*x), ours, grad_y, median_ms)}
    mambapy = peer("mambapy.pscan")
    if mambapy is not None:
        implementations["mamba.py pscan"] = (mambapy_selective_scan(mambapy.pscan), theirs, grad_y.transpose(1, 2),
                                              median_ms)
    interface, compiled = mamba_ssm_selective_scan()
    if compiled:
        implementations["mamba_ssm selective_scan_cuda"] = (lambda *x: interface.selective_scan_fn(*x), ours, grad_y,
                                                             median_ms)
    reference = None if args.skip_mamba_ssm_ref or interface is None else interface.selective_scan_ref
    if reference is not None:
        implementations["mamba_ssm selective_scan_ref"] = (lambda *x: reference(*x), ours, grad_y, single_run_ms)

    element = u.element_size()
    activations = batch * dim * length
    bc_bytes = 2 * batch * dstate * length * element
    elements = activations * dstate
    floors = {"forward": floor_ms(3 * activations * element + bc_bytes, elements, 1),     # u, delta -> y
              "forward+backward": floor_ms(8 * activations * element + 3 * bc_bytes, elements, 2)}  # + u, delta, dy -> du, ddelta

    rows = []
    with torch.no_grad():
        y_ours = selective_scan(*ours).float()
    for name, (fn, inputs, grad, backward_timer) in implementations.items():
        with torch.no_grad():  # each peer is fed correctly: its y matches ours up to bfloat16 rounding
            y = fn(*inputs).float()
        y = y.transpose(1, 2) if y.shape != y_ours.shape else y
        agreement = ((y - y_ours).norm() / y_ours.norm()).item()
        del y
        for pass_name in floors:
            inputs = [x.detach().requires_grad_(pass_name != "forward" and x.is_floating_point()) for x in inputs]
            if pass_name == "forward":
                with torch.no_grad():
                    ms = median_ms(lambda: fn(*inputs))
            else:
                ms = backward_timer(forward_backward(fn, inputs, grad))
            floor = floors[pass_name]
            rows.append(dict(implementation=name, passes=pass_name, ms=ms,
                             GBps=gbps(floor["memory_ms"] * copy_bandwidth_gbps() * 1e6, ms),
                             pct_of_floor=100 * floor["floor_ms"] / ms, rel_diff_vs_ours=agreement,
                             timing="one run" if pass_name != "forward" and backward_timer is single_run_ms else "median"))
            if runtime.DEVICE.type == "cuda":
                torch.cuda.empty_cache()   # mamba.py's (batch, L, dim, N) tensors take gigabytes
    for row in rows:
        base = next((r["ms"] for r in rows if r["implementation"] == "mamba.py pscan" and r["passes"] == row["passes"]), None)
        row["speedup_vs_mambapy"] = base / row["ms"] if base else float("nan")

    print(f"device: {runtime.device_name()}; batch {batch}, dim {dim}, dstate {dstate}, L {length}, bfloat16 inputs; "
          f"copy bandwidth {copy_bandwidth_gbps():.0f} GB/s")
    for pass_name, floor in floors.items():
        print(f"floor, {pass_name}: {floor['floor_ms']:.3f} ms (memory {floor['memory_ms']:.3f}, "
              f"exp {floor['exp_ms']:.3f}, fma {floor['fma_ms']:.3f})")
    print_table(rows)
    if args.json:
        result = dict(device=runtime.device_name(), batch=batch, dim=dim, dstate=dstate, length=length,
                      dtype="bfloat16", copy_bandwidth_gbps=copy_bandwidth_gbps(), floors=floors, rows=rows)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
