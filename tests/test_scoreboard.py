"""The scoreboard appendix (benchmarks/scoreboard.py, rendered by book/_ext/scoreboard_page.py): every
stored benchmark file is shown, speeds and verdicts are the stored times' ratios, and the roofline
uses benchmarks/costs.py's counts."""
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import costs  # noqa: E402
import scoreboard  # noqa: E402


@pytest.mark.parametrize("topic", sorted(scoreboard.TOPICS))
def test_every_topic_tabulates_the_stored_runs(topic):
    for table in scoreboard.tables(topic):
        assert table.rows, table.title
        assert all(len(row) == len(table.columns) for row in table.rows), table.title
        assert (ROOT / "book" / "data" / table.source).is_file()
        assert table.device == json.loads((ROOT / "book" / "data" / table.source).read_text())["device"]


def test_every_stored_benchmark_file_has_a_table():
    """A new benchmark script's output must be given a table, not silently left off the page."""
    unread = [row[0] for row in scoreboard.sources().rows if row[2] == "–"]
    assert not unread, f"book/data files no scoreboard table reads: {unread}"


def test_a_run_stored_before_its_code_changed_is_named(tmp_path):
    """The page says which runs are older than the code they time: there the tables may not show
    the present kernels."""
    for path in (ROOT / "book" / "data").glob("*_bench.json"):  # every table reads its own file
        (tmp_path / path.name).write_bytes(path.read_bytes())
    runs = {"book/data/ssd_bench.json": "c1", "book/data/attention_bench.json": "c5"}
    changed_code = {("c1", "mamba_annotated/ssd")}  # what differs now from the run's commit

    def stored(path):
        return (runs[path], datetime.datetime(2026, 11, int(runs[path][1:]), tzinfo=datetime.timezone.utc)) \
            if path in runs else None

    def changed(commit, *paths, shared=()):
        assert shared == scoreboard.SHARED_CODE
        return any((commit, p) in changed_code for p in paths)

    table = scoreboard.sources(tmp_path, stored, changed)
    dated = {row[0]: row[3:] for row in table.rows if row[3] != "–"}
    assert dated == {"attention_bench.json": ["2026-11-05", "no"], "ssd_bench.json": ["2026-11-01", "yes"]}
    assert f"1 of the {len(table.rows)} runs was stored before a change to the code they time " \
           "(ssd_bench.json)" in table.verdict[-1]
    outside_git = scoreboard.sources(tmp_path, lambda path: None, changed)
    assert all(row[3:] == ["–", "–"] for row in outside_git.rows)
    assert not any("stored before" in sentence for sentence in outside_git.verdict)


def test_code_of_is_blind_to_docstrings_and_comments_only():
    before = 'def f(x):\n    """Doubles."""\n    return 2 * x  # twice\n'
    reworded = '"""A module."""\n\n\ndef f(x):\n    """Twice x, reworded."""\n    # a comment of its own\n    return 2 * x\n'
    assert scoreboard.code_of(before) == scoreboard.code_of(reworded)
    assert scoreboard.code_of(before) != scoreboard.code_of(before.replace("2 * x", "3 * x"))
    assert scoreboard.code_of('def f():\n    """Only a docstring."""\n') == scoreboard.code_of("def f():\n    pass\n")
    assert scoreboard.changes_what_runs("run.json", "{}", '{"a": 1}')
    assert scoreboard.changes_what_runs("new.py", None, "x = 1\n")
    assert not scoreboard.changes_what_runs("a.py", before, reworded)


def repository(tmp_path, monkeypatch):
    """A git repository of its own in tmp_path, holding the scoreboard's book/data, and a function
    that writes files there and commits them (``day``: the commit's date in November 2026);
    returns ``commit(files, message="c", day=None) -> the commit's id``."""
    git_env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # not the project's index
    for key in [k for k in os.environ if k.startswith("GIT_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(scoreboard, "DATA", tmp_path / "book" / "data")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, env=git_env)

    def commit(files, message="c", day=None):
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True, env=git_env)
        dated = {}
        if day is not None:
            date = f"2026-11-{day:02d}T12:00:00+00:00"
            dated = {"GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date}
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit",
                        "-qm", message], cwd=tmp_path, check=True, env={**git_env, **dated})
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                              check=True, env=git_env).stdout.strip()
    return commit


