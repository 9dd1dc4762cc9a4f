"""benchmarks/sweep_bidirectional_dbc.py's case loop on CPU (the script itself needs a GPU, where the
launch constants take effect; the interpreter keeps its own small blocks): one row per launch, the
default's gradients its own, a launch the GPU cannot hold recorded rather than fatal, and the
module's constants restored."""
import pathlib
import sys

import pytest
import torch
from triton.runtime.errors import OutOfResources

from mamba_annotated import bench
from mamba_annotated.bidirectional import chunk_scan_bwd

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import sweep_bidirectional_dbc as sweep  # noqa: E402


@pytest.mark.parametrize("shift", [False, True])
def test_sweep_case_times_every_launch_and_restores_the_constants(monkeypatch, shift):
    default = tuple(getattr(chunk_scan_bwd, name) for name in sweep.CONSTANTS)
    assert default == sweep.CONFIGS[0]
    configs = sweep.CONFIGS[:3]
    too_big = configs[2]
    backward = sweep.bidirectional_backward

    def backward_or_out_of_memory(*args, **kwargs):
        if tuple(getattr(chunk_scan_bwd, name) for name in sweep.CONSTANTS) == too_big:
            raise OutOfResources(237568, 232448, "shared memory")
        return backward(*args, **kwargs)

    monkeypatch.setattr(sweep, "CONFIGS", configs)
    monkeypatch.setattr(sweep, "CHUNK", 16)  # the interpreter's time grows with the chunk
    monkeypatch.setattr(sweep, "bidirectional_backward", backward_or_out_of_memory)
    # the profiler's kernel times exist on a GPU only; one timed call is enough here
    monkeypatch.setattr(sweep, "median_ms", lambda fn: (fn(), 2.5)[1])
    monkeypatch.setattr(bench, "kernel_times", lambda step: [dict(stage=sweep.KERNEL + "<...>", ms=0.5),
                                                            dict(stage="another kernel", ms=9.0)])
    rows = sweep.sweep_case((1, 40, 2, 16, 16), shift)
    assert tuple(getattr(chunk_scan_bwd, name) for name in sweep.CONSTANTS) == default
    assert [(r["rows"], r["block_n"], r["warps"], r["stages"]) for r in rows] == configs
    assert [r["default"] for r in rows] == [True, False, False]
    for r in rows[:2]:
        assert r["error"] == "" and r["dbc_ms"] == 0.5 and r["backward_ms"] == 2.5
        assert r["rel_diff"] < 1e-6  # the interpreter ignores the constants: the same launch each time
    assert rows[0]["rel_diff"] == 0
    assert rows[2]["error"] == "out of shared memory"
    assert rows[2]["dbc_ms"] is None and rows[2]["backward_ms"] is None and rows[2]["rel_diff"] is None


class LaunchRecorder:
    """Stands in for a kernel: records each launch's grid, block sizes, warps and stages."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M=None, BLOCK_N=None, num_warps=None, num_stages=None, **options):
            self.launches.append((grid, BLOCK_M, BLOCK_N, num_warps, num_stages))
        return launch


@pytest.mark.parametrize("dtype, headdim, launch", [
    (torch.bfloat16, 64, (32, 32, 4, 2)),   # a Mamba-2 layer's: the module's constants, set here to another launch
    (torch.float32, 64, (32, 64, 8, 3)),    # the others as before the constants: 32 rows, 8 warps
    (torch.float32, 128, (32, 32, 8, 1)),   # float32 of a wide head: narrower slots, one stage
    (torch.bfloat16, 128, (32, 64, 8, 3)),
])
def test_the_dbc_launch_on_a_gpu_reads_the_constants_for_16_bit_heads_of_64(monkeypatch, dtype, headdim, launch):
    """What chunk_scan_bwd_dbc launches on a GPU (the kernels replaced by recorders, the interpreter's
    own blocks switched off): (rows, dstate columns, warps, stages), and the checked relaunch on the
    same grid with 8 warps and one stage."""
    monkeypatch.setattr(chunk_scan_bwd, "INTERPRETED", False)
    for name, value in zip(sweep.CONSTANTS, (32, 32, 4, 2)):
        monkeypatch.setattr(chunk_scan_bwd, name, value)
    dbc, checked = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(chunk_scan_bwd, "chunk_scan_bwd_dbc_kernel", dbc)
    monkeypatch.setattr(chunk_scan_bwd, "chunk_scan_bwd_dbc_checked_kernel", checked)
    monkeypatch.setattr(chunk_scan_bwd, "chunk_scan_bwd_dscores_kernel", LaunchRecorder())
    batch, length, heads, dstate, chunk = 1, 512, 2, 128, 256
    x = torch.zeros(batch, length, heads, headdim, dtype=dtype)
    B = torch.zeros(batch, length, 1, dstate, dtype=dtype)
    a = torch.zeros(batch, heads, length // chunk, chunk)
    G = torch.zeros(batch, length // chunk, 1, chunk, chunk)
    chunk_scan_bwd.chunk_scan_bwd_dbc(x, x, B, B, B, B, G, None, None, None, None, a, a, a, a, a)
    rows, block_n = launch[:2]
    grid = (batch * (length // chunk), (chunk // rows) * (dstate // block_n))
    assert dbc.launches == [(grid, *launch)]
    assert checked.launches == [(grid, rows, block_n, 8, 1)]
