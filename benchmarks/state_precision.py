"""What storing the chunk states in float32 would buy and cost: the probe behind issue 14's 16-bit dA.

The GPU sweep's open failures of ``ssd_chunk_scan`` and ``bidirectional_chunk_scan`` are mostly
16-bit dA, d dt and d dt_bias past their bounds: in bfloat16 twice mamba_ssm's error for SSD (a
fixed bound in float16), 3 x the two-call foil's for the bidirectional op. Both ops store the states
entering each chunk and the state gradients in the inputs' dtype, where mamba_ssm's backward
recomputes the states in float32 and forms the carry term of dA (the sum over a state of
dS_c * gamma_c H_c) from float32 states and state gradients. This script runs each op as shipped and
with those two stored in float32 (the kernels read either dtype; a patch of the op's own
state-passing calls, for this probe only: the bidirectional op's foil, two calls of
``ssd_chunk_scan``, stays as shipped), and prints, for each variant:

1. for every sweep failure kept in ``book/data/reliability.json`` whose failing outputs are all
   step gradients (dA, d dt, d dt_bias), and for its parameters at ``--seeds`` more seeds: the
   sweep's own verdict (``scripts/reliability/cases.py``, same seed and parameters) with the
   relative errors of those gradients against float64 that it measured; on a CPU only cases up to
   ``--max-length`` run;
2. forward and forward+backward time (``do_bench`` medians) and peak memory at the speed bars'
   shape, bfloat16, chunk 256 (GPU only).

The kernels' dots round what they read to the inputs' dtype in both variants (as mamba_ssm's do),
so the float32 variant changes the carry term of dA and the bytes moved, nothing else. Since the
reverse state passing forms that term itself, from the float32 state gradients and the initial
states as given, what is left for the float32 variant to change is the stored H_c it reads. The
H100 run (before that change) is in ``book/data/state_precision.json`` (README, "Using the
kernels", says what it decided).

``--json PATH`` writes everything. Most of the time goes to compiling kernels (each case's shape,
each variant's state dtype), so on a GPU the two parts may need a device call each. Usage:

    python benchmarks/state_precision.py [--json out.json] [--parts verdicts,speeds] [--seeds 2]
                                         [--max-length 400]
"""
import argparse
import contextlib
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "reliability")]
import cases  # noqa: E402  (puts tests/ on the path too)
from bench_ssd import make_inputs  # noqa: E402
from mamba_annotated import bench  # noqa: E402
from mamba_annotated.bidirectional import backward as bidirectional_backward  # noqa: E402
from mamba_annotated.bidirectional import bidirectional_chunk_scan  # noqa: E402
from mamba_annotated.bidirectional import forward as bidirectional_forward  # noqa: E402
from mamba_annotated.runtime import INTERPRETED, device_name  # noqa: E402
from mamba_annotated.ssd import backward as ssd_backward  # noqa: E402
from mamba_annotated.ssd import forward as ssd_forward  # noqa: E402
from mamba_annotated.ssd import ssd_chunk_scan  # noqa: E402
from peak_memory import peak_mib  # noqa: E402
from sweep import recorded_reproducers  # noqa: E402
from test_ssd import mamba_ssm_combined  # noqa: E402

OPS = ("ssd_chunk_scan", "bidirectional_chunk_scan")
# the state-passing calls of each pipeline: (module, the function's name there)
STATE_PASSING_CALLS = {"ssd_chunk_scan": ((ssd_forward, "state_passing"), (ssd_backward, "state_passing_backward")),
                       "bidirectional_chunk_scan": ((bidirectional_forward, "state_passing"),
                                                    (bidirectional_backward, "state_passing_backward"))}
STEP_GRADIENTS = ("grad A", "grad dt", "grad dt_bias")
SPEED_SHAPE = (4, 4096, 80, 64, 128)  # (batch, L, heads, headdim, dstate): the speed bars' first shape
CHUNK = 256


@contextlib.contextmanager
def float32_states(op):
    """The state-passing calls of ``op``'s pipeline store what they emit (the states entering each
    chunk, the state gradients) in float32; the running carry is float32 either way."""
    originals = {(module, name): getattr(module, name) for module, name in STATE_PASSING_CALLS[op]}

    def patched(original):
        return lambda *args, **kwargs: original(*args, **{**kwargs, "out_dtype": torch.float32})

    for (module, name), original in originals.items():
        setattr(module, name, patched(original))
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