def test_the_code_is_compared_with_the_runs_commit_docstrings_and_comments_aside(tmp_path, monkeypatch):
    """A run is older than its code only when the code differs from the code at the run's commit:
    in a repository of its own, a commit that rewords a docstring does not make it older; one that
    changes a line does, and so does such a change not yet committed, or a new file not yet added
    (named with an accent, which git quotes unless told not to); a change reverted later does not
    (dating the code by its newest commit said it did). A run not yet committed is the code's own."""
    dated_commit = repository(tmp_path, monkeypatch)

    def commit(day, files, message):
        dated_commit(files, message, day)
    code = 'def f(x):\n    """Doubles."""\n    return 2 * x\n'
    commit(1, {"pkg/a.py": code}, "code")
    commit(2, {"book/data/run.json": "{}"}, "a run")

    def older():
        run, stamp = scoreboard.stored_run("book/data/run.json")
        assert stamp.day == 2
        return scoreboard.changed_since(run, "pkg")
    commit(3, {"pkg/a.py": code.replace("Doubles.", "Twice x.") + "# a note\n"}, "prose")
    assert not older()
    (tmp_path / "pkg/a.py").write_text(code.replace("Doubles.", "Reworded again."))  # uncommitted prose
    assert not older()
    commit(4, {"pkg/a.py": code.replace("2 * x", "x + x")}, "code")
    assert older()
    commit(5, {"pkg/a.py": code}, "the code change reverted")
    assert not older()
    (tmp_path / "pkg/a.py").write_text(code.replace("2 * x", "3 * x"))  # uncommitted code
    assert older()
    (tmp_path / "pkg/a.py").write_text(code)
    commit(6, {"pkg/é.py": code}, "a file whose name git quotes")
    assert older()
    commit(7, {"pkg/é.py": code.replace("Doubles.", "Twice x.")}, "its prose")
    assert older()
    commit(8, {"book/data/run.json": '{"again": 1}'}, "a new run")
    new_run, stamp = scoreboard.stored_run("book/data/run.json")
    assert stamp.day == 8 and not scoreboard.changed_since(new_run, "pkg")
    (tmp_path / "pkg/new.py").write_text("x = 1\n")  # untracked
    assert scoreboard.changed_since(new_run, "pkg")
    (tmp_path / "book/data/run.json").write_text('{"uncommitted": 1}')  # a run of the working tree
    run, stamp = scoreboard.stored_run("book/data/run.json")
    assert run is None and stamp.day == datetime.datetime.now(datetime.timezone.utc).day
    assert not scoreboard.changed_since(run, "pkg")


