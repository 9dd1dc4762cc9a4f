"""The scoreboard: every stored benchmark run (book/data/*_bench.json) as tables of ours against each
peer, with the verdict in words, and a roofline placing the kernels against the measured copy
bandwidth, matmul rate and exponential rate.

The book's appendix page renders this at build time (book/_ext/scoreboard_page.py), so re-running
scripts/gpu_benchmarks.sh and rebuilding the book updates the page. From a terminal:

    python benchmarks/scoreboard.py [--data book/data]          # the tables, as text
    python benchmarks/scoreboard.py --roofline roofline.png     # and the plot

"Speed" throughout is the peer's time over ours (above 1: ours is faster); for throughputs
(tokens per second) it is ours over the peer's, which means the same. Plain Python and
matplotlib: no torch, so the book builds without importing the kernels.
"""
import argparse
import ast
import dataclasses
import datetime
import json
import math
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from costs import CHUNK, attention_forward_bytes, bidirectional_min_bytes, scan_intensity, ssd_min_bytes  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent.parent / "book" / "data"
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass
class Table:
    title: str
    source: str                      # the file under book/data it is read from
    device: str
    columns: list
    rows: list                       # lists of strings, one per column
    verdict: list                    # sentences


def load(name, data=DATA):
    return json.loads((pathlib.Path(data) / name).read_text())


def number(x, digits=3):
    """A time, rate or size with ``digits`` significant digits; a dash where it was not measured."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def times(speed):
    return "–" if speed is None else f"{speed:.2f}×"


PAR = 0.02  # speeds within 2% of 1 are "on par": about the spread of repeated do_bench medians


class Verdict:
    """Collects (case, peer, speed) and says, per peer, in how many cases ours is faster, on par or
    slower, and the range."""

    def __init__(self):
        self.speeds = {}

    def add(self, peer, case, speed):
        if speed is not None and not math.isnan(speed):
            self.speeds.setdefault(peer, []).append((speed, case))
        return speed

    def sentences(self, ours="ours"):
        out = []
        for peer, speeds in self.speeds.items():
            speeds.sort()
            (low, low_case), (high, high_case) = speeds[0], speeds[-1]
            if len(speeds) == 1:
                word = ("on par with" if abs(low - 1) <= PAR else "faster than" if low > 1 else "slower than")
                out.append(f"{ours} is {word} {peer}: {low:.2f}× ({low_case}).")
                continue
            faster = sum(s > 1 + PAR for s, _ in speeds)
            slower = sum(s < 1 - PAR for s, _ in speeds)
            par = len(speeds) - faster - slower
            counts = ", ".join(f"{word} in {n}" for word, n in (("on par (within 2%)", par), ("slower", slower)) if n)
            counts = f", {counts}" if counts else ""
            out.append(f"{ours} is faster than {peer} in {faster} of {len(speeds)} cases{counts}: "
                       f"from {low:.2f}× ({low_case}) to {high:.2f}× ({high_case}).")
        return out


def bars_table(title, source, device, bars, columns):
    """The speed bars a benchmark script checks itself (``bars`` in its JSON) and whether they hold;
    ``columns`` maps the keys that say where a bar was measured to their headings."""
    rows = [[bar["bar"], *(str(bar[k]) for k in columns), f"{bar['ratio']:.2f}", bar["target"],
             "holds" if bar["holds"] else "does not hold"] for bar in bars]
    held = sum(bar["holds"] for bar in bars)
    return Table(title, source, device, ["bar", *columns.values(), "ratio", "target", "verdict"], rows,
                 [f"{held} of {len(bars)} bars hold."])


def linear_scan(data):
    d = load("linear_scan_bench.json", data)
    rows = d["sections"]["linear_scan"]
    peers = sorted({r["impl"] for r in rows} - {"linear_scan"})
    verdict, out = Verdict(), []
    for ours in (r for r in rows if r["impl"] == "linear_scan"):
        case = f"{ours['shape']} {ours['dtype']} {ours['pass_']}"
        cells = []
        for peer in peers:
            theirs = next((r for r in rows if r["impl"] == peer and r["shape"] == ours["shape"]
                           and r["dtype"] == ours["dtype"] and r["pass_"] == ours["pass_"]), None)
            speed = verdict.add(peer, case, theirs and theirs["ms"] / ours["ms"])
            cells.append("–" if theirs is None else f"{number(theirs['ms'])} ({times(speed)})")
        out.append([ours["shape"], ours["dtype"], ours["pass_"], number(ours["ms"]), f"{ours['pct_floor']:.0f}%",
                    *cells])
    floor = [r["pct_floor"] for r in rows if r["impl"] == "linear_scan" and r["dtype"] == "float32"]
    sentences = verdict.sentences("linear_scan") + [
        f"In float32 it runs at {min(floor):.0f}–{max(floor):.0f}% of the copy floor "
        f"({d['copy_GBps']:,.0f} GB/s measured)."]
    return [Table("linear_scan against accelerated-scan (ms; speed in brackets)", "linear_scan_bench.json",
                  d["device"], ["shape", "dtype", "pass", "ours ms", "of copy floor", *peers], out, sentences)]


def selective_scan(data):
    d = load("selective_scan_cuda_bench.json", data)
    verdict, rows = Verdict(), []
    shapes = {}  # "long (8, 2048, 16, 4096)": the name in the rows, the shape in the title
    for r in d["rows"]:
        name, _, shape = r["shape"].partition(" (")
        shapes[name] = f"({shape}" if shape else ""
        verdict.add(f"selective_scan_cuda in {r['dtype']} {r['passes']}", f"{name}, {r['variant']}", r["speedup"])
        rows.append([name, r["dtype"], r["variant"], r["passes"], number(r["ours_ms"]), number(r["cuda_ms"]),
                     times(r["speedup"])])
    named = "; ".join(f"{name} {shape}" for name, shape in shapes.items())
    tables = [Table(f"selective_scan against mamba_ssm's CUDA kernel (ms; shapes (batch, dim, N, L): {named})",
                    "selective_scan_cuda_bench.json",
                    d["device"], ["shape", "dtype", "variant", "passes", "ours", "selective_scan_cuda", "speed"],
                    rows, verdict.sentences("selective_scan"))]
    d = load("selective_scan_bench.json", data)
    verdict, rows = Verdict(), []
    ours = {r["passes"]: r for r in d["rows"] if r["implementation"] == "selective_scan (ours)"}
    for r in d["rows"]:
        mine = ours[r["passes"]]
        speed = None if r is mine else verdict.add(r["implementation"], r["passes"], r["ms"] / mine["ms"])
        rows.append([r["implementation"], r["passes"], number(r["ms"]), f"{r['pct_of_floor']:.2g}%", times(speed),
                     r["timing"]])
    shape = f"({d['batch']}, {d['dim']}, {d['dstate']}, {d['length']}) {d['dtype']}"
    floors = d["floors"]["forward"]
    tables.append(Table(f"selective_scan against every implementation at {shape} (ms)", "selective_scan_bench.json",
                        d["device"], ["implementation", "passes", "ms", "of floor", "speed", "timing"], rows,
                        verdict.sentences("selective_scan") + [
                            f"The forward's floor is its exponentials ({floors['exp_ms']:.3f} ms), not its bytes "
                            f"({floors['memory_ms']:.3f} ms) nor its multiply-adds ({floors['fma_ms']:.3f} ms)."]))
    return tables


# bench_ssd.py --variants: chunks 64 and 128 and packed sequences, a run of its own
VARIANTS_FILE = "ssd_variants_bench.json"


def ssd_variants_run(data):
    """The stored run of SSD's other chunk sizes and packed sequences, or None before the first."""
    return load(VARIANTS_FILE, data) if (pathlib.Path(data) / VARIANTS_FILE).exists() else None


