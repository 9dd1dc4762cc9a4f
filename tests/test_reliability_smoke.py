"""scripts/gpu_reliability.sh's pieces (scripts/reliability/) in a smoke mode on CPU: a few cases
per op at interpreter sizes, so CI proves the script works before it meets a GPU. The pieces
that need CUDA (compute-sanitizer, memory_allocated, CUDA graphs) skip here, saying why, after
their argument parsing and case generation are tested."""
import importlib
import json
import math
import pkgutil
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "reliability"))
import cases  # noqa: E402
import contraction  # noqa: E402
import large  # noqa: E402
import leaks  # noqa: E402
import nonfinite  # noqa: E402
import reproducible  # noqa: E402
import sanitize  # noqa: E402
import scores_defect  # noqa: E402
import summary  # noqa: E402
import sweep  # noqa: E402

from mamba_annotated import linear_scan  # noqa: E402
from mamba_annotated.attention.reference import attention_ref  # noqa: E402
from mamba_annotated.runtime import DEVICE, INTERPRETED, size  # noqa: E402
from mamba_annotated.testing import seed_everything  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU box only)")


def test_draws_are_seeded_plain_data_that_respect_the_constraints():
    for op in cases.OPS.values():
        for seed in range(40):
            params = cases.draw_case(op, seed)
            assert params == cases.draw_case(op, seed) == json.loads(json.dumps(params))
            # cases of one variant share everything the kernels are compiled and tuned for
            grouped, first = (cases.draw_case(op, s, cases_per_variant=8) for s in (seed, seed - seed % 8))
            assert grouped == json.loads(json.dumps(grouped))
            assert variant(op, grouped) == variant(op, first)
            dims = params["dims"]
            if "groups" in dims and "heads" in dims:
                assert dims["heads"] % dims["groups"] == 0
            if "kv_heads" in dims:
                assert dims["heads"] % dims["kv_heads"] == 0 and 16 <= dims["head_dim"] <= 256
            for smaller in cases.smaller(op, params):  # every shrinking step is a valid, smaller case
                assert all(smaller["dims"][k] >= op.minimum.get(k, 1) for k in smaller["dims"])


def variant(op, params):
    compiled = ("headdim", "dstate", "chunk", "head_dim")
    return (params["dtype"], params["layouts"], {k: v for k, v in params["opts"].items() if k not in op.free_opts},
            {k: v for k, v in params["dims"].items() if k in compiled})


def test_same_bits_treats_a_repeated_nan_as_equal_and_any_changed_bit_as_different():
    """A case whose outputs hold NaN was reported as not reproducible by torch.equal (NaN != NaN)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        a = torch.tensor([1.0, float("nan"), -0.0, float("inf")], dtype=dtype)
        assert cases.same_bits(a, a.clone()) and not torch.equal(a, a.clone())
        assert not cases.same_bits(a, torch.tensor([1.0, float("nan"), 0.0, float("inf")], dtype=dtype))  # -0 vs +0
        assert not cases.same_bits(a, a.double() if dtype != torch.float64 else a.float())
    assert cases.same_bits(torch.arange(4), torch.arange(4)) and not cases.same_bits(torch.arange(4), torch.arange(1, 5))


def test_views_have_the_shapes_asked_for_and_the_strides_promised():
    for layout in cases.LAYOUTS:
        base = torch.randn(cases.base_shape((3, 4, 5), layout))
        v = cases.view(base, (3, 4, 5), layout)
        assert v.shape == (3, 4, 5)
        assert v.is_contiguous() == (layout in ("contiguous", "offset"))
        assert (v.storage_offset() > 0) == (layout == "offset")
    assert 0 in cases.view(torch.randn(1, 4, 5), (3, 4, 5), "expanded").stride()


def test_sweep_runs_every_op_and_writes_its_report(tmp_path):
    out = tmp_path / "sweep.json"
    code = sweep.main(["--cases", "2", "--seed", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["ops"]) == set(cases.OPS)
    assert all(r["cases"] == 2 for r in report["ops"].values())
    assert code == 0, [r["reproducers"] for r in report["ops"].values()]


def test_sweep_hands_its_report_over_after_every_case():
    """A process killed by the device call's limit once lost every case it had run."""
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "3"])
    seen = []
    sweep.sweep_op(cases.OPS["linear_scan"], args, deadline=None, save=lambda report: seen.append(report["cases"]))
    assert seen == [0, 1, 2, 3]


def test_sweep_keeps_why_an_output_went_unjudged(monkeypatch):
    """An H100 shard left 50 of its 59 cases' bfloat16 dA unjudged, and its report could not say why."""
    reasons = iter(["grad A (mamba_ssm could not run this case: AssertionError\nits second line)",
                    "grad A (mamba_ssm could not run this case: AssertionError\nits second line)",
                    "grad dt_bias (another reason)"])
    monkeypatch.setattr(sweep, "run_case", lambda op, params, seed: cases.Verdict(unjudged=[next(reasons)]))
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "3", "--seed", "7"])
    report = sweep.sweep_op(cases.OPS["linear_scan"], args, deadline=None)
    assert report["unjudged"] == 3
    assert report["unjudged_reasons"] == {"grad A (mamba_ssm could not run this case: AssertionError": 7,
                                          "grad dt_bias (another reason)": 9}


def test_the_summary_merges_why_outputs_went_unjudged():
    """Reports from before the reasons were kept have none; a reason found by several shards keeps
    its lowest seed."""
    def shard(unjudged, reasons=None):
        report = dict(cases=5, failures=0, unjudged=unjudged, largest={}, reproducers=[], stopped_early=False)
        if reasons is not None:
            report["unjudged_reasons"] = reasons
        return dict(item="sweep", ops={"ssd_chunk_scan": report})

    merged = summary.merge([shard(0), shard(2, {"grad A (a)": 70, "grad A (b)": 71}), shard(1, {"grad A (a)": 12})])
    ssd = merged["sweep"]["ssd_chunk_scan"]
    assert ssd["cases"] == 15 and ssd["unjudged"] == 3
    assert ssd["unjudged_reasons"] == {"grad A (a)": 12, "grad A (b)": 71}


def test_sweep_and_summary_keep_each_yardstick_pair(monkeypatch):
    """A 16-bit step gradient judged against the same computation keeps [seed, ours, theirs] per
    case; the summary adds the shards' pairs up and describes the ratios over all of them."""
    verdicts = iter([cases.Verdict(errors={"grad A": 2e-3}, yardsticks={"grad A": 1e-3}),
                     cases.Verdict(errors={"grad A": 1e-4, "grad dt": 1e-5}, yardsticks={"grad A": 4e-4}),
                     cases.Verdict()])
    monkeypatch.setattr(sweep, "run_case", lambda op, params, seed: next(verdicts))
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "3", "--seed", "40"])
    report = sweep.sweep_op(cases.OPS["linear_scan"], args, deadline=None)
    assert report["yardsticks"] == {"grad A": [[40, 2e-3, 1e-3], [41, 1e-4, 4e-4]]}
    older = dict(cases=5, failures=0, unjudged=0, largest={}, reproducers=[], stopped_early=False)
    merged = summary.merge([dict(item="sweep", ops={"ssd_chunk_scan": older}),
                            dict(item="sweep", ops={"ssd_chunk_scan": report}),
                            dict(item="sweep", ops={"ssd_chunk_scan": dict(report, yardsticks={
                                "grad A": [[90, 3e-3, 1e-4], [91, 0.0, 0.0]]})})])
    pairs = merged["sweep"]["ssd_chunk_scan"]["yardsticks"]["grad A"]
    assert [seed for seed, _, _ in pairs] == [40, 41, 90, 91]
    line = summary.against_yardstick("grad A", pairs)  # ratios 0.25, 1 (both exact), 2, 30
    assert "4 cases" in line and "median 1.5" in line and "ours the smaller in 1" in line
    assert "largest 30 (seed 90)" in line


class WrongScan(cases.FirstOrderScan):
    """linear_scan 10 % too large: the sweep must catch and shrink it. (With only its last step
    dropped, as it once was, the case drawn on the H100 stayed within its bound: one wrong step among
    many is a small relative error.)"""

    def __init__(self):
        super().__init__("linear_scan", lambda a, b, h0=None, reverse=False: 1.1 * linear_scan(a, b, h0=h0,
                                                                                               reverse=reverse))


def test_sweep_catches_a_wrong_op_and_prints_a_shrunk_reproducer(capsys):
    op = WrongScan()
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "1", "--seed", "5"])
    report = sweep.sweep_op(op, args, deadline=None)
    assert report["failures"] == 1
    printed = capsys.readouterr().out
    assert "REPRO: python scripts/reliability/sweep.py --ops linear_scan --seed 5 --params" in printed
    params = json.loads(report["reproducers"][0]["command"].split("--params ")[1].strip("'"))
    assert params["dims"] == {"rows": 1, "L": 1} and all(v == "contiguous" for v in params["layouts"].values())
    assert report["reproducers"][0]["shrunk"]


@pytest.mark.parametrize("op_name", ["ssd_state_update", "selective_state_update"])
def test_decoding_step_cases_catch_a_step_that_drops_D(monkeypatch, op_name):
    """The decoding steps' cases judge y and the state after the steps against the float64
    recurrence: a step that leaves out the skip connection D is caught, in y only."""
    op = cases.OPS[op_name]
    params = json.loads(json.dumps(op.small()[0]))
    assert cases.run_case(op, params, 0).failures == []
    step = getattr(cases, op_name)
    monkeypatch.setattr(cases, op_name, lambda state, x, dt, A, B, C, D, *rest, **kw: step(state, x, dt, A, B, C, None,
                                                                                            *rest, **kw))
    failures = cases.run_case(op, params, 0).failures
    assert len(failures) == 1 and failures[0].startswith("y: relative error"), failures


def test_norm_cases_catch_a_norm_five_percent_off(monkeypatch):
    op = cases.OPS["rmsnorm_fn"]
    params = json.loads(json.dumps(op.small()[0]))
    assert cases.run_case(op, params, 0).failures == []
    norm = cases.rmsnorm_fn
    monkeypatch.setattr(cases, "rmsnorm_fn", lambda *args: 1.05 * norm(*args))  # the bound: bfloat16 z's 1e-2
    failures = cases.run_case(op, params, 0).failures
    assert failures and failures[0].startswith("out: relative error"), failures


def test_conv_cases_catch_a_conv_five_percent_off_and_a_window_one_step_off(monkeypatch):
    op = cases.OPS["depthwise_conv1d"]
    params = json.loads(json.dumps(op.small()[0]))
    assert params["layouts"]["x"] == "projection" and cases.run_case(op, params, 0).failures == []
    conv = cases.depthwise_conv1d
    monkeypatch.setattr(cases, "depthwise_conv1d", lambda *args: 1.05 * conv(*args))
    failures = cases.run_case(op, params, 0).failures
    assert failures and failures[0].startswith("out against its terms: relative error"), failures
    monkeypatch.setattr(cases, "depthwise_conv1d", lambda x, w, b, left, *rest: conv(x, w, b, left - 1, *rest))
    failures = cases.run_case(op, params, 0).failures  # (the case's window is causal: left 3 of width 4)
    assert failures and failures[0].startswith("out against its terms: relative error"), failures


