"""Chapter 6: from the partial sums of the backward kernels to the gradients of dt, dt_rev, A, dt_bias.

Algorithm, per chunk and head (:mod:`.decays` and :mod:`.chunk_scan_bwd` for the notation):
    forward:  d a_t = d a_t (columns) + d r_t + [t last] d a_last
              d(A dt_k) = sum_{t >= k} d a_t  -  shift * d r_k          (r_t = a_t - shift * A dt_t)
    reverse:  d b_t = d e_t + d rho_t + [t last] d b_last
              d(A dt'_k) = sum_{t >= k} d b_t  -  d e_k  -  (1 - shift) d rho_k
              (e_t = b_t - A dt'_t; rho_t = b_t, or e_t without the shift)
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
from ..ssd.chunk_cumsum import BLOCK_H, add, carry_sum, slot_sum, step_gradient_buffers, step_gradients
from ..triton_ops import cdiv
from .chunk_scan_bwd import COLUMN, COLUMN_REV, DIRECT, DIRECT_REV, ROW, ROW_REV, STATE_COLUMN, STATE_COLUMN_REV


@triton.jit
def reverse_cumsum_with_last(d, last, k, CHUNK: tl.constexpr):
    """sum_{t >= k} (d_t + [t last] last)."""
    d += tl.where(k[None, :] == CHUNK - 1, last[:, None], 0.0)
    return tl.associative_scan(d, 1, add, reverse=True)


@lean_launch
@triton.jit
def step_backward_kernel(dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, state_column_ptr, state_column_rev_ptr,
                         row_ptr, row_rev_ptr, column_ptr, column_rev_ptr, state_ptr, state_rev_ptr, carry_ptr,
                         carry_rev_ptr, grad_dt_ptr, grad_A_part_ptr, grad_bias_part_ptr, length, heads, n_chunks,
                         stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                         dt_min, dt_max, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                         FORWARD: tl.constexpr, REVERSE: tl.constexpr, SHIFT: tl.constexpr,
                         TILES: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    chunk = (pid_b * heads + h).to(tl.int64) * n_chunks + pid_c
    k = tl.arange(0, CHUNK)
    position = chunk[:, None] * CHUNK + k[None, :]
    row_mask = h_ok[:, None]
    d_step = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    if FORWARD:
        d_r = (slot_sum(row_ptr, chunk, k, row_mask, TILES, CHUNK, BLOCK_H)
               + slot_sum(state_ptr, chunk, k, row_mask, SLOTS, CHUNK, BLOCK_H))
        state_column = tl.load(state_column_ptr + position, mask=row_mask, other=0.0)
        # exp(a_last - a_s) of the chunk states: what a_s gets, a_last gets negated
        last = carry_sum(carry_ptr, chunk, h_ok, SLOTS, BLOCK_H) - tl.sum(state_column, axis=1)
        d_a = slot_sum(column_ptr, chunk, k, row_mask, TILES, CHUNK, BLOCK_H) + state_column + d_r
        d_step += reverse_cumsum_with_last(d_a, last, k, CHUNK) - SHIFT * d_r
    if REVERSE:
        d_e = (tl.load(state_column_rev_ptr + position, mask=row_mask, other=0.0)
               + slot_sum(column_rev_ptr, chunk, k, row_mask, TILES, CHUNK, BLOCK_H))
        d_rho_state = slot_sum(state_rev_ptr, chunk, k, row_mask, SLOTS, CHUNK, BLOCK_H)
        d_rho = slot_sum(row_rev_ptr, chunk, k, row_mask, TILES, CHUNK, BLOCK_H) + d_rho_state
        # exp(b_last - rho_t) of the state from the right: what rho_t gets, b_last gets negated
        last = carry_sum(carry_rev_ptr, chunk, h_ok, SLOTS, BLOCK_H) - tl.sum(d_rho_state, axis=1)
        d_step += reverse_cumsum_with_last(d_e + d_rho, last, k, CHUNK) - d_e - (1 - SHIFT) * d_rho
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
        slots.rows[STATE_COLUMN], slots.rows[STATE_COLUMN_REV], slots.diag[ROW], slots.diag[ROW_REV],
        slots.diag[COLUMN], slots.diag[COLUMN_REV], slots.state[0], slots.state[1], slots.carry[0], slots.carry[1],
        grad_dt, grad_A_part, grad_bias_part if dt_bias is not None else grad_A_part, length, heads, n_chunks,
        *dt.stride(), *grad_dt.stride(), float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, FORWARD=forward, REVERSE=reverse, SHIFT=int(shift),
        TILES=slots.diag.shape[-2], SLOTS=slots.state.shape[-2], CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
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