def ssd(data):
    d = load("ssd_bench.json", data)
    verdict, rows = Verdict(), []
    for ours in (r for r in d["rows"] if r["impl"] == "ours"):
        peer = next(r for r in d["rows"] if r["impl"] == "mamba_ssm" and r["shape"] == ours["shape"]
                    and r["pass_"] == ours["pass_"])
        speed = verdict.add("mamba_chunk_scan_combined", f"{ours['shape']} {ours['pass_']}", peer["ms"] / ours["ms"])
        rows.append([ours["shape"], ours["pass_"], number(ours["ms"]), number(ours["TFLOPs"]),
                     f"{ours['pct_floor']:.0f}%", number(peer["ms"]), times(speed),
                     f"{number(ours['peak_MB'])} / {number(peer['peak_MB'])}"])
    tables = [Table("ssd_chunk_scan against mamba_ssm's mamba_chunk_scan_combined (bfloat16, chunk 256)",
                    "ssd_bench.json", d["device"],
                    ["shape (b, L, h, p, n)", "pass", "ours ms", "TFLOP/s", "of floor", "mamba_ssm ms", "speed",
                     "peak MiB ours / theirs"], rows, verdict.sentences("ssd_chunk_scan"))]
    run = ssd_variants_run(data)
    variants = [r for r in run["variants"] if r["impl"] == "ours"] if run else []
    if variants:
        verdict, rows = Verdict(), []
        for r in variants:
            peer = next((q for q in run["variants"] if q["impl"] == "mamba_ssm"
                         and (q["chunk"], q["packed"], q["pass_"]) == (r["chunk"], r["packed"], r["pass_"])), None)
            speed = verdict.add("mamba_chunk_scan_combined", f"chunk {r['chunk']}, {r['packed']} sequences, "
                                f"{r['pass_']}", r["speedup"] if peer else None)
            rows.append([r["chunk"], r["packed"], r["pass_"], number(r["ms"]), number(peer and peer["ms"]),
                         times(speed), "–" if r["packed"] == 1 else times(r["packing_cost"])])
        tables.append(Table(f"ssd_chunk_scan at other chunk sizes and with packed sequences (seq_idx), at "
                            f"{variants[0]['shape']}", VARIANTS_FILE, run["device"],
                            ["chunk", "sequences", "pass", "ours ms", "mamba_ssm ms", "speed",
                             "time over one sequence's"], rows, verdict.sentences("ssd_chunk_scan")))
        if run.get("packing_stages"):
            tables.append(packing_table(run))
    return tables


def packing_table(run):
    """Where the packed call's extra forward+backward time goes, kernel by kernel (bench_ssd.py's
    packing breakdown), against the extra time of the whole call in the same run."""
    stages = run["packing_stages"]
    rows = [[r["stage"], f"{r['calls_one']} / {r['calls_packed']}", number(r["ms_one"]), number(r["ms_packed"]),
             f"{r['extra_ms']:+.3f}"] for r in stages]
    whole = {r["packed"]: r["ms"] for r in run["variants"]
             if r["impl"] == "ours" and r["chunk"] == CHUNK and r["pass_"] == "fwd+bwd"}
    kernels = stages[-1]["extra_ms"]  # the last row sums the kernels
    sentences = [f"Summed over its kernels, the packed pass takes {kernels:+.3f} ms per forward and backward."]
    if len(whole) == 2:
        extra = whole[max(whole)] - whole[1]
        between = extra - kernels
        # the two are measured differently (medians of whole calls with the L2 cache flushed before each,
        # kernel times from the profiler): a difference within a tenth of the extra time says nothing
        if abs(between) <= 0.1 * abs(extra):
            reading = "is within a tenth of it, so the extra time is spent in the kernels"
        elif between > 0:
            reading = "is mostly time between the kernels, where the GPU waits for the host"
        else:
            reading = ("is negative: the kernels' extra time is more than the whole call's, so the two "
                       "measurements disagree beyond their noise")
        sentences.append(f"The whole call took {extra:+.3f} ms more (the table above). The difference, "
                         f"{between:+.3f} ms, {reading}; the two are measured differently (medians of whole "
                         f"calls with the L2 cache flushed before each, and kernel times from the profiler), so "
                         f"it is an estimate.")
    return Table("where the packed sequences' extra time goes: each kernel of ssd_chunk_scan's forward and "
                 "backward pass, one sequence per row and packed", VARIANTS_FILE, run["device"],
                 ["kernel", "launches (one / packed)", "ms, one sequence", "ms, packed", "extra ms"], rows, sentences)