def test_a_conv_output_whose_terms_cancel_is_judged_against_them_and_a_wrong_one_still_fails(monkeypatch):
    """One tap and a bias, b = -fl(w x): float32 gives w x + b as 0 (or, fused, the residual), where
    float64 gives the residual of rounding w x, 1e-8 or so: 100 % off against itself, nothing against
    the size of its terms. (A GPU sweep found such a case, seed 83: 1.5e-5 against a bound of 1e-5.)
    An output half a percent of its terms off (0.01 x 0.77 against |w x| + |b| = 1.54) still fails."""
    op = cases.OPS["depthwise_conv1d"]
    params = {"dims": {"L": 1, "batch": 1, "channels": 1, "gap": 0, "left": 0, "width": 1}, "dtype": "float32",
              "layouts": {"bias": "contiguous", "weight": "contiguous", "x": "contiguous"},
              "opts": {"bias": True, "cuts": [], "nn_weight": False, "packing": None, "silu": False,
                       "weight_dtype": "float32"}}
    x, w = torch.tensor([[[1.1]]], device=cases.DEVICE), torch.tensor([[0.7]], device=cases.DEVICE)
    leaves = dict(x=x.requires_grad_(), weight=w.requires_grad_(), bias=-(x * w).detach()[0, 0].requires_grad_())
    verdict = op.judge(params, leaves, 0)
    assert verdict.errors["out"] > 1e-5 and verdict.errors["out against its terms"] < 1e-7, verdict.errors
    assert verdict.failures == [], verdict.failures
    conv = cases.depthwise_conv1d
    monkeypatch.setattr(cases, "depthwise_conv1d", lambda *args: conv(*args) + 0.01 * 0.77)
    failures = op.judge(params, leaves, 0).failures
    assert failures and failures[0].startswith("out against its terms: relative error"), failures


@pytest.mark.parametrize("op_name", ["rmsnorm_fn", "depthwise_conv1d"])
def test_projection_slices_catch_a_kernel_told_a_wrong_alignment(monkeypatch, op_name):
    """The "projection" layout is a slice of rows gap + width + 24 wide: with a gap of 3 the row
    stride is odd, and a kernel told that 8 divides it (known_multiple rounds the stride down to a
    multiple of 8) reads other rows, which the case's judge catches."""
    from mamba_annotated import conv1d, gated_norm

    op = cases.OPS[op_name]
    params = json.loads(json.dumps(op.small()[-1 if op_name == "rmsnorm_fn" else 0]))
    params["dims"]["gap"] = 3
    sliced = [k for k, layout in params["layouts"].items() if layout == "projection"]
    assert sliced and cases.run_case(op, params, 0).failures == []
    if op_name == "rmsnorm_fn":
        options = gated_norm.launch_options
        monkeypatch.setattr(gated_norm, "launch_options", lambda group, rows: {**options(group, rows), "ALIGN": 8})
    else:
        monkeypatch.setattr(conv1d, "launch_alignment", lambda channels, *tensors: 8)
    failures = cases.run_case(op, params, 0).failures
    assert failures, f"{op_name}: a wrong alignment on {sliced} went unnoticed"


def test_a_float32_d_dt_bias_past_its_bound_is_judged_against_its_terms_and_a_wrong_one_still_fails(monkeypatch):
    """The size of d dt_bias's terms forgives rounding of that size, not an error of the sum: a d dt_bias
    one percent of its terms off fails at any seed, in the interpreter or on a GPU."""
    want, terms = torch.tensor([4.0e-4], dtype=torch.float64), torch.tensor([2.755], dtype=torch.float64)
    assert cases.error_against_terms(torch.tensor([4.0e-4 + 1.4e-7]), want, terms) < 1e-4
    op = cases.OPS["ssd_chunk_scan"]
    name, seed, params = TYPICAL_INTERPRETER_CASES["ssd_float32_dt_bias_of_two_cancelling_terms"]
    ours = op.ours

    class OffByAPercentOfTheTerms(torch.autograd.Function):  # the forward as before, d dt_bias 0.01 x 2.755 off
        @staticmethod
        def forward(ctx, dt_bias):
            return dt_bias.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad + 0.01 * 2.755

    def off_by_a_percent_of_the_terms(params):
        fn = ours(params)
        return lambda **args: fn(**{**args, "dt_bias": OffByAPercentOfTheTerms.apply(args["dt_bias"])})

    monkeypatch.setattr(op, "ours", off_by_a_percent_of_the_terms)
    failures = cases.run_case(op, params, seed).failures
    assert any(f.startswith("grad dt_bias") for f in failures), failures


@pytest.mark.skipif(not INTERPRETED, reason="the seed's inputs are the interpreter's draws (past the fixed bound)")
def test_a_16bit_final_state_is_judged_against_the_noise_of_rounding_its_terms(monkeypatch):
    """SSD's bfloat16 final state whose terms cancel (seed 31 of a one-head, one-channel case): past
    the fixed relative bound, within the noise of rounding each term to bfloat16; the same state with
    the last position's term dropped is past that noise."""
    op = cases.OPS["ssd_chunk_scan"]
    name, seed, params = TYPICAL_INTERPRETER_CASES["ssd_bfloat16_final_state_cancels_in_the_interpreter"]
    opts = params["opts"]
    assert params["dims"]["heads"] == params["dims"]["groups"] == 1  # the dropped term's indexing below
    assert not (opts["dt_softplus"] or opts["dt_bias"] or opts["dt_limit"] or opts["initial_states"])  # dt as given
    verdict = cases.run_case(op, params, seed)
    assert not verdict.failures and "final_states" in verdict.yardsticks
    scan = cases.ssd_chunk_scan

    def dropping_the_last_term(x, dt, A, B, C, **kwargs):
        y, final = scan(x, dt, A, B, C, **kwargs)
        return y, final - dt[:, -1, :, None, None].float() * x[:, -1, :, :, None].float() * B[:, -1, :, None, :].float()

    monkeypatch.setattr(cases, "ssd_chunk_scan", dropping_the_last_term)
    failures = cases.run_case(op, params, seed).failures
    assert any(f.startswith("final_states: error") for f in failures), failures


@pytest.mark.parametrize("packing", [None, "seq_idx", "cu_seqlens"])
def test_the_foil_on_a_grid_moved_by_one_position_is_the_same_function(packing):
    """The bidirectional judge's yardstick at chunk 16 (padded_at_both_ends): in float32 its output and
    every gradient match float64 as the op's own do, with and without packed sequences."""
    op = cases.OPS["bidirectional_chunk_scan"]
    _, seed, params = TYPICAL_INTERPRETER_CASES["bidirectional_bfloat16_dA_the_foil_reads_no_state"]
    params = json.loads(json.dumps(params))
    params["dtype"], params["opts"]["dt_dtype"], params["opts"]["packing"] = "float32", "float32", packing
    seed_everything(seed)
    leaves = op.inputs(params)
    foil = op.padded_at_both_ends(op.call(params, cases.bidirectional_two_calls))
    ref = op.call(params, cases.bidirectional_ref)
    args, args64 = op.views(params, leaves), op.views(params, cases.as64(leaves))
    assert cases.error_against(foil(**args)[0], ref(**args64)[0]) < 1e-5
    grad_out = cases.upstream(leaves["x"].numel(), torch.float32, seed)
    got, want = (cases.gradients_of_arguments(f, a, grad_out) for f, a in ((foil, args), (ref, args64)))
    assert set(got) == set(want) and len(want) == 9
    for name in want:
        assert cases.error_against(got[name], want[name]) < 1e-5, name


def test_decoding_steps_step_a_copy_of_the_state_through_its_layout():
    """Each call steps its own copy of the state, made through the state's layout (the kernel sees
    the strides a user's cache has), so the leaf stays as drawn and repeated calls agree bitwise."""
    for op_name in ("ssd_state_update", "selective_state_update"):
        op = cases.OPS[op_name]
        params = op.small()[0]
        leaves = op.inputs(params)
        before = leaves["state"].clone()
        y, state = op.ours(params)(**op.views(params, leaves))
        assert cases.same_bits(leaves["state"], before) and not cases.same_bits(state, before.view(state.shape))
        assert state.stride() == cases.view(before, state.shape, params["layouts"]["state"]).stride()
        assert all(cases.same_bits(a, b) for a, b in zip((y, state), op.ours(params)(**op.views(params, leaves))))


def test_a_failure_is_saved_before_it_is_shrunk():
    """An H100 sweep's processes, killed by the call's limit while shrinking, reported 0 failures
    for cases whose failures they had printed."""
    saved = []
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "1", "--seed", "5"])
    sweep.sweep_op(WrongScan(), args, deadline=None, save=lambda report: saved.append(json.loads(json.dumps(report))))
    before_shrinking = saved[1]
    assert before_shrinking["failures"] == 1 and before_shrinking["reproducers"][0]["shrunk"] is False


def test_a_shrink_budget_leaves_time_for_the_other_cases():
    """An H100 sweep process spent its whole time budget shrinking its first failure and ran no
    other case; with --shrink-budget each failure gets that long and the sweep goes on."""
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "2", "--seed", "5", "--shrink-budget", "0"])
    report = sweep.sweep_op(WrongScan(), args, deadline=None)
    assert report["cases"] == 2 and report["failures"] == 2
    assert [r["shrunk"] for r in report["reproducers"]] == [False, False]


def test_a_shrink_cut_off_by_the_deadline_keeps_its_smallest_failing_case(monkeypatch):
    """An H100 sweep's SSD failure was reported as drawn: the device call's limit ended the process
    in the middle of shrinking, and every smaller failing case found until then was lost."""
    # the loop's check before the case, the check before shrinking, then three attempts
    checks = iter([False] * 5 + [True] * 100)
    monkeypatch.setattr(sweep, "out_of_time", lambda deadline: next(checks))
    op, saved = WrongScan(), []
    args = sweep.parse_args(["--ops", "linear_scan", "--cases", "1", "--seed", "5"])
    report = sweep.sweep_op(op, args, deadline=None, save=lambda r: saved.append(json.loads(json.dumps(r))))
    drawn = cases.draw_case(op, 5, args.cases_per_variant)
    kept = report["reproducers"][0]
    assert report["failures"] == 1 and kept["shrunk"] == "partly" and kept["failures"]
    params = json.loads(kept["command"].split("--params ")[1].strip("'"))
    assert params != drawn and all(params["dims"][k] <= v for k, v in drawn["dims"].items())
    assert cases.run_case(op, params, 5).failures  # the saved case still fails
    assert saved[-1]["reproducers"][0] == kept  # and was saved as soon as it was found


def test_a_shrunk_case_still_fails_the_way_the_drawn_one_failed_first(monkeypatch):
    """An H100 sweep's bidirectional case had a wrong output and NaN gradients; shrinking kept any
    failing case and ended at a 16-bit dA case (another, known defect), losing the wrong output.
    Here the output is wrong only from L = 8 on and grad a fails at every size: the shrunk case
    must keep the wrong output."""
    def judged(op, params, seed):
        wrong_out = ["out: relative error 1e+00"] if params["dims"]["L"] >= 8 else []
        return cases.Verdict(failures=wrong_out + ["grad a: error 1e-03 above 2 x ..."])

    monkeypatch.setattr(sweep, "run_case", judged)
    op = cases.OPS["linear_scan"]
    params = dict(dims=dict(rows=3, L=50), dtype="float32", lead=1, opts=dict(op.defaults),
                  layouts=dict(a="contiguous", b="contiguous", h0="contiguous"))
    report = dict(reproducers=[{}])
    smallest, verdict = sweep.shrink_and_save(op, params, 1, judged(op, params, 1), None, report, lambda r: None)
    assert smallest["dims"] == {"rows": 1, "L": 8}
    assert sweep.failing_names(verdict)[0] == "out" and report["reproducers"][0]["shrunk"] is True


