"""Every test runs with poisoned kernel outputs (NaN-filled before each launch) and its own seed.

A test's seed is ``MAMBA_ANNOTATED_TEST_SEED`` (default 1234) plus a hash of its node id, so it
draws the same inputs however pytest-xdist spreads the tests over workers and whatever tests are
added: a failure reproduces with ``pytest <node id>``. (Seeds that counted up in execution order
gave a test a different draw in every ``-n auto`` run, so a bound that held only for some draws
failed now and then.) Changing ``MAMBA_ANNOTATED_TEST_SEED`` gives every test new draws, to look
for bounds that hold only for some of them (a test must pass for every seed).
"""
import os
import zlib

import pytest

from mamba_annotated.testing import poisoned_outputs, seed_everything

BASE_SEED = int(os.environ.get("MAMBA_ANNOTATED_TEST_SEED", "1234"))


@pytest.fixture(autouse=True)
def _poison_and_seed(request):
    seed_everything(BASE_SEED + zlib.crc32(request.node.nodeid.encode()) % 1_000_000)
    with poisoned_outputs():
        yield


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch in the interpreter fails: for tests that an input needs none."""
    import triton.runtime.interpreter

    def refuse(*grid):
        raise AssertionError(f"a kernel was launched on grid {grid}")
    monkeypatch.setattr(triton.runtime.interpreter.interpreter_builder, "set_grid_dim", refuse)
