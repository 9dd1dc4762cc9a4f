"""The public bidirectional SSM: input checks, and the op registered with torch.library (:mod:`..library`)."""
import math
from typing import Optional

import torch

from ..library import absent, contiguous, define_op, last_dim_contiguous, traced_or_captured
from ..ssd.api import INDEX_DTYPES, check_ssd_inputs
from ..ssd.gate import gate_backward
from ..triton_ops import cdiv
from ..validation import check_same, check_same_device, check_tensor, refuse_unless
from .backward import bidirectional_backward
from .forward import Saved, bidirectional_forward
from .reference import packed_seq_idx


def check_bidirectional_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit, seq_idx, cu_seqlens, dt_rev,
                               B_rev, C_rev):
    """Every argument of :func:`bidirectional_chunk_scan`; returns chunk_size as an int."""
    chunk_size = check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, None, seq_idx, None, dt_limit, False,
                                  None)
    batch, length, heads, _ = x.shape
    if dt_rev is not None:
        check_tensor("dt_rev", dt_rev, shape=(batch, length, heads))
        check_same_device("dt_rev", dt_rev, "x", x)
    for name, value in (("B_rev", B_rev), ("C_rev", C_rev)):
        if value is not None:
            check_tensor(name, value)
            check_same(name, value, "B", B)
    if cu_seqlens is not None:
        if seq_idx is not None:
            raise ValueError("give seq_idx or cu_seqlens, not both (each says where the packed sequences are)")
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        check_same_device("cu_seqlens", cu_seqlens, "x", x)
        if cu_seqlens.shape[0] == 0:
            raise ValueError("cu_seqlens must hold at least one offset (sequences + 1 of them); got none")
        if batch != 1:
            raise ValueError(f"cu_seqlens needs batch 1 (the packed sequences in one row); got batch {batch}")
        if not traced_or_captured():
            valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] <= length) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
            refuse_unless(valid, f"cu_seqlens must be nondecreasing offsets in [0, L = {length}] starting at 0")
    return chunk_size