def test_the_gpu_sweeps_false_failures_stay_fixed():
    """The GPU sweeps (H100) failed 17 selective-scan cases whose delta_bias, drawn without softplus,
    made steps negative and states overflow; and attention cases with one or two keys and dropout,
    whose gradients are mostly the stored output's rounding: judged now against the kernels'
    formula on that output."""
    op = cases.OPS["selective_scan"]
    params = dict(dims=dict(L=29, batch=1, dim=4, dstate=1, groups=0), dtype="float16",
                  layouts={k: "contiguous" for k in ("u", "delta", "A", "B", "C", "z")},
                  opts=dict(op.defaults, delta_bias=True, z=True))
    leaves = op.inputs(params)
    assert ((leaves["delta"].float() + leaves["delta_bias"][:, None]) > 0).all()
    assert not cases.run_case(op, params, 130).failures
    op = cases.OPS["attention"]
    plain = dict(q="contiguous", k="contiguous", v="contiguous")
    for dims, dtype, opts, layouts, seed in (  # each fails the exact rule in the interpreter too
            (dict(Lk=1, Lq=3, head_dim=16, heads=1), "float16", dict(dropout_p=0.1), plain, 515),
            (dict(Lk=2, Lq=1, head_dim=21, heads=1), "float16", dict(dropout_p=0.1, softmax_scale=2.0, causal=True),
             dict(q="offset", k="contiguous", v="strided"), 58),
            (dict(Lk=2, Lq=2, head_dim=32, heads=4), "bfloat16", dict(dropout_p=0.1, softmax_scale=-0.7, causal=True),
             dict(q="transposed", k="contiguous", v="offset"), 272)):
        params = dict(dims=dict(dims, batch=1, kv_heads=dims["heads"]), dtype=dtype, layouts=layouts,
                      opts=dict(op.defaults, **opts))
        verdict = cases.run_case(op, params, seed)
        assert not verdict.failures and not verdict.unjudged


# Minimal cases of the second GPU sweep (H100) that failed in the interpreter too, both in the sums
# over every position, dA and d dt_bias. SSD's grew with the chunk (dA 4.8e-5 at chunk 64, 1.6e-4 at
# 256) while dx stayed at 1e-6: its step gradients were a reverse cumulative sum of d a_t = C.dC - B.dB,
# where the pairs on both sides of a step cancel; summed over the straddling pairs only (ssd/
# chunk_scan_bwd.py), dA is 1.5e-5 off here in the interpreter. The GPU draws other inputs from the
# same seed: there dA went from 2.8e-5 to 9.8e-7 and d dt_bias from 5.0e-4 to 1.3e-4 (H100), still
# past its bound, for a cause not yet found (dt's own gradient is 4e-6 off, the same before and after).
# On the H100 on 2026-11-25 (kernels as at 3e4778d) it passed; which change did it was not established.
FIXED_SUM_CASES = {
    "ssd_float32_chunk256": ("ssd_chunk_scan", 765, dict(
        dims=dict(L=362, batch=1, chunk=256, dstate=3, groups=1, headdim=7, heads=2), dtype="float32",
        layouts=dict(A="contiguous", B="contiguous", C="expanded", D="offset", dt="contiguous",
                     initial_states="expanded", x="transposed", z="transposed"),
        opts=dict(D=None, cuts=[273], dt_bias=True, dt_dtype="float32", dt_limit=None, dt_softplus=True,
                  initial_states=True, packing="seq_idx", return_final_states=False, z=True))),
}
# The bidirectional op's step gradients now take the same form (float32 dA at chunk 256 went from
# 1.3e-4 to 5.9e-6 in the interpreter). This bfloat16 case's d dt_bias stayed past 3 x the two-call
# foil's error on the case's own upstream gradient (4.5e-3 against 1.3e-3); the sweep now judges the
# 16-bit step gradients over five upstream gradients (cases.UPSTREAM_DRAWS), and over those it is
# within the rule: on medians 3.5e-3 against the foil's 1.3e-3 (interpreter), and pooled.
TYPICAL_SUM_CASES = {
    "bidirectional_bfloat16_varlen": ("bidirectional_chunk_scan", 500, dict(
        dims=dict(L=249, batch=1, chunk=64, dstate=1, groups=1, headdim=5, heads=3), dtype="bfloat16",
        layouts=dict(A="contiguous", B="transposed", B_rev="contiguous", C="transposed", C_rev="contiguous",
                     D="strided", dt="contiguous", dt_rev="contiguous", x="transposed", z="reversed"),
        opts=dict(B_rev=True, C_rev=True, D=None, cuts=[69], dt_bias=True, dt_dtype="bfloat16",
                  dt_limit=[0.01, 2.0], dt_rev=True, dt_softplus=False, packing="cu_seqlens", shift=False,
                  z=False))),
    # an H100 sweep case (seed 5050, shrunk to one head, headdim 1, dstate 1, chunk 16): on its own
    # upstream gradient a bfloat16 dA 3.6e-4 against 2 x mamba_ssm's 1.6e-4; within the rule over
    # five upstream gradients on the H100 (2026-11-25), and in the interpreter's draws
    "ssd_bfloat16_dA_on_gpu": ("ssd_chunk_scan", 5050, dict(
        dims=dict(L=97, batch=1, chunk=16, dstate=1, groups=1, headdim=1, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="contiguous", C="contiguous", D="contiguous", dt="expanded",
                     initial_states="contiguous", x="strided", z="contiguous"),
        opts=dict(D=None, cuts=[55, 95], dt_bias=False, dt_dtype="bfloat16", dt_limit=None, dt_softplus=False,
                  initial_states=False, packing=None, return_final_states=True, z=False))),
    # an H100 sweep case (seed 20339): bfloat16 dA 4.6e-3 against twice mamba_ssm's 3.1e-4 plus the floor
    # on its own upstream gradient, 2.6e-3 against twice 8.9e-4 over five. Its float32 initial states
    # were rounded to bfloat16 with the states entering each chunk, and the carry's term of dA was
    # formed from that copy and from the rounded state gradients, where mamba_ssm's backward uses
    # float32 for both. Formed in the reverse state passing from the float32 state gradients and the
    # initial states as given (ssd/state_passing.py), it passes on the H100 (2026-11-25).
    "ssd_bfloat16_dA_on_gpu_initial_states": ("ssd_chunk_scan", 20339, dict(
        dims=dict(L=62, batch=1, chunk=16, dstate=100, groups=2, headdim=37, heads=2), dtype="bfloat16",
        layouts=dict(A="contiguous", B="transposed", C="expanded", D="contiguous", dt="contiguous",
                     initial_states="contiguous", x="contiguous", z="offset"),
        opts=dict(D="channel", cuts=[52, 54], dt_bias=True, dt_dtype="bfloat16", dt_limit=[0.01, 2.0],
                  dt_softplus=False, initial_states=True, packing=None, return_final_states=False, z=False))),
    # an H100 sweep case (seed 40601): float16 dA at L = 13 was 8.2e-2 against a fixed 5e-2 bound on its
    # own upstream gradient, a sum that cancels. SSD's float16 step gradients are now judged as its
    # bfloat16 ones, against twice mamba_ssm's error pooled over five upstream gradients: 1.69e-4
    # against mamba_ssm's 1.70e-4 on the H100 (2026-11-25); the interpreter's draws pass the fixed bound
    "ssd_float16_dA_at_13_positions": ("ssd_chunk_scan", 40601, dict(
        dims=dict(L=13, batch=1, chunk=128, dstate=128, groups=1, headdim=64, heads=1), dtype="float16",
        layouts=dict(A="contiguous", B="contiguous", C="reversed", D="offset", dt="expanded",
                     initial_states="contiguous", x="contiguous", z="contiguous"),
        opts=dict(D=None, cuts=[11], dt_bias=True, dt_dtype="float32", dt_limit=[0.01, 2.0], dt_softplus=True,
                  initial_states=False, packing=None, return_final_states=True, z=True))),
}

# 16-bit dA of one head past the rule over five upstream draws, within it over the 64 that a
# gradient of one element gets (H100, 2026-11-27): bidirectional float16 at L = 243, chunk 16 (seed
# 7002, shrunk): 1.4e-4 against 3 x the two-call foil's 3.5e-5 over five, 1.27e-4 against 3 x
# (3.8e-5 + the floor 1e-5) over 64, three times the foil's error and within the rule by its floor
# (widening the 16-bit tiles to float32 dots on the GPU left it as it was); SSD bfloat16 at L = 97,
# chunk 32, a boundary at 9 (seed 201702): 6.5e-4 against 2 x mamba_ssm's 2.7e-4 over five, 6.8e-4
# against 6.8e-4 over 64; bidirectional bfloat16 at L = 129 = chunk + 1, three packed sequences in
# the first chunk (seed 206203): 2.5e-4 against 3 x 7.9e-5 over five, 2.0e-4 against 1.7e-4 over 64
# (kernels as at 1daf8b7). They run with the other recorded GPU sweep cases that pass now, below.
SUM_CASES_WITHIN_THE_RULE_OVER_MORE_DRAWS = {
    "bidirectional_float16_dA_on_gpu": ("bidirectional_chunk_scan", 7002, dict(
        dims=dict(L=243, batch=1, chunk=16, dstate=1, groups=1, headdim=1, heads=1), dtype="float16",
        layouts=dict(A="strided", B="contiguous", B_rev="reversed", C="strided", C_rev="contiguous", D="contiguous",
                     dt="expanded", dt_rev="contiguous", x="contiguous", z="expanded"),
        opts=dict(B_rev=True, C_rev=True, D=None, cuts=[84], dt_bias=True, dt_dtype="float32", dt_limit=[0.01, 2.0],
                  dt_rev=True, dt_softplus=True, packing="seq_idx", shift=True, z=False))),
    "ssd_bfloat16_dA_boundary_at_9": ("ssd_chunk_scan", 201702, dict(
        dims=dict(L=97, batch=1, chunk=32, dstate=256, groups=1, headdim=16, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="reversed", C="contiguous", D="contiguous", dt="offset",
                     initial_states="strided", x="contiguous", z="contiguous"),
        opts=dict(D="head", cuts=[9], dt_bias=False, dt_dtype="float32", dt_limit=None, dt_softplus=False,
                  initial_states=False, packing="seq_idx", return_final_states=True, z=False))),
    "bidirectional_bfloat16_dA_at_chunk_plus_one": ("bidirectional_chunk_scan", 206203, dict(
        dims=dict(L=129, batch=1, chunk=128, dstate=16, groups=1, headdim=32, heads=1), dtype="bfloat16",
        layouts=dict(A="expanded", B="contiguous", B_rev="contiguous", C="contiguous", C_rev="offset", D="reversed",
                     dt="transposed", dt_rev="contiguous", x="contiguous", z="strided"),
        opts=dict(B_rev=False, C_rev=False, D="head", cuts=[64, 107], dt_bias=False, dt_dtype="float32",
                  dt_limit=None, dt_rev=False, dt_softplus=True, packing="cu_seqlens", shift=False, z=False))),
}

# The same shapes in the interpreter, at seeds that fail there (of 40 seeds, 11 failed for SSD; of 25,
# 7 for the bidirectional op). SSD seed 31: the one-element final state is -0.0023 against -0.0010,
# a sum of terms of about 0.2 that cancels, and the chunk-state kernel rounds each weighted x to
# bfloat16 before its dot (as mamba_ssm does): that rounding, not a relative 1e-2 of the result, is
# what the sum can hold. Judged against the noise of that rounding (SSDChunkScan.judge_final_state)
# it passes: an error of 1.3e-3 against the bound 6.9e-3. Bidirectional float16 seed 20 failed
# on its own upstream gradient (dA 1.5e-2 against 3 x the foil's 1.7e-3) and passes pooled (1.3e-4
# against the foil's 1.2e-4 as the judge draws now). It was a case here until it took 67-94 s of CI's
# 25 minutes, drawn again over 64 upstream gradients: that path of the judge is tested by
# test_a_gradient_of_few_elements_past_the_rule_over_five_draws_is_judged_over_more in a second, and
# on the GPU by the H100 cases of SUM_CASES_WITHIN_THE_RULE_OVER_MORE_DRAWS.
def at_seed(case, seed):
    name, _, params = {**TYPICAL_SUM_CASES, **SUM_CASES_WITHIN_THE_RULE_OVER_MORE_DRAWS}[case]
    return name, seed, params