def bidirectional(data):
    d = load("bidirectional_bench.json", data)
    impls = list(dict.fromkeys(r["impl"] for r in d["rows"]))
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in d["rows"]):
        for pass_ in ("fwd", "fwd+bwd"):
            ms = {r["impl"]: r["ms"] for r in d["rows"] if r["shape"] == shape and r["pass_"] == pass_}
            rows.append([shape, pass_, *(number(ms.get(i)) for i in impls)])
    return [Table(f"bidirectional_chunk_scan and the ways to compute it (ms, bfloat16, chunk {d['chunk']})",
                  "bidirectional_bench.json", d["device"], ["shape (b, L, h, p, n)", "pass", *impls], rows, []),
            bars_table("bidirectional_chunk_scan: the speed bars", "bidirectional_bench.json", d["device"], d["bars"],
                       {"shape": "shape (b, L, h, p, n)", "pass_": "pass"})]


def attention(data):
    d = load("attention_bench.json", data)
    ours_name = "ours (split)"
    others = list(dict.fromkeys(r["impl"] for r in d["rows"] if r["impl"] != ours_name))
    tables = []
    for pass_, label in (("fwd", "forward"), ("bwd", "backward")):
        # the other backward schedules of chapter 7 share the forward kernel: compared in the backward only
        columns = [i for i in others if pass_ == "bwd" or not i.startswith("ours")]
        verdict, rows = Verdict(), []
        for ours in (r for r in d["rows"] if r["impl"] == ours_name):
            case = f"d {ours['d']}, N {ours['N']}{', causal' if ours['causal'] else ''}"
            cells = []
            for impl in columns:
                theirs = next((r for r in d["rows"] if r["impl"] == impl and r["d"] == ours["d"]
                               and r["N"] == ours["N"] and r["causal"] == ours["causal"]), None)
                speed = theirs and theirs[f"{pass_}_ms"] / ours[f"{pass_}_ms"]
                if not impl.startswith("ours"):
                    verdict.add(impl, case, speed)
                cells.append(times(speed))
            rows.append([ours["d"], ours["N"], "yes" if ours["causal"] else "no", number(ours[f"{pass_}_ms"]),
                         number(ours[f"{pass_}_tflops"]), *cells])
        others_too = " and our other backward schedules" if pass_ == "bwd" else ""
        tables.append(Table(f"attention's {label} pass against SDPA's backends{others_too} (bfloat16, batch "
                            f"{d['batch']}, {d['heads']} heads; ours: {ours_name}, the default; "
                            "speed: theirs over ours)",
                            "attention_bench.json", d["device"],
                            ["d", "N", "causal", "ours ms", "TFLOP/s", *columns], rows,
                            verdict.sentences(f"attention's {label}")))
    return tables


def attention_features(data):
    d = load("attention_features_bench.json", data)
    verdict, rows = Verdict(), []
    keys = ("case", "d", "batch", "N")
    for ours in (r for r in d["rows"] if r["impl"] == "ours"):
        flex = next((r for r in d["rows"] if r["impl"] == "flex" and all(r[k] == ours[k] for k in keys)), None)
        cells = []
        for pass_ in ("fwd", "bwd"):
            case = f"{ours['case']}, d {ours['d']}, N {ours['N']}, {pass_}"
            speed = verdict.add("FlexAttention", case, flex and flex[f"{pass_}_ms"] / ours[f"{pass_}_ms"])
            cells += [number(ours[f"{pass_}_ms"]), number(flex and flex[f"{pass_}_ms"]), times(speed)]
        rows.append([*(str(ours[k]) for k in keys), *cells])
    return [Table(f"attention's features (windows, soft-capping, ALiBi) against FlexAttention (ms, {d['dtype']}, "
                  f"{d['heads']} heads)", "attention_features_bench.json", d["device"],
                  [*keys, "ours fwd", "flex fwd", "speed", "ours bwd", "flex bwd", "speed"], rows,
                  verdict.sentences("attention"))]


def attention_dropout(data):
    """What dropout costs against the same attention without it, both timed in the features run."""
    d = load("attention_features_bench.json", data)
    keys = ("d", "batch", "N")
    rows, factors = [], []
    for mine in (r for r in d["rows"] if r["impl"] == "ours" and r["case"].startswith("dropout")):
        dense = next(r for r in d["rows"] if r["impl"] == "ours" and r["case"] == "dense"
                     and all(r[k] == mine[k] for k in keys))
        cost = [mine[f"{p}_ms"] / dense[f"{p}_ms"] for p in ("fwd", "bwd")]
        factors += cost
        rows.append([mine["case"], *(str(mine[k]) for k in keys), number(dense["fwd_ms"]), number(mine["fwd_ms"]),
                     times(cost[0]), number(dense["bwd_ms"]), number(mine["bwd_ms"]), times(cost[1])])
    return [Table(f"attention with dropout against the same attention without it (ms, {d['dtype']}, {d['heads']} "
                  "heads; cost: the time with dropout over the time without)", "attention_features_bench.json",
                  d["device"], ["case", *keys, "dense fwd", "dropout fwd", "cost", "dense bwd", "dropout bwd", "cost"],
                  rows, [f"Dropout multiplies the time by {min(factors):.1f} to {max(factors):.1f}."])]


def decoding(data):
    d = load("decoding_bench.json", data)
    cases = list(dict.fromkeys((r["batch"], r["N"]) for r in d["rows"]))
    graphed = " (CUDA graph)"  # replays of a captured call, compared with each other
    impls = list(dict.fromkeys(r["impl"] for r in d["rows"]))
    peers = [i for i in impls if i.startswith("sdpa")]
    graph_columns = ["ours" + graphed] if "ours" + graphed in impls else []
    verdict, rows = Verdict(), []
    for batch, n in cases:
        found = {r["impl"]: r for r in d["rows"] if r["batch"] == batch and r["N"] == n}
        ours, kernels = found["ours"], found["ours (kernels)"]
        cells = [number(found[c]["ms"]) for c in graph_columns]
        for peer in peers:
            theirs = found.get(peer)  # a backend that refused the case has no row
            mine = found["ours" + graphed] if peer.endswith(graphed) else ours
            speed = verdict.add(peer, f"batch {batch}, N {n}", theirs["ms"] / mine["ms"]) if theirs else None
            cells.append(f"{number(theirs['ms'])} ({times(speed)})" if theirs else "–")
        rows.append([batch, n, ours["splits"], number(ours["ms"]), f"{ours['% floor']:.0f}%", number(kernels["ms"]),
                     *cells])
    return [Table(f"a decoding step over a contiguous KV cache ({d['heads']} heads over {d['kv_heads']} kv heads, "
                  f"head dim {d['head_dim']}, {d['dtype']}, one query; ms, speed in brackets, a CUDA graph's "
                  "replay against ours replayed; floor: the cache's bytes over the measured copy bandwidth)",
                  "decoding_bench.json", d["device"],
                  ["batch", "N", "splits", "ours ms", "of copy floor", "our kernels alone ms", *graph_columns, *peers],
                  rows,
                  verdict.sentences("attention_with_kvcache"))]


