"""The reliability summary (scripts/gpu_reliability.sh, step ``summary``): reads the JSON reports
of the other steps and prints one table, op by item: cases run, failures, sanitizer errors, the
largest sizes passed; writes the merged report as JSON (for the issue's closing note and the book).

    python scripts/reliability/summary.py /tmp/reliability/*.json --json book/data/reliability.json
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from sanitize import describe_hazards

OPS = ("linear_scan", "sequential_scan", "selective_scan", "ssd_chunk_scan", "bidirectional_chunk_scan", "attention",
       "attention_varlen", "attention_with_kvcache", "ssd_state_update", "selective_state_update", "rmsnorm_fn",
       "depthwise_conv1d")
ITEMS = ("sweep", "sanitize", "reproducible", "large", "nonfinite", "leaks")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", help="JSON reports of the steps (several sweep files are added up)")
    parser.add_argument("--json", default=None, help="write the merged report here")
    parser.add_argument("--about", default=None,
                        help="where the reports come from (device, commit, date), kept in the JSON beside the table")
    return parser.parse_args(argv)


def merge(reports):
    """{item: {op: report}}; the sweep's cases, failures and largest sizes add up over files."""
    merged = {}
    for report in reports:
        item = merged.setdefault(report["item"], {})
        for op, r in report["ops"].items():
            if report["item"] != "sweep" or op not in item:
                item[op] = r
                continue
            old = item[op]
            for key in ("cases", "failures", "unjudged"):
                old[key] += r[key]
            old["reproducers"] += r["reproducers"]
            reasons = old.setdefault("unjudged_reasons", {})
            for reason, seed in r.get("unjudged_reasons", {}).items():  # absent from reports before they were kept
                reasons[reason] = min(seed, reasons.get(reason, seed))
            for key, value in r["largest"].items():
                old["largest"][key] = max(old["largest"].get(key, value), value)
            pairs = old.setdefault("yardsticks", {})
            for name, more in r.get("yardsticks", {}).items():  # absent from reports before they were kept
                pairs[name] = pairs.get(name, []) + more
    return merged


def against_yardstick(name, pairs):
    """One line on how our error compares with the same computation's over every case that kept
    the pair ([seed, ours, theirs] each): the quartiles of the ratio (1 where both are exactly 0), how
    often ours is the smaller, and the largest ratio with its seed."""
    ratios = sorted((ours / theirs if theirs > 0 else (1.0 if ours == 0 else math.inf), seed)
                    for seed, ours, theirs in pairs)
    values = [ratio for ratio, _ in ratios]
    q1, median, q3 = (statistics.quantiles(values, n=4) if len(values) > 1 else values * 3)
    smaller = sum(ratio < 1 for ratio in values)
    return (f"{name}: {len(values)} cases, our error / the same computation's: median {median:.2g} "
            f"(quartiles {q1:.2g}-{q3:.2g}), ours the smaller in {smaller}, largest {values[-1]:.3g} "
            f"(seed {ratios[-1][1]})")


def cell(item, r):
    """One table cell: what ran and what failed."""
    if r is None:
        return "not run"
    if item == "sweep":
        return f"{r['cases']} cases, {r['failures']} failed" + (f", {r['unjudged']} unjudged" if r["unjudged"] else "")
    if item == "sanitize":
        errors = {tool: v["errors"] for tool, v in r.items()}
        bad = {t: e for t, e in errors.items() if e != 0 or r[t]["exit"] != 0}
        return f"{len(errors)} tools, " + (f"errors {bad}" if bad else "0 errors")
    if item == "reproducible":
        return f"{r['cases']} cases, {r['failures']} differ"
    if item == "large":
        return "pass" if not r["failures"] else f"{len(r['failures'])} failed"
    if item == "nonfinite":
        return f"{r['cases']} probes, {r['failures']} failed"
    return f"{r['calls']} calls, " + ("FAIL" if r["failed"] else f"grew {max(r['leaked_bytes'], 0)} B, graphs equal")


def failed(item, r):
    if r is None:
        return False
    if item == "sanitize":
        return any(v["errors"] != 0 or v["exit"] != 0 for v in r.values())
    if item == "leaks":
        return r["failed"]  # leaks.py's verdict: memory grew, or a CUDA graph differed
    return bool(r["failures"])


def main(argv=None):
    args = parse_args(argv)
    merged = merge(json.loads(Path(p).read_text()) for p in args.reports)
    rows = []
    for op in OPS:
        row = {"op": op}
        for item in ITEMS:
            row[item] = cell(item, merged.get(item, {}).get(op))
        sweep = merged.get("sweep", {}).get(op)
        large = merged.get("large", {}).get(op)
        row["largest passed"] = "; ".join(filter(None, [
            f"sweep {sweep['largest']}" if sweep and sweep["largest"] else "",
            f"large: {large['size']}" if large and not large["failures"] and "size" in large else ""]))
        rows.append(row)
    columns = ["op", *ITEMS, "largest passed"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    for item, ops in merged.items():
        for op, r in ops.items():
            if item == "sanitize":
                for tool, v in r.items():
                    for line in describe_hazards(v.get("hazards", [])):
                        print(f"sanitize {op} {tool}: {line}")
            if item in ("sanitize", "leaks"):
                continue
            for reason, seed in r.get("unjudged_reasons", {}).items():
                print(f"{item} {op}: unjudged (first at seed {seed}): {reason}")
            for name, pairs in r.get("yardsticks", {}).items():
                print(f"{item} {op}: {against_yardstick(name, pairs)}")
            for line in r.get("reproducers") or r.get("problems") or r.get("failures") or []:
                print(f"{item} {op}: {line if isinstance(line, str) else line['command']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(about=args.about, table=rows, reports=merged), indent=1))
    any_failed = any(failed(item, r) for item, ops in merged.items() for r in ops.values())
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
