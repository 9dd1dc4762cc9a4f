"""Chapter 1: the linear recurrence walked one time step after another.

Algorithm
    Forward:  h_t = a_t * h_{t-1} + b_t,  h_{-1} = h0 (or 0); ``REVERSE`` walks t = L-1 .. 0 and
              uses h_{t+1} instead.
    Backward: with g_t = dLoss/dh_t, the adjoint lam_t = g_t + a_{t+1} * lam_{t+1} is the same
              recurrence run the other way with the decays shifted by one step; then
              db_t = lam_t, da_t = lam_t * h_{t-1}, dh0 = a_0 * lam_0.

Parallelism: one program owns BLOCK_C channels (rows) and loops over all L steps, carrying h in
registers. There is no parallelism along time at all: that is the cost this chapter measures.

Shapes: a, b, h (channels, L) contiguous, the caller flattens leading dimensions; h0 (channels,).
Each step loads a column of BLOCK_C elements at stride L, so consecutive steps of one row share a
32-byte sector and are served from cache; loads do not depend on the carried state, so the
compiler can pipeline them ahead of the multiply-add chain.

Bytes moved (element size s): forward reads a, b and writes h: 3*C*L*s. Backward reads a, h, dh
and writes da, db: 5*C*L*s. Accumulation is float32 whatever the input dtype.
"""
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import cdiv

BLOCK_C = 32   # one warp of channels per program: small blocks give more programs to fill the SMs
NUM_WARPS = 1


@lean_launch
@triton.jit
def sequential_scan_fwd_kernel(a_ptr, b_ptr, h0_ptr, h_ptr, channels, length,
                               HAS_H0: tl.constexpr, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < channels
    row_start = rows.to(tl.int64) * length  # 64-bit: channels * length may pass 2^31
    if HAS_H0:
        h = tl.load(h0_ptr + rows, mask=row_mask).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(length):
        if REVERSE:
            t = length - 1 - i
        else:
            t = i
        a = tl.load(a_ptr + row_start + t, mask=row_mask).to(tl.float32)
        b = tl.load(b_ptr + row_start + t, mask=row_mask).to(tl.float32)
        h = a * h + b
        tl.store(h_ptr + row_start + t, h.to(h_ptr.dtype.element_ty), mask=row_mask)


@lean_launch
@triton.jit
def sequential_scan_bwd_kernel(a_ptr, h_ptr, h0_ptr, grad_h_ptr, grad_a_ptr, grad_b_ptr, grad_h0_ptr,
                               channels, length,
                               HAS_H0: tl.constexpr, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < channels
    row_start = rows.to(tl.int64) * length
    if HAS_H0:
        h0 = tl.load(h0_ptr + rows, mask=row_mask).to(tl.float32)
    else:
        h0 = tl.zeros([BLOCK_C], dtype=tl.float32)
    lam = tl.zeros([BLOCK_C], dtype=tl.float32)
    a_next = tl.zeros([BLOCK_C], dtype=tl.float32)  # a_{t+1}: zero past the last step
    for i in range(length):
        # walk opposite to the forward pass; "previous" is the step the forward pass took before t
        if REVERSE:
            t = i
            has_prev = t + 1 < length
            prev = tl.minimum(t + 1, length - 1)  # clamped in bounds; replaced by h0 when unused
        else:
            t = length - 1 - i
            has_prev = t > 0
            prev = tl.maximum(t - 1, 0)
        lam = tl.load(grad_h_ptr + row_start + t, mask=row_mask).to(tl.float32) + a_next * lam
        h_prev = tl.load(h_ptr + row_start + prev, mask=row_mask).to(tl.float32)
        h_prev = tl.where(has_prev, h_prev, h0)
        tl.store(grad_b_ptr + row_start + t, lam.to(grad_b_ptr.dtype.element_ty), mask=row_mask)
        tl.store(grad_a_ptr + row_start + t, (lam * h_prev).to(grad_a_ptr.dtype.element_ty), mask=row_mask)
        a_next = tl.load(a_ptr + row_start + t, mask=row_mask).to(tl.float32)
    if HAS_H0:
        # a_next now holds the decay of the forward pass's first step
        tl.store(grad_h0_ptr + rows, (a_next * lam).to(grad_h0_ptr.dtype.element_ty), mask=row_mask)


def sequential_scan_forward(a, b, h0=None, *, reverse=False):
    """a, b: (..., L) contiguous, same dtype, the leading dimensions taken as channels; h0: (...)
    contiguous, or None. Returns h like a."""
    length = a.shape[-1]
    channels = a.numel() // length
    h = outputs.empty(a.shape, a.dtype, a.device)
    grid = (cdiv(channels, BLOCK_C),)
    sequential_scan_fwd_kernel[grid](
        a, b, h0 if h0 is not None else a, h, channels, length,
        HAS_H0=h0 is not None, REVERSE=reverse, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )
    return h


def sequential_scan_backward(a, h, h0, grad_h, *, reverse=False):
    """Gradients (da, db, dh0) of the forward pass that produced ``h``; dh0 is None without h0."""
    length = a.shape[-1]
    channels = a.numel() // length
    grad_a = outputs.empty(a.shape, a.dtype, a.device)
    grad_b = outputs.empty(a.shape, a.dtype, a.device)
    grad_h0 = outputs.empty(h0.shape, h0.dtype, h0.device) if h0 is not None else None
    grid = (cdiv(channels, BLOCK_C),)
    sequential_scan_bwd_kernel[grid](
        a, h, h0 if h0 is not None else a, grad_h, grad_a, grad_b,
        grad_h0 if h0 is not None else grad_a, channels, length,
        HAS_H0=h0 is not None, REVERSE=reverse, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )
    return grad_a, grad_b, grad_h0
