"""Public scan functions: input checks, flattening, and the autograd Functions."""
import torch

from ..validation import check_same, check_tensor
from .sequential import sequential_scan_backward, sequential_scan_forward


def check_scan_inputs(a, b, h0):
    """a, b: (..., L) float tensors of one dtype and shape; h0: a.shape[:-1] or None."""
    check_tensor("a", a, min_ndim=1)
    check_tensor("b", b)
    check_same("b", b, "a", a)
    if a.shape[-1] == 0:
        raise ValueError(f"a must have at least one time step (last dimension); got shape {tuple(a.shape)}")
    if h0 is not None:
        check_tensor("h0", h0, shape=a.shape[:-1])


def _flatten(x):
    """(..., L) -> (channels, L), contiguous (a copy only if x was not)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


class SequentialScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, h0, reverse):
        a2, b2 = _flatten(a), _flatten(b)
        h0_flat = h0.reshape(-1).contiguous() if h0 is not None else None
        h = sequential_scan_forward(a2, b2, h0_flat, reverse)
        ctx.save_for_backward(a2, h, h0_flat)
        ctx.reverse = reverse
        return h.view(a.shape)

    @staticmethod
    def backward(ctx, grad_h):
        a2, h, h0_flat = ctx.saved_tensors
        grad_a, grad_b, grad_h0 = sequential_scan_backward(a2, h, h0_flat, _flatten(grad_h), ctx.reverse)
        shape = grad_h.shape
        grad_h0 = grad_h0.view(shape[:-1]) if grad_h0 is not None else None
        return grad_a.view(shape), grad_b.view(shape), grad_h0, None


def sequential_scan(a, b, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dimension, one step at a time (chapter 1).

    a, b: (..., L), float32, float16 or bfloat16, one dtype; h0: (...) initial state (any of
    those dtypes) or None for zero. ``reverse=True`` runs h_t = a_t * h_{t+1} + b_t from the end.
    Returns h with a's shape and dtype (float32 accumulation). Differentiable in a, b and h0.
    """
    check_scan_inputs(a, b, h0)
    return SequentialScan.apply(a, b, h0, bool(reverse))
