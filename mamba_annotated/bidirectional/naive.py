"""The naive bidirectional SSM, chapter 6's foil and the benchmark's naive peer: chapter 5's causal
SSD called twice, once on the sequence and once on its reverse, glued by reversals in PyTorch.

Each reversal and the sum are a full pass over memory, and the two calls cannot share their
reads of x; the fused pipeline (``bidirectional_chunk_scan``) removes both.
"""
import math

import torch.nn.functional as F

from ..ssd import ssd_chunk_scan
from .reference import packed_seq_idx, reverse_within_sequences, shift_within_sequences


def bidirectional_two_calls(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, *,
                            dt_limit=(0.0, math.inf), seq_idx=None, cu_seqlens=None, shift=False, dt_rev=None,
                            B_rev=None, C_rev=None):
    """y = SS(x) + rev(SS'(rev x)) + D x (shift=False), or with each direction's output shifted by
    one step before the reversal back (shift=True); out = y * silu(z). The arguments and result
    of ``bidirectional_chunk_scan``: out like x. Differentiable through autograd."""
    seq_idx = packed_seq_idx(seq_idx, cu_seqlens, x.shape[1])

    def rev(t):
        return reverse_within_sequences(t, seq_idx)

    dt_rev, B_rev, C_rev = (dt if dt_rev is None else dt_rev, B if B_rev is None else B_rev,
                            C if C_rev is None else C_rev)
    options = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx)
    forward = ssd_chunk_scan(x, dt, A, B, C, chunk_size, **options)
    backward = ssd_chunk_scan(rev(x), rev(dt_rev), A, rev(B_rev), rev(C_rev), chunk_size, **options)
    if shift:
        forward, backward = (shift_within_sequences(y, seq_idx) for y in (forward, backward))
    y = forward.float() + rev(backward).float()           # one rounding to x's dtype, at the end
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
