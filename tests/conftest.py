"""Every test runs with poisoned kernel outputs (NaN-filled before each launch) and a fresh seed.

The seeds count up from 1234 in collection order, so adding a test changes the draws of the tests
after it. ``MAMBA_ANNOTATED_TEST_SEED`` moves the start, to look for bounds that hold only for
some draws (a test must pass for every seed).
"""
import itertools
import os

import pytest

from mamba_annotated.testing import poisoned_outputs, seed_everything

_seeds = itertools.count(int(os.environ.get("MAMBA_ANNOTATED_TEST_SEED", "1234")))


@pytest.fixture(autouse=True)
def _poison_and_seed():
    seed_everything(next(_seeds))
    with poisoned_outputs():
        yield


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch in the interpreter fails: for tests that an input needs none."""
    import triton.runtime.interpreter

    def refuse(*grid):
        raise AssertionError(f"a kernel was launched on grid {grid}")
    monkeypatch.setattr(triton.runtime.interpreter.interpreter_builder, "set_grid_dim", refuse)