VARIANTS = {"as shipped": lambda op: contextlib.nullcontext(), "float32 states": float32_states}


def step_gradient_failures(path):
    """(op, seed, params) of each recorded sweep failure of the two chunked ops in step gradients only."""
    return [(op, seed, params) for op, seed, params, failures in recorded_reproducers([path], OPS)
            if {failure.split(":")[0] for failure in failures} <= set(STEP_GRADIENTS)]


def verdicts(failures, extra_seeds, max_length):
    rows = []
    for op, seed, params in failures:
        if max_length is not None and params["dims"]["L"] > max_length:
            continue
        for s in range(seed, seed + 1 + extra_seeds):
            row = dict(op=op, seed=s, drawn_seed=seed, dtype=params["dtype"], dims=params["dims"])
            print(f"{op} seed {s} ({params['dtype']}, {params['dims']}):", flush=True)
            for variant, context in VARIANTS.items():
                with context(op):
                    verdict = cases.run_case(cases.OPS[op], params, s)
                errors = {name: verdict.errors[name] for name in STEP_GRADIENTS if name in verdict.errors}
                judged = verdict.failures or [f"unjudged: {reason}" for reason in verdict.unjudged]
                row[variant] = dict(verdict=judged, errors=errors)
                print(f"    {variant:15s} " + "  ".join(f"{k} {v:.1e}" for k, v in errors.items())
                      + f"  {'; '.join(judged) or 'pass'}", flush=True)
            rows.append(row)
    return rows


def speed_inputs(op):
    scan = ssd_chunk_scan if op == "ssd_chunk_scan" else bidirectional_chunk_scan
    return scan, make_inputs(*SPEED_SHAPE)


def speeds():
    rows = []
    for op in OPS:
        scan, inputs = speed_inputs(op)
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        grad_out = torch.randn_like(inputs["x"])

        def forward():
            return scan(**leaves, chunk_size=CHUNK, dt_softplus=True)

        def forward_backward():
            torch.autograd.backward(forward(), grad_out)

        for variant, context in VARIANTS.items():
            with context(op):
                row = dict(op=op, variant=variant, fwd_ms=bench.median_ms(forward),
                           fwd_bwd_ms=bench.median_ms(forward_backward), peak_MB=peak_mib(forward_backward))
            rows.append(row)
            print(f"{op:26s} {variant:15s} fwd {row['fwd_ms']:.3f} ms  fwd+bwd {row['fwd_bwd_ms']:.3f} ms  "
                  f"peak {row['peak_MB']:.0f} MB", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--parts", default="verdicts,speeds", help="comma-separated: verdicts, speeds")
    parser.add_argument("--seeds", type=int, default=2, help="seeds after each failure's own, same parameters")
    parser.add_argument("--max-length", type=int, default=400 if INTERPRETED else None,
                        help="skip failures longer than this (default: 400 in the interpreter, none on a GPU)")
    parser.add_argument("--reliability", type=pathlib.Path, default=ROOT / "book" / "data" / "reliability.json")
    args = parser.parse_args(argv)
    print(f"device: {device_name()}")
    parts = args.parts.split(",")
    if not set(parts) <= {"verdicts", "speeds"}:
        parser.error(f"--parts takes verdicts and/or speeds; got {args.parts!r}")
    if not INTERPRETED and mamba_ssm_combined() is None:  # the bfloat16 SSD rule's yardstick
        print("WARNING: mamba_ssm is missing: SSD's bfloat16 dA and d dt_bias will be unjudged", flush=True)
    report = dict(device=device_name(), speed_shape=SPEED_SHAPE, chunk=CHUNK, verdicts=[], speeds=[])
    if "verdicts" in parts:
        report["verdicts"] = verdicts(step_gradient_failures(args.reliability), args.seeds, args.max_length)
    if "speeds" in parts and not INTERPRETED:  # timings in the interpreter say nothing about a GPU
        report["speeds"] = speeds()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