TYPICAL_INTERPRETER_CASES = {
    "ssd_bfloat16_final_state_cancels_in_the_interpreter": at_seed("ssd_bfloat16_dA_on_gpu", 31),
    # An interpreter sweep case (seed 80270) past the step-gradient rule, pooled over upstream
    # gradients too (over 32 draws, its dA having two elements: 2.3e-4 against the foil's 8.8e-8; past
    # what luck gives, so the judge fails it over five): with the shift at L = 17 and chunk 16, the
    # foil's shifted output at row 16 is its first call's row 15, inside the first chunk, so no output
    # of the foil reads a state entering a chunk, while ours reads the state entering chunk 1 for row
    # 16, stored and read in bfloat16 (at L = 16 or in float32 both are 1e-7; at L = 18, where the foil
    # reads that state too, both are 1e-3). Against the foil on a grid moved by one position
    # (BidirectionalChunkScan.padded_at_both_ends; chunk 16 has no half chunk) it passes: 1.7e-4 against
    # that foil's 2.7e-4 (3.7e-4 with its forward grid moved alone).
    "bidirectional_bfloat16_dA_the_foil_reads_no_state": ("bidirectional_chunk_scan", 80270, dict(
        dims=dict(L=17, batch=1, chunk=16, dstate=3, groups=1, headdim=17, heads=2), dtype="bfloat16",
        layouts=dict(A="contiguous", B="contiguous", B_rev="contiguous", C="contiguous", C_rev="contiguous",
                     D="contiguous", dt="contiguous", dt_rev="contiguous", x="contiguous", z="reversed"),
        opts=dict(B_rev=True, C_rev=True, D="head", cuts=[1], dt_bias=False, dt_dtype="bfloat16",
                  dt_limit=[0.01, 2.0], dt_rev=True, dt_softplus=False, packing="seq_idx", shift=True, z=False))),
    # An interpreter sweep case (seed 80138): d dt at L = 2 was 5.7e-3 against 3 x the foil's 1.6e-3
    # on medians over five upstream gradients (7.9e-3 while the interpreter truncated to bfloat16). It
    # has two elements in bfloat16, one of them 0: on the first upstream draw ours is two bfloat16
    # steps from float64 (-0.7305 against -0.7375) and the foil's within one (-0.7383), while the
    # float32 d dt_bias, the same sum before rounding, is 6.5e-3 off against the foil's 1.7e-3 there
    # and 2.2e-3 against 4.7e-3, 5.5e-3 against 3.1e-3 on the next two draws: noise of bfloat16's
    # size, which medians over five draws of two elements did not average out. Pooled over the draws
    # (cases.pooled_error) it is within the rule: 5.7e-3 against 3 x the foil's 3.1e-3.
    "bidirectional_bfloat16_d_dt_at_two_positions": ("bidirectional_chunk_scan", 80138, dict(
        dims=dict(L=2, batch=1, chunk=32, dstate=7, groups=1, headdim=5, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="expanded", B_rev="offset", C="contiguous", C_rev="contiguous",
                     D="contiguous", dt="contiguous", dt_rev="contiguous", x="contiguous", z="contiguous"),
        opts=dict(B_rev=True, C_rev=False, D="head", cuts=[1], dt_bias=True, dt_dtype="bfloat16",
                  dt_limit=[0.01, 2.0], dt_rev=False, dt_softplus=False, packing=None, shift=False, z=True))),
    # An interpreter sweep case (seed 900368, shrunk), the reverse direction's twin of seed 80270: float16
    # dA with the shift at L = 17 and chunk 16 was 1.0e-4 against 3 x the foil's 3.5e-5, pooled over 32
    # upstream gradients, with the foil's forward grid moved by one position. The foil's reverse call
    # reads the sequence from its end, so with the shift its output at row 0 falls in that call's first
    # chunk too and reads no state; moving that grid as well (padded_at_both_ends), it passes.
    "bidirectional_float16_dA_the_foils_reverse_call_reads_no_state": ("bidirectional_chunk_scan", 900368, dict(
        dims=dict(L=17, batch=1, chunk=16, dstate=7, groups=2, headdim=5, heads=2), dtype="float16",
        layouts=dict(A="contiguous", B="contiguous", B_rev="contiguous", C="contiguous", C_rev="contiguous",
                     D="offset", dt="contiguous", dt_rev="expanded", x="expanded", z="strided"),
        opts=dict(B_rev=True, C_rev=True, D=None, cuts=[15, 16], dt_bias=False, dt_dtype="float16", dt_limit=None,
                  dt_rev=True, dt_softplus=True, packing=None, shift=True, z=False))),
    # An interpreter sweep case (seed 901685, shrunk): float32 d dt_bias at batch 2 and L = 1 is the sum
    # of two terms that cancel, -1.3774 + 1.3778; 3.5e-4 past the fixed bound of 1e-4 by an absolute
    # error of 1.4e-7. Against the size of its terms (cases.error_against_terms) it is within the bound.
    "ssd_float32_dt_bias_of_two_cancelling_terms": ("ssd_chunk_scan", 901685, dict(
        dims=dict(L=1, batch=2, chunk=16, dstate=3, groups=1, headdim=17, heads=1), dtype="float32",
        layouts=dict(A="offset", B="expanded", C="contiguous", D="offset", dt="contiguous", initial_states="offset",
                     x="contiguous", z="reversed"),
        opts=dict(D=None, cuts=[], dt_bias=True, dt_dtype="float32", dt_limit=None, dt_softplus=False,
                  initial_states=True, packing=None, return_final_states=True, z=True))),
}


INTERPRETER_DRAWS = pytest.mark.skipif(not INTERPRETED, reason="the seed's inputs are the interpreter's draws")
ALL_SUM_CASES = {**FIXED_SUM_CASES, **TYPICAL_SUM_CASES, **TYPICAL_INTERPRETER_CASES}


# The recorded H100 sweep failures that still fail when rejudged on the H100 with the step
# gradients pooled over five upstream gradients (book/data/reliability_rejudge.json, kernels as at
# 07a72ca), as their reproducers give them. Their inputs are the GPU's draws from the seed, so they
# are skipped in the interpreter; on the GPU they are strict xfails until fixed.
# Recorded H100 sweep failures that pass now: three fixed in the kernels, the others under the judge's later
# rules (a gradient past its fixed bound against the foil pooled; a 16-bit step gradient against the foil at
# half the chunk too), on an H100 with the kernels as at 8fc534f. A change that makes one fail again is a
# regression of the kernels or the judge
PASSING_GPU_SWEEP_CASES = {
    # Fixed in decoding_config (issue 15). attention_with_kvcache float32 at head dim 203 (a 256-column
    # tile) raised OutOfResources on an H200: 64-key tiles in 3 stages asked 282,688 bytes of shared
    # memory, past its 232,448; float32 past head dim 128 now takes 32-key tiles
    "kvcache_float32_head_dim_203_shared_memory": ("attention_with_kvcache", 723150, dict(
        dims=dict(Lq=1, batch=1, capacity=31, head_dim=203, heads=1, kv_heads=1, new=1, page_size=64),
        dtype="float32",
        layouts=dict(k="strided", k_cache="transposed", q="contiguous", v="transposed", v_cache="contiguous"),
        opts=dict(alibi=None, causal=False, layout="contiguous", leftpad=False, num_splits=32, rotary=None,
                  rotary_dtype="same", rotary_fraction=0.5, seqlens="int", softcap=0.0, softmax_scale=None,
                  window_size=[-1, -1]))),
    # Fixed in the kernels (issue 14). SSD float32 at L = 2039, chunk 256: final state 2.7e-5 against 1e-5,
    # dA 5.1e-4 against 1e-4, from chunk sums kept in float32 (README: "What 71461 was"); with the sums'
    # low part kept (two float32 planes) 8.0e-8 and 3.6e-6 on an H100, where mamba_ssm with exact float32
    # dots gives 4.5e-6 and 1.8e-4
    "ssd_float32_final_state_at_chunk256": ("ssd_chunk_scan", 71461, dict(
        dims=dict(L=2039, batch=1, chunk=256, dstate=16, groups=1, headdim=16, heads=1), dtype="float32",
        layouts=dict(A="contiguous", B="offset", C="contiguous", D="transposed", dt="reversed",
                     initial_states="offset", x="contiguous", z="contiguous"),
        opts=dict(D="channel", cuts=[37, 1085, 1376], dt_bias=False, dt_dtype="float32", dt_limit=None,
                  dt_softplus=True, initial_states=False, packing=None, return_final_states=True, z=False))),
    # rmsnorm_fn float32 grad x of groups of one element: 8.9e-3 and 1.8e-3 against twice PyTorch's formula's
    # 4.2e-3 and 2.7e-4 (d out / dx = w eps / (x^2 + eps)^1.5, two terms that agree to 1e-6 cancelling); the
    # kernel now takes that formula for a group of one (tests/test_gated_norm.py::test_groups_of_one_element)
    "rmsnorm_float32_grad_x_of_one_element_groups": ("rmsnorm_fn", 69, dict(
        dims=dict(batch=1, group=1, rows=4, width=1), dtype="float32",
        layouts=dict(bias="contiguous", weight="contiguous", x="contiguous", z="contiguous"),
        opts=dict(bias=False, eps=1e-6, norm_before_gate=True, z="float32"))),
    "rmsnorm_float32_grad_x_of_one_element": ("rmsnorm_fn", 71, dict(
        dims=dict(batch=1, group=1, rows=1, width=1), dtype="float32",
        layouts=dict(bias="contiguous", weight="contiguous", x="contiguous", z="contiguous"),
        opts=dict(bias=False, eps=1e-6, norm_before_gate=True, z=None))),
    # bfloat16 grad x at headdim 1: 1.26e-2 against the fixed 1e-2 on one draw; pooled 4.6e-3, the foil's 4.6e-3
    "bidirectional_bfloat16_grad_x_at_headdim1": ("bidirectional_chunk_scan", 71006, dict(
        dims=dict(L=13, batch=1, chunk=16, dstate=1, groups=1, headdim=1, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="contiguous", B_rev="contiguous", C="contiguous", C_rev="contiguous",
                     D="contiguous", dt="contiguous", dt_rev="contiguous", x="contiguous", z="contiguous"),
        opts=dict(B_rev=False, C_rev=False, D=None, cuts=[6], dt_bias=True, dt_dtype="float32", dt_limit=None,
                  dt_rev=True, dt_softplus=False, packing=None, shift=False, z=False))),
    # bfloat16 dA pooled: 6.5e-4 against 3 x the two-call foil's 2.0e-4; its foil at chunk 32 5.5e-4
    "bidirectional_bfloat16_dA_packed_shifted": ("bidirectional_chunk_scan", 71504, dict(
        dims=dict(L=316, batch=1, chunk=64, dstate=1, groups=1, headdim=1, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="reversed", B_rev="contiguous", C="offset", C_rev="transposed",
                     D="contiguous", dt="contiguous", dt_rev="reversed", x="expanded", z="contiguous"),
        opts=dict(B_rev=True, C_rev=False, D="head", cuts=[10, 202, 256], dt_bias=False, dt_dtype="float32",
                  dt_limit=None, dt_rev=True, dt_softplus=False, packing="cu_seqlens", shift=True, z=False))),
    # bfloat16 dA pooled, the shift at L = 257 and chunk 256: 3.3e-4 against 3 x the foil's 1.3e-5, which reads
    # no chunk state there; its foil at chunk 128 2.8e-4
    "bidirectional_bfloat16_dA_one_step_past_a_chunk": ("bidirectional_chunk_scan", 72440, dict(
        dims=dict(L=257, batch=1, chunk=256, dstate=48, groups=1, headdim=80, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="expanded", B_rev="strided", C="offset", C_rev="contiguous",
                     D="contiguous", dt="contiguous", dt_rev="strided", x="strided", z="expanded"),
        opts=dict(B_rev=True, C_rev=True, D="channel", cuts=[93, 205, 225], dt_bias=False, dt_dtype="bfloat16",
                  dt_limit=None, dt_rev=True, dt_softplus=False, packing=None, shift=True, z=False))),
    # bfloat16 dA pooled, the same shape again: 4.8e-4 against 3 x the foil's 1.1e-5; at chunk 128 7.3e-4
    "bidirectional_bfloat16_dA_one_step_past_a_chunk_packed": ("bidirectional_chunk_scan", 90104, dict(
        dims=dict(L=257, batch=1, chunk=256, dstate=48, groups=1, headdim=80, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="expanded", B_rev="expanded", C="expanded", C_rev="contiguous",
                     D="contiguous", dt="contiguous", dt_rev="contiguous", x="transposed", z="contiguous"),
        opts=dict(B_rev=False, C_rev=False, D=None, cuts=[94, 226], dt_bias=False, dt_dtype="bfloat16",
                  dt_limit=[0.01, 2.0], dt_rev=False, dt_softplus=False, packing="cu_seqlens", shift=True, z=False))),
    # Fixed in the kernels (issue 14). bfloat16 dD of one head with the gate z at L = 2 (an H100 sweep case
    # under the judge of 2026-11-27, not shrunk): 2.2e-3 pooled over five draws against 3 x the two-call
    # foil's 1e-8, dD being summed from dy = d_out silu(z) rounded to bfloat16; summed from the float32
    # product in the gate's backward kernel (ssd/gate.py), 6.1e-7 on an H100
    "bidirectional_bfloat16_dD_with_the_gate_at_L2": ("bidirectional_chunk_scan", 509003, dict(
        dims=dict(L=2, batch=2, chunk=128, dstate=64, groups=1, headdim=128, heads=1), dtype="bfloat16",
        layouts=dict(A="contiguous", B="transposed", B_rev="strided", C="contiguous", C_rev="reversed",
                     D="contiguous", dt="reversed", dt_rev="contiguous", x="contiguous", z="strided"),
        opts=dict(B_rev=False, C_rev=False, D="head", cuts=[1], dt_bias=False, dt_dtype="float32", dt_limit=None,
                  dt_rev=True, dt_softplus=True, packing=None, shift=True, z=True))),
    **SUM_CASES_WITHIN_THE_RULE_OVER_MORE_DRAWS,
}


