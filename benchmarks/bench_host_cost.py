"""Host cost per call of every public op beside its peer, and CUDA-graph capture of each.

At small shapes a GPU finishes a kernel before Python has launched the next, so the time per call
is the host's: argument checks, autograd, allocation and the kernel launches. Each case runs a
loop of calls and synchronises the device once, after the loop; time per call = loop time / calls.
Ours and the peer's loops alternate, fifteen rounds each, and the ratio is the median of the
rounds' ratios (with their quartiles): the host's speed drifts over a run (other tenants, clocks)
by more than the differences measured, and alternating puts both sides under the same drift. How
far that drift still moves a ratio shows in an A/A row per case: ours against ours, which should
read 1.00. Forward alone runs under torch.no_grad(); forward+backward goes through
autograd (``torch.autograd.grad``), as training does. Peers in the same run: accelerated-scan's
Triton scan for linear_scan, mamba_ssm 2.3.2.post1's CUDA ``selective_scan_fn`` for selective_scan
(where its extension is built: build_selective_scan_cuda.py), its Triton ``mamba_chunk_scan_combined``
for ssd_chunk_scan, PyTorch SDPA for attention.

Then each op's forward (and its forward and backward together) is captured in one CUDA graph,
replayed, and compared with an eager run bit for bit; the replay time per call is printed beside
the eager one. A replay costs the host almost nothing, so it is the device's time for the same
work: where the eager time is not far above it, the case is bound by the device, not the host.

With ``--breakdown`` it splits each op's forward+backward time, ours beside the peer's: the forward
recording the autograd graph, the backward alone (the graph kept), and, as a yardstick for what
autograd itself costs, a Python ``autograd.Function`` that does nothing beside a native op that does
nothing. Then, for each op of ours, its Python backward timed where autograd runs it (for CUDA
tensors, the engine's own thread for the device) beside the same call made on the main thread: on a
GPU host the same Python can take much longer on the engine's thread, and this row says how much
for each op. With ``--profile`` it also prints where the host time of each op's forward and
forward+backward go (cProfile, the functions with the most time of their own).

Usage: python benchmarks/bench_host_cost.py [--json out.json] [--calls 200] [--profile] [--breakdown]
"""
import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

from mamba_annotated import runtime  # noqa: F401  (first: decides interpreter or GPU before triton is imported)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from peers import mamba_ssm_module, mamba_ssm_selective_scan, peer  # noqa: E402

from mamba_annotated import attention, linear_scan, selective_scan, ssd_chunk_scan  # noqa: E402
from mamba_annotated.bench import capture_graph  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402


def synchronize():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def loop_us(fn, calls):
    """Time per call of a loop of ``calls`` calls, the device synchronised once, after the loop."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def per_call_us(fn, calls, rounds=7):
    fn()
    synchronize()
    return statistics.median(loop_us(fn, calls) for _ in range(rounds))


def paired_us(ours, theirs, calls, rounds=15):
    """(ours, theirs, ratio, (lower, upper) quartiles of the ratio): the median time per call of
    each and the median of the rounds' ratios, their loops alternating round by round."""
    for fn in (ours, theirs):
        fn()
    synchronize()
    times = [(loop_us(ours, calls), loop_us(theirs, calls)) for _ in range(rounds)]
    ratios = [t / u for t, u in times]
    quartiles = statistics.quantiles(ratios, n=4)
    return (statistics.median(t for t, _ in times), statistics.median(t for _, t in times),
            statistics.median(ratios), (quartiles[0], quartiles[2]))


def randn(*shape, dtype=torch.bfloat16, scale=1.0, grad=False):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_(grad)


