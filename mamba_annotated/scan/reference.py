"""Float64 references for the scan chapters: readable loops, the ground truth every kernel meets.

Both functions walk time one step at a time, exactly as the math reads; they are slow and never
wrong. Inputs are upcast to float64, so the result is the exact answer for the given inputs up to
float64 rounding, and autograd through the loop gives reference gradients.
"""
import torch
import torch.nn.functional as F

from ..testing import check, tolerance


def linear_scan_ref(a, b, h0=None, reverse=False, dtype=torch.float64):
    """h_t = a_t * h_{t-1} + b_t along the last dimension (``reverse``: h_t = a_t * h_{t+1} + b_t).

    a, b: (..., L); h0: (...) or None (zero). Returns h: (..., L) computed in ``dtype`` (float64:
    the ground truth; float32 on a GPU: the naive PyTorch loop that chapter 1 times).
    """
    a, b = a.to(dtype), b.to(dtype)
    h = torch.zeros_like(a[..., 0]) if h0 is None else h0.to(dtype)
    steps = range(a.shape[-1] - 1, -1, -1) if reverse else range(a.shape[-1])
    states = {}
    for t in steps:
        h = a[..., t] * h + b[..., t]
        states[t] = h
    return torch.stack([states[t] for t in range(a.shape[-1])], dim=-1)


def discretize(delta, A, B, u, delta_bias=None, delta_softplus=False):
    """Mamba's zero-order-hold discretization, per channel d, state n, time t (float64).

    delta: (batch, dim, L); A: (dim, N); B: (batch, dim, N, L) (already expanded over groups);
    u: (batch, dim, L). Returns (A_bar, Bu_bar), both (batch, dim, N, L):
    A_bar = exp(delta * A), Bu_bar = delta * B * u (the Euler form of B_bar that Mamba uses).
    """
    delta = delta.double()
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    A_bar = torch.exp(delta[:, :, None, :] * A.double()[None, :, :, None])
    Bu_bar = delta[:, :, None, :] * B.double() * u.double()[:, :, None, :]
    return A_bar, Bu_bar


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """Mamba-1's selective SSM, in mamba_ssm's ``selective_scan_fn`` layout (float64).

    u, delta: (batch, dim, L); A: (dim, N); B, C: (batch, N, L) or (batch, groups, N, L), channel
    d using group d // (dim // groups); D: (dim,); z: (batch, dim, L); delta_bias: (dim,).
    h_t = A_bar_t * h_{t-1} + Bu_bar_t (per channel and state), y_t = sum_n C_t h_t + D u_t,
    then y * silu(z). Returns y (batch, dim, L) and, if asked, the last state (batch, dim, N).
    """
    dim = u.shape[1]

    def per_channel(M):
        M = M.double()
        if M.dim() == 3:
            M = M[:, None]
        return M.repeat_interleave(dim // M.shape[1], dim=1)  # (batch, dim, N, L)

    B, C = per_channel(B), per_channel(C)
    A_bar, Bu_bar = discretize(delta, A, B, u, delta_bias, delta_softplus)
    h = linear_scan_ref(A_bar, Bu_bar)  # (batch, dim, N, L): the state at every step
    y = (h * C).sum(dim=2)
    if D is not None:
        y = y + D.double()[:, None] * u.double()
    if z is not None:
        y = y * F.silu(z.double())
    return (y, h[..., -1]) if return_last_state else y


def check_scan_gradients(name, forward, backward, a, b, h0, reverse, **launcher_args):
    """Notebook check of a first-order scan's backward launcher (chapters 1, 2 and 4).

    Runs ``forward(a, b, h0, reverse=reverse)`` then ``backward(a, h, h0, grad_h, reverse=reverse)`` with a random
    upstream gradient and compares (grad a, grad b, grad h0) with autograd through the float64
    loop; prints one line per gradient, raises on failure.
    """
    h = forward(a, b, h0, reverse=reverse, **launcher_args)
    # rounded to a's dtype, as the kernel receives it, so that both sides see the same values
    grad_h = torch.randn(a.shape, dtype=torch.float64, device=a.device).to(a.dtype).double()
    got = backward(a, h, h0, grad_h.to(a.dtype), reverse=reverse, **launcher_args)
    leaves = [x.double().requires_grad_() for x in (a, b, h0)]
    want = torch.autograd.grad(linear_scan_ref(*leaves, reverse=reverse), leaves, grad_h)
    for arg, g, w in zip(("a", "b", "h0"), got, want):
        check(f"{name}: grad {arg}", g, w, tolerance(a.dtype))
