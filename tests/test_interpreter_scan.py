"""The interpreter's scan by slices (mamba_annotated.interpreter_scan) gives the bits of Triton's own
per-element scan: 1-D tiles forward and reversed (chapter 2's tuple scan), a bit-packed single
operand (chapter 3), and 2-D tiles scanned along their second axis (the selective scan)."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from mamba_annotated import selective_scan
from mamba_annotated.interpreter_scan import per_element_scan, scan_by_slices
from mamba_annotated.runtime import INTERPRETED
from mamba_annotated.scan.associative import tuple_scan_forward
from mamba_annotated.scan.combine import first_order_combine
from mamba_annotated.scan.packed import packed_scan_forward
from mamba_annotated.testing import randn, uniform

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the patch is for Triton's interpreter only")


def results_of_both(monkeypatch, run):
    """run() with Triton's per-element scan, then with the scan by slices."""
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", per_element_scan)
    theirs = run()
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", scan_by_slices)
    return theirs, run()


def test_the_package_installs_the_scan_by_slices():
    assert interpreter.ScanOps.generic_scan is scan_by_slices


@pytest.mark.parametrize("reverse", [False, True])
def test_tuple_scan(monkeypatch, reverse):
    a, b, h0 = uniform(3, 37, low=0.5, high=1.0), randn(3, 37), randn(3)
    theirs, ours = results_of_both(monkeypatch, lambda: tuple_scan_forward(a, b, h0, reverse=reverse))
    assert torch.equal(theirs, ours)


def test_packed_scan(monkeypatch):
    a, b = uniform(2, 21, low=0.5, high=1.0), randn(2, 21)
    theirs, ours = results_of_both(monkeypatch, lambda: packed_scan_forward(a, b))
    assert torch.equal(theirs, ours)


def test_selective_scan_forward_and_backward(monkeypatch):
    leaves = dict(u=randn(2, 8, 37), delta=uniform(2, 8, 37, low=0.01, high=0.5), A=-uniform(8, 4, low=0.1, high=2.0),
                  B=randn(2, 4, 37), C=randn(2, 4, 37))
    d_out = randn(2, 8, 37)

    def run():
        inputs = {k: v.detach().requires_grad_() for k, v in leaves.items()}
        out = selective_scan(**inputs, delta_softplus=True)
        return [out, *torch.autograd.grad(out, list(inputs.values()), d_out)]

    for theirs, ours in zip(*results_of_both(monkeypatch, run)):
        assert torch.equal(theirs, ours)


@triton.jit
def scan_rows_kernel(a_ptr, b_ptr, h_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr):
    """h = the first-order scan of each row of a (ROWS, COLS) tile, along AXIS (1 or -1)."""
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    _, h = tl.associative_scan((tl.load(a_ptr + offsets), tl.load(b_ptr + offsets)), AXIS, first_order_combine)
    tl.store(h_ptr + offsets, h)


def test_a_scan_along_axis_minus_one(monkeypatch):
    """Axis -1 is axis 1 here. (Triton 3.9's per-element scan gets axis -1 wrong: it never finds the
    previous element along a negative axis, so it is compared at axis 1.)"""
    a, b = uniform(4, 16, low=0.5, high=1.0), randn(4, 16)

    def run(axis):
        h = torch.empty_like(a)
        scan_rows_kernel[(1,)](a, b, h, ROWS=4, COLS=16, AXIS=axis)
        return h

    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", per_element_scan)
    theirs = run(1)
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", scan_by_slices)
    assert torch.equal(theirs, run(-1))
