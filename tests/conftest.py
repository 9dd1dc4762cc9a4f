"""Every test runs with poisoned kernel outputs (NaN-filled before each launch) and a fresh seed."""
import itertools

import pytest

from mamba_annotated.testing import poisoned_outputs, seed_everything

_seeds = itertools.count(1234)


@pytest.fixture(autouse=True)
def _poison_and_seed():
    seed_everything(next(_seeds))
    with poisoned_outputs():
        yield