@pytest.mark.skipif(INTERPRETED, reason="the seed's inputs are the GPU's draws")
@pytest.mark.parametrize("case", PASSING_GPU_SWEEP_CASES)
def test_recorded_gpu_sweep_failures_that_pass_now(case):
    name, seed, params = PASSING_GPU_SWEEP_CASES[case]
    failures = cases.run_case(cases.OPS[name], params, seed).failures
    assert not failures, failures


# The slowest of the H100 sweep's cases in the interpreter (about 290, 60, 31 and 25 s; CI has two
# cores and 25 minutes): the interpreter draws other inputs from a seed than the GPU does, so there
# they replay nothing; the GPU pipeline runs them in seconds, on the seeds' GPU draws
# (a tuple: a set's order changes between processes, and xdist's workers must collect the same list)
GPU_ONLY = ("bidirectional_bfloat16_varlen", "ssd_float32_chunk256", "ssd_float16_dA_at_13_positions",
            "ssd_bfloat16_dA_on_gpu_initial_states")
GPU_RUNS_IT = pytest.mark.skipif(INTERPRETED, reason="slow in the interpreter, a GPU draw: run by the GPU pipeline")


@pytest.mark.parametrize("case", [*(c for c in {**FIXED_SUM_CASES, **TYPICAL_SUM_CASES} if c not in GPU_ONLY),
                                  *(pytest.param(c, marks=GPU_RUNS_IT) for c in GPU_ONLY),
                                  *(pytest.param(c, marks=INTERPRETER_DRAWS) for c in TYPICAL_INTERPRETER_CASES)])
def test_sweep_cases_of_the_sums_over_positions(case):
    name, seed, params = ALL_SUM_CASES[case]
    failures = cases.run_case(cases.OPS[name], params, seed).failures
    assert not failures, failures


def test_the_formula_on_the_stored_output_is_the_exact_gradient_when_the_output_is_exact():
    op = cases.OPS["attention"]
    params = dict(dims=dict(Lk=5, Lq=4, head_dim=16, heads=2, batch=1, kv_heads=1), dtype="float32",
                  layouts=dict(q="contiguous", k="contiguous", v="contiguous"), opts=dict(op.defaults, causal=True))
    leaves = cases.as64(op.inputs(params))
    ref = op.call(params, attention_ref)
    out = ref(**op.views(params, leaves))[0].detach()
    grad_out = cases.upstream(out.numel(), torch.float64, 3)
    exact = cases.gradients_of_arguments(lambda **kw: ref(**kw)[:1], op.views(params, leaves), grad_out)
    formula = op.from_stored_output(params, ref, leaves, out, grad_out)
    for name in exact:
        torch.testing.assert_close(formula[name], exact[name], rtol=1e-12, atol=1e-12)
    rounded = op.from_stored_output(params, ref, leaves, out.half(), grad_out)
    assert not torch.allclose(rounded["q"], exact["q"], rtol=1e-6, atol=0)


def test_the_rounding_of_a_cancelled_dp_minus_d_is_allowed_and_nothing_more():
    """GPU sweep (H100, seed 5215), shrunk to one key, float32, scale 2: the exact dq and dk are 0
    (dS = P (dP - D) with P = 1 and dP = D), so a kernel's dq and dk are the rounding of dP - D,
    which PyTorch's softmax backward happens to get exactly. The allowance admits that rounding,
    made here the way the kernels make it (dP and D summed in float32 in different orders), and
    not a hundred times it; where little cancels it stays below float32's floor of 1e-6."""
    op = cases.OPS["attention"]

    def setup(Lq, Lk, scale):
        params = dict(dims=dict(Lq=Lq, Lk=Lk, head_dim=32, heads=2, batch=1, kv_heads=1), dtype="float32",
                      layouts=dict(q="contiguous", k="transposed", v="contiguous"),
                      opts=dict(op.defaults, softmax_scale=scale))
        torch.manual_seed(0)  # inputs whose two sums below round differently
        leaves = cases.as64(op.inputs(params))
        ref = op.call(params, attention_ref)
        out = ref(**op.views(params, leaves))[0].detach()
        grad_out = cases.upstream(out.numel(), torch.float32, 7)
        exact = cases.gradients_of_arguments(lambda **kw: ref(**kw)[:1], op.views(params, leaves), grad_out)
        return params, leaves, out, grad_out, exact, op.cancellation_rounding(params, leaves, out, grad_out, None)

    params, leaves, out, grad_out, exact, rounding = setup(1, 1, 2.0)
    assert exact["k"].abs().max() == 0 and set(rounding) == {"q", "k"}
    q, k, v = (t.detach().float() for t in (leaves["q"], leaves["k"], leaves["v"]))
    d_out, out32 = grad_out.float().view(out.shape), out.float()
    d_probs = (d_out * v).sum(-1)                           # (batch, 1, heads): dO . v, one key
    delta = torch.zeros_like(d_probs)
    for j in reversed(range(q.shape[-1])):                  # D = rowsum(dO o O), in another order
        delta = delta + d_out[..., j] * out32[..., j]
    d_scores = d_probs - delta                              # P = 1: dS is the rounding alone
    assert d_scores.abs().max() > 0, "no rounding to judge: the two orders agreed"
    dk = 2.0 * (d_scores[..., None] * q).sum(2, keepdim=True)  # both heads share the key head
    cases.assert_within_same_computation("grad k", dk, exact["k"] * 0, exact["k"], torch.float32,
                                         rounding=rounding["k"])
    with pytest.raises(AssertionError):
        cases.assert_within_same_computation("grad k", 100 * dk, exact["k"] * 0, exact["k"], torch.float32,
                                             rounding=rounding["k"])
    _, _, _, _, exact, rounding = setup(64, 96, None)  # the default scale: softmax far from one-hot
    for name in ("q", "k"):
        assert rounding[name].norm() / exact[name].norm() < 1e-6


def test_time_budget_stops_early_and_says_so(tmp_path):
    out = tmp_path / "sweep.json"
    sweep.main(["--ops", "sequential_scan", "--cases", "1000", "--time-budget", "0", "--json", str(out)])
    r = json.loads(out.read_text())["ops"]["sequential_scan"]
    assert r["stopped_early"] and r["cases"] == 0


def test_unknown_ops_are_refused():
    with pytest.raises(SystemExit):
        sweep.parse_args(["--ops", "flash"])
    with pytest.raises(SystemExit):
        sanitize.parse_args(["--tools", "asan"])


