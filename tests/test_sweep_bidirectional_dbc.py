"""benchmarks/sweep_bidirectional_dbc.py's case loop on CPU (the script itself needs a GPU, where the
launch constants take effect; the interpreter keeps its own small blocks): one row per launch, the
default's gradients its own, a launch the GPU cannot hold recorded rather than fatal, and the
module's constants restored."""
import pathlib
import sys

import pytest
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