def gated_norm(data):
    d = load("gated_norm_bench.json", data)
    peers = [i for i in dict.fromkeys(r["impl"] for r in d["results"]) if i != "ours"]
    verdict, by_kernels, rows = Verdict(), Verdict(), []
    for ours in (r for r in d["results"] if r["impl"] == "ours"):
        case = f"groups {ours['groups']}, norm before gate {ours['norm_before_gate']}, {ours['pass_']}"
        cells = []
        for peer in peers:
            theirs = next(r for r in d["results"] if r["impl"] == peer and r["groups"] == ours["groups"]
                          and r["norm_before_gate"] == ours["norm_before_gate"] and r["pass_"] == ours["pass_"])
            cell = f"{number(theirs['ms'])} ({times(verdict.add(peer, case, theirs['ms'] / ours['ms']))}"
            if "kernel_ms" in ours:
                speed = by_kernels.add(peer, case, theirs["kernel_ms"] / ours["kernel_ms"])
                cell += f"; kernels {number(theirs['kernel_ms'])}, {times(speed)}"
            cells.append(cell + ")")
        # runs stored before 2026-12-01 lack the kernels' own time
        kernels = ([number(ours["kernel_ms"]), f"{ours['pct_floor_kernels']:.0f}%"] if "kernel_ms" in ours
                   else ["–", "–"])
        rows.append([ours["groups"], str(ours["norm_before_gate"]), ours["pass_"], number(ours["ms"]),
                     f"{ours['pct_floor']:.0f}%", *kernels, *cells])
    return [Table(f"the gated RMSNorm against mamba_ssm's and torch's ({d['rows']} rows of width {d['width']}, "
                  f"{d['dtype']}; ms, speed in brackets; 'kernels': the GPU time of the kernels one call "
                  "launches, without the host's, and the speed by it)", "gated_norm_bench.json", d["device"],
                  ["groups", "norm before gate", "pass", "ours ms", "of copy floor", "our kernels ms",
                   "kernels of copy floor", *peers], rows,
                  verdict.sentences("the gated norm") + by_kernels.sentences("by the kernels' GPU time, the gated norm"))]


def host_cost(data):
    d = load("host_cost_bench.json", data)
    verdict, rows = Verdict(), []
    for r in d["rows"]:
        # the script's own statistic: the median of paired rounds' ratios (ours / peer), less noisy than
        # the ratio of the two medians
        speed = verdict.add(r["peer"], f"{r['op']}, {r['pass_']}", 1 / r["ratio"])
        rows.append([r["op"], r["pass_"], number(r["ours_us"]), r["peer"], number(r["peer_us"]), times(speed),
                     number(r["graph_us"])])
    return [Table(f"host cost of one call at small shapes (µs per call, {d['calls']} calls, torch {d['torch']}; "
                  "speed: the median over paired rounds of the peer's time over ours, not the ratio of the two "
                  "columns' medians)",
                  "host_cost_bench.json", d["device"],
                  ["op", "pass", "ours µs", "peer", "peer µs", "speed", "ours in a CUDA graph µs"], rows,
                  verdict.sentences("ours"))]


MODEL_PEER, GRAPH = "mamba_ssm Mamba2", ", CUDA graph"  # bench_models.py's names: the peer; decoding by graph replay


def model_peer_row(rows, r):
    """The peer's row that ``r`` is measured against: the same pass and shape, and, for decoding
    from a CUDA graph, the peer's decoding from one."""
    impl = MODEL_PEER + (GRAPH if r["impl"].endswith(GRAPH) else "")
    return next(o for o in rows if o["impl"] == impl and o["pass_"] == r["pass_"] and o["batch"] == r["batch"]
                and o["seq_len"] == r["seq_len"])


def models(data):
    d = load("models_bench.json", data)
    m = d["model"]
    verdicts, rows = {}, []  # one per implementation of ours
    for r in d["rows"]:
        peer = model_peer_row(d["rows"], r)
        speed = r["tokens_per_s"] / peer["tokens_per_s"]
        if r["impl"] != peer["impl"]:
            verdicts.setdefault(r["impl"], Verdict()).add(
                "mamba_ssm's Mamba2" + (" decoding from a CUDA graph" if peer["impl"].endswith(GRAPH) else ""),
                f"{r['pass_']}, batch {r['batch']}, L {r['seq_len']}", speed)
        rows.append([r["pass_"], r["batch"], r["seq_len"], r["impl"], number(r["tokens_per_s"]), times(speed),
                     number(r.get("peak_GB"))])
    title = (f"a Mamba-2 language model ({m['n_layer']} layers, width {m['d_model']}, state {m['d_state']}) "
             "on our kernels and on mamba_ssm's modules (tokens/s; speed: each row's over mamba_ssm's, decoding "
             "from a CUDA graph over mamba_ssm's decoding from one; L: the training length, or the prompt before "
             "decoding)")
    return [Table(title, "models_bench.json", d["device"], ["pass", "batch", "L", "implementation", "tokens/s",
                                                            "speed", "peak GiB"], rows,
                  [line for impl, verdict in verdicts.items()
                   for line in verdict.sentences("The model on " + impl.replace("ours", "our kernels")
                                                 .replace(", torch.compile", " under torch.compile")
                                                 .replace(GRAPH, " decoding from a CUDA graph"))]),
            bars_table("the model: speed bars", "models_bench.json", d["device"], d["bars"],
                       {"batch": "batch", "seq_len": "L"})]


TOPICS = {"linear_scan": linear_scan, "selective_scan": selective_scan, "ssd": ssd, "bidirectional": bidirectional,
          "attention": attention, "attention_features": attention_features, "attention_dropout": attention_dropout,
          "decoding": decoding, "gated_norm": gated_norm, "host_cost": host_cost, "models": models}


def tables(topic, data=DATA):
    return TOPICS[topic](data)


