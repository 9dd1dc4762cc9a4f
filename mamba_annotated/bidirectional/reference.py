"""Float64 references for bidirectional (non-causal) SSMs: the ground truth of chapter 6.

A causal SSD head multiplies x by a lower-triangular semiseparable matrix (chapter 5's
:func:`~mamba_annotated.ssd.reference.ssd_matrix`). A bidirectional one adds a second SSD run
backwards in time with its own step, B and C, and a diagonal D: its matrix is *quasiseparable*,

    M = L_fwd + U_bwd + diag(D),

where L_fwd is lower and U_bwd upper triangular, and every block strictly below (or above) the
diagonal has rank <= dstate. With the backward direction's step dt', B', C' and
a_t = A sum_{k <= t} dt_k,

    L_fwd[t, s] = (C_t . B_s)   exp(a_t - a_s) dt_s                       for s <= t,
    U_bwd[t, s] = (C'_t . B'_s) exp(A sum_{t <= k < s} dt'_k) dt'_s       for s >= t,

which is SS(rev x) reversed back: rev reverses time within each packed sequence. So the two
models that use it are

    shift=False (Bi-Mamba2): y = SS(x) + rev(SS'(rev x)) + D x        (the diagonal counted twice),
    shift=True  (Hydra):     y = shift(SS(x)) + rev(shift(SS'(rev x))) + D x,

where shift(y)_t = y_{t-1} (zero at a sequence start), so with shift=True each direction sees
strictly the past (or the future) and the diagonal of M is D alone. The output is y * silu(z)
when z is given. Packed sequences (``seq_idx``, or ``cu_seqlens`` from which it follows) make M
block diagonal: no state crosses a boundary in either direction.

Shapes as chapter 5: x (batch, L, heads, headdim), dt (batch, L, heads), A (heads,),
B, C (batch, L, groups, dstate), D (heads,) or (heads, headdim), z like x, dt_bias (heads,),
seq_idx (batch, L) nondecreasing integers, cu_seqlens (sequences + 1,) with batch 1.
"""
import math

import torch
import torch.nn.functional as F

from ..ssd.reference import process_dt, ssd_matrix


def packed_seq_idx(seq_idx, cu_seqlens, length):
    """The sequence id of every position, (batch, L), or None for one sequence per row: seq_idx if
    given, else the ids that cu_seqlens (sequences + 1 offsets, batch 1) implies. Positions past
    the last offset form one more sequence."""
    if seq_idx is not None or cu_seqlens is None:
        return seq_idx
    positions = torch.arange(length, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    # searchsorted wants contiguous boundaries: given a strided view of offsets (a column of a
    # per-batch record) it would make the same copy itself, with a warning
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)[None]


def along(index, t, dim):
    """A (batch, L) tensor viewed to broadcast against t, whose batch is dim 0 and time is ``dim``."""
    shape = [1] * t.dim()
    shape[0], shape[dim] = index.shape
    return index.reshape(shape)


def reverse_within_sequences(t, seq_idx, dim=1):
    """rev(t): time reversed within each packed sequence; position i of the sequence [s, e) goes
    to s + e - 1 - i. Without seq_idx this is ``t.flip(dim)``. t's batch is dim 0."""
    if seq_idx is None:
        return t.flip(dim)
    # seq_idx is sorted along L: the first and one-past-last positions of each id by binary search
    first = torch.searchsorted(seq_idx, seq_idx)
    end = torch.searchsorted(seq_idx, seq_idx, right=True)
    source = first + end - 1 - torch.arange(seq_idx.shape[1], device=seq_idx.device)
    return torch.gather(t, dim, along(source, t, dim).expand(t.shape))


def shift_within_sequences(t, seq_idx, dim=1):
    """shift(t)_i = t_{i-1} along ``dim``, zero at the start of each packed sequence (position 0
    included). t's batch is dim 0."""
    length = t.shape[dim]
    starts = torch.zeros(t.shape[0], length, dtype=torch.bool, device=t.device)
    starts[:, :1] = True
    if seq_idx is not None:
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return torch.where(along(starts, t, dim), 0.0, t.roll(1, dims=dim))


def quasiseparable_matrix(dt, A, B, C, seq_idx=None, *, shift=False, dt_rev=None, B_rev=None, C_rev=None, D=None):
    """M of every head, (batch, heads, L, L): y = M x, L_fwd + U_bwd + diag(D) (see the module).

    ``dt`` and ``dt_rev`` are processed steps (:func:`~mamba_annotated.ssd.reference.process_dt`);
    dt_rev, B_rev, C_rev default to dt, B, C. D (heads,) sits on the diagonal; D (heads, headdim)
    gives one matrix per channel, (batch, heads, headdim, L, L). Float64, differentiable.
    """
    dt_rev, B_rev, C_rev = (dt if dt_rev is None else dt_rev, B if B_rev is None else B_rev,
                            C if C_rev is None else C_rev)

    def rev(t, dim=1):
        return reverse_within_sequences(t, seq_idx, dim)

    forward = ssd_matrix(dt, A, B, C, seq_idx)
    # the backward direction is the causal matrix of the reversed sequence, its rows and columns
    # reversed back (reversal keeps every position in its sequence, so seq_idx is unchanged)
    backward = ssd_matrix(rev(dt_rev), A, rev(B_rev), rev(C_rev), seq_idx)
    if shift:  # row t takes row t - 1: the output shifted by one step
        forward, backward = (shift_within_sequences(m, seq_idx, dim=2) for m in (forward, backward))
    M = forward + rev(rev(backward, dim=2), dim=3)
    if D is None:
        return M
    eye = torch.eye(M.shape[-1], dtype=torch.float64, device=M.device)
    D = D.double()
    if D.dim() == 1:
        return M + D[:, None, None] * eye
    return M[:, :, None] + D[:, :, None, None] * eye


def bidirectional_ref(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *,
                      dt_limit=(0.0, math.inf), seq_idx=None, cu_seqlens=None, shift=False, dt_rev=None,
                      B_rev=None, C_rev=None):
    """The bidirectional SSM by its matrix (the quadratic form), float64:

        out = (M x) * silu(z),   M = quasiseparable_matrix(...)   (see the module for M).

    Both steps are processed alike: dt (+ dt_bias), softplus'ed if ``dt_softplus``, always
    clamped to ``dt_limit``; dt_rev, B_rev, C_rev default to dt, B, C. ``shift=False`` is
    Bi-Mamba2's ``bimamba_chunk_scan_combined``, ``shift=True`` Hydra's module. Returns
    (batch, L, heads, headdim) float64; differentiable in every float input.
    """
    seq_idx = packed_seq_idx(seq_idx, cu_seqlens, x.shape[1])
    step, step_rev = (process_dt(t, dt_bias, dt_softplus, dt_limit) for t in (dt, dt if dt_rev is None else dt_rev))
    M = quasiseparable_matrix(step, A, B, C, seq_idx, shift=shift, dt_rev=step_rev, B_rev=B_rev, C_rev=C_rev, D=D)
    if M.dim() == 4:
        y = torch.einsum("bhts,bshp->bthp", M, x.double())
    else:
        y = torch.einsum("bhpts,bshp->bthp", M, x.double())
    return y if z is None else y * F.silu(z.double())