def test_a_shared_helper_file_counts_where_its_change_reaches_the_runs_code(tmp_path, monkeypatch):
    """A helper file every op imports from (``shared``) makes a run older than its code only where
    its change reaches a definition the run's code names: directly, through another definition of
    the shared files, or by a change outside the definitions (a constant, a relative import). A
    helper added or changed for another kernel does not, nor does an absolute import that only
    such a helper reads."""
    commit = repository(tmp_path, monkeypatch)
    helpers = ("import math\n\n\ndef used(x):\n    return inner(x)\n\n\ndef inner(x):\n    return x + 1\n\n\n"
               "def other(x):\n    return x * 2\n")
    run = commit({"pkg/helpers.py": helpers, "pkg/scan.py": "from .helpers import used\n\n\ndef scan(x):\n"
                  "    return used(x)\n", "pkg/ssd.py": "from . import helpers\n\n\ndef ssd(x):\n"
                  "    return helpers.other(x)\n"})

    def older(path):
        return scoreboard.changed_since(run, path, shared=("pkg/helpers.py",))

    commit({"pkg/helpers.py": helpers + "\n\ndef added(x):\n    return x\n"})  # a helper for another kernel
    assert not older("pkg/scan.py") and not older("pkg/ssd.py")
    commit({"pkg/helpers.py": helpers.replace("x * 2", "x * 3")})  # the ssd's helper only
    assert not older("pkg/scan.py") and older("pkg/ssd.py")
    commit({"pkg/helpers.py": helpers.replace("x + 1", "x + 2")})  # reaches scan through used()
    assert older("pkg/scan.py") and not older("pkg/ssd.py")
    commit({"pkg/helpers.py": helpers.replace("import math", "import math\n\nSTEP = 1")})  # outside the definitions
    assert older("pkg/scan.py") and older("pkg/ssd.py")
    commit({"pkg/helpers.py": helpers.replace("import math", "import cmath\nimport os.path as osp")})
    assert not older("pkg/scan.py") and not older("pkg/ssd.py")  # modules that nothing here reads
    reading = helpers.replace("x * 2", "math.sqrt(x)")
    run = commit({"pkg/helpers.py": reading, "pkg/scan.py": "import cmath\nfrom .helpers import used\n\n\n"
                  "def scan(x):\n    return cmath.sqrt(used(x))\n"})  # a run of this code
    commit({"pkg/helpers.py": reading.replace("import math", "import cmath as math")})
    assert not older("pkg/scan.py") and older("pkg/ssd.py")  # the import reaches the helper that reads it
    commit({"pkg/helpers.py": reading.replace("import math", "import math\nimport cmath")})
    assert not older("pkg/scan.py")  # scan reads its own cmath, not the helpers'
    commit({"pkg/helpers.py": reading.replace("import math", "import math\nfrom . import registry")})
    assert older("pkg/scan.py") and older("pkg/ssd.py")  # a relative import may register ops as it loads
    commit({"pkg/helpers.py": reading.replace("def other(x):\n", "def other(x):\n    \"\"\"Roots.\"\"\"\n")})
    assert not older("pkg/scan.py") and not older("pkg/ssd.py")  # a docstring
    commit({"notes.txt": "not code"})  # without shared files, only the code under the paths counts
    assert not scoreboard.changed_since(run, "pkg/scan.py")


def test_model_code_dates_the_model_run_and_not_the_host_cost_run(tmp_path, monkeypatch):
    """bench_host_cost.py times the four ops, not the model blocks or the training and decoding
    loops: a change there makes the model run older than its code and leaves the host-cost run as
    it was; a change to an op's code dates both (the runs' own pathspecs, in a repository of its own)."""
    commit = repository(tmp_path, monkeypatch)
    code = "def f(x):\n    return 2 * x\n"
    files = ("mamba_annotated/modules/lm.py", "mamba_annotated/train.py", "mamba_annotated/scan/api.py")
    run = commit({name: code for name in files})

    def older(name):
        return scoreboard.changed_since(run, *scoreboard.MEASURED_CODE[name])
    for changed in files:
        commit({changed: code.replace("2 * x", "3 * x")})
        assert older("models_bench.json")
        assert older("host_cost_bench.json") == changed.startswith("mamba_annotated/scan"), changed
        commit({changed: code})


def write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_speed_and_verdict_are_the_peers_time_over_ours(tmp_path):
    def row(shape, impl, pass_, ms):
        return dict(shape=shape, impl=impl, pass_=pass_, ms=ms, TFLOPs=1.0, floor_ms=0.1, pct_floor=10.0, peak_MB=1.0)

    write(tmp_path, "ssd_bench.json", dict(device="GPU X", rows=[
        row("(1, 2, 3, 4, 5)", "ours", "fwd", 2.0), row("(1, 2, 3, 4, 5)", "mamba_ssm", "fwd", 1.0),
        row("(1, 2, 3, 4, 5)", "ours", "fwd+bwd", 3.0), row("(1, 2, 3, 4, 5)", "mamba_ssm", "fwd+bwd", 6.0)]))
    (table,) = scoreboard.tables("ssd", tmp_path)
    assert [r[6] for r in table.rows] == ["0.50×", "2.00×"]
    assert table.verdict == ["ssd_chunk_scan is faster than mamba_chunk_scan_combined in 1 of 2 cases, slower in 1: "
                             "from 0.50× ((1, 2, 3, 4, 5) fwd) to 2.00× ((1, 2, 3, 4, 5) fwd+bwd)."]


