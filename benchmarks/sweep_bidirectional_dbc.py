"""Pick the bidirectional backward's dB/dC kernel launch: time every (rows, dstate columns, warps,
stages) on the benchmark's shapes, in one run, and store the table.

The dBC kernel (mamba_annotated/bidirectional/chunk_scan_bwd.py) is not autotuned: its partial sums
go to slots whose layout the launch fixes, and the checked relaunch must use the same blocks. For
16-bit inputs of headdim <= 64 it reads its launch from the module's ``DBC_*`` constants at each
call; this script sets them in turn. For each shape of bench_bidirectional.py and both forms
(``shift=False`` with shared parameters, the speed bar's; ``shift=True`` with the reverse
direction's own dt, B and C, whose kernel keeps twice the accumulators) it runs the forward once,
then per launch: the whole backward on the same saved record and upstream gradient, its gradients
checked against the default launch's (``rel_diff``, the largest over the inputs' gradients: the
sums over heads and positions run in another order), the dBC kernel's own time (PyTorch's profiler)
and the whole backward's (``triton.testing.do_bench``). bfloat16, chunk 256, D, dt_bias, softplus.

    python benchmarks/sweep_bidirectional_dbc.py --json book/data/bidirectional_dbc_sweep.json
"""
import argparse
import json
import pathlib
import sys

from mamba_annotated import bench, runtime  # first: decides interpreter or GPU before triton is imported

import torch  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from mamba_annotated.bench import median_ms, print_table  # noqa: E402
from mamba_annotated.bidirectional import chunk_scan_bwd  # noqa: E402
from mamba_annotated.bidirectional.backward import bidirectional_backward  # noqa: E402
from mamba_annotated.bidirectional.forward import bidirectional_forward  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_bidirectional import REVERSE, SHAPES, make_inputs  # noqa: E402
from costs import CHUNK  # noqa: E402

CONSTANTS = ("DBC_ROWS", "DBC_BLOCK_N", "DBC_WARPS", "DBC_STAGES")
DEFAULT = tuple(getattr(chunk_scan_bwd, name) for name in CONSTANTS)  # the module's launch, before any is set
# (rows, dstate columns, warps, stages); the default first. 128 columns only with 32 rows: 64 rows of
# 128 columns make four float32 accumulators of 32 K values, more than 8 warps' registers hold
TRIED = [(64, 64, 8, 3), (64, 64, 8, 2), (64, 64, 8, 4), (64, 64, 4, 3), (64, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 2),
         (32, 64, 8, 3), (32, 64, 4, 3), (32, 64, 4, 2), (32, 32, 4, 3), (32, 128, 8, 3), (32, 128, 8, 2)]
CONFIGS = [DEFAULT] + [config for config in TRIED if config != DEFAULT]
# a launch whose gradients differ from the default's by more than reordered float32 sums do
MAX_REL_DIFF = 1e-5
KERNEL = "chunk_scan_bwd_dbc_kernel"


def set_launch(config):
    for name, value in zip(CONSTANTS, config):
        setattr(chunk_scan_bwd, name, value)


def sweep_case(shape, shift):
    """Rows of the table for one shape and form, every launch of CONFIGS."""
    inputs = make_inputs(*shape)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    options = dict(D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True, shift=shift,
                   **({k: inputs[k] for k in REVERSE} if shift else {}))
    saved = bidirectional_forward(*args, CHUNK, **options)[2]
    dy = torch.randn_like(inputs["x"])

    def backward():
        return bidirectional_backward(dy, *args, saved, **options)

    try:
        set_launch(CONFIGS[0])
        expected = {k: g.float() for k, g in backward().items() if g is not None}
        return [time_launch(config, shape, shift, backward, expected) for config in CONFIGS]
    finally:
        set_launch(DEFAULT)


def time_launch(config, shape, shift, backward, expected):
    """One row: ``config``'s launch checked against the default's gradients and timed."""
    set_launch(config)
    row = dict(shape=str(shape), shift=shift, rows=config[0], block_n=config[1], warps=config[2], stages=config[3],
               default=config == CONFIGS[0])
    try:
        got = backward()
    except OutOfResources as error:  # a launch that asks for more than the GPU has: recorded, not timed
        row.update(dbc_ms=None, backward_ms=None, rel_diff=None, error=f"out of {error.name}")
        print(row, flush=True)
        return row
    rel_diff = max(((got[k].float() - e).norm() / e.norm()).item() for k, e in expected.items())
    del got
    kernel_ms = sum(r["ms"] for r in bench.kernel_times(backward) if r["stage"].startswith(KERNEL))
    row.update(dbc_ms=round(kernel_ms, 4), backward_ms=round(median_ms(backward), 4), rel_diff=float(f"{rel_diff:.1e}"),
               error="")
    print(row, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--shape", type=int, action="append",
                        help="index into bench_bidirectional's SHAPES (repeatable; default all)")
    args = parser.parse_args()
    if runtime.DEVICE.type != "cuda":  # the interpreter launches the kernel with its own small blocks
        sys.exit("sweep_bidirectional_dbc: needs a GPU")
    rows = []
    for shape in [SHAPES[i] for i in args.shape] if args.shape else SHAPES:
        for shift in (False, True):
            rows += sweep_case(shape, shift)
            torch.cuda.empty_cache()
            if args.json:  # after every case: a run stopped by a time limit keeps the cases it finished
                args.json.write_text(json.dumps(dict(device=runtime.device_name(), constants=CONSTANTS, rows=rows),
                                                indent=1))
    print(f"device: {runtime.device_name()}; bfloat16, chunk {CHUNK}; dbc_ms: the dBC kernel alone (profiler), "
          f"backward_ms: the whole backward; rel_diff against the default launch {CONFIGS[0]}")
    print_table(rows)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for shift in (False, True):
            case = [r for r in rows if r["shape"] == shape and r["shift"] == shift and not r["error"]
                    and r["rel_diff"] <= MAX_REL_DIFF]
            if not case:
                print(f"{shape} shift={shift}: no launch ran and agreed with the default")
                continue
            best = min(case, key=lambda r: r["backward_ms"])
            default = next((f"{r['backward_ms']} ms" for r in case if r["default"]), "not run")
            print(f"{shape} shift={shift}: fastest backward {best['backward_ms']} ms with (rows, block_n, warps, "
                  f"stages) = {best['rows'], best['block_n'], best['warps'], best['stages']}; default {default}")


if __name__ == "__main__":
    main()
