"""Chapter 2: the combine is associative (in PyTorch and in Triton), the one-block tuple scan and its
reverse-scan backward match the float64 loop, and the log-space scan loses precision with length."""
import pytest
import torch

from mamba_annotated.runtime import size
from mamba_annotated.scan.associative import (MAX_LENGTH, combine_both_bracketings, tuple_scan_backward,
                                              tuple_scan_forward)
from mamba_annotated.scan.combine import first_order_combine_torch
from mamba_annotated.scan.log_space import log_space_scan
from mamba_annotated.scan.reference import linear_scan_ref
from mamba_annotated.testing import (FLOAT_DTYPES, assert_associative, assert_close, gradients, randn,
                                     rel_error, tolerance, uniform)


def test_combine_is_associative_in_pytorch():
    def sample():
        return uniform(64, low=-1.5, high=1.5, dtype=torch.float64), randn(64, dtype=torch.float64)
    assert_associative(first_order_combine_torch, sample, tol=1e-12)


def test_triton_combine_is_associative():
    # the interpreter folds scans left to right, so only this test catches a wrong combine on CPU
    a = uniform(3, 64, low=-1.5, high=1.5)
    b = randn(3, 64)
    left, right = combine_both_bracketings(a, b)
    assert_close(left, right, tolerance(torch.float32), "(x o y) o z vs x o (y o z)")
    x, y, z = [(a[i].double(), b[i].double()) for i in range(3)]
    want = torch.stack(first_order_combine_torch(first_order_combine_torch(x, y), z))
    assert_close(left, want, tolerance(torch.float32), "Triton combine vs PyTorch combine")


def test_identity_element():
    a, b = uniform(32, low=-2, high=2, dtype=torch.float64), randn(32, dtype=torch.float64)
    one, zero = torch.ones_like(a), torch.zeros_like(b)
    for got in (first_order_combine_torch((one, zero), (a, b)), first_order_combine_torch((a, b), (one, zero))):
        assert torch.equal(got[0], a) and torch.equal(got[1], b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("length", [1, 7, 100, 1000])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_tuple_scan_forward_and_backward(dtype, length, reverse, with_h0):
    rows = size(gpu=333, cpu=3)
    a = uniform(rows, length, low=0.6, high=1.0, dtype=dtype)
    b = randn(rows, length, dtype=dtype)
    h0 = randn(rows) if with_h0 else None
    tol = tolerance(dtype)
    h = tuple_scan_forward(a, b, h0, reverse=reverse)
    assert_close(h, linear_scan_ref(a, b, h0, reverse), tol, "h")
    grad_h = randn(rows, length, dtype=dtype).double()  # the values the kernel receives, for both
    grad_a, grad_b, grad_h0 = tuple_scan_backward(a, h, h0, grad_h.to(dtype), reverse=reverse)
    inputs = dict(a=a.double().requires_grad_(), b=b.double().requires_grad_())
    if with_h0:
        inputs["h0"] = h0.double().requires_grad_()
    want = gradients(lambda **x: linear_scan_ref(**x, reverse=reverse), inputs, grad_h)
    assert_close(grad_a, want["a"], tol, "grad a")
    assert_close(grad_b, want["b"], tol, "grad b")
    if with_h0:
        assert_close(grad_h0, want["h0"], tol, "grad h0")
    else:
        assert grad_h0 is None


def test_tuple_scan_refuses_rows_longer_than_one_block():
    a = torch.ones(1, MAX_LENGTH + 1)
    with pytest.raises(ValueError, match="at most"):
        tuple_scan_forward(a, a)


def test_log_space_scan_is_exact_in_float64():
    a = uniform(4, 300, low=0.9, high=1.0, dtype=torch.float64)
    b = uniform(4, 300, low=0.1, high=1.1, dtype=torch.float64)
    assert_close(log_space_scan(a, b), linear_scan_ref(a, b), 1e-12)


def test_log_space_scan_loses_precision_with_length_and_tuple_scan_does_not():
    length = 4096
    a = uniform(1, length, low=0.9, high=1.0)
    b = uniform(1, length, low=0.1, high=1.1)
    ref = linear_scan_ref(a, b)
    tuple_error = rel_error(tuple_scan_forward(a, b), ref)
    log_error = rel_error(log_space_scan(a, b), ref)
    assert tuple_error < tolerance(torch.float32)
    assert log_error > 10 * tuple_error


def test_log_space_scan_refuses_nonpositive_b():
    with pytest.raises(ValueError, match="b must be positive"):
        log_space_scan(torch.full((3,), 0.5), torch.tensor([1.0, -1.0, 1.0]))


def test_running_product_from_the_scan():
    # chapter 2, exercise 2: with b = 0 and h0 = 1 the state is the running product of the decays
    a = uniform(4, 50, low=0.5, high=1.5)
    assert_close(tuple_scan_forward(a, torch.zeros_like(a), torch.ones(4, device=a.device)),
                 torch.cumprod(a.double(), dim=-1), tolerance(torch.float32))
