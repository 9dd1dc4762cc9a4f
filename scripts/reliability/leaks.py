"""No leaks, and CUDA graphs (scripts/gpu_reliability.sh, step ``leaks``).

Per op, on its first small case (:meth:`cases.Op.small`): ``--calls`` calls forward and backward
leave ``torch.cuda.memory_allocated()`` where it was after a warm-up; then the op captured in a
CUDA graph, forward alone and forward with backward (``torch.autograd.grad`` inside the capture),
replays to the same bits as an eager call; attention with dropout, captured, draws a fresh mask
on each replay. Needs CUDA; on CPU it says so and exits 0.

    python scripts/reliability/leaks.py --calls 10000 --json out.json
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import OPS, flat, forward_backward, same_bits, upstream  # noqa: E402
from cli import comma_list, write_report  # noqa: E402
from mamba_annotated import attention  # noqa: E402
from mamba_annotated.bench import capture_graph  # noqa: E402
from mamba_annotated.testing import seed_everything  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.ops = comma_list(parser, args.ops, OPS, "--ops")
    return args


def leaked_bytes(op, params, leaves, calls):
    for _ in range(3):
        forward_backward(op, params, leaves, seed=0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(calls):
        forward_backward(op, params, leaves, seed=0)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before  # < 0: something the warm-up held was let go, no leak


def graph_differences(op, params, leaves, backward):
    """Names of what a replayed CUDA graph gives differently from an eager call (or why it failed)."""
    with torch.no_grad():
        like = flat(op.ours(params)(**op.views(params, leaves)))
    grad_out = upstream(like.numel(), like.dtype, seed=0).to(like.dtype)  # made before the capture

    def step():
        if backward:
            outs, grads = forward_backward(op, params, leaves, seed=0, grad_out=grad_out)
            return [*outs, *grads.values()]
        with torch.no_grad():
            return list(op.ours(params)(**op.views(params, leaves)))

    eager = [t.clone() for t in step()]
    try:
        graph, captured = capture_graph(step)
    except Exception as e:
        return [f"capture raised {type(e).__name__}: {str(e).splitlines()[0]}"]
    graph.replay()
    torch.cuda.synchronize()
    return [f"output {i}" for i, (a, b) in enumerate(zip(eager, captured)) if not same_bits(a, b)]


def graph_dropout_fresh(op, params, leaves):
    """Attention with dropout 0.5 captured in a CUDA graph: two replays must draw two masks (the
    seed is a tensor drawn inside the graph, not a number frozen at capture). Empty: they did."""
    params = {**params, "opts": {**params["opts"], "dropout_p": 0.5}}
    args = op.views(params, leaves)

    def step():
        with torch.no_grad():
            return attention(*(args[k] for k in ("q", "k", "v")), 0.5)
    try:
        graph, out = capture_graph(step)
    except Exception as e:
        return [f"capture raised {type(e).__name__}: {str(e).splitlines()[0]}"]
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    return ["two replays drew the same dropout mask"] if same_bits(first, out) else []


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("leaks: skipped (memory_allocated and CUDA graphs need a CUDA device)")
        return 0
    report, failed = {}, False
    for name in args.ops:
        op = OPS[name]
        params = op.small()[0]
        seed_everything(0)
        leaves = op.inputs(params)
        start = time.monotonic()
        r = report[name] = dict(calls=args.calls, leaked_bytes=leaked_bytes(op, params, leaves, args.calls))
        r["graph_forward"] = graph_differences(op, params, leaves, backward=False)
        r["graph_forward_backward"] = graph_differences(op, params, leaves, backward=True) if op.differentiable else []
        if name == "attention":
            r["graph_dropout"] = graph_dropout_fresh(op, params, leaves)
        r["seconds"] = round(time.monotonic() - start, 1)
        r["failed"] = bool(r["leaked_bytes"] > 0 or r["graph_forward"] or r["graph_forward_backward"]
                           or r.get("graph_dropout"))
        failed |= r["failed"]
        print(f"leaks {name}: {args.calls} calls leaked {r['leaked_bytes']} bytes; CUDA graph forward "
              f"{r['graph_forward'] or 'equal'}, forward+backward {r['graph_forward_backward'] or 'equal'}"
              + (f"; dropout replays {r['graph_dropout'] or 'fresh'}" if "graph_dropout" in r else ""), flush=True)
    write_report(args.json, "leaks", report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
