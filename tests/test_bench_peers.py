"""benchmarks/peers.py's tuning of a peer at its fastest, on CPU with stand-in autotuners: each
tuning draws the next pick of every autotuner whose cache was cleared, and a pass's time is a
function of the picks it ran with."""
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402


def stand_in(picks):
    """An autotuner that, meeting its key with an empty cache, picks the next of ``picks``."""
    tuner = types.SimpleNamespace(cache={}, drawn=iter(picks))

    def meet():
        if "key" not in tuner.cache:
            tuner.cache["key"] = next(tuner.drawn)
        return tuner.cache["key"]
    tuner.meet = meet
    return tuner


def test_each_pass_keeps_the_picks_of_its_fastest_tuning_and_leaves_the_earlier_passes_picks():
    forward_kernel = stand_in(["slow", "fast", "middle", "never"])
    backward_kernel = stand_in(["b0", "b1", "b2", "never"])
    tuners = {"fwd_kernel": forward_kernel, "bwd_kernel": backward_kernel}
    cost = {"slow": 3.0, "middle": 2.0, "fast": 1.0, "b0": 0.5, "b1": 0.7, "b2": 0.2}
    ran = []

    def forward():
        ran.append(("fwd", forward_kernel.meet()))

    def forward_backward():
        ran.append(("fwd+bwd", forward_kernel.meet(), backward_kernel.meet()))

    def time(fn):
        fn()
        return sum(cost[pick] for pick in ran[-1][1:])

    picks = []
    times = peers.tune_fastest((forward, forward_backward), tuners, tunings=3, time=time, picks=picks)
    assert times == [[3.0, 1.0, 2.0], [1.5, 1.7, 1.2]]
    # each tuning's picks, of every autotuner: the forward's, then the kept forward pick beside the backward's
    assert picks == [[{"fwd_kernel": ["slow"]}, {"fwd_kernel": ["fast"]}, {"fwd_kernel": ["middle"]}],
                     [{"fwd_kernel": ["fast"], "bwd_kernel": [b]} for b in ("b0", "b1", "b2")]]
    # the forward kept its fastest pick through the second pass's tunings, which drew only backward picks
    assert all(entry[1] == "fast" for entry in ran if entry[0] == "fwd+bwd")
    assert forward_kernel.cache == {"key": "fast"} and backward_kernel.cache == {"key": "b2"}
    forward_backward()
    assert ran[-1] == ("fwd+bwd", "fast", "b2")  # what the benchmark then times


def test_autotuners_finds_the_triton_autotuners_of_imported_modules_by_prefix():
    import triton
    from triton.runtime.autotuner import Autotuner

    @triton.autotune([triton.Config({})], key=[])
    @triton.jit
    def kernel(x):
        pass

    module = types.ModuleType("peer_for_test.ops")
    module.kernel, module.other = kernel, object()
    sys.modules["peer_for_test.ops"] = module
    try:
        found = peers.autotuners("peer_for_test.")
    finally:
        del sys.modules["peer_for_test.ops"]
    assert list(found) == ["peer_for_test.ops.kernel"] and isinstance(found["peer_for_test.ops.kernel"], Autotuner)
    assert peers.autotuners("no_such_peer.") == {}


def test_our_autotuners_are_found_inside_lean_launch_and_their_configurations_kept_by_key():
    """On a GPU our kernels are LeanLaunch wrappers around the autotuner (mamba_annotated.launch):
    autotuners unwraps them, and cached_configs records every key's configuration, so a benchmark
    stores which configuration ran in which case (an SSD kernel with and without seq_idx)."""
    import triton
    from mamba_annotated.launch import LeanLaunch

    @triton.autotune([triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
    @triton.jit
    def kernel(x, n, BLOCK: triton.language.constexpr):
        pass

    wrapped = LeanLaunch.__new__(LeanLaunch)  # its constructor needs a compiled JITFunction, not the interpreter's
    wrapped.kernel = kernel
    module = types.ModuleType("mamba_annotated_for_test.ops")
    module.kernel, module.plain = wrapped, kernel.fn
    sys.modules["mamba_annotated_for_test.ops"] = module
    try:
        found = peers.autotuners("mamba_annotated_for_test.")
    finally:
        del sys.modules["mamba_annotated_for_test.ops"]
    assert found == {"mamba_annotated_for_test.ops.kernel": kernel}
    assert peers.cached_configs(found) == {}                          # nothing tuned yet: nothing to record
    kernel.cache[(64, "torch.int32")] = kernel.configs[1]
    kernel.cache[(64, "torch.float32")] = kernel.configs[0]
    assert peers.cached_configs(found) == {"mamba_annotated_for_test.ops.kernel": {
        "(64, 'torch.int32')": str(kernel.configs[1]), "(64, 'torch.float32')": str(kernel.configs[0])}}


def test_the_peers_tunings_are_printed_and_kept_for_the_json(capsys):
    import bench_ssd

    records = bench_ssd.report_tunings("(4, 4096, 80, 64, 128), chunk 256", [[0.998, 0.711], [4.098, 3.403]])
    assert records == [dict(case="(4, 4096, 80, 64, 128), chunk 256", pass_="fwd", tunings_ms=[0.998, 0.711]),
                       dict(case="(4, 4096, 80, 64, 128), chunk 256", pass_="fwd+bwd", tunings_ms=[4.098, 3.403])]
    picks = [[{"k": ["a"]}, {"k": ["b"]}], [{"j": ["c"]}, {"j": ["c"]}]]
    records = bench_ssd.report_tunings("case", [[1.0, 2.0], [3.0, 4.0]], picks)
    assert [r["picks"] for r in records] == picks
    assert "fwd 0.998, 0.711; fwd+bwd 4.098, 3.403; rows: the fastest" in capsys.readouterr().out


def test_tuning_the_peer_keeps_every_tunings_picks_and_hands_each_pass_its_times(monkeypatch, capsys):
    """bench_ssd.tune_peer (the SSD and bidirectional benchmarks' one way to tune mamba_ssm) with a
    stand-in autotuner: the records carry the picks, and the times by pass are the records' own."""
    import bench_ssd

    kernel = stand_in(["a", "b", "c"])
    monkeypatch.setattr(bench_ssd, "autotuners", lambda prefix: {"kernel": kernel} if prefix == "mamba_ssm." else {})
    records, tuned = bench_ssd.tune_peer("case", (kernel.meet, kernel.meet))
    assert [r["pass_"] for r in records] == ["fwd", "fwd+bwd"]
    assert records[0]["picks"] == [{"kernel": [pick]} for pick in "abc"]
    assert records[1]["picks"] == [{"kernel": [kernel.cache["key"]]}] * 3   # the forward's autotuner stays tuned
    assert tuned == {r["pass_"]: r["tunings_ms"] for r in records} and all(len(t) == 3 for t in tuned.values())
    assert "case: mamba_ssm after each tuning" in capsys.readouterr().out


def test_a_row_takes_the_fastest_tuning_where_putting_its_picks_back_did_not_bring_its_time_back():
    # the H200 case of session 67: the time after the picks were put back is kept beside the row's
    assert peers.row_time(5.44, [5.344, 4.282, 5.292]) == dict(ms=4.282, ms_after_picks_put_back=5.44)
    assert peers.row_time(0.693, [0.694, 0.689, 0.689])["ms"] == 0.689
    assert peers.row_time(1.0, [1.2, 1.1])["ms"] == 1.0                   # the timed run can be the fastest
    assert peers.row_time(0.63) == dict(ms=0.63)                          # ours: not tuned, as timed
