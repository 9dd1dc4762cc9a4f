"""Bitwise reproducibility (scripts/gpu_reliability.sh, step ``reproducible``): every op's
outputs and gradients are the same bits when a call is repeated on the same inputs.

Per op: its small cases (:meth:`cases.Op.small`) and ``--cases`` cases drawn as the sweep draws
them (in variants of ``--cases-per-variant`` seeds), each run forward and backward ``--runs``
times on the same tensors and upstream gradient, with the autotuner on (the first call of a shape
also runs the tuner's trials). Exit 1 on any difference.

    python scripts/reliability/reproducible.py --ops ssd_chunk_scan --cases 50 --json out.json
"""
import argparse
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import OPS, draw_case, forward_backward, same_bits  # noqa: E402
from cli import comma_list, write_report  # noqa: E402
from mamba_annotated.testing import seed_everything  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--cases", type=int, default=50, help="drawn cases per op, besides the small ones")
    parser.add_argument("--runs", type=int, default=3, help="calls compared per case")
    parser.add_argument("--seed", type=int, default=10_000)
    parser.add_argument("--cases-per-variant", type=int, default=10,
                        help="consecutive seeds that share a kernel variant (see cases.draw_case)")
    parser.add_argument("--time-budget", type=float, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.ops = comma_list(parser, args.ops, OPS, "--ops")
    return args


def differences(op, params, seed, runs):
    """Names of the outputs and gradients that changed between calls (empty: reproducible)."""
    seed_everything(seed)
    leaves = op.inputs(params)
    first_out, first_grads = forward_backward(op, params, leaves, seed)
    changed = set()
    for _ in range(runs - 1):
        outs, grads = forward_backward(op, params, leaves, seed)
        changed |= {f"output {i}" for i, (a, b) in enumerate(zip(first_out, outs)) if not same_bits(a, b)}
        changed |= {f"grad {k}" for k in grads if not same_bits(grads[k], first_grads[k])}
    return sorted(changed)


def main(argv=None):
    args = parse_args(argv)
    deadline = time.monotonic() + args.time_budget if args.time_budget is not None else None
    report, failed = {}, False
    for name in args.ops:
        op = OPS[name]
        cases = [(i, p) for i, p in enumerate(op.small())]
        cases += [(args.seed + i, draw_case(op, args.seed + i, args.cases_per_variant)) for i in range(args.cases)]
        r = report[name] = dict(cases=0, failures=0, reproducers=[])
        for seed, params in cases:
            # written after every case: a process killed by the device call's limit keeps its cases
            write_report(args.json, "reproducible", report)
            if deadline is not None and time.monotonic() > deadline:
                r["stopped_early"] = True
                break
            try:
                changed = differences(op, params, seed, args.runs)
            except Exception as e:
                changed = [f"raised {type(e).__name__}: {e}"]
            r["cases"] += 1
            if changed:
                r["failures"] += 1
                line = f"{name} seed={seed} {json.dumps(params, sort_keys=True)}: not reproducible: {changed}"
                r["reproducers"].append(line)
                print(line, flush=True)
        failed |= bool(r["failures"])
        print(f"reproducible {name}: {r['cases']} cases x {args.runs} calls, {r['failures']} not bitwise equal",
              flush=True)
    write_report(args.json, "reproducible", report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
