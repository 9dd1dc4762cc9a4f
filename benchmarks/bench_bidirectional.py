"""Benchmark chapter 6's fused bidirectional SSD beside our causal SSD and the ways the published
models compute a bidirectional SSM on mamba_ssm's ``mamba_chunk_scan_combined``.

bfloat16, chunk 256, with D, dt_bias and softplus, at the two shapes of the speed bar. Timed in one
run, forward and forward+backward (medians of do_bench):

    ours shift=False         bidirectional_chunk_scan, shared reverse parameters (Bi-Mamba2's form)
    causal (ours)            ssd_chunk_scan on the same shape: the 1.25x bar
    naive two calls          flip, two mamba_chunk_scan_combined calls, flip, add
    ours shift=True          bidirectional_chunk_scan with dt_rev, B_rev, C_rev (Hydra's form)
    hydra                    Hydra's module's method: both directions stacked along the batch through
                             one mamba_chunk_scan_combined call, roll by one (first row zeroed), flip
                             the second half, add, plus D x

It checks ours against the peers at the benchmark shape first (relative errors printed), then
prints the times, achieved TFLOP/s and the floor (FLOPs over the measured matmul rate, bytes over
the measured copy bandwidth), peak memory over forward+backward, the ratio against each bar
(ours/causal <= 1.25, naive/ours >= 1.6, hydra/ours >= 1.5), and where our time goes: the
forward and backward pipelines timed whole and each kernel's share (from the profiler).
``--json PATH`` writes everything as JSON; ``--quick`` runs one small shape.

    python benchmarks/bench_bidirectional.py [--json out.json] [--quick]
"""
import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_ssd import make_inputs as causal_inputs, our_configs, tune_peer  # noqa: E402
from costs import CHUNK, bidirectional_flops as flops, bidirectional_min_bytes as min_bytes  # noqa: E402
from costs import ssd_flops as causal_flops, ssd_min_bytes as causal_min_bytes  # noqa: E402
from mamba_annotated import bench  # noqa: E402
from mamba_annotated.bidirectional import bidirectional_chunk_scan  # noqa: E402
from mamba_annotated.bidirectional.backward import bidirectional_backward  # noqa: E402
from mamba_annotated.bidirectional.forward import bidirectional_forward  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402
from mamba_annotated.ssd import ssd_chunk_scan  # noqa: E402
from mamba_annotated.testing import rel_error  # noqa: E402
from peak_memory import peak_mib  # noqa: E402
from peers import row_time  # noqa: E402

SHAPES = [  # (batch, L, heads, headdim, dstate), groups 1
    (4, 4096, 80, 64, 128),
    (1, 65536, 32, 64, 128),
]
QUICK_SHAPES = [(2, 2048, 16, 64, 128)]
OURS, OURS_HYDRA, CAUSAL = "ours shift=False", "ours shift=True", "causal ssd_chunk_scan (ours)"
NAIVE, HYDRA = "naive two calls (mamba_ssm)", "hydra (mamba_ssm)"
# each bar: time(num) / time(den) must meet the target
BARS = [
    dict(bar="ours shift=False / causal", num=OURS, den=CAUSAL, target="<= 1.25", holds=lambda r: r <= 1.25),
    dict(bar="naive / ours shift=False", num=NAIVE, den=OURS, target=">= 1.6", holds=lambda r: r >= 1.6),
    dict(bar="hydra / ours shift=True", num=HYDRA, den=OURS_HYDRA, target=">= 1.5", holds=lambda r: r >= 1.5),
]
REVERSE = ("dt_rev", "B_rev", "C_rev")


def make_inputs(batch, length, heads, headdim, dstate, dtype=torch.bfloat16, groups=1):
    """bench_ssd's tensors, plus the reverse direction's own dt, B, C (used by the shift=True rows)."""
    inputs = causal_inputs(batch, length, heads, headdim, dstate, dtype=dtype, groups=groups)
    g = torch.Generator(device=DEVICE).manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, device=DEVICE, generator=g) * 0.3).to(dtype)

    inputs.update(dt_rev=torch.randn(batch, length, heads, device=DEVICE, generator=g) - 1,
                  B_rev=rnd(batch, length, groups, dstate), C_rev=rnd(batch, length, groups, dstate))
    return inputs