def test_speeds_within_two_percent_are_on_par():
    verdict = scoreboard.Verdict()
    for case, speed in (("a", 0.985), ("b", 1.015), ("c", 1.03), ("d", 0.9)):
        verdict.add("peer", case, speed)
    assert verdict.sentences() == ["ours is faster than peer in 1 of 4 cases, on par (within 2%) in 2, slower in 1: "
                                   "from 0.90× (d) to 1.03× (c)."]
    single = scoreboard.Verdict()
    single.add("peer", "a", 1.01)
    assert single.sentences() == ["ours is on par with peer: 1.01× (a)."]


def test_a_missing_peer_is_a_dash_and_left_out_of_the_verdict(tmp_path):
    def row(impl, ms):
        return dict(section="linear_scan", impl=impl, shape="1x2x3", T=3, dtype="float32", pass_="fwd", ms=ms,
                    GBps=1.0, pct_floor=50.0, ours_faster_by=1.0)

    write(tmp_path, "linear_scan_bench.json", dict(device="GPU X", copy_GBps=1.0, sections=dict(linear_scan=[
        row("linear_scan", 1.0), row("peer a", 1.5)], packing=[], segments=[], tuning=[])))
    # a second shape that only ours ran
    data = json.loads((tmp_path / "linear_scan_bench.json").read_text())
    data["sections"]["linear_scan"].append(dict(row("linear_scan", 2.0), shape="1x2x4", T=4))
    write(tmp_path, "linear_scan_bench.json", data)
    (table,) = scoreboard.tables("linear_scan", tmp_path)
    assert [r[5] for r in table.rows] == ["1.5 (1.50×)", "–"]
    assert table.verdict[0] == "linear_scan is faster than peer a: 1.50× (1x2x3 float32 fwd)."


def test_cost_counts():
    # one chunk of Q = 4 steps, one head, P = 2, N = 3: states 2*(2*Q*P*N), diagonal Q*Q*P, C.B Q*Q*N
    Q, P, N = 4, 2, 3
    forward, total = costs.ssd_flops(1, 4, 1, P, N, Q=Q)
    assert forward == 2 * (2 * Q * P * N) + Q * Q * P + Q * Q * N
    assert costs.bidirectional_flops((1, 4, 1, P, N), Q=Q) == (2 * forward, 2 * total)
    assert costs.attention_flops(1, 1, 8, 16, causal=True) == (4 * 8 * 8 * 16 / 2, 2.5 * 4 * 8 * 8 * 16 / 2)
    assert costs.scan_intensity(4) == pytest.approx(1 / 6)


def test_roofline_points_and_plot(tmp_path):
    measured, points = scoreboard.roofs(), scoreboard.roofline_points()
    ssd = json.loads((ROOT / "book" / "data" / "ssd_bench.json").read_text())
    largest = max((r for r in ssd["rows"] if r["impl"] == "ours" and r["pass_"] == "fwd"),
                  key=lambda r: math.prod(scoreboard.shape_of(r["shape"])))
    (point,) = [p for p in points[ssd["device"]] if p.kernel == "SSD ours"]
    shape = scoreboard.shape_of(largest["shape"])
    assert point.intensity == pytest.approx(costs.ssd_flops(*shape)[0] / costs.ssd_min_bytes(*shape)[0], rel=1e-3)
    assert point.tflops == largest["TFLOPs"]
    left_out = scoreboard.plot_roofline(tmp_path / "roofline.png")
    assert (tmp_path / "roofline.png").stat().st_size > 10_000
    placed = set(points) - set(left_out)
    assert placed and all({"copy", "matmul"} <= set(measured[device]) for device in placed)