# The roofline -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Point:
    family: str                      # points of one family share a colour
    kernel: str
    ours: bool
    intensity: float                 # FLOP per byte that must move
    tflops: float                    # achieved


SELECTIVE_FLOP = 6  # per element of the (b, d, N, L) state: three multiply-adds (and one exponential)


def roofs(data=DATA):
    """Per device: the copy bandwidth (TB/s), the bfloat16 matmul rate and the selective scan's
    exponential-bound rate (TFLOP/s) that its stored runs measured (``copy_GBps``, ``matmul_TFLOPs``)
    or imply (attention's rows give their share of the matmul rate; the selective scan its floors)."""
    out = {}
    for path in sorted(pathlib.Path(data).glob("*_bench.json")):
        d = load(path.name, data)
        roof = out.setdefault(d["device"], {})
        if "copy_GBps" in d or "copy_bandwidth_gbps" in d:
            roof.setdefault("copy", d.get("copy_GBps", d.get("copy_bandwidth_gbps")) / 1e3)
        if "matmul_TFLOPs" in d:
            roof.setdefault("matmul", d["matmul_TFLOPs"])
    att = load("attention_bench.json", data)
    out[att["device"]].setdefault("matmul", next(r["fwd_tflops"] / (r["fwd_pct_peak"] / 100)
                                                for r in att["rows"] if r["fwd_pct_peak"] > 0))
    sel = load("selective_scan_bench.json", data)
    elements = sel["batch"] * sel["dim"] * sel["dstate"] * sel["length"]
    out[sel["device"]]["exp"] = SELECTIVE_FLOP * elements / (sel["floors"]["forward"]["exp_ms"] * 1e9)
    return out


def shape_of(text):
    return tuple(int(v) for v in text.strip("()").split(","))


def roofline_points(data=DATA):
    """Forward passes of ours and the peers at their largest stored shapes, by device."""
    points = {}

    def add(device, *point):
        points.setdefault(device, []).append(Point(*point))

    scans = load("linear_scan_bench.json", data)
    for r in scans["sections"]["linear_scan"]:
        if r["pass_"] == "fwd" and r["T"] == max(q["T"] for q in scans["sections"]["linear_scan"]):
            intensity = scan_intensity(ELEMENT_BYTES[r["dtype"]])
            add(scans["device"], "scan", f"{r['impl']} {r['dtype']}", r["impl"] == "linear_scan", intensity,
                r["GBps"] * intensity / 1e3)
    sel = load("selective_scan_bench.json", data)
    elements = sel["batch"] * sel["dim"] * sel["dstate"] * sel["length"]
    nbytes = sel["floors"]["forward"]["memory_ms"] * 1e-3 * sel["copy_bandwidth_gbps"] * 1e9
    for r in sel["rows"]:
        if r["passes"] == "forward" and r["implementation"] in ("selective_scan (ours)",
                                                                "mamba_ssm selective_scan_cuda"):
            add(sel["device"], "selective scan", r["implementation"], "ours" in r["implementation"],
                SELECTIVE_FLOP * elements / nbytes,
                SELECTIVE_FLOP * elements / (r["ms"] * 1e9))
    for name, impls, min_bytes in (("ssd_bench.json", ("ours", "mamba_ssm"), lambda s: ssd_min_bytes(*s)[0]),
                                   ("bidirectional_bench.json", ("ours shift=False", "causal ssd_chunk_scan (ours)",
                                                                 "naive two calls (mamba_ssm)"),
                                    lambda s: bidirectional_min_bytes(s, separate=False)[0])):
        d = load(name, data)
        largest = max((r["shape"] for r in d["rows"]), key=lambda s: math.prod(shape_of(s)))
        for r in d["rows"]:
            if r["pass_"] == "fwd" and r["shape"] == largest and r["impl"] in impls:
                flop = r["TFLOPs"] * r["ms"] * 1e9
                family = "SSD" if name.startswith("ssd") else "bidirectional"
                add(d["device"], family, f"{family} {r['impl']}", "ours" in r["impl"],
                    flop / min_bytes(shape_of(r["shape"])), r["TFLOPs"])
    att = load("attention_bench.json", data)
    longest = max(r["N"] for r in att["rows"])
    for r in att["rows"]:
        if r["N"] == longest and not r["causal"] and r["impl"] in ("ours (split)", "sdpa flash", "sdpa cudnn"):
            flop = r["fwd_tflops"] * r["fwd_ms"] * 1e9
            add(att["device"], "attention", f"attention {r['impl']} d={r['d']}", "ours" in r["impl"],
                flop / attention_forward_bytes(att["batch"], att["heads"], r["N"], r["d"]), r["fwd_tflops"])
    return points


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<")


