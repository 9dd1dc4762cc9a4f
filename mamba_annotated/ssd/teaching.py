"""Chapter 5's foil: the cumulative sums of d(dt'_k A) done in PyTorch, the way they first suggest
themselves. Teaching only: the production path (:func:`.chunk_cumsum.dt_backward`) does the sums
in the registers of the kernel that already holds the chunk, and carries no option for this one.

    sum_{r >= k} (state terms from the start) = flip(cumsum(flip(...)))
    sum_{r < k}  (state terms to the end)     = cumsum of the terms shifted one position on

cost a few launches and temporaries the size of dt each, besides adding up the slots apart. The
kernel below then takes d(dt' A) from memory and finishes exactly as the production kernel does
(the same :func:`.chunk_cumsum.step_gradients`).
"""
import math

import torch
import triton
import triton.language as tl

from ..triton_ops import cdiv
from .backward import chunk_gradients, step_gradients_by_name
from .chunk_cumsum import BLOCK_H, step_gradient_buffers, step_gradients


def reverse_cumsum_by_flip(d_a):
    """sum_{t >= k} d a_t along the last dimension, by flipping twice around a cumsum."""
    return torch.flip(torch.cumsum(torch.flip(d_a, dims=[-1]), dim=-1), dims=[-1])


def spanned_tile_sums(pairs):
    """For k in row block b, the sums of the tiles (i, j) with j < b < i (tile (i, j)'s sum is its
    slot j at the first position of block i): (batch, heads, chunks, Q)."""
    tiles, chunk_size = pairs.shape[3], pairs.shape[4]
    rows = chunk_size // tiles
    tile_sums = pairs[..., ::rows]                                    # (..., j, i)
    block = torch.arange(tiles, device=pairs.device)
    spans = (block[:, None, None] < block[None, None, :]) & (block[None, None, :] < block[None, :, None])
    per_block = torch.einsum("...ji,jib->...b", tile_sums, spans.to(pairs.dtype))  # spans[j, i, b]: j < b < i
    return per_block.repeat_interleave(rows, dim=-1)


def step_gradient_in_torch(decay):
    """d(dt'_k A) from the slots of :class:`.chunk_scan_bwd.DecayGradients`, in PyTorch."""
    to_end = decay.to_end.sum(dim=3)
    before_k = torch.cumsum(torch.nn.functional.pad(to_end[..., :-1], (1, 0)), dim=-1)
    return (decay.pairs.sum(dim=3) + spanned_tile_sums(decay.pairs)
            + reverse_cumsum_by_flip(decay.from_start.sum(dim=3)) + before_k + decay.carry.sum(dim=3)[..., None])


@triton.jit
def dt_backward_from_cumulative_kernel(dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, d_dA_ptr,
                                       grad_dt_ptr, grad_A_part_ptr, grad_bias_part_ptr,
                                       length, heads, n_chunks, stride_dt_b, stride_dt_l, stride_dt_h,
                                       stride_grad_b, stride_grad_l, stride_grad_h, dt_min, dt_max,
                                       HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                                       CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    buf = ((pid_b * heads + h[:, None]).to(tl.int64) * n_chunks + pid_c) * CHUNK + tl.arange(0, CHUNK)[None, :]
    d_dA = tl.load(d_dA_ptr + buf, mask=h[:, None] < heads, other=0.0)
    step_gradients(d_dA, dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, grad_dt_ptr, grad_A_part_ptr,
                   grad_bias_part_ptr, pid_b, pid_c, h, length, heads, n_chunks,
                   stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                   dt_min, dt_max, HAS_BIAS, DT_SOFTPLUS, CHUNK, BLOCK_H)


def dt_backward_flip(dt, A, dt_out, decay, *, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """:func:`.chunk_cumsum.dt_backward` with the slots added and summed in PyTorch."""
    batch, length, heads = dt.shape
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    d_dA = step_gradient_in_torch(decay)
    grad_dt, grad_A_part, grad_bias_part = step_gradient_buffers(dt, dt_bias, n_chunks)
    dt_backward_from_cumulative_kernel[(batch, n_chunks, cdiv(heads, BLOCK_H))](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, decay.direct, d_dA,
        grad_dt, grad_A_part, grad_bias_part if dt_bias is not None else grad_A_part,
        length, heads, n_chunks, *dt.stride(), *grad_dt.stride(), float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
    )
    grad_A = grad_A_part.sum(dim=(0, 1))
    grad_bias = grad_bias_part.sum(dim=(0, 1)) if dt_bias is not None else None
    return grad_dt, grad_A, grad_bias


def ssd_backward_flip(dy, x, dt, A, B, C, saved, *, D=None, dt_bias=None, initial_states=None, seq_idx=None,
                      d_final=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """:func:`.backward.ssd_backward` with :func:`dt_backward_flip` as its last step."""
    grads, decay = chunk_gradients(dy, x, B, C, saved, D=D, initial_states=initial_states, seq_idx=seq_idx,
                                   d_final=d_final)
    step = dt_backward_flip(dt, A, saved.dt_out, decay, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    return {**grads, **step_gradients_by_name(*step, A, dt_bias)}