def test_every_model_row_is_measured_against_mamba_ssms_model():
    """One direction of speed on the page: a row's throughput over mamba_ssm's, the peer's own row 1;
    decoding from a CUDA graph over the peer's decoding from one."""
    table = scoreboard.tables("models")[0]
    data = json.loads((ROOT / "book" / "data" / "models_bench.json").read_text())
    for row, stored in zip(table.rows, data["rows"]):
        peer_impl = "mamba_ssm Mamba2" + (", CUDA graph" if stored["impl"].endswith(", CUDA graph") else "")
        peer = next(r for r in data["rows"] if r["impl"] == peer_impl and r["pass_"] == stored["pass_"]
                    and r["batch"] == stored["batch"] and r["seq_len"] == stored["seq_len"])
        assert row[5] == f"{stored['tokens_per_s'] / peer['tokens_per_s']:.2f}×"
        assert row[5] == "1.00×" or not stored["impl"].startswith("mamba_ssm")


def test_graph_decoding_rows_are_measured_against_the_peers_graph_rows(tmp_path):
    for path in (ROOT / "book" / "data").glob("*_bench.json"):
        (tmp_path / path.name).write_text(path.read_text())
    data = json.loads((tmp_path / "models_bench.json").read_text())
    decode = dict(pass_="decode", batch=1, seq_len=512)
    data["rows"] = [dict(decode, impl="ours", tokens_per_s=100.0),
                    dict(decode, impl="ours, CUDA graph", tokens_per_s=900.0),
                    dict(decode, impl="mamba_ssm Mamba2", tokens_per_s=80.0),
                    dict(decode, impl="mamba_ssm Mamba2, CUDA graph", tokens_per_s=600.0)]
    write(tmp_path, "models_bench.json", data)
    table = scoreboard.models(tmp_path)[0]
    assert [row[5] for row in table.rows] == ["1.25×", "1.50×", "1.00×", "1.00×"]
    assert table.verdict == [
        "The model on our kernels is faster than mamba_ssm's Mamba2: 1.25× (decode, batch 1, L 512).",
        "The model on our kernels decoding from a CUDA graph is faster than mamba_ssm's Mamba2 decoding from a CUDA "
        "graph: 1.50× (decode, batch 1, L 512)."]


def test_a_run_that_stores_its_rates_gives_its_device_roofs(tmp_path):
    """The benchmark scripts store the copy bandwidth and matmul rate they measured, so a device
    whose runs hold both gets a roofline panel of its own."""
    for path in (ROOT / "book" / "data").glob("*_bench.json"):
        (tmp_path / path.name).write_text(path.read_text())
    bidirectional = json.loads((tmp_path / "bidirectional_bench.json").read_text())
    bidirectional.update(device="GPU X", copy_GBps=3000.0, matmul_TFLOPs=650.0)
    write(tmp_path, "bidirectional_bench.json", bidirectional)
    assert scoreboard.roofs(tmp_path)["GPU X"] == {"copy": 3.0, "matmul": 650.0}
    assert "GPU X" not in scoreboard.plot_roofline(tmp_path / "roofline.png", tmp_path)


def test_a_bar_is_judged_by_its_worst_case():
    faster = scoreboard.bar_row("k", "speed", [(1.3, "a"), (0.97, "b"), (1.1, "c")], 1.0)
    assert faster[2:] == ["b", "0.97×", "≥ 1×", "does not hold"]
    assert scoreboard.bar_row("k", "speed", [(1.3, "a"), (1.0, "b")], 1.0)[-1] == "holds"  # the target itself meets it
    ratio = scoreboard.bar_row("k", "time ratio", [(1.05, "a"), (1.25, "b")], 1.2, at_least=False)
    assert ratio[2:] == ["b", "1.25×", "≤ 1.2×", "does not hold"]
    floor = scoreboard.bar_row("k", "of the floor", [(98.1, "a"), (97.0, "b")], 97, unit="%")
    assert floor[2:] == ["b", "97.0%", "≥ 97%", "holds"]
    assert scoreboard.bar_row("k", "chunks 64", [], 1.5)[2:] == ["not measured", "–", "≥ 1.5×", "not measured"]