def cases():
    """(op, peer name, inputs builder, ours(inputs), peer(inputs) or None) at host-bound shapes."""
    def scan_inputs(grad):
        return dict(a=(torch.rand(1, 64, 4096, device=DEVICE) * 0.4 + 0.6).bfloat16().requires_grad_(grad),
                    b=randn(1, 64, 4096, grad=grad))

    accelerated = peer("accelerated_scan.scalar")
    yield ("linear_scan (1, 64, 4096)", "accelerated_scan.scalar", scan_inputs,
           lambda i: linear_scan(i["a"], i["b"]),
           (lambda i: accelerated.scan(i["a"], i["b"])) if accelerated else None)

    def selective_inputs(grad):
        return dict(u=randn(1, 64, 256, grad=grad), delta=randn(1, 64, 256, scale=0.5, grad=grad),
                    A=(-torch.rand(64, 16, device=DEVICE) - 0.5).requires_grad_(grad),
                    B=randn(1, 16, 256, grad=grad), C=randn(1, 16, 256, grad=grad),
                    D=torch.randn(64, device=DEVICE).requires_grad_(grad), z=randn(1, 64, 256, grad=grad),
                    delta_bias=torch.randn(64, device=DEVICE).requires_grad_(grad))

    interface, compiled = mamba_ssm_selective_scan()
    yield ("selective_scan (1, 64, 16, 256)", "selective_scan_fn (CUDA)" if compiled else "(CUDA peer not built)",
           selective_inputs, lambda i: selective_scan(**i, delta_softplus=True),
           (lambda i: interface.selective_scan_fn(**i, delta_softplus=True)) if compiled else None)

    def ssd_inputs(grad):
        return dict(x=randn(1, 256, 4, 64, grad=grad), dt=randn(1, 256, 4, scale=0.5, grad=grad),
                    A=(-torch.rand(4, device=DEVICE) - 0.5).requires_grad_(grad),
                    B=randn(1, 256, 1, 64, grad=grad), C=randn(1, 256, 1, 64, grad=grad),
                    D=torch.randn(4, device=DEVICE).requires_grad_(grad),
                    dt_bias=torch.randn(4, device=DEVICE).requires_grad_(grad))

    combined = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    yield ("ssd_chunk_scan (1, 256, 4, 64, 64)", "mamba_chunk_scan_combined", ssd_inputs,
           lambda i: ssd_chunk_scan(**i, chunk_size=64, dt_softplus=True),
           (lambda i: combined.mamba_chunk_scan_combined(**i, chunk_size=64, dt_softplus=True)) if combined else None)

    def attention_inputs(grad):
        return dict(q=randn(1, 128, 4, 64, grad=grad), k=randn(1, 128, 4, 64, grad=grad),
                    v=randn(1, 128, 4, 64, grad=grad))

    def sdpa(i):
        q, k, v = (t.transpose(1, 2) for t in (i["q"], i["k"], i["v"]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    yield ("attention (1, 128, 4, 64) causal", "SDPA", attention_inputs,
           lambda i: attention(i["q"], i["k"], i["v"], causal=True), sdpa)


def forward_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(inputs)
    return run


def forward_backward(fn, inputs):
    leaves = [t for t in inputs.values() if t.requires_grad]

    def run():
        out = fn(inputs)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out.sum(), leaves)
    return run


def graph_replay(fn, inputs, backward):
    """Capture the forward pass (and the backward pass) in one CUDA graph; returns (replay, eager
    result == replay result)."""
    leaves = [t for t in inputs.values() if t.requires_grad]

    def step():
        with torch.set_grad_enabled(backward):
            out = fn(inputs)
        out = out[0] if isinstance(out, tuple) else out
        return (out, *torch.autograd.grad(out.float().square().sum(), leaves)) if backward else (out,)

    graph, captured = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    same = all(torch.equal(c, e) for c, e in zip(captured, eager))
    return graph.replay, same


def describe_launch_hooks():
    """Triton calls its launch hooks around every kernel launch, and a registered one (a profiler's)
    sends every launch through Triton's own path (:mod:`mamba_annotated.launch`)."""
    from triton import knobs

    for name in ("launch_enter_hook", "launch_exit_hook"):
        hooks = getattr(knobs.runtime, name, None)
        print(f"triton {name}: {getattr(hooks, 'calls', hooks)!r}")


def first(out):
    return out[0] if isinstance(out, tuple) else out


class PythonIdentity(torch.autograd.Function):
    """An autograd.Function that does nothing: what the Python side of autograd costs per op."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def breakdown(calls):
    """Each op's forward+backward split in two, ours beside the peer's, and autograd's own cost."""
    x = torch.randn(1, 64, 4096, device=DEVICE, requires_grad=True)
    g = torch.randn_like(x)
    parts = [("autograd: Python Function vs native op (no work)", "x.view_as(x)",
              lambda: torch.autograd.grad(PythonIdentity.apply(x), [x], g),
              lambda: torch.autograd.grad(x.view_as(x), [x], g))]
    for name, peer_name, make, ours, theirs in cases():
        if theirs is None:
            continue
        inputs = make(True)
        leaves = [t for t in inputs.values() if t.requires_grad]
        parts.append((f"{name}: forward recording the graph", peer_name,
                      lambda ours=ours, inputs=inputs: ours(inputs), lambda theirs=theirs, inputs=inputs: theirs(inputs)))
        outs = [first(fn(inputs)) for fn in (ours, theirs)]
        grads = [torch.randn_like(out) for out in outs]
        backward = [lambda out=out, grad=grad, leaves=leaves: torch.autograd.grad(out, leaves, grad, retain_graph=True)
                    for out, grad in zip(outs, grads)]
        parts.append((f"{name}: backward alone", peer_name, *backward))
    for what, peer_name, ours, theirs in parts:
        ours_us, peer_us, ratio, _ = paired_us(ours, theirs, calls)
        print(f"{what} | ours_us={ours_us:.1f} | {peer_name}_us={peer_us:.1f} | ratio={ratio:.2f}", flush=True)
    for name, _, make, ours, _ in cases():
        worker_us, main_us = backward_thread_us(ours, make(True), calls)
        print(f"{name}: the Python backward (autograd.Function.backward) | on autograd's thread_us={worker_us:.1f} "
              f"| the same call on the main thread_us={main_us:.1f} | ratio={worker_us / main_us:.2f}", flush=True)


def backward_thread_us(ours, inputs, calls):
    """(on autograd's thread, on the main thread): the median time of one call of the op's
    ``autograd.Function.backward`` (library.define_op's), timed inside ``torch.autograd.grad``, where
    the engine runs it (for CUDA tensors, on the engine's thread for the device), and then called
    directly on the main thread with the same node and the same output gradients. The difference is
    what running the Python backward on the engine's thread costs."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    out = first(ours(inputs))
    grad = torch.randn_like(out)
    function = type(out.grad_fn)._forward_cls
    backward = function.backward
    spent, seen = [], []

    def timed(ctx, *output_grads):
        start = time.perf_counter()
        result = backward(ctx, *output_grads)
        spent.append(time.perf_counter() - start)
        seen[:] = output_grads
        return result

    function.backward = staticmethod(timed)
    try:
        for _ in range(calls):
            torch.autograd.grad(first(ours(inputs)), leaves, grad)
    finally:
        function.backward = staticmethod(backward)
    synchronize()
    direct = []
    with torch.no_grad():  # as on the engine's thread without create_graph
        for _ in range(calls):
            start = time.perf_counter()
            backward(out.grad_fn, *seen)  # the node is the ctx; out's graph has not been used
            direct.append(time.perf_counter() - start)
    synchronize()
    return statistics.median(spent) * 1e6, statistics.median(direct) * 1e6


def profile(fn, calls):
    """The 15 functions with the most time of their own over ``calls`` calls of ``fn``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def describe(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(describe, value)) + ")"
    return str(value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    print(f"device: {device_name()}, torch {torch.__version__}")
    if args.profile:
        describe_launch_hooks()
    rows = []
    for name, peer_name, make, ours, theirs in cases():
        for pass_ in ("forward", "forward+backward"):
            grad = pass_ != "forward"
            inputs = make(grad)
            wrap = forward_backward if grad else forward_only
            if theirs:
                ours_us, peer_us, ratio, quartiles = paired_us(wrap(ours, inputs), wrap(theirs, inputs), args.calls)
            else:
                ours_us, peer_us, ratio, quartiles = per_call_us(wrap(ours, inputs), args.calls), None, None, None
            *_, same_ratio, _ = paired_us(wrap(ours, inputs), wrap(ours, inputs), args.calls)
            row = dict(op=name, pass_=pass_, ours_us=ours_us, peer=peer_name, peer_us=peer_us, ratio=ratio,
                       ratio_quartiles=quartiles, ours_vs_ours=same_ratio)
            if DEVICE.type == "cuda":
                replay, same = graph_replay(ours, make(grad), backward=grad)
                row.update(graph_us=per_call_us(replay, args.calls), graph_equals_eager=same)
            rows.append(row)
            if args.profile:
                print(f"--- profile: {name} {pass_}")
                profile(wrap(ours, inputs), args.calls)
            print(" | ".join(f"{k}={describe(v)}" for k, v in row.items()), flush=True)
    if args.breakdown:
        breakdown(args.calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), torch=torch.__version__, calls=args.calls, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
