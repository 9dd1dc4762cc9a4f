"""Pick the selective scan forward kernel's block sizes: time every (BLOCK_D, BLOCK_L, num_warps)
beside mamba_ssm's CUDA selective scan, in one run, and store the table.

The forward kernel (mamba_annotated/scan/selective.py) reads its block sizes from module constants
at each call; this script sets them in turn. Cases: issue 18's two shapes, each with the module's
bfloat16 inference call (z, D, delta_bias, softplus; no start states stored) and a bare float32
training forward (start states stored for the backward): four cases that span the kernel's
variants without compiling all sixteen for every configuration. Every configuration is first
checked against the CUDA kernel's output. Needs a GPU and the compiled peer (build_selective_scan_cuda.py).

    python benchmarks/sweep_selective_scan_forward.py --json book/data/selective_scan_forward_sweep.json
"""
import argparse
import itertools
import json
import pathlib
import sys

import torch

from mamba_annotated import runtime
from mamba_annotated.bench import median_ms, print_table
from mamba_annotated.scan import selective
from mamba_annotated.scan.api import selective_scan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_selective_scan_cuda import SHAPES, VARIANTS, make_inputs  # noqa: E402
from peers import mamba_ssm_selective_scan  # noqa: E402

CONFIGS = list(itertools.product((1, 2, 4), (256, 512, 1024, 2048), (4, 8)))


def forward(fn, inputs, flags, training):
    """One forward pass; in training mode through autograd, so start states are stored."""
    if training:
        return fn(**{k: v.requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}, **flags)
    with torch.no_grad():
        return fn(**inputs, **flags)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    module, compiled = mamba_ssm_selective_scan()
    if not compiled:
        sys.exit("sweep_selective_scan_forward: mamba_ssm's selective_scan_cuda is not importable")
    peer = module.selective_scan_fn
    saved = (selective.FWD_MAX_BLOCK_D, selective.FWD_BLOCK_L, selective.FWD_NUM_WARPS)
    rows = []
    cases = [(torch.bfloat16, "z, D, delta_bias, softplus", False), (torch.float32, "bare", True)]
    for (shape_name, shape), (dtype, variant, training) in itertools.product(SHAPES.items(), cases):
        full = VARIANTS[variant]
        inputs, flags = make_inputs(*shape, dtype, full)
        inputs = {k: v.detach() for k, v in inputs.items()}
        with torch.no_grad():
            expected = peer(**inputs, **flags).float()
        peer_ms = median_ms(lambda: forward(peer, dict(inputs), flags, training))
        for block_d, block_l, warps in CONFIGS:
            selective.FWD_MAX_BLOCK_D, selective.FWD_BLOCK_L, selective.FWD_NUM_WARPS = block_d, block_l, warps
            y = forward(selective_scan, dict(inputs), flags, training).detach().float()
            rel_diff = ((y - expected).norm() / expected.norm()).item()
            ours_ms = median_ms(lambda: forward(selective_scan, dict(inputs), flags, training))
            rows.append(dict(shape=f"{shape_name} {shape}", dtype=str(dtype).split(".")[-1], variant=variant,
                             training=training, BLOCK_D=block_d, BLOCK_L=block_l, num_warps=warps,
                             ours_ms=round(ours_ms, 4), cuda_ms=round(peer_ms, 4),
                             speedup=round(peer_ms / ours_ms, 3), rel_diff_y=float(f"{rel_diff:.2e}")))
        selective.FWD_MAX_BLOCK_D, selective.FWD_BLOCK_L, selective.FWD_NUM_WARPS = saved
    print(f"device: {runtime.device_name()}; speedup = CUDA time / ours")
    print_table(rows)
    # the configuration with the best worst case over every case
    by_config = {}
    for row in rows:
        by_config.setdefault((row["BLOCK_D"], row["BLOCK_L"], row["num_warps"]), []).append(row["speedup"])
    best = max(by_config, key=lambda c: min(by_config[c]))
    print(f"best worst-case speedup: BLOCK_D={best[0]} BLOCK_L={best[1]} num_warps={best[2]}: "
          f"min {min(by_config[best]):.3f}, max {max(by_config[best]):.3f}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=runtime.device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
