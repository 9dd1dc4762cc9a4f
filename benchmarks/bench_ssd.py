"""Benchmark chapter 5's SSD kernels beside mamba_ssm's ``mamba_chunk_scan_combined``.

bfloat16, chunk 256, with D, dt_bias and softplus, at the two shapes of the speed bar. Prints the
median times (forward, forward+backward), achieved TFLOP/s, the floor (FLOPs over the measured
matmul rate, bytes over the measured copy bandwidth), peak memory, the speedup over the peer, a
per-kernel breakdown of where the time goes, and the cost of a flip-based reverse cumsum against
the in-kernel one. ``--json PATH`` writes everything as JSON.

``--variants`` times the bars' other cases instead, at the first shape: chunks 64 and 128 beside
256, and 8 packed sequences (seq_idx) against none, ours and the peer on the same inputs, then
each of our kernels' time with and without the packing (where the packed call's extra time goes).
It is a run of its own (scripts/gpu_benchmarks.sh's ``ssd_variants``, data/ssd_variants_bench.json)
because each chunk size is a new specialization of every kernel to tune: on an H200 with an empty
Triton cache, the main run and the start of the variants took the 325 s a device call had left,
and the variants did not finish. Usage:

    python benchmarks/bench_ssd.py [--json out.json] [--quick | --variants]
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from costs import CHUNK, ssd_flops as flops, ssd_min_bytes as min_bytes  # noqa: E402
from mamba_annotated import bench  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402
from mamba_annotated.ssd import ssd_chunk_scan  # noqa: E402
from mamba_annotated.ssd.backward import chunk_gradients, ssd_backward  # noqa: E402
from mamba_annotated.ssd.forward import ssd_forward  # noqa: E402
from mamba_annotated.ssd.chunk_cumsum import chunk_cumsum, dt_backward  # noqa: E402
from mamba_annotated.ssd.chunk_scan import chunk_scan  # noqa: E402
from mamba_annotated.ssd.chunk_scan_bwd import chunk_scan_bwd_dbc, chunk_scan_bwd_dx  # noqa: E402
from mamba_annotated.ssd.chunk_state import chunk_cb, chunk_state  # noqa: E402
from mamba_annotated.ssd.state_passing import state_passing, state_passing_backward  # noqa: E402
from mamba_annotated.ssd.teaching import dt_backward_flip, ssd_backward_flip  # noqa: E402
from mamba_annotated.testing import rel_error  # noqa: E402
from peak_memory import peak_mib  # noqa: E402
from peers import autotuners, cached_configs, row_time, tune_fastest  # noqa: E402

SHAPES = [  # (batch, L, heads, headdim, dstate), groups 1
    (4, 4096, 80, 64, 128),
    (1, 65536, 32, 64, 128),
]


def make_inputs(batch, length, heads, headdim, dstate, dtype=torch.bfloat16, groups=1):
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)

    return dict(
        x=rnd(batch, length, heads, headdim), dt=torch.randn(batch, length, heads, device=DEVICE, generator=g) - 1,
        A=-torch.rand(heads, device=DEVICE, generator=g) * 4 - 1,
        B=rnd(batch, length, groups, dstate, scale=0.3), C=rnd(batch, length, groups, dstate, scale=0.3),
        D=torch.randn(heads, device=DEVICE, generator=g), dt_bias=torch.randn(heads, device=DEVICE, generator=g) * 0.5,
    )


def differentiable(inp):
    """The inputs that take gradients, as leaves, and an upstream gradient for y."""
    return {k: inp[k].clone().requires_grad_() for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")}, \
        torch.randn_like(inp["x"])


def passes(fn, inp, leaves, dy, *, chunk_size, seq_idx=None):
    """The forward pass (no autograd) and the forward+backward pass of ``fn`` (ours or the peer's,
    same signature) with D, dt_bias and softplus, as two callables to time."""
    def fwd():
        with torch.no_grad():
            return fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=chunk_size, D=inp["D"],
                      dt_bias=inp["dt_bias"], seq_idx=seq_idx, dt_softplus=True)

    def fwd_bwd():
        # torch.autograd.grad, not backward(): the gradients are returned, not added into .grad,
        # so no accumulation kernel (an add over x's size) is timed with the pass
        y = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=chunk_size,
               D=leaves["D"], dt_bias=leaves["dt_bias"], seq_idx=seq_idx, dt_softplus=True)
        return torch.autograd.grad(y, list(leaves.values()), dy)

    return fwd, fwd_bwd


def report_tunings(case, times, picks=None):
    """Print the peer's time after each of its tunings (:func:`peers.tune_fastest`), forward and
    forward+backward, and return them as records for the JSON (``peer_tunings``): the rows time the
    peer after its fastest tuning's picks are put back, or take that tuning's time where it is lower
    (:func:`peers.row_time`)."""
    print(f"{case}: mamba_ssm after each tuning (ms), fwd " + ", ".join(f"{t:.3f}" for t in times[0])
          + "; fwd+bwd " + ", ".join(f"{t:.3f}" for t in times[1]) + "; rows: the fastest (peers.row_time)")
    records = [dict(case=case, pass_=pass_, tunings_ms=list(ms)) for pass_, ms in zip(("fwd", "fwd+bwd"), times)]
    for record, picked in zip(records, picks or ()):
        record["picks"] = picked  # per tuning: the configurations in every autotuner's cache
    return records


def tune_peer(case, timed):
    """Tune mamba_ssm's kernels over ``timed`` (its forward, then its forward and backward) by
    :func:`peers.tune_fastest`, keeping every tuning's picks, and print the tunings. Returns (the
    records for the JSON, each pass's times after its tunings by pass, for :func:`peers.row_time`)."""
    picks = []
    records = report_tunings(case, tune_fastest(timed, autotuners("mamba_ssm."), picks=picks), picks)
    return records, {record["pass_"]: record["tunings_ms"] for record in records}