# the files the bars read
DATA_FILES = ("linear_scan_bench.json", "host_cost_bench.json", "selective_scan_cuda_bench.json", "ssd_bench.json",
              "attention_bench.json", "attention_features_bench.json", "decoding_bench.json")


def test_the_bars_read_the_stored_runs(tmp_path):
    """Each bar's worst case is one of the stored rows: slowing our SSD forward in a copy of the data
    flips its bar, and the verdict counts it."""
    bars = scoreboard.issue_bars()
    assert all(len(row) == len(bars.columns) for row in bars.rows)
    assert {row[-1] for row in bars.rows} <= {"holds", "does not hold", "not measured"}
    for name in DATA_FILES:
        (tmp_path / name).write_text((ROOT / "book" / "data" / name).read_text())
    ssd = json.loads((tmp_path / "ssd_bench.json").read_text())
    for row in ssd["rows"]:
        row["ms"] = row["ms"] * (0.1 if row["impl"] == "mamba_ssm" else 1.0)  # the peer ten times faster
    (tmp_path / "ssd_bench.json").write_text(json.dumps(ssd))
    fast = {row[1]: row for row in scoreboard.issue_bars(tmp_path).rows}
    speed = fast["forward and forward+backward against mamba_ssm, both shapes, chunk 256"]
    assert speed[-1] == "does not hold" and float(speed[3].rstrip("×")) < 0.2
    for row in ssd["rows"]:
        row["ms"] = row["ms"] * (100.0 if row["impl"] == "mamba_ssm" else 1.0)  # now ten times slower than ours
    (tmp_path / "ssd_bench.json").write_text(json.dumps(ssd))
    slow = scoreboard.issue_bars(tmp_path)
    assert {row[1]: row for row in slow.rows}[speed[1]][-1] == "holds"
    held = sum(row[-1] == "holds" for row in slow.rows)
    assert slow.verdict[0].startswith(f"{held} of ")


def test_the_ssd_variants_measure_their_bars_and_get_a_table(tmp_path):
    """bench_ssd.py --variants' chunks 64 and 128 and packed-sequence rows (a run of its own,
    ssd_variants_bench.json) decide the two SSD bars that are otherwise not measured, and show as a
    second SSD table."""
    for name in DATA_FILES:
        (tmp_path / name).write_text((ROOT / "book" / "data" / name).read_text())
    before = {row[1]: row for row in scoreboard.issue_bars(tmp_path).rows}
    assert [row[-1] for name, row in before.items() if "chunks 64" in name or "seq_idx" in name] == ["not measured"] * 2
    assert len(scoreboard.ssd(tmp_path)) == 1

    def row(chunk, packed, impl, pass_, ms, speedup, cost=float("nan")):
        return dict(shape="(4, 4096, 80, 64, 128)", chunk=chunk, packed=packed, impl=impl, pass_=pass_, ms=ms,
                    speedup=speedup, packing_cost=cost)
    variants = [row(64, 1, "ours", "fwd", 1.0, 1.6), row(64, 1, "mamba_ssm", "fwd", 1.6, 1.0),
                row(128, 1, "ours", "fwd", 1.0, 1.4), row(128, 1, "mamba_ssm", "fwd", 1.4, 1.0),
                row(256, 1, "ours", "fwd", 1.0, 1.5), row(256, 1, "mamba_ssm", "fwd", 1.5, 1.0),
                row(256, 8, "ours", "fwd", 1.05, 1.6, 1.05), row(256, 8, "mamba_ssm", "fwd", 1.7, 1.0, 1.13)]
    (tmp_path / scoreboard.VARIANTS_FILE).write_text(json.dumps(dict(device="a GPU", variants=variants)))
    after = {row[1]: row for row in scoreboard.issue_bars(tmp_path).rows}
    chunks = next(row for name, row in after.items() if "chunks 64" in name)
    assert chunks[2:4] == ["chunk 128 fwd", "1.40×"] and chunks[-1] == "does not hold"
    packed = next(row for name, row in after.items() if "seq_idx" in name)
    assert packed[3] == "1.05×" and packed[-1] == "holds"  # ours' cost, not the peer's 1.13
    tables = scoreboard.ssd(tmp_path)
    assert len(tables) == 2 and len(tables[1].rows) == 4 and tables[1].rows[3][-1] == "1.05×"
    assert tables[1].source == scoreboard.VARIANTS_FILE and tables[1].device == "a GPU"


