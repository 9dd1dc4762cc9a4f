"""Pick the selective scan kernels' block sizes: time every (BLOCK_D, BLOCK_L, num_warps) beside
mamba_ssm's CUDA selective scan, in one run, and store the table.

The kernels (mamba_annotated/scan/selective.py) read their block sizes from module constants at
each call; this script sets them in turn, for the forward kernel or, with --backward, for the
backward kernel (timed as forward+backward, the forward at its chosen sizes). Cases: issue 18's two
shapes, each with the module's bfloat16 call (z, D, delta_bias, softplus) and a bare float32 call:
four cases that span the kernels' variants without compiling all of them for every configuration.
The forward sweep times the bfloat16 case for inference (no start states stored) and the float32
one as a training forward (start states stored). Every configuration is first checked against the
CUDA kernel: its output, and with --backward the gradients of u and B. Needs a GPU and the compiled
peer (build_selective_scan_cuda.py).

    python benchmarks/sweep_selective_scan.py --json book/data/selective_scan_forward_sweep.json
    python benchmarks/sweep_selective_scan.py --backward --json book/data/selective_scan_backward_sweep.json
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
from mamba_annotated.testing import randn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_selective_scan_cuda import SHAPES, VARIANTS, make_inputs, time_pass  # noqa: E402
from peers import mamba_ssm_selective_scan  # noqa: E402

FORWARD_CONFIGS = list(itertools.product((1, 2, 4), (256, 512, 1024, 2048), (4, 8)))
BACKWARD_CONFIGS = list(itertools.product((8, 16, 32), (32, 64, 128), (2, 4)))
CONSTANTS = {False: ("FWD_MAX_BLOCK_D", "FWD_BLOCK_L", "FWD_NUM_WARPS"),
             True: ("BWD_MAX_BLOCK_D", "BWD_BLOCK_L", "BWD_NUM_WARPS")}


def set_config(backward, config):
    for name, value in zip(CONSTANTS[backward], config):
        setattr(selective, name, value)


def forward(fn, inputs, flags, training):
    """One forward pass; in training mode through autograd, so start states are stored."""
    if training:
        return fn(**{k: v.requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}, **flags)
    with torch.no_grad():
        return fn(**inputs, **flags)


def outputs_of(fn, inputs, flags, grad_y, backward):
    """The output and, with ``backward``, the gradients of u and B, as float32 tensors."""
    if not backward:
        return [forward(fn, dict(inputs), flags, False).float()]
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    y = fn(**leaves, **flags)
    return [y.detach().float(), *(g.float() for g in torch.autograd.grad(y, [leaves["u"], leaves["B"]], grad_y))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true", help="sweep the backward kernel's sizes")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    module, compiled = mamba_ssm_selective_scan()
    if not compiled:
        sys.exit("sweep_selective_scan: mamba_ssm's selective_scan_cuda is not importable")
    peer = module.selective_scan_fn
    configs = BACKWARD_CONFIGS if args.backward else FORWARD_CONFIGS
    saved = tuple(getattr(selective, name) for name in CONSTANTS[args.backward])
    rows = []
    cases = [(torch.bfloat16, "z, D, delta_bias, softplus", False), (torch.float32, "bare", True)]
    for (shape_name, shape), (dtype, variant, training) in itertools.product(SHAPES.items(), cases):
        inputs, flags = make_inputs(*shape, dtype, VARIANTS[variant])
        inputs = {k: v.detach() for k, v in inputs.items()}
        grad_y = randn(shape[0], shape[1], shape[3], dtype=dtype)
        expected = outputs_of(peer, inputs, flags, grad_y, args.backward)
        if args.backward:
            peer_ms = time_pass(peer, inputs, flags, grad_y, True)
        else:
            peer_ms = median_ms(lambda: forward(peer, dict(inputs), flags, training))
        for config in configs:
            set_config(args.backward, config)
            got = outputs_of(selective_scan, inputs, flags, grad_y, args.backward)
            rel_diffs = [((g - e).norm() / e.norm()).item() for g, e in zip(got, expected)]
            del got
            if args.backward:
                ours_ms = time_pass(selective_scan, inputs, flags, grad_y, True)
            else:
                ours_ms = median_ms(lambda: forward(selective_scan, dict(inputs), flags, training))
            rows.append(dict(shape=f"{shape_name} {shape}", dtype=str(dtype).split(".")[-1], variant=variant,
                             training=training or args.backward, BLOCK_D=config[0], BLOCK_L=config[1],
                             num_warps=config[2], ours_ms=round(ours_ms, 4), cuda_ms=round(peer_ms, 4),
                             speedup=round(peer_ms / ours_ms, 3),
                             rel_diff=float(f"{max(rel_diffs):.2e}")))
        set_config(args.backward, saved)
        torch.cuda.empty_cache()
    passes = "forward+backward" if args.backward else "forward"
    print(f"device: {runtime.device_name()}; {passes}; speedup = CUDA time / ours; "
          f"rel_diff: the largest of y{', du, dB' if args.backward else ''} against CUDA")
    print_table(rows)
    # the configuration with the best worst case over every case
    by_config = {}
    for row in rows:
        by_config.setdefault((row["BLOCK_D"], row["BLOCK_L"], row["num_warps"]), []).append(row["speedup"])
    best = max(by_config, key=lambda c: min(by_config[c]))
    print(f"best worst-case speedup: BLOCK_D={best[0]} BLOCK_L={best[1]} num_warps={best[2]}: "
          f"min {min(by_config[best]):.3f}, max {max(by_config[best]):.3f}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=runtime.device_name(), passes=passes, rows=rows), indent=1))


if __name__ == "__main__":
    main()