def implementations(peer_fn):
    """name -> (function of the input dict returning y, whether it uses the reverse parameters)."""
    def ours(t):
        return bidirectional_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"],
                                        dt_bias=t["dt_bias"], dt_softplus=True)

    def ours_hydra(t):
        return bidirectional_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"],
                                        dt_bias=t["dt_bias"], dt_softplus=True, shift=True,
                                        dt_rev=t["dt_rev"], B_rev=t["B_rev"], C_rev=t["C_rev"])

    def causal(t):
        return ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"], dt_bias=t["dt_bias"],
                              dt_softplus=True)

    impls = {OURS: (ours, False), CAUSAL: (causal, False), OURS_HYDRA: (ours_hydra, True)}
    if peer_fn is None:
        return impls

    def naive(t):
        # the forward call adds D x; the reverse one runs on flipped copies and is flipped back
        step = dict(dt_bias=t["dt_bias"], dt_softplus=True)
        forward = peer_fn(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"], **step)
        backward = peer_fn(t["x"].flip(1), t["dt"].flip(1), t["A"], t["B"].flip(1), t["C"].flip(1), CHUNK, **step)
        return forward + backward.flip(1)

    def hydra(t):
        # as Hydra's module: the reverse direction as a second half of the batch, softplus in PyTorch,
        # one scan, the output rolled one step later (first row zeroed), halves flipped back and added
        batch = t["x"].shape[0]
        x2 = torch.cat([t["x"], t["x"].flip(1)], dim=0)
        dt2 = F.softplus(torch.cat([t["dt"], t["dt_rev"].flip(1)], dim=0) + t["dt_bias"])
        B2 = torch.cat([t["B"], t["B_rev"].flip(1)], dim=0)
        C2 = torch.cat([t["C"], t["C_rev"].flip(1)], dim=0)
        y = peer_fn(x2, dt2, t["A"], B2, C2, chunk_size=CHUNK, D=None, z=None)
        y = torch.roll(y, shifts=1, dims=1)
        y[:, 0] = 0.0
        return y[:batch] + y[batch:].flip(1) + t["x"] * t["D"][:, None].to(t["x"].dtype)

    impls.update({NAIVE: (naive, False), HYDRA: (hydra, True)})
    return impls


def check_against_peers(inp, impls, dy):
    """Relative errors of ours against the peers (and the causal call against nothing) at the
    benchmark shape, forward and every gradient, before any timing."""
    pairs = [(OURS, NAIVE, False), (OURS_HYDRA, HYDRA, True)]
    for ours, peer, separate in pairs:
        if peer not in impls:
            continue
        names = [k for k in inp if separate or k not in REVERSE]
        outs, grads = {}, {}
        for name in (ours, peer):
            leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inp.items()}
            y = impls[name][0](leaves)
            outs[name] = y.detach()
            grads[name] = dict(zip(names, torch.autograd.grad(y, [leaves[k] for k in names], dy)))
        print(f"  {ours} vs {peer}: forward rel err {rel_error(outs[ours], outs[peer]):.2e}; grads: "
              + ", ".join(f"{k} {rel_error(grads[ours][k], grads[peer][k]):.1e}" for k in names))


def run_shape(shape, impls):
    inp = make_inputs(*shape)
    dy = torch.randn_like(inp["x"])
    print(f"{shape}: checking ours against the peers")
    check_against_peers(inp, impls, dy)
    rows, tunings = [], []
    for name, (fn, separate) in impls.items():
        names = [k for k in inp if separate or k not in REVERSE]
        leaves = {k: (v.clone().requires_grad_() if k in names else v) for k, v in inp.items()}
        f_fwd, f_all = causal_flops(*shape, Q=CHUNK) if name == CAUSAL else flops(shape)
        b_fwd, b_all = causal_min_bytes(*shape) if name == CAUSAL else min_bytes(shape, separate)

        def fwd():
            with torch.no_grad():
                return fn(inp)

        def fwd_bwd():
            # torch.autograd.grad: gradients returned, not accumulated into .grad (no extra add timed)
            return torch.autograd.grad(fn(leaves), [leaves[k] for k in names], dy)

        tuned = {}
        if name in (NAIVE, HYDRA):
            case, tuned = tune_peer(f"{shape}, {name}", (fwd, fwd_bwd))
            tunings += case
        for what, f, fl, by in (("fwd", fwd, f_fwd, b_fwd), ("fwd+bwd", fwd_bwd, f_all, b_all)):
            times = row_time(bench.median_ms(f), tuned.get(what))
            ms = times["ms"]
            floor = max(fl / (bench.matmul_tflops() * 1e12) * 1e3, bench.memory_floor_ms(by))
            rows.append(dict(shape=str(shape), impl=name, pass_=what, **times, TFLOPs=bench.tflops(fl, ms),
                             floor_ms=floor, pct_floor=100 * floor / ms, peak_MB=peak_mib(f)))
    return rows, tunings


