"""benchmarks/peak_memory.py: the peak of one call above what was allocated before it, with garbage
that a reference cycle holds freed first (GPU only: the counters are CUDA's)."""
import gc
import pathlib
import sys

import pytest
import torch

from mamba_annotated.runtime import DEVICE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from peak_memory import peak_mib  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="reads CUDA's memory counters")
MIB = 2**20


def test_the_peak_counts_what_the_call_allocates():
    assert peak_mib(lambda: torch.empty(32 * MIB, dtype=torch.uint8, device=DEVICE)) == pytest.approx(32, abs=1)


def test_garbage_freed_during_the_call_does_not_hide_its_peak():
    """64 MiB held only by a reference cycle: the call collects it, then allocates 32 MiB. Counted
    from a baseline that still held the garbage, the peak would be 0; it must be 32."""
    def collect_then_allocate():
        gc.collect()
        return torch.empty(32 * MIB, dtype=torch.uint8, device=DEVICE)

    gc.disable()  # the cycle must survive until peak_mib's own collection
    try:
        cycle = [torch.empty(64 * MIB, dtype=torch.uint8, device=DEVICE)]
        cycle.append(cycle)
        del cycle
        assert peak_mib(collect_then_allocate) == pytest.approx(32, abs=1)
    finally:
        gc.enable()
