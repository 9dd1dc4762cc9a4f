"""What storing the chunk states in float32 would buy and cost: the probe behind issue 14's 16-bit dA.

The GPU sweep's open failures of ``ssd_chunk_scan`` and ``bidirectional_chunk_scan`` are 16-bit dA
(and d dt_bias) past their bounds: 2 x mamba_ssm's error for SSD, 3 x the two-call foil's for the
bidirectional op. Both ops store the states entering each chunk and the state gradients in the
inputs' dtype, where mamba_ssm's backward recomputes the states in float32 and forms the carry term
of dA (the sum over a state of dS_c * gamma_c H_c) from float32 states and state gradients. This
script runs both ops as shipped and with those two stored in float32 (the kernels read either
dtype; a patch of the state-passing calls, for this probe only), and prints, for each variant:

1. the verdict of every 16-bit sweep failure kept in ``book/data/reliability.json`` (the sweep's
   own judge, ``scripts/reliability/cases.py``, with the same seed and parameters), and of the same
   parameters at ``--seeds`` more seeds; on a CPU only cases up to ``--max-length`` run;
2. forward and forward+backward time (``do_bench`` medians) and peak memory at the speed bars'
   shape, bfloat16, chunk 256 (GPU only).

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
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "reliability"), str(ROOT / "tests")]
import cases  # noqa: E402
from bench_ssd import make_inputs  # noqa: E402  (the SSD benchmark's inputs: bfloat16, D, dt_bias)
from mamba_annotated import bench  # noqa: E402
from mamba_annotated.bidirectional import backward as bidirectional_backward  # noqa: E402
from mamba_annotated.bidirectional import bidirectional_chunk_scan  # noqa: E402
from mamba_annotated.bidirectional import forward as bidirectional_forward  # noqa: E402
from mamba_annotated.runtime import DEVICE, INTERPRETED, device_name  # noqa: E402
from mamba_annotated.ssd import backward as ssd_backward  # noqa: E402
from mamba_annotated.ssd import forward as ssd_forward  # noqa: E402
from mamba_annotated.ssd import ssd_chunk_scan  # noqa: E402

OPS = ("ssd_chunk_scan", "bidirectional_chunk_scan")
PIPELINE_MODULES = (ssd_forward, ssd_backward, bidirectional_forward, bidirectional_backward)
SPEED_SHAPE = (4, 4096, 80, 64, 128)  # (batch, L, heads, headdim, dstate): the speed bars' first shape
CHUNK = 256


@contextlib.contextmanager
def float32_states():
    """Every state-passing call of both pipelines stores what it emits (the states entering each
    chunk, the state gradients) in float32; the running carry is float32 either way."""
    originals = {module: module.state_passing for module in PIPELINE_MODULES}

    def patched(original):
        return lambda *args, **kwargs: original(*args, **{**kwargs, "out_dtype": torch.float32})

    for module, original in originals.items():
        module.state_passing = patched(original)
    try:
        yield
    finally:
        for module, original in originals.items():
            module.state_passing = original


VARIANTS = {"as shipped": contextlib.nullcontext, "float32 states": float32_states}


def sixteen_bit_failures(path):
    """(op, seed, params) of each 16-bit failure the sweep kept, for the two chunked ops."""
    sweep = json.loads(path.read_text())["reports"]["sweep"]
    found = []
    for op in OPS:
        for reproducer in sweep[op]["reproducers"]:
            params = json.loads(reproducer["command"].split("--params ", 1)[1].strip("'"))
            if params["dtype"] != "float32":
                found.append((op, reproducer["seed"], params))
    return found


def verdicts(failures, extra_seeds, max_length):
    rows = []
    for op, seed, params in failures:
        if max_length is not None and params["dims"]["L"] > max_length:
            continue
        for s in range(seed, seed + 1 + extra_seeds):
            row = dict(op=op, seed=s, drawn_seed=seed, dtype=params["dtype"], dims=params["dims"])
            for variant, context in VARIANTS.items():
                with context():
                    verdict = cases.run_case(cases.OPS[op], params, s)
                row[variant] = verdict.failures or (["unjudged: " + "; ".join(verdict.unjudged)]
                                                    if verdict.unjudged else [])
            rows.append(row)
            print(f"{op} seed {s} ({params['dtype']}, {params['dims']}):", flush=True)
            for variant in VARIANTS:
                print(f"    {variant:15s} {'; '.join(row[variant]) or 'pass'}", flush=True)
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
            with context():
                row = dict(op=op, variant=variant, fwd_ms=bench.median_ms(forward),
                           fwd_bwd_ms=bench.median_ms(forward_backward))
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                forward_backward()
                row["peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            rows.append(row)
            print(f"{op:26s} {variant:15s} fwd {row['fwd_ms']:.3f} ms  fwd+bwd {row['fwd_bwd_ms']:.3f} ms  "
                  f"peak {row['peak_MiB']:.0f} MiB", flush=True)
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
    report = dict(device=device_name(), speed_shape=SPEED_SHAPE, chunk=CHUNK, verdicts=[], speeds=[])
    if "verdicts" in parts:
        report["verdicts"] = verdicts(sixteen_bit_failures(args.reliability), args.seeds, args.max_length)
    if "speeds" in parts and not INTERPRETED:  # timings in the interpreter say nothing about a GPU
        report["speeds"] = speeds()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