def plot_roofline(path, data=DATA):
    """Draws one panel per device whose runs measured both a copy bandwidth and a matmul rate;
    returns the devices whose points could not be placed (no such pair measured there)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured, points = roofs(data), roofline_points(data)
    devices = [dev for dev in points if {"copy", "matmul"} <= set(measured.get(dev, {}))]
    fig, axes = plt.subplots(len(devices), 1, figsize=(10, 5.4 * len(devices)), squeeze=False)
    for ax, device in zip(axes[:, 0], devices):
        roof = measured[device]
        x = [10 ** (k / 20) for k in range(-40, 90)]
        ax.plot(x, [min(roof["matmul"], roof["copy"] * v) for v in x], color="black", lw=2,
                label=f"copy {roof['copy']:.2f} TB/s, bf16 matmul {roof['matmul']:.0f} TFLOP/s")
        if "exp" in roof:
            ax.axhline(roof["exp"], color="dimgray", ls=":", lw=1.5,
                       label=f"the selective scan's own ceiling, its exponentials ({roof['exp']:.1f} TFLOP/s)")
        families = list(dict.fromkeys(p.family for p in points[device]))
        shown = {family: 0 for family in families}
        for p in points[device]:  # a colour per family, a marker per point in it; ours filled, peers open
            color, marker = f"C{families.index(p.family)}", MARKERS[shown[p.family] % len(MARKERS)]
            shown[p.family] += 1
            ax.scatter(p.intensity, p.tflops, s=55, zorder=4 if p.ours else 3, marker=marker, linewidths=1.5,
                       color=color if p.ours else "white", edgecolor=color, label=p.kernel)
        ax.set(xscale="log", yscale="log", xlabel="FLOP per byte that must move", ylabel="achieved TFLOP/s",
               xlim=(0.1, 3e4), ylim=(0.1, 2000), title=f"forward passes on the {device} (filled: ours; open: peers)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return sorted(set(points) - set(devices))


def bar_row(kernel, bar, cases, target, at_least=True, unit="×"):
    """One bar of the issues against the stored runs: ``cases`` are (value, where measured); the
    bar holds when the worst of them (the least for ``at_least``, else the largest) meets ``target``.
    No case: the bar was not measured (chunk sizes or shapes no script runs)."""
    wanted = f"{'≥' if at_least else '≤'} {target:.3g}{unit}"
    if not cases:
        return [kernel, bar, "not measured", "–", wanted, "not measured"]
    value, where = (min if at_least else max)(cases)
    holds = value >= target if at_least else value <= target
    shown = f"{value:.1f}%" if unit == "%" else f"{value:.2f}{unit}"
    return [kernel, bar, where, shown, wanted, "holds" if holds else "does not hold"]


def issue_bars(data=DATA):
    """The speed bars the book's issues set for each kernel (the bidirectional scan's and the
    model's are in their own tables, which their scripts check), each against the worst case of the
    stored runs that measure it."""
    rows, files = [], set()

    def read(name):
        files.add(name)
        return load(name, data)

    scans = read("linear_scan_bench.json")["sections"]["linear_scan"]
    ours = [r for r in scans if r["impl"] == "linear_scan"]
    rows.append(bar_row("linear_scan", "float32 at the copy floor, every length, forward and forward+backward",
                        [(r["pct_floor"], f"{r['shape']} {r['pass_']}") for r in ours if r["dtype"] == "float32"],
                        97, unit="%"))
    rows.append(bar_row("linear_scan", "bfloat16 forward+backward against accelerated_scan's Triton scan",
                        [(p["ms"] / r["ms"], r["shape"]) for r in ours for p in scans
                         if r["dtype"] == "bfloat16" and r["pass_"] == "fwd+bwd" and p["impl"].endswith("(Triton)")
                         and (p["shape"], p["dtype"], p["pass_"]) == (r["shape"], r["dtype"], r["pass_"])], 1.0))
    host = read("host_cost_bench.json")["rows"]
    rows.append(bar_row("linear_scan", "bfloat16 forward+backward at (1, 64, 4096), host-bound: the peer's host "
                        "time over ours", [(1 / r["ratio"], r["op"]) for r in host
                                           if r["op"].startswith("linear_scan") and r["pass_"] == "forward+backward"],
                        1.0))
    for passes in ("forward", "forward+backward"):
        rows.append(bar_row("selective_scan", f"{passes} against selective_scan_cuda, both shapes, dtypes and "
                            "variants", [(r["speedup"], f"{r['shape'].partition(' (')[0]}, {r['dtype']}, "
                                         f"{r['variant']}") for r in read("selective_scan_cuda_bench.json")["rows"]
                                         if r["passes"] == passes], 1.0))
    ssd_run = read("ssd_bench.json")
    ssd_rows = ssd_run["rows"]
    pairs = [(r, next(p for p in ssd_rows if p["impl"] == "mamba_ssm" and p["shape"] == r["shape"]
                      and p["pass_"] == r["pass_"])) for r in ssd_rows if r["impl"] == "ours"]
    rows.append(bar_row("ssd_chunk_scan", "forward and forward+backward against mamba_ssm, both shapes, chunk 256",
                        [(p["ms"] / r["ms"], f"{r['shape']} {r['pass_']}") for r, p in pairs], 1.5))
    variants_run = ssd_variants_run(data)
    if variants_run:
        files.add(VARIANTS_FILE)
    variants = variants_run["variants"] if variants_run else []
    rows.append(bar_row("ssd_chunk_scan", "the same at chunks 64 and 128, the first shape",
                        [(r["speedup"], f"chunk {r['chunk']} {r['pass_']}") for r in variants
                         if r["impl"] == "ours" and r["chunk"] != CHUNK and not math.isnan(r["speedup"])], 1.5))
    first = ssd_rows[0]["shape"]
    rows.append(bar_row("ssd_chunk_scan", "of its floor, the first shape's forward",
                        [(r["pct_floor"], r["shape"]) for r, _ in pairs if r["shape"] == first and r["pass_"] == "fwd"],
                        30, unit="%"))
    rows.append(bar_row("ssd_chunk_scan", "peak memory over mamba_ssm's",
                        [(r["peak_MB"] / p["peak_MB"], f"{r['shape']} {r['pass_']}") for r, p in pairs], 1.0,
                        at_least=False))
    rows.append(bar_row("ssd_chunk_scan", "time with 8 packed sequences (seq_idx) over the time without",
                        [(r["packing_cost"], f"{r['shape']} {r['pass_']}") for r in variants
                         if r["impl"] == "ours" and r["packed"] > 1], 1.1, at_least=False))
    attention_rows = read("attention_bench.json")["rows"]
    mine = [r for r in attention_rows if r["impl"] == "ours (split)" and r["N"] in (4096, 16384)]
    for peer in ("sdpa cudnn", "sdpa flash"):
        for pass_, label in (("fwd", "forward"), ("bwd", "backward")):
            rows.append(bar_row("attention", f"{label} against {peer}, N 4096 and 16384, head dims 64 and 128, "
                                "causal or not",
                                [(p[f"{pass_}_ms"] / r[f"{pass_}_ms"],
                                  f"d {r['d']}, N {r['N']}{', causal' if r['causal'] else ''}")
                                 for r in mine for p in attention_rows if p["impl"] == peer
                                 and (p["d"], p["N"], p["causal"]) == (r["d"], r["N"], r["causal"])], 1.0))
    rows.append(bar_row("attention", "peak memory of forward+backward at N 16384 over sdpa flash's",
                        [(r["mem_vs_flash"], f"d {r['d']}{', causal' if r['causal'] else ''}") for r in mine
                         if r["N"] == 16384], 0.6, at_least=False))
    features = read("attention_features_bench.json")["rows"]
    rows.append(bar_row("attention", "window 4096 at N 32768 over dense causal attention at N 8192 (the same "
                        "tokens), forward and backward",
                        [(w[f"{p}_ms"] / c[f"{p}_ms"], f"d {w['d']}, {p}") for w in features for c in features
                         for p in ("fwd", "bwd") if w["impl"] == c["impl"] == "ours"
                         and w["case"] == "window (4096, 0)" and c["case"] == "dense causal" and w["d"] == c["d"]],
                        1.2, at_least=False))
    steps = read("decoding_bench.json")["rows"]
    eager = [r for r in steps if r["impl"] == "ours"]
    rows.append(bar_row("attention_with_kvcache", "a decoding step against SDPA as PyTorch picks it, batch 1-64, "
                        "4096-131072 keys",
                        [(p["ms"] / r["ms"], f"batch {r['batch']}, N {r['N']}") for r in eager for p in steps
                         if p["impl"] == "sdpa default" and (p["batch"], p["N"]) == (r["batch"], r["N"])], 1.0))
    rows.append(bar_row("attention_with_kvcache", "of the copy floor at batch 1 and 131072 keys (within 10 %)",
                        [(r["% floor"], f"batch 1, N {r['N']}") for r in eager if r["batch"] == 1
                         and r["N"] == 131072], 100 / 1.1, unit="%"))
    rows.append(bar_row("every op", "host time per call, the peer's over ours (ours at most 1.2× the peer's)",
                        [(1 / r["ratio"], f"{r['op'].partition(' (')[0]} {r['pass_']}") for r in host],
                        round(1 / 1.2, 2)))
    held = sum(r[-1] == "holds" for r in rows)
    missing = sum(r[-1] == "not measured" for r in rows)
    devices = sorted({load(name, data)["device"] for name in files})
    return Table("the bars of the issues, each against the worst case the stored runs measured", "*_bench.json",
                 ", ".join(devices), ["kernel", "bar", "worst case", "measured", "target", "verdict"], rows,
                 [f"{held} of {len(rows) - missing} measured bars hold; {missing} not measured by any script."])


# The package code each stored run times: a run stored before the last change to that code may not
# show the present kernels (the shared launch, custom-op and Triton helpers count for a run where a
# change reaches a definition its code names: changed_since)
SHARED_CODE = ("mamba_annotated/triton_ops.py", "mamba_annotated/launch.py", "mamba_annotated/library.py")
# attention's decoding path (the KV-cache call and its kernels), which only the decoding run calls (the
# models decode with their own modules): git pathspecs that leave it out of the others' code
NOT_DECODING = tuple(f":(exclude)mamba_annotated/attention/{name}"
                     for name in ("kvcache.py", "split_kv.py", "index_checks.py", "rotary.py"))
# what the host-cost and model runs, which time the package at large, do not call: the book's figures,
# the tests' judging rules, the exercises' checks, the bidirectional scan (neither times it), and the
# patches of Triton's interpreter, which run on CPU only
NOT_TIMED = tuple(f":(exclude)mamba_annotated/{name}"
                  for name in ("figures.py", "testing.py", "exercises.py", "bidirectional", "modules/hydra.py",
                               "interpreter_calls.py", "interpreter_rounding.py", "interpreter_scan.py"))
# the model blocks, their convolution and the training and decoding loops, which only the model run calls
NOT_MODELS = (":(exclude)mamba_annotated/modules", ":(exclude)mamba_annotated/conv1d.py",
              ":(exclude)mamba_annotated/train.py")
MEASURED_CODE = {
    "linear_scan_bench.json": ("mamba_annotated/scan",),
    "selective_scan_bench.json": ("mamba_annotated/scan",),
    "selective_scan_cuda_bench.json": ("mamba_annotated/scan",),
    "ssd_bench.json": ("mamba_annotated/ssd",),
    VARIANTS_FILE: ("mamba_annotated/ssd",),
    "bidirectional_bench.json": ("mamba_annotated/bidirectional", "mamba_annotated/ssd"),
    "attention_bench.json": ("mamba_annotated/attention", *NOT_DECODING),
    "attention_features_bench.json": ("mamba_annotated/attention", *NOT_DECODING),
    "decoding_bench.json": ("mamba_annotated/attention",),
    "gated_norm_bench.json": ("mamba_annotated/gated_norm.py",),
    "host_cost_bench.json": ("mamba_annotated", *NOT_DECODING, *NOT_TIMED, *NOT_MODELS),
    "models_bench.json": ("mamba_annotated", *NOT_DECODING, *NOT_TIMED),
}


def git(*args):
    """The output of ``git args`` in the checkout that holds book/data; None when git cannot say."""
    try:
        return subprocess.run(["git", *args], cwd=DATA.parent.parent, capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def without_docstrings(tree):
    """``tree`` with every module, class and function docstring taken out (comments never reach a
    syntax tree)."""
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                and isinstance(node.body[0].value.value, str)):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def code_of(source):
    """What a Python file does, blind to its docstrings and comments: the dump of its syntax tree
    without them. None for no file; the text itself for one that does not parse."""
    if source is None:
        return None
    try:
        return ast.dump(without_docstrings(ast.parse(source)))
    except SyntaxError:
        return source


def definitions(source):
    """A Python file's top-level functions and classes by name, each as (what it does, docstrings
    aside; the names its body reads), the names an absolute import binds likewise (a module added
    for a new helper reaches only what reads it), and everything else at the top level (relative
    imports, which may register ops as they load, and constants) under None; None where there is
    no file or it does not parse."""
    try:
        tree = without_docstrings(ast.parse(source)) if source is not None else None
    except SyntaxError:
        return None
    if tree is None:
        return None
    found, rest = {}, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = (ast.dump(node), names_read(node))
        elif isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                found[(alias.asname or alias.name).split(".")[0]] = (ast.dump(node), set())
        else:
            rest.append(ast.dump(node))
    found[None] = ("\n".join(rest), set())
    return found


def names_read(tree):
    """Every name a syntax tree reads or imports: variables, attributes (``module.name``) and the
    names of ``from module import name``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.split(".")[-1])
    return names


