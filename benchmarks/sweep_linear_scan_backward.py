"""Pick the linear scan backward kernel's (largest block, warps): time every pair on its own, per dtype
and length, against the memory floor, in one run, and store the table.

The backward kernel (mamba_annotated/scan/blocked.py) takes its launch shape from the module's
``BACKWARD`` entry, one (block, warps) for every dtype, chosen by a sweep in bfloat16 at L = 65536.
In float32, forward+backward stays under issue 18's bar of 97 % of the floor at long rows (94 % at
L = 100000 in the stored run, where the forward alone is at 98 %): this sweep asks whether another
shape, for float32 alone, would lift the backward. It sets ``BACKWARD`` in turn (the plan cache
cleared at each change), runs the backward alone on the same saved state h and upstream gradient
as the default shape, checks each pair's gradients against the default's, and times it. The floor
counts the backward's five arrays: it reads a, h, dh and writes da, db.

    python benchmarks/sweep_linear_scan_backward.py --json book/data/linear_scan_backward_sweep.json
"""
import argparse
import itertools
import json
import pathlib

import torch

from mamba_annotated import bench, runtime
from mamba_annotated.bench import median_ms, print_table
from mamba_annotated.scan import blocked

ROWS = runtime.size(gpu=8 * 1536, cpu=4)
LENGTHS = runtime.size(gpu=[4096, 65536, 100000], cpu=[100])
DTYPES = (torch.float32, torch.bfloat16)
CONFIGS = runtime.size(gpu=list(itertools.product((512, 1024, 2048, 4096), (2, 4, 8))), cpu=[(32, 4), (64, 4)])


def set_backward(config):
    blocked.BACKWARD = config
    blocked.launch_plan.cache_clear()  # the plan remembers launch shapes by argument


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    default = blocked.BACKWARD
    rows = []
    for dtype, length in itertools.product(DTYPES, LENGTHS):
        shape = (ROWS, length)
        a = (torch.rand(shape, device=runtime.DEVICE) * 0.4 + 0.6).to(dtype)
        b = torch.randn(shape, device=runtime.DEVICE).to(dtype)
        grad_h = torch.randn(shape, device=runtime.DEVICE).to(dtype)
        h = blocked.linear_scan_forward(a, b)
        floor = bench.memory_floor_ms(5 * a.numel() * a.element_size())
        set_backward(default)
        expected = [g.float() for g in blocked.linear_scan_backward(a, h, None, grad_h)[:2]]
        for config in CONFIGS:
            set_backward(config)
            got = blocked.linear_scan_backward(a, h, None, grad_h)[:2]
            rel_diff = max(((g.float() - e).norm() / e.norm()).item() for g, e in zip(got, expected))
            del got
            ms = median_ms(lambda: blocked.linear_scan_backward(a, h, None, grad_h))
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), T=length, block=config[0], warps=config[1],
                             default=config == default, ms=round(ms, 4), pct_floor=round(100 * floor / ms, 1),
                             rel_diff=float(f"{rel_diff:.1e}")))
        del a, b, grad_h, h, expected
        set_backward(default)
        torch.cuda.empty_cache()
    print(f"device: {runtime.device_name()}; the backward alone, ({ROWS}, T); rel_diff: da and db against "
          f"the default shape {default}")
    print_table(rows)
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        by_config = {}
        for r in rows:
            if r["dtype"] == dtype:
                by_config.setdefault((r["block"], r["warps"]), []).append(r["pct_floor"])
        best = max(by_config, key=lambda c: min(by_config[c]))
        print(f"{dtype}: best worst case (block, warps) = {best}: {min(by_config[best])} % of the floor "
              f"(default {default}: {min(by_config[default])} %)")
    if args.json:
        args.json.write_text(json.dumps(dict(device=runtime.device_name(), copy_GBps=bench.copy_bandwidth_gbps(),
                                             default=default, rows=rows), indent=1))


if __name__ == "__main__":
    main()