def packed_seq_idx(shape, packed):
    """seq_idx marking ``packed`` sequences of equal length in every row of ``shape``."""
    batch, length = shape[:2]
    return (torch.arange(length, device=DEVICE, dtype=torch.int32) * packed // length).repeat(batch, 1)


def packing_breakdown(shape, packed=8):
    """Where the time that packed sequences add goes: each kernel's GPU time in one forward+backward
    pass of ours through autograd (:func:`bench.kernel_times`), with one sequence per row and with
    ``packed`` of them, side by side, the largest difference first; a last row sums them. What the
    whole call adds beyond that sum is mostly time the GPU spent waiting for the host. Rows (stage,
    calls_one, calls_packed, ms_one, ms_packed, extra_ms)."""
    inp = make_inputs(*shape)
    leaves, dy = differentiable(inp)
    times = {}
    for label, seq_idx in (("one", None), ("packed", packed_seq_idx(shape, packed))):
        _, fwd_bwd = passes(ssd_chunk_scan, inp, leaves, dy, chunk_size=CHUNK, seq_idx=seq_idx)
        for r in bench.kernel_times(fwd_bwd):
            times.setdefault(r["stage"], {})[label] = r
    rows = []
    for stage, by_label in times.items():
        one, packed_run = by_label.get("one", {}), by_label.get("packed", {})
        rows.append(dict(stage=stage, calls_one=one.get("calls", 0), calls_packed=packed_run.get("calls", 0),
                         ms_one=one.get("ms", 0.0), ms_packed=packed_run.get("ms", 0.0)))
    for r in rows:
        r["extra_ms"] = r["ms_packed"] - r["ms_one"]
    rows.sort(key=lambda r: -abs(r["extra_ms"]))
    rows.append({key: "all kernels" if key == "stage" else sum(r[key] for r in rows) for key in rows[0]})
    return rows


def run_variants(shape, peer_fn, packed=8):
    """The SSD bars' other cases at ``shape``: chunks 64 and 128 beside chunk 256, ours and the peer
    (same inputs), and ``packed`` sequences of equal length marked by seq_idx against none. Rows of
    shape, chunk, packed (sequences), impl, pass_, ms; speedup is the peer's time over ours for the
    same chunk and packing, and for ours with seq_idx also its time over ours without (packing_cost)."""
    inp = make_inputs(*shape)
    leaves, dy = differentiable(inp)
    seq_idx = packed_seq_idx(shape, packed)
    impls = {"ours": ssd_chunk_scan, **({"mamba_ssm": peer_fn} if peer_fn is not None else {})}
    rows, tunings = [], []
    for chunk, marks in ((64, None), (128, None), (CHUNK, None), (CHUNK, seq_idx)):
        for name, fn in impls.items():
            timed = passes(fn, inp, leaves, dy, chunk_size=chunk, seq_idx=marks)
            tuned = {}
            if name == "mamba_ssm":
                case, tuned = tune_peer(f"{shape}, chunk {chunk}, {1 if marks is None else packed} sequence(s)", timed)
                tunings += case
            for pass_, f in zip(("fwd", "fwd+bwd"), timed):
                rows.append(dict(shape=str(shape), chunk=chunk, packed=1 if marks is None else packed, impl=name,
                                 pass_=pass_, **row_time(bench.median_ms(f), tuned.get(pass_))))
    for r in rows:
        same = [q for q in rows if (q["chunk"], q["packed"], q["pass_"]) == (r["chunk"], r["packed"], r["pass_"])]
        peer = next((q for q in same if q["impl"] == "mamba_ssm"), None)
        r["speedup"] = peer["ms"] / r["ms"] if peer else float("nan")
        alone = next(q for q in rows if (q["chunk"], q["packed"], q["impl"], q["pass_"])
                     == (r["chunk"], 1, r["impl"], r["pass_"]))
        r["packing_cost"] = r["ms"] / alone["ms"] if r["packed"] > 1 else float("nan")
    return rows, tunings


def run_shape(shape, peer_fn):
    batch, length, heads, headdim, dstate = shape
    inp = make_inputs(*shape)
    leaves, dy = differentiable(inp)
    impls = {"ours": ssd_chunk_scan}
    if peer_fn is not None:
        impls["mamba_ssm"] = peer_fn
    rows, outs, tunings = [], {}, []
    f_fwd, f_all = flops(*shape)
    b_fwd, b_all = min_bytes(*shape)
    for name, fn in impls.items():
        fwd, fwd_bwd = passes(fn, inp, leaves, dy, chunk_size=CHUNK)
        tuned = {}
        if name == "mamba_ssm":
            tunings, tuned = tune_peer(f"{shape}, chunk {CHUNK}", (fwd, fwd_bwd))
        outs[name] = fwd()
        outs[name + "_grads"] = dict(zip(leaves, fwd_bwd()))
        for what, f, fl, by in (("fwd", fwd, f_fwd, b_fwd), ("fwd+bwd", fwd_bwd, f_all, b_all)):
            times = row_time(bench.median_ms(f), tuned.get(what))
            ms = times["ms"]
            floor = max(fl / (bench.matmul_tflops() * 1e12) * 1e3, bench.memory_floor_ms(by))
            rows.append(dict(shape=str(shape), impl=name, pass_=what, **times, TFLOPs=bench.tflops(fl, ms),
                             floor_ms=floor, pct_floor=100 * floor / ms, peak_MB=peak_mib(f)))
    for r in rows:
        peer = next((q for q in rows if q["impl"] == "mamba_ssm" and q["pass_"] == r["pass_"]), None)
        r["speedup"] = peer["ms"] / r["ms"] if peer else float("nan")
    if "mamba_ssm" in outs:
        print(f"{shape}: rel err ours vs mamba_ssm forward: {rel_error(outs['ours'], outs['mamba_ssm']):.2e}; grads: "
              + ", ".join(f"{k} {rel_error(outs['ours_grads'][k], outs['mamba_ssm_grads'][k]):.1e}"
                          for k in outs["ours_grads"]))
    return rows, breakdown(inp, dy), tunings


def breakdown(inp, dy):
    """Median time of each kernel of the forward and backward pass, on the same inputs."""
    x, dt, A, B, C, D, bias = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    L = x.shape[1]
    saved = ssd_forward(x, dt, A, B, C, CHUNK, D=D, dt_bias=bias, dt_softplus=True).saved
    dA, dt_out, CB, H = saved.tensors()
    S = chunk_state(x, B, dA, dt_out, to_end=True)
    dH = chunk_state(dy, C, dA, dt_out, to_end=False)
    dS, _, _ = state_passing_backward(dH, dA, H, length=L, out_dtype=x.dtype)
    _, decay = chunk_gradients(dy, x, B, C, saved, D=D)
    step = dict(dt_bias=bias, dt_softplus=True)
    stages = {
        "fwd chunk_cumsum": lambda: chunk_cumsum(dt, A, CHUNK, **step),
        "fwd chunk_cb": lambda: chunk_cb(C, B, CHUNK),
        "fwd chunk_state": lambda: chunk_state(x, B, dA, dt_out, to_end=True),
        "fwd state_passing": lambda: state_passing(S, dA, length=L, out_dtype=x.dtype, final_dtype=None),
        "fwd chunk_scan": lambda: chunk_scan(CB, x, C, H, dA, dt_out, D=D),
        "bwd chunk_state (dH)": lambda: chunk_state(dy, C, dA, dt_out, to_end=False),
        "bwd state_passing": lambda: state_passing_backward(dH, dA, H, length=L, out_dtype=x.dtype),
        "bwd dx": lambda: chunk_scan_bwd_dx(CB, x, dy, B, dS, dA, dt_out, D=D),
        "bwd dCB + dB dC": lambda: chunk_scan_bwd_dbc(x, dy, B, C, CB, H, dS, dA, dt_out),
        "bwd dt (in-kernel rev cumsum)": lambda: dt_backward(dt, A, dt_out, decay, **step),
        "bwd dt (flip rev cumsum)": lambda: dt_backward_flip(dt, A, dt_out, decay, **step),
        "whole bwd, in-kernel rev cumsum": lambda: ssd_backward(dy, x, dt, A, B, C, saved, D=D, **step),
        "whole bwd, flip rev cumsum": lambda: ssd_backward_flip(dy, x, dt, A, B, C, saved, D=D, **step),
    }
    return [dict(stage=k, ms=bench.median_ms(f)) for k, f in stages.items()]


def our_configs() -> dict:
    """Print and return the configuration each of our autotuned kernels ran with, in every case it
    met (:func:`peers.cached_configs`). A kernel launched with seq_idx is tuned apart from the same
    kernel without it: the dtype of its seq_idx argument enters the key."""
    configs = cached_configs(autotuners("mamba_annotated."))
    print("configurations our autotuners chose, by kernel and key:", json.dumps(configs, indent=1))
    return configs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=pathlib.Path)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="first shape only")
    which.add_argument("--variants", action="store_true", help="chunks 64 and 128, and packed sequences, instead")
    args = parser.parse_args()
    if DEVICE.type != "cuda":
        sys.exit("bench_ssd: needs a CUDA GPU")
    from peers import mamba_ssm_module
    module = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    peer_fn = module.mamba_chunk_scan_combined if module is not None else None
    print(f"device: {device_name()}; matmul {bench.matmul_tflops():.0f} TFLOP/s (bf16), "
          f"copy {bench.copy_bandwidth_gbps():.0f} GB/s")
    rates = dict(device=device_name(), copy_GBps=bench.copy_bandwidth_gbps(), matmul_TFLOPs=bench.matmul_tflops())
    if args.variants:
        variants, tunings = run_variants(SHAPES[0], peer_fn)
        bench.print_table(variants)
        packing = packing_breakdown(SHAPES[0])
        print(f"where the packed sequences' extra time goes, forward+backward, {SHAPES[0]}:")
        bench.print_table(packing)
        configs = our_configs()
        if args.json:
            args.json.write_text(json.dumps(dict(rates, variants=variants, packing_stages=packing, configs=configs,
                                                 peer_tunings=tunings), indent=1))
        return
    all_rows, all_stages, all_tunings = [], {}, []
    for shape in SHAPES[: 1 if args.quick else None]:
        rows, stages, tunings = run_shape(shape, peer_fn)
        all_rows += rows
        all_tunings += tunings
        all_stages[str(shape)] = stages
        bench.print_table(rows)
        bench.print_table(stages)
    configs = our_configs()
    if args.json:
        # the rates the floors divide by, for the scoreboard's roofline (benchmarks/scoreboard.py)
        args.json.write_text(json.dumps(dict(rates, rows=all_rows, stages=all_stages, configs=configs,
                                             peer_tunings=all_tunings), indent=1))


if __name__ == "__main__":
    main()
