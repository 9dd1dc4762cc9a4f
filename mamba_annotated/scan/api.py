"""Public scan functions: input checks, and the ops registered with torch.library (:mod:`..library`)."""
from typing import Optional

import torch

from ..library import absent, contiguous, define_op
from ..validation import check_same, check_same_device, check_tensor
from .blocked import linear_scan_backward, linear_scan_forward
from .selective import selective_scan_backward, selective_scan_forward
from .sequential import sequential_scan_backward, sequential_scan_forward


def check_scan_inputs(a, b, h0):
    """a, b: (..., L) float tensors of one dtype and shape; h0: a.shape[:-1] or None."""
    check_tensor("a", a, min_ndim=1)
    check_tensor("b", b)
    check_same("b", b, "a", a)
    if h0 is not None:
        check_tensor("h0", h0, shape=a.shape[:-1])
        check_same_device("h0", h0, "a", a)


def first_order_scan_op(name, forward_launcher, backward_launcher):
    """The op h = scan(a, b) for one family of launchers. Both families share one contract:
    forward(a, b, h0, *, reverse) -> h and backward(a, h, h0, grad_h, *, reverse) -> (grad_a, grad_b,
    grad_h0 or None), on (..., L) contiguous tensors, their leading dimensions taken as rows, with
    outputs of the inputs' shapes (no reshape on either side: each costs host time at every call)."""

    def forward(a: torch.Tensor, b: torch.Tensor, h0: Optional[torch.Tensor], reverse: bool) -> torch.Tensor:
        if a.numel() == 0:
            return torch.empty_like(a, memory_format=torch.contiguous_format)
        return forward_launcher(contiguous(a), contiguous(b), contiguous(h0), reverse=reverse)

    def fake_forward(a, b, h0, reverse):
        return torch.empty_like(a, memory_format=torch.contiguous_format)

    def backward(a: torch.Tensor, h: torch.Tensor, h0: Optional[torch.Tensor], grad_h: torch.Tensor,
                 reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if a.numel() == 0:
            grad_h0 = h0.new_zeros(h0.shape) if h0 is not None else absent(a)
            return a.new_zeros(a.shape), a.new_zeros(a.shape), grad_h0
        grad_a, grad_b, grad_h0 = backward_launcher(contiguous(a), contiguous(h), contiguous(h0), contiguous(grad_h),
                                                    reverse=reverse)
        return grad_a, grad_b, grad_h0 if h0 is not None else absent(a)

    def fake_backward(a, h, h0, grad_h, reverse):
        grad_h0 = h0.new_empty(h0.shape) if h0 is not None else absent(a)
        return a.new_empty(a.shape), a.new_empty(a.shape), grad_h0

    def save(ctx, inputs, output):
        a, _, h0, reverse = inputs
        ctx.save_for_backward(a, output, h0)
        ctx.reverse = reverse

    def grads(ctx, run_backward, grad_h):
        a, h, h0 = ctx.saved_tensors
        grad_a, grad_b, grad_h0 = run_backward(a, h, h0, grad_h, ctx.reverse)
        return grad_a, grad_b, grad_h0 if h0 is not None else None, None

    return define_op(name, forward, fake_forward, backward, fake_backward, save, grads)


sequential_scan_op = first_order_scan_op("sequential_scan", sequential_scan_forward, sequential_scan_backward)
linear_scan_op = first_order_scan_op("linear_scan", linear_scan_forward, linear_scan_backward)


def sequential_scan(a, b, *, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dimension, one step at a time (chapter 1).

    Arguments, returns and gradients as :func:`linear_scan`, which is the fast way.
    """
    check_scan_inputs(a, b, h0)
    return sequential_scan_op(a, b, h0, bool(reverse))


def linear_scan(a, b, *, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dimension, as a blocked parallel scan (chapters 2-4).

    accelerated-scan's ``scan(gates, tokens)`` with keyword extras: a, b (..., L), float32, float16
    or bfloat16, one dtype, any length (empty inputs give an empty h); ``h0`` (...) initial state
    (any of those dtypes) or None for zero; ``reverse=True`` runs h_t = a_t * h_{t+1} + b_t from
    the end. Returns h with a's shape and dtype (float32 accumulation). Differentiable in a, b and
    h0; the gradients are deterministic.
    """
    check_scan_inputs(a, b, h0)
    return linear_scan_op(a, b, h0, bool(reverse))


# --- chapter 4: the selective scan (Mamba-1) -----------------------------------------------------

def check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm's selective_scan_fn layout; every tensor on u's device."""
    check_tensor("u", u, ndim=3)
    batch, dim, length = u.shape
    check_tensor("delta", delta)
    check_same("delta", delta, "u", u)
    if A.is_complex():
        raise NotImplementedError("A: complex A (mamba_ssm's complex selective scan) is not implemented")
    check_tensor("A", A, ndim=2)
    check_same_device("A", A, "u", u)
    if A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, N) = ({dim}, N); got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        if isinstance(M, torch.Tensor) and M.dim() == 2:
            raise NotImplementedError(f"{name}: a time-invariant {name} of shape (dim, N) is not implemented; "
                                      f"pass (batch, N, L) or (batch, groups, N, L)")
    check_tensor("B", B)
    if B.dim() == 3:
        expected = (batch, dstate, length)
    elif B.dim() == 4:
        groups = B.shape[1]
        if groups == 0 or dim % groups:
            raise ValueError(f"B's groups (dimension 1, here {groups}) must divide dim = {dim}")
        expected = (batch, groups, dstate, length)
    else:
        raise ValueError(f"B must have shape (batch, N, L) or (batch, groups, N, L); got {tuple(B.shape)}")
    if tuple(B.shape) != expected:
        raise ValueError(f"B must have shape {expected} (batch, [groups,] N, L); got {tuple(B.shape)}")
    check_same_device("B", B, "u", u)
    check_tensor("C", C)
    check_same("C", C, "B", B)
    for name, vector in (("D", D), ("delta_bias", delta_bias)):
        if vector is not None:
            check_tensor(name, vector, shape=(dim,))
            check_same_device(name, vector, "u", u)
    if z is not None:
        check_tensor("z", z)
        check_same("z", z, "u", u)


def as_groups(M):
    """(batch, N, L) -> (batch, 1, N, L); a 4-d B or C is already (batch, groups, N, L)."""
    return M if M.dim() == 4 else M.unsqueeze(1)  # unsqueeze: a microsecond less host time than M[:, None]


def selective_forward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                      delta_softplus: bool, store_chunk_states: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, the last state and the chunk start states the backward pass needs (empty if not stored)."""
    batch, dim, length = u.shape
    if u.numel() == 0:
        return (torch.zeros(u.shape, dtype=u.dtype, device=u.device),
                torch.zeros(batch, dim, A.shape[1], dtype=torch.float32, device=u.device), absent(u))
    y, last_state, chunk_states = selective_scan_forward(
        *(contiguous(x) for x in (u, delta, A, as_groups(B), as_groups(C), D, z, delta_bias)),
        delta_softplus=delta_softplus, store_chunk_states=store_chunk_states)
    return y, last_state, chunk_states if chunk_states is not None else absent(u)


def fake_selective_forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, store_chunk_states):
    from .selective import chunk_states_shape

    batch, dim, length = u.shape
    chunk_states = (u.new_empty(chunk_states_shape(batch, dim, A.shape[1], length), dtype=torch.float32)
                    if store_chunk_states and u.numel() else absent(u))
    return u.new_empty(u.shape), u.new_empty((batch, dim, A.shape[1]), dtype=torch.float32), chunk_states


SELECTIVE_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def selective_backward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
                       delta_softplus: bool, chunk_states: torch.Tensor, grad_y: torch.Tensor,
                       grad_last_state: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of each of the eight tensor inputs, in its dtype and shape (absent for None)."""
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    if u.numel() == 0:
        return [x.new_zeros(x.shape) if x is not None else absent(u) for x in inputs]
    grads = selective_scan_backward(
        *(contiguous(x) for x in (u, delta, A, as_groups(B), as_groups(C), D, z, delta_bias)),
        delta_softplus=delta_softplus, chunk_states=chunk_states, grad_y=grad_y.contiguous(),
        grad_last_state=contiguous(grad_last_state))
    return [as_input(grads[name], x) if x is not None else absent(u) for name, x in zip(SELECTIVE_INPUTS, inputs)]


def as_input(grad, x):
    """``grad`` in ``x``'s dtype and shape. A gradient has x's shape already or, for a 3-d B or C,
    the grouped (batch, 1, N, L), so the number of dimensions tells them apart. Most gradients need
    neither change, and a ``to`` or ``view_as`` that changes nothing still costs a microsecond or
    two of host time per call."""
    if grad.dtype != x.dtype:
        grad = grad.to(x.dtype)
    return grad if grad.dim() == x.dim() else grad.view_as(x)


def fake_selective_backward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_states, grad_y,
                            grad_last_state):
    return [x.new_empty(x.shape) if x is not None else absent(u) for x in (u, delta, A, B, C, D, z, delta_bias)]


def save_selective(ctx, inputs, output):
    *tensors, delta_softplus, _ = inputs
    ctx.save_for_backward(*tensors, output[2])
    ctx.delta_softplus = delta_softplus


def selective_grads(ctx, run_backward, grad_y, grad_last_state, _grad_chunk_states):
    *tensors, chunk_states = ctx.saved_tensors
    u = tensors[0]
    grad_y = torch.zeros_like(u) if grad_y is None else grad_y
    grads = run_backward(*tensors, ctx.delta_softplus, chunk_states, grad_y, grad_last_state)
    return (*(g if x is not None else None for g, x in zip(grads, tensors)), None, None)


selective_scan_op = define_op("selective_scan", selective_forward, fake_selective_forward, selective_backward,
                              fake_selective_backward, save_selective, selective_grads)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """Mamba-1's selective state-space scan (S6): mamba_ssm's ``selective_scan_fn`` (chapter 4.9).

    u, delta: (batch, dim, L), float32, float16 or bfloat16, one dtype; A: (dim, N) real;
    B, C: (batch, N, L) or (batch, groups, N, L) in u's dtype, channel d using group
    d // (dim // groups); D, delta_bias: (dim,); z: like u. With delta' = softplus(delta +
    delta_bias) (each optional), h_t = exp(delta'_t A) h_{t-1} + delta'_t B_t u_t,
    y_t = C_t . h_t + D u_t, y_t *= silu(z_t).
    Returns y like u (float32 accumulation) and, if ``return_last_state``, the tuple (y, h at the
    last step (batch, dim, N) float32). Differentiable in every tensor argument, the last state
    included; gradients are deterministic. Not implemented (NotImplementedError): complex A, and
    time-invariant B or C of shape (dim, N).
    """
    check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (u, delta, A, B, C, D, z, delta_bias))
    y, last_state, _ = selective_scan_op(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), needs_grad)
    return (y, last_state) if return_last_state else y
