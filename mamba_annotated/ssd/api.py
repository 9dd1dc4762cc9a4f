"""The public SSD function: input checks, the autograd Function, and ``ssd_chunk_scan``."""
import math

import torch

from ..validation import check_same, check_tensor
from .backward import ssd_backward
from .forward import Saved, ssd_forward

CHUNK_SIZES = (16, 32, 64, 128, 256)
MAX_HEADDIM = 128  # the backward kernels hold a whole row of headdim in registers


def check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit):
    check_tensor("x", x, ndim=4)
    batch, length, heads, headdim = x.shape
    if length == 0:
        raise ValueError(f"x must have at least one time step (dimension 1); got shape {tuple(x.shape)}")
    if headdim > MAX_HEADDIM:
        raise NotImplementedError(f"x: headdim {headdim} > {MAX_HEADDIM} is not supported")
    check_tensor("dt", dt, shape=(batch, length, heads))
    check_tensor("A", A, shape=(heads,))
    check_tensor("B", B, ndim=4)
    groups, dstate = B.shape[2], B.shape[3]
    if B.shape[:2] != x.shape[:2] or groups == 0 or heads % groups != 0:
        raise ValueError(f"B must have shape (batch, L, groups, dstate) = ({batch}, {length}, groups, dstate) "
                         f"with groups dividing heads = {heads}; got {tuple(B.shape)}")
    if B.dtype != x.dtype:
        raise TypeError(f"B must have the dtype of x ({x.dtype}); got {B.dtype}")
    check_tensor("C", C)
    check_same("C", C, "B", B)
    if not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}; got {chunk_size!r}")
    if D is not None:
        check_tensor("D", D)
        if tuple(D.shape) not in ((heads,), (heads, headdim)):
            raise ValueError(f"D must have shape ({heads},) or ({heads}, {headdim}); got {tuple(D.shape)}")
    if z is not None:
        check_tensor("z", z)
        check_same("z", z, "x", x)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, shape=(heads,))
    if initial_states is not None:
        check_tensor("initial_states", initial_states, shape=(batch, heads, headdim, dstate))
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, dtypes=(torch.int32, torch.int64), shape=(batch, length))
        if length > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be nondecreasing along L (each packed sequence one run)")
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not float(dt_limit[0]) < float(dt_limit[1])):
        raise ValueError(f"dt_limit must be a pair (min, max) with min < max; got {dt_limit!r}")


class SSDChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                chunk_size, dt_softplus, dt_limit, return_final_states):
        x, B, C, A = x.contiguous(), B.contiguous(), C.contiguous(), A.contiguous()
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None
        z = z.contiguous() if z is not None else None
        D = D.contiguous() if D is not None else None
        initial_states = initial_states.contiguous() if initial_states is not None else None
        seq_idx = seq_idx.contiguous() if seq_idx is not None else None
        result = ssd_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit,
                             initial_states, seq_idx)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, result.y,
                              *result.saved.tensors())
        ctx.options = (dt_softplus, dt_limit)
        if return_final_states:
            return result.out, result.final_states
        return result.out

    @staticmethod
    def backward(ctx, d_out, d_final=None):
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, y, *saved = ctx.saved_tensors
        dt_softplus, dt_limit = ctx.options
        d_out = d_out.contiguous()
        d_z = None
        if z is not None:
            # out = y * silu(z): dy = d_out * silu(z), dz = d_out * y * silu'(z)
            zf, gate = z.float(), torch.sigmoid(z.float())
            dy = (d_out.float() * zf * gate).to(x.dtype)
            d_z = (d_out.float() * y.float() * gate * (1 + zf * (1 - gate))).to(z.dtype)
        else:
            dy = d_out
        d_final = d_final.contiguous() if d_final is not None else None
        grads = ssd_backward(dy, d_final, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                             initial_states, seq_idx, Saved(*saved))
        return (grads["x"], grads["dt"], grads["A"], grads["B"], grads["C"], grads["D"], d_z,
                grads["dt_bias"], grads["initial_states"], None, None, None, None, None)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf), return_final_states=False):
    """Mamba-2's SSM by the chunked state-space-duality algorithm (chapter 5). Differentiable.

    Arguments and shapes as mamba_ssm's ``mamba_chunk_scan_combined``:
    x (batch, L, heads, headdim) float32/float16/bfloat16; dt (batch, L, heads); A (heads,);
    B, C (batch, L, groups, dstate) in x's dtype (heads of a group share them); chunk_size one of
    16, 32, 64, 128, 256 (L need not be a multiple); D (heads,) or (heads, headdim); z like x;
    dt_bias (heads,); dt_softplus; dt_limit (min, max) clamps the step; initial_states
    (batch, heads, headdim, dstate); seq_idx (batch, L) int32, nondecreasing: packed sequences,
    no state crosses a boundary (initial_states feeds the sequence of position 0).

    Returns y like x, and with ``return_final_states`` also the state after the last position,
    (batch, heads, headdim, dstate) float32.
    """
    check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
    return SSDChunkScan.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                              chunk_size, bool(dt_softplus), dt_limit, bool(return_final_states))