def bidirectional_forward_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                             chunk_size: int, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                             dt_bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dt_softplus: bool,
                             dt_min: float, dt_max: float, shift: bool, dt_rev: Optional[torch.Tensor],
                             B_rev: Optional[torch.Tensor], C_rev: Optional[torch.Tensor]
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, y before the gate (absent without z), and what the backward pass reads (:class:`~.forward.Saved`:
    a, dt_out, b and dt_rev_out (absent without dt_rev: they are a and dt_out), G, Gd (absent with
    the shift), states_in)."""
    if x.numel() == 0:
        return forward_outputs(x, B, chunk_size, z, shift, dt_rev,
                               lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=x.device))
    out, y, saved = bidirectional_forward(
        x, dt, A.contiguous(), B, C, chunk_size, D=contiguous(D), z=z, dt_bias=contiguous(dt_bias), seq_idx=seq_idx,
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), shift=shift, dt_rev=dt_rev, B_rev=B_rev, C_rev=C_rev)
    shared_step = dt_rev is None
    return (out, y if y is not None else absent(x), saved.a, saved.dt_out,
            absent(x) if shared_step else saved.b, absent(x) if shared_step else saved.dt_rev_out,
            saved.G, saved.Gd if saved.Gd is not None else absent(x), saved.states_in)


def forward_outputs(x, B, chunk_size, z, shift, dt_rev, make):
    """The nine outputs of :func:`bidirectional_forward_op`, each made by ``make(shape, dtype)``."""
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks = cdiv(length, chunk_size)
    chunk_shape = (batch, heads, n_chunks, chunk_size)
    step_rev = (lambda: absent(x)) if dt_rev is None else (lambda: make(chunk_shape, torch.float32))
    state_shape = (2, batch, n_chunks, heads, headdim, dstate)
    return (make(x.shape, x.dtype), make(x.shape, x.dtype) if z is not None else absent(x),
            make(chunk_shape, torch.float32), make(chunk_shape, torch.float32), step_rev(), step_rev(),
            make((batch, n_chunks, groups, chunk_size, chunk_size), torch.float32),
            absent(x) if shift else make((batch, n_chunks, groups, chunk_size), torch.float32),
            make(state_shape, x.dtype))


def fake_bidirectional_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_min, dt_max,
                               shift, dt_rev, B_rev, C_rev):
    return forward_outputs(x, B, chunk_size, z, shift, dt_rev, lambda shape, dtype: x.new_empty(shape, dtype=dtype))


INPUT_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_rev", "B_rev", "C_rev")


def bidirectional_backward_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, chunk_size: int, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                              dt_bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dt_softplus: bool,
                              dt_min: float, dt_max: float, shift: bool, dt_rev: Optional[torch.Tensor],
                              B_rev: Optional[torch.Tensor], C_rev: Optional[torch.Tensor], y: Optional[torch.Tensor],
                              a: torch.Tensor, dt_out: torch.Tensor, b: torch.Tensor, dt_rev_out: torch.Tensor,
                              G: torch.Tensor, Gd: torch.Tensor, states_in: torch.Tensor, d_out: torch.Tensor
                              ) -> list[torch.Tensor]:
    """The gradients of x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev, each in its input's
    shape and dtype, contiguous (absent for an input that is None). y is the output before the gate."""
    inputs = (x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev)
    if x.numel() == 0:
        return [torch.zeros_like(t, memory_format=torch.contiguous_format) if t is not None else absent(x)
                for t in inputs]
    dy, dz, dD = gate_backward(d_out, y, z, x, D) if z is not None else (d_out, None, None)
    shared_step = dt_rev is None
    saved = Saved(a, dt_out, a if shared_step else b, dt_out if shared_step else dt_rev_out, G,
                  None if shift else Gd, states_in)
    grads = bidirectional_backward(dy, x, dt, A.contiguous(), B, C, saved, D=contiguous(D),
                                   dt_bias=contiguous(dt_bias), seq_idx=seq_idx, dt_softplus=dt_softplus,
                                   dt_limit=(dt_min, dt_max), shift=shift, dt_rev=dt_rev, B_rev=B_rev, C_rev=C_rev,
                                   sum_D=z is None)
    grads["z"] = dz
    if z is not None:
        grads["D"] = dD
    return [grads[name] if t is not None else absent(x) for name, t in zip(INPUT_NAMES, inputs)]


def fake_bidirectional_backward(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_min, dt_max,
                                shift, dt_rev, B_rev, C_rev, y, a, dt_out, b, dt_rev_out, G, Gd, states_in, d_out):
    inputs = (x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev)
    return [t.new_empty(t.shape) if t is not None else absent(x) for t in inputs]


def save_bidirectional(ctx, inputs, output):  # "output": torch.library passes it by that name
    (x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_min, dt_max, shift, dt_rev, B_rev,
     C_rev) = inputs
    _, y, *saved = output
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, seq_idx, dt_rev, B_rev, C_rev,
                          y if z is not None else None, *saved)
    ctx.options = (chunk_size, dt_softplus, dt_min, dt_max, shift)
    ctx.mark_non_differentiable(y, *saved)


def bidirectional_grads(ctx, run_backward, d_out, *_):
    x, dt, A, B, C, D, z, dt_bias, seq_idx, dt_rev, B_rev, C_rev, y, *saved = ctx.saved_tensors
    chunk_size, dt_softplus, dt_min, dt_max, shift = ctx.options
    if d_out is None:
        d_out = torch.zeros_like(x)
    grads = run_backward(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_min, dt_max, shift,
                         dt_rev, B_rev, C_rev, y, *saved, d_out)
    dx, d_dt, dA, dB, dC, dD, dz, d_bias, d_dt_rev, dB_rev, dC_rev = (
        g if t is not None else None for g, t in zip(grads, (x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev)))
    return (dx, d_dt, dA, dB, dC, None, dD, dz, d_bias, None, None, None, None, None, d_dt_rev, dB_rev, dC_rev)


bidirectional_chunk_scan_op = define_op("bidirectional_chunk_scan", bidirectional_forward_op,
                                        fake_bidirectional_forward, bidirectional_backward_op,
                                        fake_bidirectional_backward, save_bidirectional, bidirectional_grads)


def bidirectional_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, *,
                             dt_limit=(0.0, math.inf), seq_idx=None, cu_seqlens=None, shift=False, dt_rev=None,
                             B_rev=None, C_rev=None):
    """A bidirectional (non-causal) Mamba-2 SSM by one fused chunked pipeline (chapter 6): the
    sequence mixed by the quasiseparable matrix M = forward SSD + reverse SSD + diag(D).

    ``shift=False`` is Bi-Mamba2's ``bimamba_chunk_scan_combined``:
        y = SS(x, dt, A, B, C) + rev(SS(rev x, rev dt_rev, A, rev B_rev, rev C_rev)) + D x
    (the diagonal counted in both halves); ``shift=True`` is Hydra's module: each direction's
    output shifted by one step before the reversal back (zero at each sequence start), so each
    direction sees strictly the past or the future and M's diagonal is D alone. SS is chapter 5's
    causal SSD without D and z, rev the reversal of time within each packed sequence;
    out = y * silu(z) when z is given.

    x (batch, L, heads, headdim) float32/float16/bfloat16, headdim <= 128; dt (batch, L, heads) any
    float dtype; A (heads,); B, C (batch, L, groups, dstate) in x's dtype; chunk_size an integer,
    one of 16, 32, 64, 128, 256 (L need not be a multiple); D (heads,) or (heads, headdim); z like
    x; dt_bias (heads,); dt_softplus; dt_limit (min, max): both steps softplus(dt + dt_bias) are
    always clamped to it (as ``ssd_chunk_scan``); dt_rev, B_rev, C_rev: the reverse direction's own
    step, B and C (Hydra), each None to share the forward one (Bi-Mamba2). Packed sequences: seq_idx
    (batch, L) int32/int64, nondecreasing (ids compared for equality only: a negative id is a
    sequence like any other), or cu_seqlens (sequences + 1,) offsets from 0 with batch 1 (not
    both): no state crosses a boundary in either direction, and each sequence is reversed within
    itself. Any tensor may be a view (split, transposed, expanded); all on x's device. The values
    inside seq_idx and cu_seqlens are checked on the device without synchronising, as in
    ``ssd_chunk_scan``.

    Returns out like x. Differentiable in x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev and C_rev;
    the gradients are the same bits on every run (no atomic adds); once only.
    """
    chunk_size = check_bidirectional_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit, seq_idx, cu_seqlens,
                                            dt_rev, B_rev, C_rev)
    seq_idx = packed_seq_idx(seq_idx, cu_seqlens, x.shape[1])
    B, C, B_rev, C_rev = (last_dim_contiguous(t) for t in (B, C, B_rev, C_rev))  # why: ssd_chunk_scan
    out, *_ = bidirectional_chunk_scan_op(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, bool(dt_softplus),
                                          float(dt_limit[0]), float(dt_limit[1]), bool(shift), dt_rev, B_rev, C_rev)
    return out
