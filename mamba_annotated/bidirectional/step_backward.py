"""Chapter 6: from the partial sums of the backward kernels to the gradients of dt, dt_rev, A, dt_bias.

Per chunk and head (:mod:`.decays` and :mod:`.chunk_scan_bwd` for the notation), the gradient of
each step collects the terms whose exponent holds it, each kind summed over its own positions, as
in chapter 5 (none is a difference of two large sums; with the shift a row's own step is in
neither of its decays, so no sum takes it, and the totals of the tiles a step lies between add the
dG kernel's row sums of their first (forward) or last (reverse) row):
    forward:  d(A dt_k) = sum over the forward pairs with t - shift >= k > s    (straddling, slots)
                                                                                 (r_t = a_t - shift A dt_t)
                          + sum_{t >= k + shift} X_t        X: the state from the left, exp(r_t)
                          + sum_{s < k} T_s                 T: the chunk state, exp(a_last - a_s)
                          + carry                            <dS, exp(a_last) H>
    reverse:  d(A dt'_k) = sum over the reverse pairs with s > k >= t + shift   (straddling, slots)
                                                                                 (rho_t = b_t or e_t)
                          + sum_{t <= k} Z_t (t < k with the shift)   Z: the state from the right,
                                                                         exp(b_last - rho_t)
                          + sum_{s > k} Y_s                 Y: the reverse chunk state, exp(e_s)
                          + carry                            <dS', exp(b_last) H'>
then chapter 5's :func:`~mamba_annotated.ssd.chunk_cumsum.step_gradients` turns d(A dt') and the
direct d dt' into d dt (through the clamp, softplus and bias) and the partial sums of dA and
d dt_bias. Where the reverse direction shares the step (no dt_rev) one launch adds both
directions' d(A dt'); otherwise each step gets its own launch, and dA, d dt_bias add the two.
The partial sums are added in a fixed order: the gradients are the same bits on every run.

Shapes: the slots of :class:`.chunk_scan_bwd.DecaySlots`; dt, dt_rev (batch, L, heads) any float
dtype and strides. One program owns (batch, chunk, BLOCK_H heads).
"""
import triton
import triton.language as tl

from ..launch import lean_launch
from ..ssd.chunk_cumsum import (BLOCK_H, add, carry_sum, slot_sum, spanned_tiles, step_gradient_buffers,
                                 step_gradients)
from ..triton_ops import cdiv
from .chunk_scan_bwd import (DIRECT, DIRECT_REV, PAIRS, PAIRS_REV, STATE_COLUMN, STATE_COLUMN_REV,
                             row_sum_planes)


