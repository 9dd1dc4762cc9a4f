"""Property sweep: random cases of every op against the float64 references, forward and every
gradient, with the autotuner on (scripts/gpu_reliability.sh, step ``sweep``).

Case i of an op has the seed ``--seed + i``: it draws the case's sizes, options and views and
seeds its tensors, and is printed with it. Runs of ``--cases-per-variant`` seeds share their
options, views and compiled sizes and differ in lengths, batch and heads: each variant is
compiled and tuned once, which on a GPU is most of a case's time. A failing case is shrunk
(smaller sizes, plain options, contiguous inputs, while it still fails, until the time budget runs
out; each smaller failing case is saved in the report as it is found) and printed as a one-line
reproducer:

    python scripts/reliability/sweep.py --ops ssd_chunk_scan --cases 1000 --time-budget 540
    python scripts/reliability/sweep.py --ops attention --seed 17 --params '{"dims": ...}'   (one case)
    python scripts/reliability/sweep.py --ops ssd_chunk_scan --rejudge book/data/reliability.json
                                        (every recorded failure once more, at its seed)

``--time-budget`` stops early (the cases run so far are reported); ``--json`` writes the report
that scripts/reliability/summary.py reads. Exit status 1 when a case failed.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import OPS, draw_case, reproducer, run_case, shrink  # noqa: E402
from cli import comma_list, write_report  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    parser.add_argument("--cases", type=int, default=1000, help="cases per op")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case")
    parser.add_argument("--cases-per-variant", type=int, default=50,
                        help="consecutive seeds that share a kernel variant (see cases.draw_case)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for all ops together")
    parser.add_argument("--params", default=None, help="run this one case (JSON, as a reproducer prints it)")
    parser.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    parser.add_argument("--shrink-budget", type=float, default=None,
                        help="seconds of shrinking per failure (default: until the time budget): an H100 process "
                             "once spent its whole 300 s shrinking its first case and ran no other")
    parser.add_argument("--verbose", action="store_true", help="print every case")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--rejudge", nargs="+", metavar="REPORT", default=None,
                        help="instead of drawing cases, run each reproducer of these reports (sweep reports, or "
                             "the summary's merged JSON) once at its seed, unshrunk: do they fail now?")
    parser.add_argument("--shard", default="0/1", help="with --rejudge, k/n: every n-th reproducer from the k-th")
    args = parser.parse_args(argv)
    args.ops = comma_list(parser, args.ops, OPS, "--ops")
    return args


def grow(largest, measured):
    for key, value in measured.items():
        largest[key] = max(largest.get(key, value), value)


def sweep_op(op, args, deadline, save=lambda report: None):
    """Run the cases of one op until done or the deadline; returns its report, and hands it to
    ``save`` after every case (a process killed by the device's time limit keeps what it ran)."""
    report = dict(cases=0, failures=0, unjudged=0, unjudged_reasons={}, largest={}, reproducers=[], yardsticks={},
                  stopped_early=False)
    for i in range(1 if args.params else args.cases):
        save(report)
        if out_of_time(deadline):
            report["stopped_early"] = True
            break
        seed = args.seed + i
        params = json.loads(args.params) if args.params else draw_case(op, seed, args.cases_per_variant)
        verdict = run_case(op, params, seed)
        report["cases"] += 1
        report["unjudged"] += bool(verdict.unjudged)
        note_unjudged(report["unjudged_reasons"], verdict.unjudged, seed)
        note_yardsticks(report["yardsticks"], verdict, seed)
        if args.verbose or verdict.failures:
            status = "FAIL " + "; ".join(verdict.failures) if verdict.failures else "ok"
            print(f"{op.name} seed={seed} {json.dumps(params, sort_keys=True)}: {status}", flush=True)
        if not verdict.failures:
            grow(report["largest"], op.measure(params))
            continue
        report["failures"] += 1
        # saved as drawn at once: shrinking reruns the case many times, and a process killed by the
        # device's time limit meanwhile must still report the failure
        report["reproducers"].append(dict(seed=seed, failures=verdict.failures, command=reproducer(op, params, seed),
                                          shrunk=False))
        save(report)
        if not args.no_shrink and not out_of_time(deadline):  # shrinking reruns it
            budget_end = time.monotonic() + args.shrink_budget if args.shrink_budget is not None else None
            shrink_deadline = min((end for end in (deadline, budget_end) if end is not None), default=None)
            params, verdict = shrink_and_save(op, params, seed, verdict, shrink_deadline, report, save)
        line = report["reproducers"][-1]["command"]
        print(f"  minimal: {'; '.join(verdict.failures) or 'passes once shrunk: flaky?'}\n  REPRO: {line}",
              flush=True)
        if any("CUDA error" in f or "illegal memory access" in f for f in verdict.failures):
            print(f"{op.name}: the CUDA context is lost; stopping this op", flush=True)
            report["stopped_early"] = True
            break
    save(report)
    return report


MAX_UNJUDGED_REASONS = 8


def note_unjudged(reasons, unjudged, seed):
    """Keep why an output went unjudged (the first line of each reason), each distinct reason once
    with the first seed that gave it (an H100 shard once left 50 of its 59 cases' bfloat16 dA
    unjudged, and its report could not say why); at most MAX_UNJUDGED_REASONS of them."""
    for reason in unjudged:
        reason = reason.splitlines()[0]
        if reason not in reasons and len(reasons) < MAX_UNJUDGED_REASONS:
            reasons[reason] = seed


def note_yardsticks(pairs, verdict, seed):
    """Keep, per output judged by "k x the same computation's error", one [seed, ours, the same
    computation's] per case (relative errors against float64, 3 digits): the summary reads from them
    how our error compares with the yardstick's over all the cases, not one case at a time."""
    for name, theirs in verdict.yardsticks.items():
        pairs.setdefault(name, []).append([seed, float(f"{verdict.errors[name]:.3g}"), float(f"{theirs:.3g}")])


def out_of_time(deadline):
    return deadline is not None and time.monotonic() > deadline


def failing_names(verdict):
    """The outputs and gradients a verdict failed, in its order ("out", "grad A", ...)."""
    return [failure.split(":")[0] for failure in verdict.failures]


def shrink_and_save(op, params, seed, verdict, deadline, report, save):
    """Shrink a failing case until the deadline, saving each smaller failing case as it is found
    (``shrunk: "partly"``); when time is left, rerun the smallest once more, which tells a flaky
    failure (``shrunk: True``). Returns the smallest case and its verdict.

    A smaller case counts only if it still fails the way the drawn case failed first (its first
    failing output or gradient): an H100 sweep's bidirectional case with a wrong output and NaN
    gradients shrank to a 16-bit dA case, a different and known defect, and the wrong output was
    lost."""
    latest = {"failing": verdict, "tried": verdict}
    first = failing_names(verdict)[0]

    def still_fails(p, s):
        latest["tried"] = run_case(op, p, s)
        return first in failing_names(latest["tried"])

    def found(p):
        latest["failing"] = latest["tried"]
        report["reproducers"][-1] = dict(seed=seed, failures=latest["failing"].failures,
                                         command=reproducer(op, p, seed), shrunk="partly")
        save(report)

    params = shrink(op, params, seed, still_fails, found=found, out_of_time=lambda: out_of_time(deadline))
    if out_of_time(deadline):
        return params, latest["failing"]
    verdict = run_case(op, params, seed)
    report["reproducers"][-1] = dict(seed=seed, failures=verdict.failures, command=reproducer(op, params, seed),
                                     shrunk=True)
    return params, verdict


def recorded_reproducers(paths, ops):
    """(op name, seed, params, failures then) of every reproducer in ``paths`` for ``ops``: sweep
    reports ({"item": "sweep", "ops": ...}) or the summary's merged JSON ({"reports": {"sweep": ...}})."""
    found = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        by_op = report["ops"] if report.get("item") == "sweep" else report["reports"]["sweep"]
        for name in ops:
            for r in by_op.get(name, {}).get("reproducers", []):
                params = json.loads(r["command"].split("--params ", 1)[1].strip("'"))
                found.append((name, r["seed"], params, r["failures"]))
    return found


def rejudge(args):
    """Run the recorded reproducers again (``--rejudge``): after a fix, or a change of a rule."""
    k, n = (int(part) for part in args.shard.split("/"))
    rows = []
    for name, seed, params, before in recorded_reproducers(args.rejudge, args.ops)[k::n]:
        verdict = run_case(OPS[name], params, seed)
        rows.append(dict(op=name, seed=seed, failures_then=before, failures_now=verdict.failures,
                         unjudged=verdict.unjudged, errors=verdict.errors, yardsticks=verdict.yardsticks))
        print(f"{name} seed {seed}: {'; '.join(verdict.failures) or 'passes'}"
              f"{' (unjudged: ' + '; '.join(verdict.unjudged) + ')' if verdict.unjudged else ''}", flush=True)
        write_report(args.json, "rejudge", rows)
    still = sum(bool(row["failures_now"]) for row in rows)
    print(f"rejudged {len(rows)} reproducers: {still} still fail", flush=True)
    return 1 if still else 0


def main(argv=None):
    args = parse_args(argv)
    if args.rejudge:
        return rejudge(args)
    start = time.monotonic()
    deadline = start + args.time_budget if args.time_budget is not None else None
    reports = {}

    def save(name, report):
        reports[name] = report
        write_report(args.json, "sweep", reports, seed=args.seed)

    for name in args.ops:
        op_start = time.monotonic()
        reports[name] = sweep_op(OPS[name], args, deadline, lambda report: save(name, report))
        reports[name]["seconds"] = round(time.monotonic() - op_start, 1)
        r = reports[name]
        print(f"sweep {name}: {r['cases']} cases, {r['failures']} failed, {r['unjudged']} with an unjudged output, "
              f"{r['seconds']} s{' (stopped by the time budget)' if r['stopped_early'] else ''}; "
              f"largest passed {r['largest']}", flush=True)
        for reason, seed in r["unjudged_reasons"].items():
            print(f"  unjudged (first at seed {seed}): {reason}", flush=True)
    write_report(args.json, "sweep", reports, seed=args.seed)
    return 1 if any(r["failures"] for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