def test_the_packing_breakdown_gets_a_table_against_the_whole_call(tmp_path):
    """bench_ssd.py's packing breakdown (packing_stages, in the variants' file) becomes a third SSD
    table, whose verdict sets the kernels' extra time against the whole call's."""
    for name in DATA_FILES:
        (tmp_path / name).write_text((ROOT / "book" / "data" / name).read_text())

    def row(packed, pass_, ms, impl="ours"):
        return dict(shape="(4, 4096, 80, 64, 128)", chunk=256, packed=packed, impl=impl, pass_=pass_, ms=ms,
                    speedup=float("nan"), packing_cost=float("nan"))
    stages = [dict(stage="chunk_scan_kernel", calls_one=1, calls_packed=1, ms_one=1.0, ms_packed=1.25, extra_ms=0.25),
              dict(stage="all kernels", calls_one=1, calls_packed=1, ms_one=1.0, ms_packed=1.25, extra_ms=0.25)]
    run = dict(device="a GPU", variants=[row(1, "fwd+bwd", 2.0), row(8, "fwd+bwd", 2.5), row(8, "fwd", 1.2),
                                         row(1, "fwd+bwd", 3.0, "mamba_ssm"), row(8, "fwd+bwd", 3.1, "mamba_ssm")])
    (tmp_path / scoreboard.VARIANTS_FILE).write_text(json.dumps(run))
    assert len(scoreboard.ssd(tmp_path)) == 2  # no breakdown stored: no table
    (tmp_path / scoreboard.VARIANTS_FILE).write_text(json.dumps(dict(run, packing_stages=stages)))
    table = scoreboard.ssd(tmp_path)[2]
    assert table.rows[0] == ["chunk_scan_kernel", "1 / 1", "1", "1.25", "+0.250"]
    assert "+0.250 ms per forward and backward" in table.verdict[0]
    assert "+0.500 ms more" in table.verdict[1] and "+0.250 ms, is mostly time between the kernels" in table.verdict[1]
    # a whole call's extra time within a tenth of the kernels' is read as the kernels' own
    (tmp_path / scoreboard.VARIANTS_FILE).write_text(json.dumps(dict(run, packing_stages=stages, variants=[
        row(1, "fwd+bwd", 2.0), row(8, "fwd+bwd", 2.24), row(8, "fwd", 1.2)])))
    verdict = scoreboard.ssd(tmp_path)[2].verdict[1]
    assert "-0.010 ms, is within a tenth of it, so the extra time is spent in the kernels" in verdict
    # kernels' extra time well above the whole call's: the two measurements disagree
    (tmp_path / scoreboard.VARIANTS_FILE).write_text(json.dumps(dict(run, packing_stages=stages, variants=[
        row(1, "fwd+bwd", 2.0), row(8, "fwd+bwd", 2.1), row(8, "fwd", 1.2)])))
    verdict = scoreboard.ssd(tmp_path)[2].verdict[1]
    assert "+0.100 ms more" in verdict and "-0.150 ms, is negative" in verdict
    assert "disagree beyond their noise" in verdict