def bars(rows):
    """The ratio behind each speed bar and the memory bar, per shape and pass."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ms = {(r["impl"], r["pass_"]): r for r in rows if r["shape"] == shape}
        for pass_ in ("fwd", "fwd+bwd"):
            for b in BARS:
                if (b["num"], pass_) in ms and (b["den"], pass_) in ms:
                    ratio = ms[(b["num"], pass_)]["ms"] / ms[(b["den"], pass_)]["ms"]
                    out.append(dict(shape=shape, pass_=pass_, bar=b["bar"], ratio=ratio, target=b["target"],
                                    holds=bool(b["holds"](ratio))))
        if (NAIVE, "fwd+bwd") in ms:
            ours, naive = ms[(OURS, "fwd+bwd")]["peak_MB"], ms[(NAIVE, "fwd+bwd")]["peak_MB"]
            out.append(dict(shape=shape, pass_="fwd+bwd", bar="peak MB naive / ours shift=False",
                            ratio=naive / max(ours, 1e-9), target=">= 1", holds=naive >= ours))
    return out


def fwd_bwd_step(fn, leaves, dy):
    """One forward+backward pass of ``fn`` through autograd, as a step for :func:`bench.kernel_times`."""
    return lambda: torch.autograd.grad(fn(leaves), list(leaves.values()), dy)


def kernel_breakdown(shape, impls):
    """Where our time goes (shift=False, shared parameters): the forward and backward pipelines
    timed whole (``bidirectional_forward``, ``bidirectional_backward``), then each kernel's CUDA
    time, ours and (for comparison, kernel by kernel) our causal ssd_chunk_scan's."""
    inp = make_inputs(*shape)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items() if k not in REVERSE}
    dy = torch.randn_like(inp["x"])
    args = [inp[k] for k in ("x", "dt", "A", "B", "C")]
    step = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
    saved = bidirectional_forward(*args, CHUNK, **step)[2]
    whole = [dict(stage="whole forward (bidirectional_forward)", calls=1,
                  ms=bench.median_ms(lambda: bidirectional_forward(*args, CHUNK, **step))),
             dict(stage="whole backward (bidirectional_backward)", calls=1,
                  ms=bench.median_ms(lambda: bidirectional_backward(dy, *args, saved, **step)))]
    ours = [dict(r, impl=OURS) for r in bench.kernel_times(fwd_bwd_step(impls[OURS][0], leaves, dy))]
    causal = [dict(r, impl=CAUSAL) for r in bench.kernel_times(fwd_bwd_step(impls[CAUSAL][0], leaves, dy))]
    return [dict(r, impl=OURS, pct=float("nan")) for r in whole] + ours + causal


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="one small shape: a smoke run")
    parser.add_argument("--shape", type=int, action="append",
                        help="index into SHAPES (repeatable; default all): split a run across device calls")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other shapes' rows already in --json (for runs split by --shape)")
    args = parser.parse_args()
    if DEVICE.type != "cuda":
        sys.exit("bench_bidirectional: needs a CUDA GPU (this machine runs the kernels in Triton's interpreter)")
    from peers import mamba_ssm_module
    module = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    peer_fn = module.mamba_chunk_scan_combined if module is not None else None
    impls = implementations(peer_fn)
    print(f"device: {device_name()}; matmul {bench.matmul_tflops():.0f} TFLOP/s (bf16), "
          f"copy {bench.copy_bandwidth_gbps():.0f} GB/s")
    all_rows, all_stages, all_tunings = [], {}, []
    shapes = QUICK_SHAPES if args.quick else [SHAPES[i] for i in args.shape] if args.shape else SHAPES
    if args.merge and args.json and args.json.exists():
        old = json.loads(args.json.read_text())
        done = {str(s) for s in shapes}
        all_rows = [r for r in old["rows"] if r["shape"] not in done]
        all_stages = {k: v for k, v in old["stages"].items() if k not in done}
        all_tunings = [t for t in old.get("peer_tunings", []) if not any(t["case"].startswith(s) for s in done)]
    for shape in shapes:
        rows, tunings = run_shape(shape, impls)
        all_rows += rows
        all_tunings += tunings
        bench.print_table(rows)
        stages = kernel_breakdown(shape, impls)
        all_stages[str(shape)] = stages
        print(f"where the time goes, forward+backward, {shape}:")
        bench.print_table(stages)
    # a run split by --shape lists its shapes in SHAPES' order, whichever ran last
    order = {str(s): i for i, s in enumerate(SHAPES + QUICK_SHAPES)}
    all_rows.sort(key=lambda r: order[r["shape"]])
    all_stages = dict(sorted(all_stages.items(), key=lambda item: order[item[0]]))
    verdicts = bars(all_rows)
    print("bars:")
    bench.print_table(verdicts)
    configs = our_configs()  # this process's shapes only, with --merge too
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # the rates the floors divide by, for the scoreboard's roofline (benchmarks/scoreboard.py)
        args.json.write_text(json.dumps(dict(device=device_name(), copy_GBps=bench.copy_bandwidth_gbps(),
                                             matmul_TFLOPs=bench.matmul_tflops(), chunk=CHUNK, rows=all_rows,
                                             bars=verdicts, stages=all_stages, configs=configs,
                                             peer_tunings=all_tunings), indent=1))


if __name__ == "__main__":
    main()
