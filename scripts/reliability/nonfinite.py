"""Non-finite inputs (scripts/gpu_reliability.sh, step ``nonfinite``): a NaN, +inf or -inf at
position t of one input must not reach the outputs it cannot reach (for a causal op, positions
before t; for the bidirectional op, the other packed sequences; for the norm, the other rows; for
the convolution, the positions whose window does not hold t, and the other packed sequences):
those stay the same bits as without it. Where it does reach, each output is non-finite exactly
where the float64 reference on the same inputs is non-finite (never a finite garbage value, never a NaN the math has not got).
Forward, then a backward pass that must not crash. Ops are not fixed here: failures are reported.

The reference is not used before t: there its own 0 x NaN (a masked score times a NaN value)
would be NaN too; the unpoisoned call is the yardstick there. For the same reason it is no judge
of attention's and the bidirectional op's reached outputs, whose dense products spread a NaN of
v (x) to every row: a row of attention that sees the value must be non-finite in full, and the
exact reach inside a bidirectional sequence (forward inputs read by t and after, reverse ones by
t and before) is a unit test (tests/test_bidirectional.py).

    python scripts/reliability/nonfinite.py --json out.json
"""
import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import OPS, as64, forward_backward, rms_norm_f64  # noqa: E402
from cli import comma_list, write_report  # noqa: E402
from mamba_annotated.attention.api import resolve_window  # noqa: E402
from mamba_annotated.attention.reference import window_mask  # noqa: E402
from mamba_annotated.bidirectional.reference import bidirectional_ref, packed_seq_idx  # noqa: E402
from mamba_annotated.conv1d import depthwise_conv_ref  # noqa: E402
from mamba_annotated.scan.reference import linear_scan_ref, selective_scan_ref  # noqa: E402
from mamba_annotated.ssd.reference import ssd_quadratic_ref  # noqa: E402
from mamba_annotated.testing import seed_everything  # noqa: E402

# op -> (the inputs poisoned, their time dim, the output's time dim)
PROBES = {"linear_scan": (("a", "b"), -1, -1), "sequential_scan": (("a", "b"), -1, -1),
          "selective_scan": (("u", "delta", "B", "C"), -1, -1), "ssd_chunk_scan": (("x", "dt", "B", "C"), 1, 1),
          "bidirectional_chunk_scan": (("x", "dt", "B"), 1, 1), "attention": (("q", "k", "v"), 1, 1),
          "attention_varlen": (("q", "k", "v"), 0, 0),
          "attention_with_kvcache": (("q", "k", "v", "k_cache", "v_cache"), 1, 1),
          "ssd_state_update": (("x", "dt", "B", "C"), 1, 1), "selective_state_update": (("x", "dt", "B", "C"), 1, 1),
          "rmsnorm_fn": (("x", "z"), 1, 1), "depthwise_conv1d": (("x",), -1, -1)}
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(PROBES))
    parser.add_argument("--values", default=",".join(VALUES), help="of nan, +inf, -inf")
    parser.add_argument("--positions", default="first,middle,last,25", help="of first, middle, last, 25")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.ops = comma_list(parser, args.ops, tuple(PROBES), "--ops")
    args.values = comma_list(parser, args.values, VALUES, "--values")
    args.positions = comma_list(parser, args.positions, ("first", "middle", "last", "25"), "--positions")
    return args


def plain_cases(op):
    """The op's first small case with contiguous inputs: one sequence per row, and for SSD and
    the bidirectional op also packed sequences (the small cases cut at 5, inside the first chunk,
    so a value at the first position has another sequence after it in its chunk)."""
    params = json.loads(json.dumps(op.small()[0]))
    params["layouts"] = {k: "contiguous" for k in params["layouts"]}
    if op.name in ("attention", "attention_varlen"):
        params["dims"]["Lk"] = params["dims"]["Lq"]
        params["opts"]["causal"] = True
    if op.name == "attention_with_kvcache":  # cache row b holds sequence b: a position t of the cache is one key
        params["opts"]["layout"] = "contiguous"
    if op.name not in ("ssd_chunk_scan", "bidirectional_chunk_scan", "depthwise_conv1d"):
        return [params]
    packed = json.loads(json.dumps(params))
    params["opts"]["packing"], packed["opts"]["packing"] = None, "seq_idx"
    return [params, packed]


def reference(op, params):
    """The float64 reference of the op's first output, on the op's arguments."""
    opts = params["opts"]
    if not op.differentiable:  # a decoding step: the float64 recurrence over its steps
        return lambda **a: op.reference(params)(**a)[0]
    if op.name == "rmsnorm_fn":
        return lambda **a: op.call(params, rms_norm_f64)(**a)[0]
    if op.name == "depthwise_conv1d":
        return lambda **a: op.call(params, depthwise_conv_ref)(**a)[0]
    if op.name in ("linear_scan", "sequential_scan"):
        return lambda a, b, h0=None: linear_scan_ref(a, b, h0, opts["reverse"])
    if op.name == "selective_scan":
        return lambda **a: selective_scan_ref(**a, delta_softplus=opts["delta_softplus"])
    if op.name == "attention_with_kvcache":
        return lambda **a: op.reference(params)(**a)[0]
    if op.name == "attention":
        from mamba_annotated.attention.reference import attention_ref
        return lambda q, k, v: attention_ref(q, k, v, opts["causal"], opts["softmax_scale"])[0]
    if op.name == "attention_varlen":
        from mamba_annotated.attention.reference import varlen_reference
        return lambda **a: varlen_reference(**a, causal=opts["causal"], softmax_scale=opts["softmax_scale"])[0]
    kw = dict(dt_softplus=opts["dt_softplus"], dt_limit=tuple(opts["dt_limit"] or (0.0, float("inf"))))
    if op.name == "ssd_chunk_scan":
        return lambda **a: ssd_quadratic_ref(**a, **kw)
    return lambda **a: bidirectional_ref(**a, **kw, shift=opts["shift"])


