"""benchmarks/bench_ssd.py's packing breakdown on CPU: each kernel's time with and without packed
sequences, paired by kernel, the real passes run (the profiler's times stood in for)."""
import pathlib
import sys

import pytest
import torch

from mamba_annotated import bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_ssd  # noqa: E402


def test_packed_seq_idx_marks_equal_runs_in_every_row():
    seq_idx = bench_ssd.packed_seq_idx((3, 12, 2, 16, 16), packed=4)
    assert seq_idx.shape == (3, 12) and seq_idx.dtype == torch.int32
    assert seq_idx[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert (seq_idx == seq_idx[:1]).all()


def test_packing_breakdown_pairs_each_kernel_and_sums_them(monkeypatch):
    """Kernels are paired by name; one that only the packed pass launches (the device-side check of
    seq_idx) counts 0 ms in the other; the largest difference comes first and the last row sums
    every column. Each pass really runs, with and without seq_idx."""
    profiled = [  # what the profiler would report for the pass without, then with, seq_idx
        [dict(stage="chunk_scan_kernel", calls=1, ms=1.0, pct=50.0), dict(stage="chunk_state_kernel", calls=2, ms=1.0,
                                                                           pct=50.0)],
        [dict(stage="chunk_state_kernel", calls=2, ms=1.05, pct=40.0), dict(stage="chunk_scan_kernel", calls=1, ms=1.5,
                                                                             pct=55.0),
         dict(stage="assert_async", calls=1, ms=0.002, pct=5.0)],
    ]
    passes = []

    def kernel_times(step):
        passes.append([t.clone() for t in step()])  # the gradients of a real forward+backward pass
        return profiled[len(passes) - 1]

    monkeypatch.setattr(bench, "kernel_times", kernel_times)
    rows = bench_ssd.packing_breakdown((1, 40, 2, 16, 16), packed=4)
    assert [r["stage"] for r in rows] == ["chunk_scan_kernel", "chunk_state_kernel", "assert_async", "all kernels"]
    scan, state, check, total = rows
    assert (scan["ms_one"], scan["ms_packed"], scan["extra_ms"]) == (1.0, 1.5, 0.5)
    assert (check["calls_one"], check["calls_packed"], check["ms_one"]) == (0, 1, 0.0)
    assert state["extra_ms"] == pytest.approx(0.05)
    assert total["ms_one"] == 2.0 and total["ms_packed"] == pytest.approx(2.552)
    assert total["extra_ms"] == pytest.approx(0.552) and total["calls_packed"] == 4
    # the packed pass is a different computation: sequences do not see each other
    assert len(passes) == 2 and any(not torch.equal(a, b) for a, b in zip(*passes))
