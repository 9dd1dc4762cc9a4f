"""Time linear_scan (chapters 2-4) beside its peers in one run; print tables, write JSON.

Sections (each a list of rows in the JSON, written after every section so a cut-off run keeps
what it measured):
  linear_scan  (8, 1536, T), T = 4096, 65536, 100000, float32 and bfloat16, forward and
               forward+backward: ours, chapter 1's sequential scan, accelerated-scan 0.3.1's Triton
               scan (``accelerated_scan.scalar``; the issue's ``accelerated_scan.triton`` is named
               ``scalar`` in 0.3.1) and its CUDA warp scan (``accelerated_scan.warp``: power-of-two
               T in [32, 65536] only). % of floor = bytes that must move / measured copy bandwidth.
  packing      chapter 3: the packed-word scan against the tuple scan, one block per row.
  segments     chapter 4: the chained walk (one segment per row) against three phases, by rows.
  tuning       BLOCK x num_warps for the chained walk (float32, forward).
  warp_bfloat16  accelerated_scan.warp on bfloat16 inputs. Not in the default run: on an H200 it hit
               an illegal memory access at T = 4096 (one run) and T = 65536 (another), which poisons
               the CUDA context and fails the script; ask for it by name to reproduce.

Usage: python benchmarks/bench_linear_scan.py [--json out.json] [--sections linear_scan,packing]
"""
import argparse
import json
import os
import sys

from mamba_annotated import bench  # first: decides interpreter or GPU before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from peers import peer  # noqa: E402

from mamba_annotated.runtime import DEVICE, device_name, size  # noqa: E402
from mamba_annotated.scan import blocked, linear_scan, sequential_scan  # noqa: E402
from mamba_annotated.scan.associative import tuple_scan_forward  # noqa: E402
from mamba_annotated.scan.packed import packed_scan_forward  # noqa: E402

BATCH, CHANNELS = size(gpu=(8, 1536), cpu=(1, 4))
LENGTHS = size(gpu=[4096, 65536, 100000], cpu=[64, 100])


def make(shape, dtype, grad=False):
    a = (torch.rand(shape, device=DEVICE) * 0.4 + 0.6).to(dtype).requires_grad_(grad)
    b = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(grad)
    return a, b


def forward_backward(fn, a, b, grad_h):
    def run():
        h = fn(a, b)
        torch.autograd.grad(h, (a, b), grad_h)
    return run


def row(section, name, shape, dtype, direction, ms, nbytes, **extra):
    floor = bench.memory_floor_ms(nbytes)
    return dict(section=section, impl=name, shape="x".join(map(str, shape)), T=shape[-1],
                dtype=str(dtype).removeprefix("torch."), pass_=direction, ms=ms,
                GBps=bench.gbps(nbytes, ms), pct_floor=100 * floor / ms, **extra)