def changes_what_runs(name, old, new):
    """Whether a file's change from ``old`` to ``new`` (texts, None where absent) can change what a
    benchmark measures: for Python, a change of more than docstrings and comments; any other file's
    change counts (a benchmark run's JSON included), and so does one that git could not show on
    either side (both None), rather than pass for no change."""
    if old is None and new is None:
        return True
    if not name.endswith(".py"):
        return old != new
    return code_of(old) != code_of(new)


def stored_run(path):
    """The commit that stored a benchmark run (the newest that changed its file) and its commit
    time; (None, now) where the working tree changes the file (a run not yet committed, made by the
    code as it is); None outside a git checkout, in a shallow clone, whose history may not reach
    back to the run, or for a file git has never held."""
    if git("rev-parse", "--is-shallow-repository") != "false":
        return None
    if git("diff", "--name-only", "HEAD", "--", path) or git("ls-files", "--others", "--exclude-standard", "--", path):
        return None, datetime.datetime.now(datetime.timezone.utc)
    line = git("log", "-1", "--format=%H|%cI", "--", path)
    if not line:
        return None
    commit, stamp = line.split("|")
    return commit, datetime.datetime.fromisoformat(stamp)


def changed_since(commit, *paths, shared=()):
    """Whether the code under ``paths`` (git pathspecs from the repository's top) differs between
    ``commit`` and the working tree, docstrings and comments aside (:func:`changes_what_runs`). The
    code at the run's commit against the code now, not the history between: a change that was
    later reverted, or reworded, is no change. ``commit`` None: the working tree's own run.

    ``shared`` names files that the code of every run imports helpers from. A change there counts
    only where it reaches the code under ``paths``: a top-level function or class it changed,
    removed or added that this code names, directly or through the shared files' other
    definitions, or a change outside the definitions (an import, a constant). A helper added for
    another kernel does not make every run look older than its code."""
    if commit is None:
        return False
    top = pathlib.Path(git("rev-parse", "--show-toplevel"))

    def differing(*pathspecs):
        names = ("-c", "core.quotePath=false")  # names as they are, not C-quoted, for git show
        found = (git(*names, "diff", "--name-only", commit, "--", *pathspecs) or "").splitlines()
        return found + (git(*names, "ls-files", "--others", "--exclude-standard", "--full-name", "--", *pathspecs)
                        or "").splitlines()  # untracked

    def now(name):
        return (top / name).read_text() if (top / name).exists() else None

    if any(changes_what_runs(name, git("show", f"{commit}:{name}"), now(name)) for name in differing(*paths)):
        return True
    if not shared:  # (git diff with no pathspec would name every file)
        return False
    changed_names, current, imported = set(), {}, set()
    for name in differing(*shared):
        old, new = definitions(git("show", f"{commit}:{name}")), definitions(now(name))
        if old is None or new is None or old[None] != new[None]:
            return True
        changed_names |= {d for d in old.keys() | new.keys() if old.get(d) != new.get(d)}
        imported |= {d for defs in (old, new) for d, (text, _) in defs.items() if d and text.startswith("Import")}
    if not changed_names:
        return False
    for name in shared:
        current.update(definitions(now(name)) or {})
    while True:  # a shared definition that reads a changed one has changed with it
        reached = {d for d, (_, reads) in current.items() if d is not None and reads & changed_names}
        if reached <= changed_names:
            break
        changed_names |= reached
    measured = (git("ls-files", "--cached", "--others", "--exclude-standard", "--full-name", "--", *paths)
                or "").splitlines()
    # a module a shared file imports is bound there: the run's code that reads that name reads its own import
    return any(reads_any(now(name), changed_names - imported) for name in measured if name.endswith(".py"))