def test_sanitizer_command_and_log_parsing():
    args = sanitize.parse_args(["--ops", "attention", "--tools", "memcheck,initcheck"])
    assert args.tools == ["memcheck", "initcheck"]
    command = sanitize.sanitizer_command("racecheck", "attention")
    assert command[1:3] == ["--tool", "racecheck"] and command[-3:] == ["--driver", "--ops", "attention"]
    assert sanitize.ENV["TRITON_DISABLE_LINE_INFO"] == "0"
    log = ("========= Invalid __global__ write of size 4 bytes\n=========     at chunk_scan_kernel+0x1a0 in "
           "/x/chunk_scan.py:120\n========= ERROR SUMMARY: 3 errors\n")
    errors, kernels = sanitize.count_errors(log)
    assert errors == 3 and kernels == ["chunk_scan_kernel"]
    # racecheck's own summary line (its absence read as a failed run, seen on the H100)
    assert sanitize.count_errors("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")[0] == 0
    assert sanitize.count_errors("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")[0] == 1
    assert sanitize.count_errors("no summary at all")[0] is None
    # racecheck names the kernel in the frames under each hazard, not at the start of a line (an
    # H100 run reported 7317 hazards and no kernel)
    hazard = ("========= Error: Potential WAW hazard detected at __shared__ 0x420 in block (15,0,0) :\n"
              "=========     Write Thread (31, 0, 0) at chunk_scan_bwd_dx_kernel+0x3c40 in /x/chunk_scan_bwd.py:150\n"
              "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert sanitize.count_errors(hazard) == (1, ["chunk_scan_bwd_dx_kernel"])


def test_racecheck_hazards_are_counted_by_kernel_line_and_shape():
    """Hazards counted by kind, kernel, line and shape, as an H100 racecheck log prints them: two
    lanes of one warp at one instruction (every hazard of the SSD backward there) apart from any
    other pair of accesses; a hazard whose accesses cannot be read is still counted."""
    def hazard(t1, pc1, t2, pc2, line2="/w/chunk_scan_bwd.py:173", kind="WAW"):
        return (f"========= Error: Potential {kind} hazard detected at __shared__ 0x414 in block (31,0,0) :\n"
                f"=========     Write Thread ({t1}) at chunk_scan_bwd_dx_kernel+{pc1} in /w/chunk_scan_bwd.py:173\n"
                f"=========     Read Thread ({t2}) at chunk_scan_bwd_dx_kernel+{pc2} in {line2}\n"
                "=========     Current Value : 63, Incoming Value : 65\n=========\n")
    log = (hazard("47,0,0", "0x4080", "48, 0, 0", "0x4080") + hazard("15,0,0", "0x4080", "16,0,0", "0x4080")
           + hazard("31,0,0", "0x4080", "32,0,0", "0x4080")  # two warps
           + hazard("3,0,0", "0x4080", "3,1,0", "0x4080")  # another row of threads
           + hazard("3,0,0", "0x4080", "9,0,0", "0x40a0", "/w/chunk_scan_bwd.py:180", kind="RAW")
           + "========= Error: Potential WAR hazard detected at __shared__ 0x10 in block (0,0,0) :\n"
           "=========     Write Thread (1,0,0) at void k<float, 4>(float*)+0x10\n=========\n"
           + "========= RACECHECK SUMMARY: 6 hazards displayed (6 errors, 0 warnings)\n")
    kernel, line = "chunk_scan_bwd_dx_kernel", "chunk_scan_bwd.py:173"
    assert sanitize.racecheck_hazards(log) == [
        dict(kind="WAW", kernel=kernel, line=line, shape="one instruction, one warp", count=2),
        dict(kind="WAW", kernel=kernel, line=line, shape="two instructions or warps", count=2),
        dict(kind="RAW", kernel=kernel, line="chunk_scan_bwd.py:173 / chunk_scan_bwd.py:180",
             shape="two instructions or warps", count=1),
        dict(kind="WAR", kernel="?", line="?", shape="accesses not read", count=1)]
    assert sanitize.racecheck_hazards("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)") == []


def test_sanitizer_driver_runs_each_op_forward_and_backward(capsys):
    sanitize.drive(["sequential_scan", "attention"])
    assert capsys.readouterr().out.count("forward and backward") == 2


@needs_cuda
def test_sanitizer_runs_under_cuda(tmp_path):
    assert sanitize.main(["--ops", "sequential_scan", "--tools", "memcheck", "--json", str(tmp_path / "s.json")]) == 0


def test_reproducible_compares_repeated_calls(tmp_path):
    out = tmp_path / "r.json"
    assert reproducible.main(["--ops", "linear_scan,attention", "--cases", "1", "--runs", "2", "--json", str(out)]) == 0
    assert all(r["cases"] == 3 for r in json.loads(out.read_text())["ops"].values())


def test_large_checks_at_smoke_sizes(tmp_path):
    """The window references of the 2^20-token checks, exact in float64, pass at a few hundred tokens."""
    out = tmp_path / "l.json"
    code = large.main(["--smoke", "--checks", "ssd_chunk_scan,bidirectional_chunk_scan,attention,linear_scan",
                       "--json", str(out)])
    report = json.loads(out.read_text())["ops"]
    assert code == 0, {k: v["failures"] for k, v in report.items()}
    assert len(report["ssd_chunk_scan"]["windows"]) == 4


def test_nonfinite_probes_report_per_op(tmp_path):
    out = tmp_path / "n.json"
    nonfinite.main(["--ops", "linear_scan,attention,ssd_state_update,rmsnorm_fn", "--values", "nan", "--positions",
                    "25", "--json", str(out)])
    report = json.loads(out.read_text())["ops"]
    assert report["linear_scan"] == dict(cases=2, failures=0, problems=[])
    assert report["attention"]["cases"] == 3
    assert report["ssd_state_update"] == dict(cases=4, failures=0, problems=[])  # x, dt, B, C at the last step
    assert report["rmsnorm_fn"] == dict(cases=2, failures=0, problems=[])  # x and z: only their row is reached


def test_conv_probes_reach_the_windows_that_hold_t_in_its_sequence(tmp_path, monkeypatch):
    """A value at t reaches the outputs t - (width - 1 - left) .. t + left of its own packed
    sequence; a convolution that let a window cross into the next sequence is caught."""
    op = cases.OPS["depthwise_conv1d"]
    one, packed = nonfinite.plain_cases(op)
    assert one["opts"]["packing"] is None and packed["opts"]["packing"] == "seq_idx" and packed["opts"]["cuts"] == [5]
    args = op.views(packed, op.inputs(packed))
    length = packed["dims"]["L"]
    for t, left, want in ((4, 3, [4]), (4, 1, [2, 3, 4]), (6, 1, [5, 6, 7]),
                            (length - 1, 0, list(range(length - 4, length)))):
        params = json.loads(json.dumps(packed))
        params["dims"]["left"] = left  # width 4
        reach = nonfinite.reached(op, params, args, "x", t, length)
        assert reach.nonzero().flatten().tolist() == want, (t, left)
    out = tmp_path / "n.json"
    assert nonfinite.main(["--ops", "depthwise_conv1d", "--values", "nan,-inf", "--positions", "first,25",
                           "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ops"]["depthwise_conv1d"] == dict(cases=8, failures=0, problems=[])
    conv = cases.depthwise_conv1d
    monkeypatch.setattr(cases, "depthwise_conv1d", lambda x, w, b, left, seq_idx, act: conv(x, w, b, left, None, act))
    problems = nonfinite.probe(op, packed, op.inputs(packed), "x", 4, float("nan"))
    assert problems and "outputs it cannot reach changed" in problems[0], problems


def test_kvcache_probes_reach_each_sequence_at_its_own_positions():
    """A NaN at cache position t is a key of each sequence that holds t and that the append leaves
    (different rows for different cache_seqlens); a NaN new key t sits at cache_seqlens[b] + t.
    Two probes of nonfinite.py's run, with the reach they were judged by."""
    op = cases.OPS["attention_with_kvcache"]
    params = nonfinite.plain_cases(op)[0]
    seed_everything(0)
    leaves = op.inputs(params)
    args = op.views(params, leaves)
    # the probed positions are picked from the draw (the GPU draws other lengths than the CPU): the
    # last cache position some sequence holds and keeps, which the case's window of 9 keys before
    # the newest still sees (the first one is out of every window when the GPU draws long
    # sequences), and the last new key
    kept = [(args["cache_leftpad"] <= t) & (t < args["cache_seqlens"]) for t in range(params["dims"]["capacity"])]
    last_kept = max(t for t, rows in enumerate(kept) if rows.any())
    for name, t in (("k_cache", last_kept), ("v", params["dims"]["new"] - 1)):
        reach = nonfinite.reached(op, params, args, name, t, params["dims"]["Lq"])
        assert reach.shape == (params["dims"]["batch"], params["dims"]["Lq"])
        assert nonfinite.probe(op, params, leaves, name, t, float("nan")) == []
        position = t if name == "k_cache" else args["cache_seqlens"].long() + t
        held = (position >= args["cache_leftpad"]) & (position < args["cache_seqlens"] + params["dims"]["new"])
        if name == "k_cache":  # the slots of the new keys are overwritten
            held &= position < args["cache_seqlens"]
        assert reach.any() and not (reach & ~held[:, None]).any()


def test_varlen_probes_reach_the_rows_of_their_sequence():
    """A NaN in key t of a packed sequence reaches the rows of that sequence whose window holds it,
    and no other row (:meth:`cases.AttentionVarlen.reach`): a probe of nonfinite.py's run, on the
    first key that some row sees (the sizes differ between the GPU and the CPU), with its reach."""
    op = cases.OPS["attention_varlen"]
    params = nonfinite.plain_cases(op)[0]
    seed_everything(0)
    leaves = op.inputs(params)
    args = op.views(params, leaves)
    bounds_q, bounds_k = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
    total_q = args["q"].shape[0]
    t = next(t for t in range(bounds_k[-1]) if nonfinite.reached(op, params, args, "v", t, total_q).any())
    b = next(b for b in range(len(bounds_k) - 1) if bounds_k[b] <= t < bounds_k[b + 1])
    reach = nonfinite.reached(op, params, args, "v", t, total_q)
    assert not reach[:bounds_q[b]].any() and not reach[bounds_q[b + 1]:].any()
    assert nonfinite.probe(op, params, leaves, "v", t, float("nan")) == []


def test_leaks_arguments_and_skip_without_cuda():
    assert leaks.parse_args(["--calls", "7"]).calls == 7
    if not torch.cuda.is_available():
        assert leaks.main(["--calls", "1"]) == 0  # prints why it skipped
        pytest.skip("memory_allocated and CUDA graphs need a CUDA device")
    assert leaks.main(["--ops", "sequential_scan", "--calls", "10"]) == 0


def test_contraction_finds_a_product_fused_with_its_partners_sum(tmp_path):
    """The PTX of ``tl.sum(acc * xs, axis=1)`` as Triton 3.6 compiled it for the SSD dx kernel on
    an H100: lane i adds its partner's rounded product to its own unrounded one, so partners
    disagree. The product rounded first, an FMA whose addend is no shuffle's, a combine of one's
    own (no standard.py frame) and an FMA after a .loc outside the sum are not reported."""
    def ptx(first_add):
        return ('\t.file\t1 "/w/mamba_annotated/ssd/chunk_scan_bwd.py"\n'
                "\t.loc\t1 173 52                        // chunk_scan_bwd.py:173:52\n"
                "\tmul.f32 \t%r13, %r1, %r5;\n"
                "\t.loc\t3 293 36                        // standard.py:293:36 @[ chunk_scan_bwd.py:173:46 ]\n"
                "\tshfl.sync.bfly.b32 \t%r17, %r13, 16, 31, -1;\n"
                "\t.loc\t3 263 15                        // standard.py:263:15 @[ standard.py:293:36 @[ "
                "chunk_scan_bwd.py:173:46 ] ]\n"
                f"\t{first_add}\n")
    contracted = ptx("fma.rn.f32 \t%r18, %r1, %r5, %r17;")
    assert contraction.shuffled_addends(contracted) == {"chunk_scan_bwd.py:173": 1}
    assert not contraction.shuffled_addends(ptx("add.f32 \t%r18, %r13, %r17;"))
    assert not contraction.shuffled_addends(ptx("fma.rn.f32 \t%r18, %r1, %r5, %r9;"))
    own_combine = contracted.replace("standard.py:293:36 @[ ", "").replace("standard.py:263:15 @[ ", "")
    assert not contraction.shuffled_addends(own_combine.replace(" ]", "")), "a tl.reduce combine of one's own"
    moved_on = contracted.replace("\tfma.rn", "\t.loc\t1 180 3\n\tfma.rn")
    assert not contraction.shuffled_addends(moved_on), "an FMA after a .loc outside the sum"
    (tmp_path / "HASH").mkdir()
    (tmp_path / "HASH" / "chunk_scan_bwd_dx_kernel.ptx").write_text(contracted)
    assert contraction.scan(tmp_path) == [("ssd/chunk_scan_bwd_dx_kernel", "chunk_scan_bwd.py:173", 1)]
    assert contraction.main([str(tmp_path)]) == 1


def compiled_ptx(kernel):
    """The PTX of every variant of a (possibly autotuned) Triton kernel compiled in this process."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn  # an Autotuner or Heuristics wraps the JITFunction
    for caches in kernel.device_caches.values():
        for compiled in caches[0].values():  # the first of each device's caches: key -> kernel
            yield compiled.asm["ptx"]


@pytest.mark.skipif(INTERPRETED, reason="reads the PTX that a GPU compile produces")
def test_no_backward_reduction_fuses_a_lanes_product_with_its_partners_sum():
    """Every racecheck hazard of the SSD and bidirectional backward on an H100 came from
    ``tl.sum(a * b)`` contracted into FMAs whose addend is a shuffled partner sum (see
    scripts/reliability/contraction.py); ``rounded_product`` leaves nothing to contract. Runs both
    ops forward and backward (the autotuner compiles every configuration it tries), then reads the
    PTX of every backward kernel variant compiled."""
    from mamba_annotated import bidirectional_chunk_scan, ssd_chunk_scan
    from mamba_annotated.bidirectional import chunk_scan_bwd as bidirectional_bwd, step_backward
    from mamba_annotated.ssd import chunk_cumsum, chunk_scan_bwd as ssd_bwd

    batch, length, heads, headdim, dstate = 2, 200, 4, 64, 32
    for op in (ssd_chunk_scan, bidirectional_chunk_scan):
        for dtype, chunk in ((torch.float32, 16), (torch.bfloat16, 64)):
            leaves = dict(x=torch.randn(batch, length, heads, headdim), dt=torch.rand(batch, length, heads),
                          A=-torch.rand(heads) - 0.5, B=torch.randn(batch, length, 1, dstate),
                          C=torch.randn(batch, length, 1, dstate), D=torch.randn(heads))
            leaves = {k: v.to("cuda", dtype if k in ("x", "B", "C") else torch.float32).requires_grad_()
                      for k, v in leaves.items()}
            y = op(leaves.pop("x"), leaves.pop("dt"), leaves.pop("A"), leaves.pop("B"), leaves.pop("C"), chunk,
                   D=leaves.pop("D"), dt_softplus=True)
            (y if isinstance(y, torch.Tensor) else y[0]).float().square().sum().backward()
    found, variants = {}, 0
    for module in (ssd_bwd, chunk_cumsum, bidirectional_bwd, step_backward):
        for name, kernel in vars(module).items():
            if name.endswith("_kernel") and hasattr(kernel, "run"):
                for ptx in compiled_ptx(kernel):
                    variants += 1
                    for where, count in contraction.shuffled_addends(ptx).items():
                        found[f"{module.__name__}.{name} at {where}"] = count
    assert variants >= 6, "the backward kernels were not compiled"
    assert not found, found


@pytest.mark.skipif(INTERPRETED, reason="reads the PTX that a GPU compile produces")
def test_the_selective_step_sums_rounded_products():
    """racecheck found 25 write-after-write hazards at the selective step's ``tl.sum(state * C)``
    on an H100, the pattern of scripts/reliability/contraction.py; the step now sums rounded products."""
    from mamba_annotated.scan import selective_step

    for dtype in (torch.float32, torch.bfloat16):
        state = torch.randn(2, 37, 16, device="cuda", dtype=dtype)
        selective_step.selective_state_update(state, *(torch.randn(2, 37, device="cuda") for _ in range(2)),
                                              -torch.rand(37, 16, device="cuda"),
                                              *(torch.randn(2, 16, device="cuda") for _ in range(2)), dt_softplus=True)
    variants = list(compiled_ptx(selective_step.selective_state_update_kernel))
    assert variants, "the step's kernel was not compiled"
    assert not [found for ptx in variants for found in contraction.shuffled_addends(ptx).items()]


def test_the_float32_final_state_probe_reports_each_chunk_size(monkeypatch, tmp_path):
    """scripts/reliability/float32_final_state.py on SSD seed 71461's options at a length the
    interpreter runs (L = 37, chunk 16): every error it reports is a float32 one."""
    import float32_final_state as probe

    name, seed, params = probe.PASSING_GPU_SWEEP_CASES["ssd_float32_final_state_at_chunk256"]
    small = json.loads(json.dumps(params))
    small["dims"]["L"] = 37
    monkeypatch.setitem(probe.PASSING_GPU_SWEEP_CASES, "ssd_float32_final_state_at_chunk256", (name, seed, small))
    monkeypatch.setattr(probe, "CHUNKS", (16,))
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    out = tmp_path / "probe.json"
    assert probe.main(["--json", str(out)]) == 0
    row = json.loads(out.read_text())["ops"][name]["chunk 16"]
    assert max(row["ours"].values()) < 1e-5, row["ours"]
    assert row["states_in"] < 1e-5 and row["float32_torch_final_state"] < 1e-5 and row["cumsum_abs_error"] < 1e-4
    assert row["final_state_with_correctly_rounded_cumsums"] < 1e-5 and row["last_exponents_abs_error"] < 1e-5
    assert row["last_slot_less_last_position"] == 0.0  # the interpreter adds in order
    assert probe.forward_module.chunk_cumsum is probe.chunk_cumsum  # put back after its run


def test_summary_merges_reports_into_one_table(tmp_path, capsys):
    rng = random.Random(0)
    paths = []
    for i in range(2):  # two sweep files (one op split over two device calls) add up
        ops = {"attention": dict(cases=10, failures=i, unjudged=0, largest={"Lq": rng.randint(1, 99)},
                                 reproducers=[dict(command="python ...")] * i)}
        paths.append(tmp_path / f"sweep{i}.json")
        paths[-1].write_text(json.dumps(dict(item="sweep", ops=ops)))
    paths.append(tmp_path / "san.json")
    paths[-1].write_text(json.dumps(dict(item="sanitize", ops={"attention": {
        "memcheck": dict(errors=0, exit=0, kernels=[]), "racecheck": dict(errors=2, exit=0, kernels=["k"],
                         hazards=[dict(kind="WAW", kernel="k", line="f.py:9", shape="one instruction, one warp",
                                       count=2)])}})))
    paths.append(tmp_path / "leaks.json")  # memory that shrank is no leak; leaks.py gives the verdict
    paths[-1].write_text(json.dumps(dict(item="leaks", ops={"linear_scan": dict(
        calls=10, leaked_bytes=-512, graph_forward=[], graph_forward_backward=[], failed=False)})))
    out = tmp_path / "summary.json"
    assert summary.main([*map(str, paths), "--json", str(out)]) == 1
    table = {row["op"]: row for row in json.loads(out.read_text())["table"]}
    assert table["attention"]["sweep"] == "20 cases, 1 failed"
    assert "racecheck" in table["attention"]["sanitize"] and table["linear_scan"]["sweep"] == "not run"
    assert table["linear_scan"]["leaks"] == "10 calls, grew 0 B, graphs equal"
    printed = capsys.readouterr().out
    assert "| attention |" in printed
    assert "sanitize attention racecheck: 2 WAW at k (f.py:9), one instruction, one warp" in printed


@pytest.mark.parametrize("op_name", ["ssd_chunk_scan", "attention", "bidirectional_chunk_scan",
                                     "attention_with_kvcache", "attention_varlen"])
def test_sanitizer_driver_wakes_the_checked_paths(monkeypatch, op_name):
    """The sanitizer's driver runs each op whose kernels have a checked pass once more for each
    input that wakes one, with a NaN in it, so that compute-sanitizer watches those passes too."""
    seen = []
    monkeypatch.setattr(cases, "forward_backward", lambda op, params, leaves, seed: seen.append(leaves))
    sanitize.drive([op_name])
    names = sanitize.CHECKED_PATH_INPUTS[op_name]
    small, poisoned = seen[:-len(names)], seen[-len(names):]
    assert len(small) == len(cases.OPS[op_name].small())
    assert all(torch.isfinite(leaves[name]).all() for leaves in small for name in names)
    for name, leaves in zip(names, poisoned):
        assert torch.isnan(leaves[name]).any(), "a poisoned run should hold a NaN in " + name
        assert all(torch.isfinite(leaves[other]).all() for other in names if other != name)


def test_a_peer_that_cannot_run_a_case_leaves_it_unjudged(monkeypatch):
    """An H100 sweep reported an SSD case as failed with a bare AssertionError raised while the
    bfloat16 rule ran its peer, mamba_ssm (ours had already run by then): the peer's failure to
    run a case is not ours."""
    class Peer:
        @staticmethod
        def mamba_chunk_scan_combined(*args, **kwargs):
            assert False

    monkeypatch.setattr(cases, "mamba_ssm_combined", lambda: Peer)
    op = cases.OPS["ssd_chunk_scan"]
    params = op.small()[0]
    leaves = op.inputs(params)
    outputs = op.ours(params)(**op.views(params, leaves))
    verdict = cases.Verdict()
    op.against_peer(params, leaves, 0, outputs, ["A", "dt_bias"], verdict)
    assert not verdict.failures and len(verdict.unjudged) == 2
    assert all("mamba_ssm could not run this case: AssertionError" in reason for reason in verdict.unjudged)


def test_the_ssd_peer_rule_judges_a_float16_case_in_float16(monkeypatch):
    """The peer rule for SSD's step gradients covers both 16-bit dtypes; a float16 case is measured
    against mamba_ssm run in float16, with float16's floor (it was bfloat16's, for bfloat16 only)."""
    judged = []
    monkeypatch.setattr(cases, "mamba_ssm_combined", lambda: types.SimpleNamespace(mamba_chunk_scan_combined=None))
    monkeypatch.setattr(cases, "judge_typical_errors", lambda *args, **kwargs: judged.append(args[9]))
    op = cases.OPS["ssd_chunk_scan"]
    params = dict(op.small()[1], dtype="float16")
    leaves = op.inputs(params)
    op.against_peer(params, leaves, 0, op.ours(params)(**op.views(params, leaves)), ["A"], cases.Verdict())
    assert judged == [torch.float16]


def test_a_verdict_keeps_the_errors_it_judged():
    """benchmarks/state_precision.py reads the step gradients' errors from the verdict rather than
    computing the case twice; each judged output and gradient has its error against float64, and a
    failure's message quotes it."""
    op = cases.OPS["linear_scan"]
    verdict = cases.run_case(op, op.small()[0], 0)
    assert {"h", "grad a", "grad b"} <= set(verdict.errors) and not verdict.failures
    assert all(0 <= error < 1e-3 for error in verdict.errors.values())
    wrong = cases.run_case(WrongScan(), op.small()[0], 0)
    assert f"{wrong.errors['h']:.3e}" in wrong.failures[0]


@pytest.mark.xfail(not INTERPRETED, strict=True, reason="open (issue 14): G stored astray on an H100 (Triton 3.6)")
def test_scores_of_a_time_major_B_rev_at_an_odd_length():
    """An H100 sweep case (bidirectional seed 30671) gave a wrong output and NaN gradients: its B'
    was stored time major, strides (1, 1, L, L), at L = 1021, and the scores kernel's stores of G
    went to wrong addresses (memcheck: writes out of bounds). On the H100 the fault needs a length
    that is not a multiple of 16, chunk 32 with 4 warps, a dstate with a masked tail (100 here) and
    the kernel's two products (README, "Using the kernels"); the op copies such a B'
    (tests/test_bidirectional.py). scripts/reliability/scores_defect.py's one run computes the
    scores with that B' and with it contiguous, in a process of its own: on the GPU the kernel
    writes out of bounds, which must not reach this process's tensors. The scores must not depend
    on how B' is laid out (in the interpreter they do not; exit 1 reports the defect)."""
    run = subprocess.run([sys.executable, str(Path(scores_defect.__file__)), "--once"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "time-major B': 0 of 32768 entries of G differ" in run.stdout and "Gd differs at 0 of 1024" in run.stdout


def test_rejudge_reruns_the_recorded_reproducers(tmp_path):
    """--rejudge reads reproducers from a sweep report and from the summary's merged JSON and runs
    each once at its seed: a failure recorded then that passes now is reported as passing."""
    op = cases.OPS["linear_scan"]
    recorded = {"linear_scan": dict(reproducers=[dict(seed=3, failures=["h: then"],
                                                      command=cases.reproducer(op, op.small()[0], 3))])}
    shard, merged, out = tmp_path / "shard.json", tmp_path / "merged.json", tmp_path / "out.json"
    shard.write_text(json.dumps(dict(item="sweep", ops=recorded)))
    merged.write_text(json.dumps(dict(reports=dict(sweep=recorded))))
    assert sweep.main(["--ops", "linear_scan", "--rejudge", str(shard), str(merged), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ops"]
    assert [(row["seed"], row["failures_then"], row["failures_now"]) for row in rows] == [(3, ["h: then"], [])] * 2


def test_step_gradients_are_judged_on_errors_pooled_over_upstream_draws():
    """The 16-bit step gradients' rule compares errors pooled over cases.UPSTREAM_DRAWS upstream
    gradients: a gradient 1 % off at every draw still fails it, one as exact as the yardstick passes,
    a draw whose exact gradient nearly cancels weighs by its size, and a NaN in any draw fails."""
    w = torch.tensor([0.3, -1.2, 2.0], device=DEVICE, requires_grad=True)
    w64 = w.detach().double().requires_grad_()

    def exact(w):
        return (w * w,)

    def judged(fn):
        verdict = cases.Verdict()
        cases.judge_typical_errors(verdict, ["w"], fn, exact, exact, dict(w=w), dict(w=w64), torch.zeros_like(w), 7,
                                   torch.bfloat16, factor=2.0)
        return verdict

    assert not judged(exact).failures
    off = judged(lambda w: (1.01 * w * w,))  # the yardstick exact, ours 1e-2: no luck, no more draws
    assert off.failures[0].startswith("grad w: error 1.000e-02 above 2 x") and "pooled over 5" in off.failures[0]
    assert off.errors["grad w"] == pytest.approx(1e-2, rel=1e-4) and off.yardsticks["grad w"] < 1e-6
    refs = [torch.tensor([10.0], dtype=torch.float64), torch.tensor([1e-3], dtype=torch.float64)]
    outs = [torch.tensor([10.01], dtype=torch.float64), torch.tensor([2e-3], dtype=torch.float64)]
    assert cases.pooled_error(outs, refs) == pytest.approx(math.hypot(0.01, 1e-3) / math.hypot(10.0, 1e-3))
    assert math.isnan(cases.pooled_error([torch.tensor([1.0]), torch.tensor([float("nan")])], refs))
    assert cases.pooled_error([torch.tensor([0.0])], [torch.tensor([-1.7e-20], dtype=torch.float64)]) == 0.0
    assert cases.upstream_seeds(7)[0] == 7 and len(set(cases.upstream_seeds(7))) == cases.UPSTREAM_DRAWS


def test_a_gradient_of_few_elements_past_the_rule_over_five_draws_is_judged_over_more():
    """Two computations that err alike, each with a rounding error of the same size in another
    direction of the output: over five upstream draws at seed 83 one gradient's pooled error is four
    times the other's (a draw of luck; cases.POOLED_TERMS), over the 64 draws that a gradient of one
    element gets then it is 1.04 times, within the rule, and the verdict keeps the 64 draws' errors."""
    c = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64, device=DEVICE)
    ours_off, theirs_off = torch.zeros_like(c), torch.zeros_like(c)
    ours_off[:4], theirs_off[4:] = 1e-3, 1e-3
    w = torch.tensor([0.7], device=DEVICE, dtype=torch.float64, requires_grad=True)
    w64 = w.detach().clone().requires_grad_()
    like = torch.zeros(8, device=DEVICE)

    def scaled(column):
        return lambda w: ((c + column) * w,)

    five = [cases.upstream(8, torch.float32, s) for s in cases.upstream_seeds(83)]
    over_five = [cases.pooled_error([(g * (c + off)).sum(0, keepdim=True) for g in five],
                                    [(g * c).sum(0, keepdim=True) for g in five]) for off in (ours_off, theirs_off)]
    assert over_five[0] > 2 * over_five[1]  # the premise: five draws alone would fail ours
    verdict = cases.Verdict()
    cases.judge_typical_errors(verdict, ["w"], scaled(ours_off), scaled(theirs_off), scaled(torch.zeros_like(c)),
                               dict(w=w), dict(w=w64), like, 83, torch.bfloat16, factor=2.0)
    assert not verdict.failures and cases.draws_for(1) == 64
    assert verdict.errors["grad w"] == pytest.approx(1.04 * verdict.yardsticks["grad w"], rel=0.01)
    # three times the yardstick's error at every draw: a ratio that luck can give over five draws, so
    # drawn again, and still past
    verdict = cases.Verdict()
    cases.judge_typical_errors(verdict, ["w"], lambda w: (c * 1.003 * w,), lambda w: (c * 1.001 * w,),
                               scaled(torch.zeros_like(c)), dict(w=w), dict(w=w64), like, 83, torch.bfloat16,
                               factor=2.0)
    assert len(verdict.failures) == 1 and "pooled over 64 upstream" in verdict.failures[0]


def test_a_second_form_of_the_same_computation_is_consulted_only_where_the_first_fails():
    """The bidirectional op's foil at half the chunk: it runs only for a gradient past the first
    yardstick, and the larger error of the two is the bound; a gradient off by more than both
    still fails, and a second form that raises is the yardstick's failure (YardstickFailed), as
    the first's is."""
    w = torch.tensor([0.3, -1.2, 2.0], device=DEVICE, requires_grad=True)
    w64 = w.detach().double().requires_grad_()
    calls = []

    def exact(w):
        return (w * w,)

    def coarse(w):  # the yardstick of a computation 3e-3 off
        calls.append(1)
        return (1.003 * w * w,)

    def judged(fn):
        verdict = cases.Verdict()
        cases.judge_typical_errors(verdict, ["w"], fn, exact, exact, dict(w=w), dict(w=w64), torch.zeros_like(w), 7,
                                   torch.bfloat16, factor=3.0, other_same_fn=coarse)
        return verdict

    assert not judged(exact).failures and not calls  # within the first yardstick: the second never runs
    near = judged(lambda w: (1.005 * w * w,))
    assert not near.failures and near.yardsticks["grad w"] == pytest.approx(3e-3, rel=1e-3) and calls
    assert judged(lambda w: (1.01 * w * w,)).failures[0].startswith("grad w: error 1.000e-02 above 3 x")

    def raising(w):
        raise RuntimeError("chunk too small")
    verdict = cases.Verdict()
    with pytest.raises(cases.YardstickFailed):
        cases.judge_typical_errors(verdict, ["w"], lambda w: (1.005 * w * w,), exact, exact, dict(w=w),
                                   dict(w=w64), torch.zeros_like(w), 7, torch.bfloat16, factor=3.0,
                                   other_same_fn=raising)


def test_a_vanishing_reference_is_judged_as_a_zero():
    """A float64 gradient of -1.7e-20 beside an exact 0 of ours is not a relative error of 1 (an
    interpreter sweep's bidirectional dA, seed 80397); a gradient of that size that ours misses is
    still caught, and so is a nonzero result where the reference vanishes."""
    verdict = cases.Verdict()
    cases.compare(verdict, "grad A", torch.zeros(1), torch.tensor([-1.7e-20], dtype=torch.float64), 3e-4)
    assert not verdict.failures and verdict.errors["grad A"] == 0.0
    cases.compare(verdict, "grad B", torch.zeros(1), torch.tensor([2e-3], dtype=torch.float64), 3e-4)
    cases.compare(verdict, "grad C", torch.tensor([1e-3]), torch.tensor([1e-20], dtype=torch.float64), 3e-4)
    assert [f.split(":")[0] for f in verdict.failures] == ["grad B", "grad C"]


def test_a_16bit_bidirectional_verdict_keeps_the_foils_errors_beside_its_own():
    op = cases.OPS["bidirectional_chunk_scan"]
    params = json.loads(json.dumps(op.small()[1]))
    assert params["dtype"] == "bfloat16"
    params["dims"].update(batch=1, heads=1, groups=1, L=size(gpu=params["dims"]["L"], cpu=21))
    params["opts"]["cuts"] = [5]
    verdict = cases.run_case(op, op.fix(params), 3)
    assert set(verdict.yardsticks) == {"grad dt", "grad A", "grad dt_bias", "grad dt_rev"}
    assert all(0 < verdict.yardsticks[name] < 3e-2 and name in verdict.errors for name in verdict.yardsticks)


def test_the_state_precision_probe_judges_the_recorded_step_gradient_failures_only(monkeypatch):
    """It reads the recorded reproducers as sweep.py --rejudge does, keeping those that failed in
    step gradients alone (not SSD seed 71461's final state, nor bidirectional seed 71006's grad x)."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import state_precision

    found = {(op, seed) for op, seed, _ in state_precision.step_gradient_failures(root / "book/data/reliability.json")}
    assert {("ssd_chunk_scan", 20339), ("bidirectional_chunk_scan", 60144)} <= found
    assert not found & {("ssd_chunk_scan", 71461), ("bidirectional_chunk_scan", 71006)}


def test_the_state_precision_probe_stores_states_in_float32_only_inside_its_variant(monkeypatch):
    """benchmarks/state_precision.py compares each chunked op as shipped with its states stored in
    float32; a patch that missed a call would compare the shipped code with itself, and one that
    reached the other op would move the bidirectional op's yardstick (two calls of the SSD op)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import state_precision
    from mamba_annotated.bidirectional import state_passing as bidirectional_state_passing
    from mamba_annotated.bidirectional.forward import bidirectional_forward
    from mamba_annotated.ssd import state_passing as ssd_state_passing
    from mamba_annotated.ssd.forward import ssd_forward

    for package in ("mamba_annotated.ssd", "mamba_annotated.bidirectional"):  # every module, imported or not yet
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            importlib.import_module(f"{package}.{info.name}")
    names = ("state_passing", "state_passing_backward")
    originals = {getattr(module, name) for module in (ssd_state_passing, bidirectional_state_passing) for name in names}
    callers = {(module, name) for module_name, module in sys.modules.items() for name in names
               if module_name.startswith(("mamba_annotated.ssd.", "mamba_annotated.bidirectional."))
               and getattr(module, name, None) in originals
               and module not in (ssd_state_passing, bidirectional_state_passing)}
    assert callers == {call for calls in state_precision.STATE_PASSING_CALLS.values() for call in calls}

    g = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(1, 40, n, 16, generator=g).to(DEVICE, torch.bfloat16) for n in (2, 1, 1))
    dt, A = torch.rand(1, 40, 2, generator=g).to(DEVICE), -torch.rand(2, generator=g).to(DEVICE)

    def stored_dtypes():  # the states each forward pass saves, the state gradients SSD's backward emits
        ssd_states = ssd_forward(x, dt, A, B, C, 16).saved.states_in
        state_grads, _, _ = state_precision.ssd_backward.state_passing_backward(
            torch.zeros(1, 3, 2, 16, 16, device=DEVICE), torch.zeros(1, 2, 3, 16, device=DEVICE), ssd_states,
            length=40, out_dtype=x.dtype)
        bidirectional_states = bidirectional_forward(x, dt, A, B, C, 16)[2].states_in
        return ssd_states.dtype, state_grads.dtype, bidirectional_states.dtype

    bf16, f32 = torch.bfloat16, torch.float32
    assert stored_dtypes() == (bf16, bf16, bf16)
    with state_precision.float32_states("ssd_chunk_scan"):
        assert stored_dtypes() == (f32, f32, bf16)
    with state_precision.float32_states("bidirectional_chunk_scan"):
        assert stored_dtypes() == (bf16, bf16, f32)
    assert stored_dtypes() == (bf16, bf16, bf16)