def reached(op, params, args, name, t, length):
    """(batch-independent) positions of the output the poison may reach: from t on (causal), and
    only in t's packed sequence; for attention, the rows whose window holds key t (k, v) or row t
    (q); for the bidirectional op, t's packed sequence; for the convolution, the positions of t's
    packed sequence whose window holds t. For attention over a KV cache, (batch,
    length): each sequence's own rows (its keys sit at positions of its own,
    :meth:`cases.AttentionWithKVCache.reach`); over packed sequences, the rows of t's sequence
    (:meth:`cases.AttentionVarlen.reach`)."""
    if op.name in ("attention_with_kvcache", "attention_varlen"):
        return op.reach(params, args, name, t)
    positions = torch.arange(length)
    if op.name == "rmsnorm_fn":  # row by row: a row's groups read nothing of the others
        return positions == t
    if op.name == "attention":
        if name == "q":
            return positions == t
        opts, d = params["opts"], params["dims"]
        window = resolve_window(opts["causal"], tuple(opts["window_size"]), d["Lk"])
        return window_mask(d["Lq"], d["Lk"], window)[:, t]
    same_sequence = positions >= 0
    if args.get("seq_idx") is not None or args.get("cu_seqlens") is not None:
        ids = packed_seq_idx(args.get("seq_idx"), args.get("cu_seqlens"), length)[0].cpu()
        same_sequence = ids == ids[t]
    if op.name == "depthwise_conv1d":  # the windows that hold t, within its sequence
        return same_sequence & op.reach(params, t, positions)
    return same_sequence if op.name == "bidirectional_chunk_scan" else same_sequence & (positions >= t)


def probe(op, params, leaves, name, t, value):
    """What went wrong with ``value`` at position t of input ``name`` (empty: nothing)."""
    _, time_dim, out_dim = PROBES[op.name]
    fn = op.ours(params)
    with torch.no_grad():
        clean = fn(**op.views(params, leaves))[0]
        poisoned_leaves = {k: v.detach().clone() for k, v in leaves.items()}
        poisoned_leaves[name].select(time_dim, t).fill_(value)
        args = op.views(params, poisoned_leaves)
        out = fn(**args)[0]
        args64 = op.views(params, as64(poisoned_leaves))
        ref = reference(op, params)(**{k: v for k, v in args64.items() if k in ("a", "b", "h0") or
                                       op.name not in ("linear_scan", "sequential_scan")})
    length = out.shape[out_dim]
    reach = reached(op, params, args, name, t, length).to(out.device)
    shape = [1] * out.dim()
    shape[out_dim] = length
    if reach.dim() == 2:  # per sequence
        shape[0] = reach.shape[0]
    reach = reach.view(shape).expand(out.shape)
    problems = []
    before = ~reach
    changed = (out[before] != clean[before]) & ~(out[before].isnan() & clean[before].isnan())
    if changed.any():
        where = before.nonzero()[changed.nonzero()[:, 0]][:, out_dim].unique().tolist()
        problems.append(f"{int(changed.sum())} outputs it cannot reach changed (positions {where[:8]})")
    if op.name in ("attention", "attention_varlen", "attention_with_kvcache"):  # every row that sees it: in full
        mismatch = out[reach].isfinite()
    elif op.name == "bidirectional_chunk_scan":  # which of t's sequence read it: tests/test_bidirectional.py
        mismatch = torch.zeros(1, dtype=torch.bool)
    else:
        mismatch = out[reach].isfinite() != ref.to(out.device)[reach].isfinite()
    if mismatch.any():
        problems.append(f"{int(mismatch.sum())} of {int(reach.sum())} reached outputs finite where the reference "
                        f"is not, or the reverse")
    try:
        forward_backward(op, params, {k: v.requires_grad_(leaves[k].requires_grad) for k, v in
                                      poisoned_leaves.items()}, seed=0)
    except Exception as e:
        problems.append(f"backward raised {type(e).__name__}: {str(e).splitlines()[0]}")
    return problems


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", "invalid value encountered")  # numpy's, in the interpreter
    report, failed = {}, False
    for name in args.ops:
        op = OPS[name]
        inputs, time_dim, _ = PROBES[name]
        r = report[name] = dict(cases=0, failures=0, problems=[])
        for params in plain_cases(op):
            seed_everything(0)
            leaves = op.inputs(params)
            packing = params["opts"].get("packing")
            for input_name in inputs:
                length = leaves[input_name].shape[time_dim]
                where = dict(first=0, middle=length // 2 + 1, last=length - 1, **{"25": min(25, length - 1)})
                for t in sorted({where[p] for p in args.positions}):
                    for label in args.values:
                        problems = probe(op, params, leaves, input_name, t, VALUES[label])
                        r["cases"] += 1
                        if problems:
                            r["failures"] += 1
                            line = (f"{name} ({packing or 'one sequence'}): {label} in {input_name} at t={t}: "
                                    + "; ".join(problems))
                            r["problems"].append(line)
                            print(line, flush=True)
            print(f"nonfinite {name} ({packing or 'one sequence'}): case {json.dumps(params['dims'], sort_keys=True)}",
                  flush=True)
        failed |= bool(r["failures"])
        print(f"nonfinite {name}: {r['cases']} probes, {r['failures']} failed", flush=True)
    write_report(args.json, "nonfinite", report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
