"""Public scan functions: input checks, flattening, and the autograd Functions."""
import torch

from ..validation import check_same, check_tensor
from .blocked import linear_scan_backward, linear_scan_forward
from .selective import selective_scan_backward, selective_scan_forward
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


class FirstOrderScan(torch.autograd.Function):
    """Autograd for h_t = a_t h_{t-1} + b_t, given a (forward, backward) pair of launchers.

    Both kernel families share one contract: forward(a, b, h0, reverse) -> h on (channels, L)
    tensors, backward(a, h, h0, grad_h, reverse) -> (grad_a, grad_b, grad_h0).
    """

    @staticmethod
    def forward(ctx, a, b, h0, reverse, launchers):
        forward_launcher, ctx.backward_launcher = launchers
        a2, b2 = _flatten(a), _flatten(b)
        h0_flat = h0.reshape(-1).contiguous() if h0 is not None else None
        h = forward_launcher(a2, b2, h0_flat, reverse)
        ctx.save_for_backward(a2, h, h0_flat)
        ctx.reverse = reverse
        return h.view(a.shape)

    @staticmethod
    def backward(ctx, grad_h):
        a2, h, h0_flat = ctx.saved_tensors
        grad_a, grad_b, grad_h0 = ctx.backward_launcher(a2, h, h0_flat, _flatten(grad_h), ctx.reverse)
        shape = grad_h.shape
        grad_h0 = grad_h0.view(shape[:-1]) if grad_h0 is not None else None
        return grad_a.view(shape), grad_b.view(shape), grad_h0, None, None


def sequential_scan(a, b, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dimension, one step at a time (chapter 1).

    a, b: (..., L), float32, float16 or bfloat16, one dtype; h0: (...) initial state (any of
    those dtypes) or None for zero. ``reverse=True`` runs h_t = a_t * h_{t+1} + b_t from the end.
    Returns h with a's shape and dtype (float32 accumulation). Differentiable in a, b and h0.
    """
    check_scan_inputs(a, b, h0)
    return FirstOrderScan.apply(a, b, h0, bool(reverse), (sequential_scan_forward, sequential_scan_backward))


def linear_scan(a, b, h0=None, reverse=False):
    """h_t = a_t * h_{t-1} + b_t along the last dimension, as a blocked parallel scan (chapters 2-4).

    a, b: (..., L), float32, float16 or bfloat16, one dtype, any length L >= 1; h0: (...) initial
    state (any of those dtypes) or None for zero. ``reverse=True`` runs h_t = a_t * h_{t+1} + b_t
    from the end. Returns h with a's shape and dtype (float32 accumulation). Differentiable in a,
    b and h0. The fast default for every later chapter.
    """
    check_scan_inputs(a, b, h0)
    return FirstOrderScan.apply(a, b, h0, bool(reverse), (linear_scan_forward, linear_scan_backward))


# --- chapter 4: the selective scan (Mamba-1) -----------------------------------------------------

def check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm's selective_scan_fn layout; every tensor on the kernels' device."""
    check_tensor("u", u, ndim=3)
    batch, dim, length = u.shape
    if dim == 0 or length == 0:
        raise ValueError(f"u must have at least one channel and one time step; got shape {tuple(u.shape)}")
    check_tensor("delta", delta)
    check_same("delta", delta, "u", u)
    check_tensor("A", A, ndim=2)
    if A.shape[0] != dim or A.shape[1] == 0:
        raise ValueError(f"A must have shape (dim, N) = ({dim}, N) with N >= 1; got {tuple(A.shape)}")
    dstate = A.shape[1]
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
    check_tensor("C", C)
    check_same("C", C, "B", B)
    if D is not None:
        check_tensor("D", D, shape=(dim,))
    if z is not None:
        check_tensor("z", z)
        check_same("z", z, "u", u)
    if delta_bias is not None:
        check_tensor("delta_bias", delta_bias, shape=(dim,))


def _contiguous(x):
    return x.contiguous() if x is not None else None


def _as_groups(M):
    """(batch, N, L) -> (batch, 1, N, L); a 4-d B or C is already (batch, groups, N, L)."""
    return M if M.dim() == 4 else M[:, None]


class SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        inputs = [_contiguous(x) for x in (u, delta, A, _as_groups(B), _as_groups(C), D, z, delta_bias)]
        y, last_state, chunk_states = selective_scan_forward(*inputs, delta_softplus, any(ctx.needs_input_grad))
        ctx.save_for_backward(*inputs, chunk_states)
        ctx.delta_softplus = delta_softplus
        ctx.B_shape = B.shape
        ctx.set_materialize_grads(False)
        return y, last_state

    @staticmethod
    def backward(ctx, grad_y, grad_last_state):
        *inputs, chunk_states = ctx.saved_tensors
        u = inputs[0]
        grad_y = torch.zeros_like(u) if grad_y is None else grad_y.contiguous()
        grads = selective_scan_backward(*inputs, ctx.delta_softplus, chunk_states, grad_y,
                                        _contiguous(grad_last_state))
        names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
        out = [grads[name].to(x.dtype) if x is not None else None for name, x in zip(names, inputs)]
        out[3], out[4] = out[3].view(ctx.B_shape), out[4].view(ctx.B_shape)
        return (*out, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """Mamba-1's selective state-space scan (S6), in mamba_ssm's ``selective_scan_fn`` layout (chapter 4).

    u, delta: (batch, dim, L), float32, float16 or bfloat16, one dtype; A: (dim, N) real;
    B, C: (batch, N, L) or (batch, groups, N, L), channel d using group d // (dim // groups);
    D, delta_bias: (dim,); z: like u. With delta' = softplus(delta + delta_bias) (each optional),
    h_t = exp(delta'_t A) h_{t-1} + delta'_t B_t u_t,  y_t = C_t . h_t + D u_t,  y_t *= silu(z_t).
    Returns y like u (float32 accumulation) and, if ``return_last_state``, h at the last step
    (batch, dim, N) float32. Differentiable in every tensor argument, the last state included.
    """
    check_selective_scan_inputs(u, delta, A, B, C, D, z, delta_bias)
    y, last_state = SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus))
    return (y, last_state) if return_last_state else y