def time_or_none(fn):
    try:
        return bench.median_ms(fn)
    except Exception as e:  # a peer that refuses a shape is reported, not fatal
        print(f"  skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None


def warp_supports(length):
    return length & (length - 1) == 0 and 32 <= length <= 65536


def peer_impls(dtype):
    """accelerated-scan's two scans. Its CUDA warp scan hits illegal memory accesses with bfloat16
    on an H200 (see the module docstring), which poison the CUDA context; it is timed on 16-bit
    inputs only in the warp_bfloat16 section, which runs when asked for by name."""
    impls = {}
    scalar = peer("accelerated_scan.scalar")
    if scalar is not None:
        impls["accelerated_scan.scalar (Triton)"] = scalar.scan
    warp = peer("accelerated_scan.warp") if dtype == torch.float32 else None
    if warp is not None:
        impls["accelerated_scan.warp (CUDA)"] = warp.scan
    return impls


def time_scans(section, impls, dtype, lengths):
    """Forward and forward+backward of each implementation at (BATCH, CHANNELS, T), one row each."""
    rows = []
    for length in lengths:
        shape = (BATCH, CHANNELS, length)
        a, b = make(shape, dtype, grad=True)
        grad_h = torch.randn(shape, device=DEVICE).to(dtype)
        elems, s = a.numel(), a.element_size()
        for name, fn in impls.items():
            if "warp" in name and not warp_supports(length):
                print(f"  {name}: T={length} unsupported (power of two in [32, 65536] only)")
                continue
            if "sequential" in name and length > 4096:
                continue  # chapter 1's point is made at T=4096; longer rows only cost time
            for direction, run, nbytes in (("fwd", lambda: fn(a, b), 3 * elems * s),
                                           ("fwd+bwd", forward_backward(fn, a, b, grad_h), 8 * elems * s)):
                with torch.set_grad_enabled(direction == "fwd+bwd"):
                    ms = time_or_none(run)
                if ms is not None:
                    rows.append(row(section, name, shape, dtype, direction, ms, nbytes))
                    print(f"  {name} {shape} {dtype} {direction}: {ms:.3f} ms, "
                          f"{rows[-1]['pct_floor']:.1f}% of floor", flush=True)
        del a, b, grad_h
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def add_ratio_to_ours(rows):
    """ours_faster_by = a row's time / linear_scan's time at the same T, dtype and pass."""
    ours = {(r["T"], r["dtype"], r["pass_"]): r["ms"] for r in rows if r["impl"] == "linear_scan"}
    for r in rows:
        key = (r["T"], r["dtype"], r["pass_"])
        if key in ours:
            r["ours_faster_by"] = r["ms"] / ours[key]
    return rows


def linear_scan_section():
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        impls = {"linear_scan": linear_scan, "sequential_scan (ch. 1)": sequential_scan, **peer_impls(dtype)}
        rows += time_scans("linear_scan", impls, dtype, LENGTHS)
    return add_ratio_to_ours(rows)


def warp_bfloat16_section():
    warp = peer("accelerated_scan.warp")
    if warp is None:
        return []
    impls = {"linear_scan": linear_scan, "accelerated_scan.warp (CUDA)": warp.scan}
    rows = time_scans("warp_bfloat16", impls, torch.bfloat16,
                      [n for n in LENGTHS if warp_supports(n)])
    return add_ratio_to_ours(rows)


def packing_section():
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for length in size(gpu=[1024, 4096, 16384], cpu=[64]):
            shape = (BATCH * CHANNELS, length)
            a, b = make(shape, dtype)
            nbytes = 3 * a.numel() * a.element_size()
            for name, fn in (("tuple", tuple_scan_forward), ("packed", packed_scan_forward)):
                rows.append(row("packing", name, shape, dtype, "fwd", bench.median_ms(lambda: fn(a, b)), nbytes))
    return rows


def segments_section():
    rows = []
    length = size(gpu=1 << 20, cpu=256)
    for n_rows in size(gpu=[1, 8, 64, 512, 4096], cpu=[1, 2]):
        shape = (n_rows, length)
        a, b = make(shape, torch.float32)
        nbytes = 3 * a.numel() * a.element_size()
        block, per_segment, segments = blocked.plan(n_rows, length)
        n_blocks = triton.cdiv(length, block)
        for name, bps in (("chained walk", n_blocks), ("three phases", per_segment)):
            if name == "three phases" and segments == 1:
                continue
            ms = bench.median_ms(lambda: blocked.linear_scan_forward(a, b, blocks_per_segment=bps))
            rows.append(row("segments", name, shape, torch.float32, "fwd", ms, nbytes,
                            segments=triton.cdiv(n_blocks, bps)))
        del a, b
    return rows


def tuning_section():
    rows = []
    shape = (BATCH * CHANNELS, size(gpu=65536, cpu=128))
    a, b = make(shape, torch.float32)
    nbytes = 3 * a.numel() * a.element_size()
    for block in size(gpu=[1024, 2048, 4096, 8192], cpu=[32]):
        for warps in size(gpu=[4, 8, 16], cpu=[4]):
            ms = bench.median_ms(lambda: blocked.linear_scan_forward(a, b, block=block, num_warps=warps))
            rows.append(row("tuning", f"BLOCK={block} warps={warps}", shape, torch.float32, "fwd", ms, nbytes))
    return rows


SECTIONS = {"linear_scan": linear_scan_section, "packing": packing_section,
            "segments": segments_section, "tuning": tuning_section, "warp_bfloat16": warp_bfloat16_section}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sections", default="linear_scan,packing,segments,tuning")
    args = parser.parse_args()
    results = {"device": device_name(), "copy_GBps": bench.copy_bandwidth_gbps(), "sections": {}}
    print(f"device: {results['device']}  measured copy bandwidth: {results['copy_GBps']:.0f} GB/s", flush=True)
    for name in args.sections.split(","):
        print(f"\n== {name} ==", flush=True)
        rows = SECTIONS[name]()
        results["sections"][name] = rows
        bench.print_table([{k: v for k, v in r.items() if k != "section"} for r in rows])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
