"""The interpreter's scan by slices (mamba_annotated.interpreter_scan) gives the bits of Triton's own
per-element scan: 1-D tiles forward and reversed (chapter 2's tuple scan), a bit-packed single
operand (chapter 3), and 2-D tiles scanned along their second axis (the selective scan)."""
import pytest
import torch
from triton.runtime import interpreter

from mamba_annotated import selective_scan
from mamba_annotated.interpreter_scan import per_element_scan, scan_by_slices
from mamba_annotated.runtime import INTERPRETED
from mamba_annotated.scan.associative import tuple_scan_forward
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