def reads_any(source, names):
    """Whether Python ``source`` reads any of ``names``; True where it does not parse (it cannot be
    cleared)."""
    if source is None:
        return False
    try:
        return bool(names_read(ast.parse(source)) & names)
    except SyntaxError:
        return True


def sources(data=DATA, stored=stored_run, changed=changed_since):
    """Each stored benchmark file: its device, the tables that read it, when it was stored and
    whether the code it times has changed since (``stored(path)`` gives the run's commit and time,
    ``changed(commit, *paths, shared=...)`` whether the code differs from that commit's)."""
    read_by = {}
    for topic in TOPICS:
        for table in tables(topic, data):
            read_by.setdefault(table.source, set()).add(topic)
    rows, older = [], []
    for path in sorted(pathlib.Path(data).glob("*_bench.json")):
        run = stored(f"book/data/{path.name}")
        behind = run is not None and changed(run[0], *MEASURED_CODE.get(path.name, ("mamba_annotated",)),
                                             shared=SHARED_CODE)
        if behind:
            older.append(path.name)
        rows.append([path.name, load(path.name, data)["device"], ", ".join(sorted(read_by.get(path.name, ["–"]))),
                     run[1].date().isoformat() if run else "–", "yes" if behind else "no" if run else "–"])
    devices = sorted({r[1] for r in rows})
    verdict = ([f"All of them ran on one GPU, the {devices[0]}."] if len(devices) == 1 else
               [f"They come from {len(devices)} GPUs ({', '.join(devices)}), not from one run: compare times only "
                "within a table, and re-run scripts/gpu_benchmarks.sh on one GPU to make every table comparable."])
    if older:
        verdict.append(f"{len(older)} of the {len(rows)} runs {'was' if len(older) == 1 else 'were'} stored before a "
                       "change to the code they time "
                       f"({', '.join(older)}): their numbers may not be those of the present kernels until "
                       "scripts/gpu_benchmarks.sh runs again.")
    return Table("the stored runs", "*_bench.json", ", ".join(devices),
                 ["file", "device", "tables", "stored", "code changed since"], rows, verdict)


def text(table):
    widths = [max(len(str(c)), *(len(str(r[i])) for r in table.rows)) for i, c in enumerate(table.columns)]
    lines = [f"== {table.title} [{table.device}; book/data/{table.source}]",
             "  ".join(str(c).ljust(w) for c, w in zip(table.columns, widths))]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in table.rows]
    return "\n".join(lines + table.verdict)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    parser.add_argument("--roofline", type=pathlib.Path, help="also draw the roofline into this PNG")
    args = parser.parse_args()
    print(text(sources(args.data)), end="\n\n")
    print(text(issue_bars(args.data)), end="\n\n")
    for topic in TOPICS:
        for table in tables(topic, args.data):
            print(text(table), end="\n\n")
    if args.roofline:
        left_out = plot_roofline(args.roofline, args.data)
        print(f"roofline: {args.roofline}"
              + (f" (not placed, no roofs measured there: {left_out})" if left_out else ""))


if __name__ == "__main__":
    main()