@triton.jit
def spanned_tiles_reverse(pairs_ptr, chunk, k, h_ok, TILES: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """Chapter 5's :func:`~mamba_annotated.ssd.chunk_cumsum.spanned_tiles` for the reverse pairs: for
    k in row block b, the tiles (i, j) with i < b < j, whose sum over all their pairs is what their
    slot j holds at the last position of block i."""
    ROWS: tl.constexpr = CHUNK // TILES
    block = k // ROWS
    total = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    for j in tl.static_range(2, TILES):
        for i in tl.static_range(0, j - 1):
            tile = tl.load(pairs_ptr + (chunk * TILES + j) * CHUNK + (i + 1) * ROWS - 1, mask=h_ok, other=0.0)
            total += tl.where((block[None, :] > i) & (block[None, :] < j), tile[:, None], 0.0)
    return total


@triton.jit
def suffix_sum(x):
    """sum_{t >= k} x_t along the chunk."""
    return tl.associative_scan(x, 1, add, reverse=True)


@triton.jit
def prefix_sum(x):
    """sum_{t <= k} x_t along the chunk."""
    return tl.associative_scan(x, 1, add)


@lean_launch
@triton.jit
def step_backward_kernel(dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, state_column_ptr, state_column_rev_ptr,
                         pairs_ptr, pairs_rev_ptr, row_ptr, row_rev_ptr, state_ptr, state_rev_ptr, carry_ptr,
                         carry_rev_ptr, grad_dt_ptr, grad_A_part_ptr, grad_bias_part_ptr, length, heads, n_chunks,
                         stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                         dt_min, dt_max, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                         FORWARD: tl.constexpr, REVERSE: tl.constexpr, SHIFT: tl.constexpr,
                         TILES: tl.constexpr, SLOTS: tl.constexpr, CARRY_SLOTS: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    chunk = (pid_b * heads + h).to(tl.int64) * n_chunks + pid_c
    k = tl.arange(0, CHUNK)
    every = h_ok[:, None]
    # the terms one position back (k - 1) or on (k + 1), for the sums that leave k itself out
    back, on = every & (k[None, :] >= 1), every & (k[None, :] + 1 < CHUNK)
    d_step = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    if FORWARD:
        d_step += (slot_sum(pairs_ptr, chunk, k, every, TILES, CHUNK, BLOCK_H)
                   + spanned_tiles(pairs_ptr, chunk, k, h_ok, TILES, CHUNK, BLOCK_H))
        if SHIFT:  # the pair sums leave the row's own step out: a tile's whole sum, for the steps
            # between its blocks, is its slot's sum at its first row plus that row's own
            d_step += spanned_tiles(row_ptr, chunk, k, h_ok, TILES, CHUNK, BLOCK_H)
            # and the state from the left is read from k + 1
            d_step += suffix_sum(slot_sum(state_ptr, chunk, k + 1, on, SLOTS, CHUNK, BLOCK_H))
        else:
            d_step += suffix_sum(slot_sum(state_ptr, chunk, k, every, SLOTS, CHUNK, BLOCK_H))
        # the chunk state's exp(a_last - a_s), for s < k (the dx kernel stored d a_s = -T_s)
        d_step -= prefix_sum(slot_sum(state_column_ptr, chunk, k - 1, back, 1, CHUNK, BLOCK_H))
        d_step += carry_sum(carry_ptr, chunk, h_ok, CARRY_SLOTS, BLOCK_H)[:, None]
    if REVERSE:
        d_step += (slot_sum(pairs_rev_ptr, chunk, k, every, TILES, CHUNK, BLOCK_H)
                   + spanned_tiles_reverse(pairs_rev_ptr, chunk, k, h_ok, TILES, CHUNK, BLOCK_H))
        # the state from the right, exp(b_last - rho_t), for t <= k (t < k with the shift; the
        # dBC kernel stored d rho_t = -Z_t)
        if SHIFT:  # (a tile's whole sum: at its last row, plus that row's own)
            d_step += spanned_tiles_reverse(row_rev_ptr, chunk, k, h_ok, TILES, CHUNK, BLOCK_H)
            d_step -= prefix_sum(slot_sum(state_rev_ptr, chunk, k - 1, back, SLOTS, CHUNK, BLOCK_H))
        else:
            d_step -= prefix_sum(slot_sum(state_rev_ptr, chunk, k, every, SLOTS, CHUNK, BLOCK_H))
        # the reverse chunk state's exp(e_s), for s > k
        d_step += suffix_sum(slot_sum(state_column_rev_ptr, chunk, k + 1, on, 1, CHUNK, BLOCK_H))
        d_step += carry_sum(carry_rev_ptr, chunk, h_ok, CARRY_SLOTS, BLOCK_H)[:, None]
    step_gradients(d_step, dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, grad_dt_ptr,
                   grad_A_part_ptr, grad_bias_part_ptr, pid_b, pid_c, h, length, heads, n_chunks,
                   stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                   dt_min, dt_max, HAS_BIAS, DT_SOFTPLUS, CHUNK, BLOCK_H)


def launch(dt, dt_out, A, dt_bias, slots, *, forward, reverse, shift, dt_softplus, dt_limit):
    batch, length, heads = dt.shape
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    grad_dt, grad_A_part, grad_bias_part = step_gradient_buffers(dt, dt_bias, n_chunks)
    step_backward_kernel[(batch, n_chunks, cdiv(heads, BLOCK_H))](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, slots.rows[DIRECT if forward else DIRECT_REV],
        slots.rows[STATE_COLUMN], slots.rows[STATE_COLUMN_REV], slots.diag[PAIRS], slots.diag[PAIRS_REV],
        *row_sum_planes(slots.diag, shift), slots.state[0], slots.state[1], slots.carry[0], slots.carry[1],
        grad_dt, grad_A_part, grad_bias_part if dt_bias is not None else grad_A_part, length, heads, n_chunks,
        *dt.stride(), *grad_dt.stride(), float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, FORWARD=forward, REVERSE=reverse, SHIFT=int(shift),
        TILES=slots.diag.shape[-2], SLOTS=slots.state.shape[-2], CARRY_SLOTS=slots.carry.shape[-1],
        CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return grad_dt, grad_A_part.sum(dim=(0, 1)), grad_bias_part.sum(dim=(0, 1)) if dt_bias is not None else None


def step_backward(dt, dt_rev, A, saved, slots, *, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                  shift=False):
    """(d dt, d dt_rev or None, dA, d dt_bias or None): d dt and d dt_rev in their inputs' dtypes,
    contiguous; dA and d dt_bias float32. ``saved``: the forward pass's :class:`~.forward.Saved`."""
    options = dict(shift=shift, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if dt_rev is None:
        grad_dt, grad_A, grad_bias = launch(dt, saved.dt_out, A, dt_bias, slots, forward=True, reverse=True,
                                            **options)
        return grad_dt, None, grad_A, grad_bias
    grad_dt, grad_A, grad_bias = launch(dt, saved.dt_out, A, dt_bias, slots, forward=True, reverse=False, **options)
    grad_dt_rev, grad_A_rev, grad_bias_rev = launch(dt_rev, saved.dt_rev_out, A, dt_bias, slots, forward=False,
                                                    reverse=True, **options)
    return (grad_dt, grad_dt_rev, grad_A + grad_A_rev,
            grad_bias + grad_bias_rev if dt_bias is not None else None)
