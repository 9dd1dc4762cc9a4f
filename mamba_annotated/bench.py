"""Shared timing helpers: every chapter and benchmark script measures speed the same way.

Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs). Speed
is stated against the hardware floor: bytes that must move over the *measured* device-to-device
copy bandwidth, and FLOPs over the *measured* bf16 matmul rate, both taken once per process.
On the interpreter the same calls fall back to one wall-clock timing so a chapter's speed cell
still runs on a laptop; those numbers say nothing about a GPU.
"""
import functools
import sys
import time

import torch

from .runtime import DEVICE


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds on a GPU (``warmup``/``rep`` are milliseconds there);
    on a CPU the time of one call."""
    if DEVICE.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    # On a CPU one call, with no warm-up: the interpreter compiles nothing, and its times say only
    # which kernels ran (the chapters' timing cells took 4 calls each, a minute and a half of CI's
    # notebook run for chapter 4's selective-scan timings alone)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def capture_graph(step, warmup: int = 3):
    """(a CUDA graph of ``step()``, the tensors the captured call returned), after ``warmup`` calls on
    a side stream, as torch.cuda.graphs asks (kernels compile and allocators settle outside the
    capture); raises what the capture raises. ``graph.replay()`` then reruns the captured kernels
    with no host work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def kernel_times(step, iters: int = 10) -> list[dict]:
    """The GPU time of each kernel that ``step()`` launches, per step, from PyTorch's profiler over
    ``iters`` steps after three untimed ones (compilation and autotuning happen there): rows
    (stage: the kernel's name, cut to 60 characters, kernels whose names agree that far counted as
    one, as PyTorch's reductions of different templates are; calls per step; ms per step; pct of all
    the kernels' time in the step), longest first. GPU only: the interpreter launches no kernel."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    by_name = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # torch before 2.4 names it after CUDA
            us = getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            stage = by_name.setdefault(event.key[:60], dict(stage=event.key[:60], calls=0, ms=0.0))
            stage["calls"] += event.count // iters
            stage["ms"] += us / iters / 1e3
    stages = sorted(by_name.values(), key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in stages)
    for r in stages:
        r["pct"] = 100 * r["ms"] / total
    return stages


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbps() -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    n = (1 << 28) if DEVICE.type == "cuda" else (1 << 20)  # 1 GiB of float32 on a GPU: far past L2
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return gbps(2 * src.numel() * src.element_size(), ms)


@functools.lru_cache(maxsize=None)
def matmul_tflops(dtype=torch.bfloat16) -> float:
    """Measured dense matmul rate on random data (8192^3 on a GPU)."""
    n = 8192 if DEVICE.type == "cuda" else 256
    a = torch.randn(n, n, device=DEVICE).to(dtype)
    b = torch.randn(n, n, device=DEVICE).to(dtype)
    ms = median_ms(lambda: a @ b)
    return tflops(2 * n**3, ms)


def memory_floor_ms(nbytes: float) -> float:
    """The least time moving ``nbytes`` can take at the measured copy bandwidth."""
    return nbytes / (copy_bandwidth_gbps() * 1e9) * 1e3


def progress(items, label: str = ""):
    """Yield from ``items`` while printing ``[i/n] item`` on one line of stderr."""
    items = list(items)
    for i, item in enumerate(items, 1):
        print(f"\r{label}[{i}/{len(items)}] {item}".ljust(60), end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr, flush=True)


def format_table(rows: list[dict], floatfmt: str = ".3g") -> str:
    """A plain-text table of ``rows`` (dicts sharing keys), numbers formatted with ``floatfmt``."""
    if not rows:
        return ""
    columns = list(rows[0])
    cells = [[f"{r[c]:{floatfmt}}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows: list[dict], floatfmt: str = ".3g") -> None:
    print(format_table(rows, floatfmt))


def plot_series(rows: list[dict], x: str, y: str, series: str, *, title: str, xlabel: str, ylabel: str,
                logx: bool = True, logy: bool = False, floor: dict | None = None, ax=None):
    """Line plot of ``rows``: one line per value of ``rows[i][series]``, ``y`` against ``x``.

    ``floor`` maps x values to the hardware floor, drawn as a dashed black line.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.8))
    for name in dict.fromkeys(r[series] for r in rows):
        points = sorted((r[x], r[y]) for r in rows if r[series] == name)
        ax.plot(*zip(*points), marker="o", label=str(name))
    if floor:
        ax.plot(*zip(*sorted(floor.items())), "k--", label="hardware floor")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax
