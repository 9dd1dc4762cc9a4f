"""The error of SSD's sums over every position, dA and d dt_bias, beside mamba_ssm's, against float64.

dA and d dt_bias add a gradient over every step of every chunk, so their error is what the sums of
the step gradients leave (``mamba_annotated/ssd/chunk_scan_bwd.py`` says how they are formed).
For each dtype, chunk size and seed: relative errors of ours and of mamba_ssm's
``mamba_chunk_scan_combined`` on the same inputs and upstream gradient, against float64 autograd
through the quadratic reference; dx is listed as the yardstick of a gradient without such a sum.
``--json PATH`` writes the rows. Usage:

    python benchmarks/ssd_decay_gradient_error.py [--json out.json] [--seeds 3] [--chunks 64,256]
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402
from mamba_annotated.ssd import ssd_chunk_scan  # noqa: E402
from mamba_annotated.ssd.reference import ssd_quadratic_ref  # noqa: E402
from mamba_annotated.testing import gradients, rel_error  # noqa: E402
from peers import mamba_ssm_module  # noqa: E402

DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "dt_bias")
REPORTED = ("A", "dt_bias", "x")


def make_inputs(seed, dtype, length, heads=8, headdim=64, dstate=128, batch=2):
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)

    return dict(x=rnd(batch, length, heads, headdim),
                dt=torch.rand(batch, length, heads, device=DEVICE, generator=g) - 1,
                A=-torch.rand(heads, device=DEVICE, generator=g) * 1.5 - 0.5,
                B=rnd(batch, length, 1, dstate, scale=0.3), C=rnd(batch, length, 1, dstate, scale=0.3),
                D=torch.randn(heads, device=DEVICE, generator=g),
                dt_bias=torch.randn(heads, device=DEVICE, generator=g) * 0.5)


def errors(seed, dtype, chunk, peer):
    inputs = make_inputs(seed, dtype, length=3 * chunk + 37)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    grad_out = torch.randn(inputs["x"].shape, device=DEVICE,
                           generator=torch.Generator(device=DEVICE).manual_seed(seed + 1000)).to(dtype)
    kw = dict(dt_softplus=True)
    want = gradients(lambda **a: ssd_quadratic_ref(**a, **kw),
                     {k: v.detach().double().requires_grad_() for k, v in inputs.items()}, grad_out.double())
    runs = dict(ours=lambda **a: ssd_chunk_scan(**a, chunk_size=chunk, **kw))
    if peer is not None:
        runs["mamba_ssm"] = lambda **a: peer.mamba_chunk_scan_combined(**a, chunk_size=chunk, **kw)
    row = dict(dtype=str(dtype)[6:], chunk=chunk, seed=seed)
    for impl, fn in runs.items():
        got = gradients(fn, leaves, grad_out)
        for name in REPORTED:
            row[f"{impl} d{name}"] = rel_error(got[name], want[name])
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--chunks", default="64,256", help="comma-separated chunk sizes")
    args = parser.parse_args(argv)
    peer = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = [errors(seed, dtype, chunk, peer) for dtype in (torch.float32, torch.bfloat16) for chunk in chunks
            for seed in range(args.seeds)]
    print(f"device: {device_name()}")
    for row in rows:
        print("  ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(dict(device=device_name(), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
