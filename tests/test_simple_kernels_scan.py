"""Chapter 4.9's teaching kernel (mamba_annotated/scan/simple.py) against the float64 loop."""
import pytest

from mamba_annotated.scan.reference import selective_scan_ref
from mamba_annotated.scan.simple import selective_scan_simple
from mamba_annotated.testing import FLOAT_DTYPES, assert_close, randn, tolerance, uniform


def make_inputs(batch, dim, dstate, length, dtype):
    return dict(
        x=randn(batch, dim, length, dtype=dtype),
        delta=uniform(batch, dim, length, low=0.02, high=0.6, dtype=dtype),
        A=-uniform(dim, dstate, low=0.2, high=2.0),
        B=randn(batch, dstate, length, dtype=dtype),
        C=randn(batch, dstate, length, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("batch, dim, dstate, length", [(2, 3, 4, 19), (1, 2, 5, 1), (1, 1, 16, 33)])
def test_simple_selective_scan_matches_the_float64_loop(dtype, batch, dim, dstate, length):
    inputs = make_inputs(batch, dim, dstate, length, dtype)
    y = selective_scan_simple(**inputs)
    assert y.dtype == dtype
    x = inputs.pop("x")
    assert_close(y, selective_scan_ref(u=x, **inputs), tolerance(dtype))
