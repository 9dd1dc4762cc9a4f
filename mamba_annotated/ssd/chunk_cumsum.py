"""Chapter 5, kernel 1: the step sizes and the cumulative log-decay inside each chunk.

Algorithm
    dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max)   (each part optional, as in mamba_ssm)
    a_t = sum_{k <= t, k in the chunk} dt'_k * A_h          (tl.cumsum along the chunk)
    Positions past the end of the sequence get dt' = 0, so a stays flat there and a chunk's last
    slot always holds the decay of the whole chunk.
    The backward twin (:func:`dt_backward`) turns d a_t into d dt'_k = A_h * sum_{t >= k} d a_t
    (a reverse cumulative sum, done in registers), adds the direct d dt', and pulls it back through
    the clamp, the softplus and the bias.

Shapes: dt (batch, L, heads) any float dtype; A, dt_bias (heads,). Outputs dA_cumsum and dt_out,
both (batch, heads, chunks, Q) float32. One program owns (batch, chunk, BLOCK_H heads).

Bytes moved: reads batch*L*heads dt elements, writes 2 float32 values per element; negligible
next to x, B, C (headdim and dstate times larger).
"""
import math

import torch
import triton
import triton.language as tl

from .. import outputs

BLOCK_H = 8


@triton.jit
def _process_dt(dt, bias, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, dt_min, dt_max):
    """dt + bias, softplus'ed, clamped. Returns the step and its derivative d step / d dt."""
    v = dt + bias
    slope = tl.full(v.shape, 1.0, tl.float32)
    if DT_SOFTPLUS:
        # softplus(v) = log(1 + e^v); past 20 it equals v in float32 (the threshold torch uses)
        e = tl.exp(tl.minimum(v, 20.0))
        slope = tl.where(v > 20.0, 1.0, e / (1.0 + e))
        v = tl.where(v > 20.0, v, tl.log(1.0 + e))
    if HAS_LIMIT:
        inside = (v >= dt_min) & (v <= dt_max)
        slope = tl.where(inside, slope, 0.0)
        v = tl.minimum(tl.maximum(v, dt_min), dt_max)
    return v, slope


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def chunk_cumsum_kernel(dt_ptr, A_ptr, bias_ptr, dA_cumsum_ptr, dt_out_ptr,
                        length, heads, n_chunks, stride_dt_b, stride_dt_l, stride_dt_h,
                        dt_min, dt_max,
                        HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask = (h[:, None] < heads) & (t[None, :] < length)
    dt = tl.load(dt_ptr + pid_b.to(tl.int64) * stride_dt_b + t[None, :].to(tl.int64) * stride_dt_l
                 + h[:, None] * stride_dt_h, mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    dt, _ = _process_dt(dt, bias[:, None], DT_SOFTPLUS, HAS_LIMIT, dt_min, dt_max)
    dt = tl.where(mask, dt, 0.0)
    A = tl.load(A_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    dA_cumsum = tl.cumsum(dt * A[:, None], axis=1)
    out = ((pid_b * heads + h[:, None]).to(tl.int64) * n_chunks + pid_c) * CHUNK + tl.arange(0, CHUNK)[None, :]
    h_mask = h[:, None] < heads
    tl.store(dA_cumsum_ptr + out, dA_cumsum, mask=h_mask)
    tl.store(dt_out_ptr + out, dt, mask=h_mask)


@triton.jit
def dt_backward_kernel(dt_ptr, A_ptr, bias_ptr, dt_out_ptr, ddA_ptr, ddt_ptr,
                       grad_dt_ptr, grad_A_part_ptr, grad_bias_part_ptr,
                       length, heads, n_chunks, stride_dt_b, stride_dt_l, stride_dt_h,
                       dt_min, dt_max,
                       HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       DDA_IS_CUMULATIVE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """ddA holds d a_t (or, with DDA_IS_CUMULATIVE, its reverse cumulative sum already);
    ddt holds the direct d dt'. Writes d dt (raw), and per-program partial sums of dA and d bias."""
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask = (h[:, None] < heads) & (t[None, :] < length)
    buf = ((pid_b * heads + h[:, None]).to(tl.int64) * n_chunks + pid_c) * CHUNK + tl.arange(0, CHUNK)[None, :]
    # padded slots past L are read too: the chunk's last slot carries d a_last (from the state passing)
    d_a = tl.load(ddA_ptr + buf, mask=h[:, None] < heads, other=0.0)
    if DDA_IS_CUMULATIVE:
        d_dA = d_a
    else:
        d_dA = tl.associative_scan(d_a, 1, _add, reverse=True)  # d(dt'_k A) = sum_{t >= k} d a_t
    A = tl.load(A_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    step = tl.load(dt_out_ptr + buf, mask=mask, other=0.0)
    d_step = tl.load(ddt_ptr + buf, mask=mask, other=0.0) + d_dA * A[:, None]
    dt_offs = pid_b.to(tl.int64) * stride_dt_b + t[None, :].to(tl.int64) * stride_dt_l + h[:, None] * stride_dt_h
    dt = tl.load(dt_ptr + dt_offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    _, slope = _process_dt(dt, bias[:, None], DT_SOFTPLUS, HAS_LIMIT, dt_min, dt_max)
    d_dt = tl.where(mask, d_step * slope, 0.0)
    tl.store(grad_dt_ptr + dt_offs, d_dt.to(grad_dt_ptr.dtype.element_ty), mask=mask)
    part = (pid_b * n_chunks + pid_c).to(tl.int64) * heads + h
    tl.store(grad_A_part_ptr + part, tl.sum(d_dA * step, axis=1), mask=h < heads)
    if HAS_BIAS:
        tl.store(grad_bias_part_ptr + part, tl.sum(d_dt, axis=1), mask=h < heads)


def _limits(dt_limit):
    has_limit = tuple(dt_limit) != (0.0, math.inf)
    return has_limit, float(dt_limit[0]), float(min(dt_limit[1], 3.0e38))


def chunk_cumsum(dt, A, dt_bias, dt_softplus, dt_limit, chunk_size):
    """dt (batch, L, heads) -> (dA_cumsum, dt_out), both (batch, heads, chunks, chunk_size) float32."""
    batch, length, heads = dt.shape
    n_chunks = triton.cdiv(length, chunk_size)
    dA_cumsum = outputs.empty((batch, heads, n_chunks, chunk_size), torch.float32, dt.device)
    dt_out = outputs.empty((batch, heads, n_chunks, chunk_size), torch.float32, dt.device)
    has_limit, dt_min, dt_max = _limits(dt_limit)
    grid = (batch, n_chunks, triton.cdiv(heads, BLOCK_H))
    chunk_cumsum_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, dA_cumsum, dt_out,
        length, heads, n_chunks, *dt.stride(), dt_min, dt_max,
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return dA_cumsum, dt_out


def dt_backward(dt, A, dt_bias, dt_softplus, dt_limit, dt_out, d_a, d_step, reverse_cumsum="kernel"):
    """Gradients (d dt, dA, d dt_bias) from d a_t and the direct d dt' (both like dt_out).

    ``reverse_cumsum="flip"`` does the reverse cumulative sum in PyTorch (flip, cumsum, flip)
    instead of in the kernel's registers: chapter 5 times the two.
    """
    batch, length, heads = dt.shape
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    if reverse_cumsum == "flip":
        d_a = torch.flip(torch.cumsum(torch.flip(d_a, dims=[-1]), dim=-1), dims=[-1])
    grad_dt = outputs.empty(dt.shape, dt.dtype, dt.device)
    grad_A_part = outputs.empty((batch, n_chunks, heads), torch.float32, dt.device)
    grad_bias_part = outputs.empty((batch, n_chunks, heads), torch.float32, dt.device) if dt_bias is not None else None
    has_limit, dt_min, dt_max = _limits(dt_limit)
    grid = (batch, n_chunks, triton.cdiv(heads, BLOCK_H))
    dt_backward_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, d_a, d_step,
        grad_dt, grad_A_part, grad_bias_part if dt_bias is not None else grad_A_part,
        length, heads, n_chunks, *dt.stride(), dt_min, dt_max,
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        DDA_IS_CUMULATIVE=reverse_cumsum == "flip", CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
    )
    grad_A = grad_A_part.sum(dim=(0, 1))
    grad_bias = grad_bias_part.sum(dim=(0, 1)) if dt_bias is not None else None
    return grad_dt, grad_A, grad_bias
