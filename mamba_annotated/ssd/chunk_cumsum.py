"""Chapter 5, kernel 1: the step sizes and the cumulative log-decay inside each chunk.

Algorithm
    dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max)   (bias and softplus optional; the clamp
          always applies, as in mamba_ssm: the default limits (0, inf) turn a negative step into 0)
    a_t = sum_{k <= t, k in the chunk} dt'_k * A_h          (tl.cumsum along the chunk, in float64,
                                                            stored as two float32 planes)
    Positions past the end of the sequence get dt' = 0, so a stays flat there and a chunk's last
    slot holds the decay of the whole chunk. With packed sequences (``seq_idx``) the sum restarts
    at every boundary inside the chunk, k running over t's own sequence only. The consumers are
    unchanged: they use a_t - a_s for s and t of one sequence (the same value either way), a_t for
    the sequence carried into the chunk and a_last - a_s for the one that leaves it (the chunk's
    first and last runs), a_last as the chunk's whole decay only where no sequence starts inside
    it (elsewhere the carried state is dropped), and every other weight is dropped by a select.
    (With initial states, which belong to id 0 and, as in mamba_ssm, decay from position 0
    through any runs of negative ids before it, the launcher hands the kernel negative ids as 0,
    so those runs and id 0's share one sum from the first chunk's start.)
    The restart keeps a non-finite step out of the later sequences of its chunk (mamba_ssm's sums
    run across). (It once also spared a sequence the rounding of the earlier ones' decay; with the
    two planes below, a_t - a_s is as exact as float32 holds it however large |a| grows.)
    The softplus is the identity past 20 (as in torch and mamba_ssm) and accurate to float32
    rounding below (:func:`..triton_ops.softplus`): a step of 1e-5 is 1e-5, not 1e-5 give or take
    6e-3 of it.
    The backward twin (:func:`dt_backward`) first gathers d(dt'_k A) from the partial sums that
    the backward kernels left in slots of their own (:class:`.chunk_scan_bwd.DecayGradients`),
    adding the slots in a fixed order, the state terms through a reverse and a forward cumulative
    sum in registers (:mod:`.chunk_scan_bwd` says why not one reverse sum of d a_t), then forms
    d dt'_k = A_h * d(dt'_k A), adds the direct d dt', and pulls it back through the clamp (zero
    outside the limits, as mamba_ssm), the softplus (times the sigmoid) and the bias.

Shapes: dt (batch, L, heads) any float dtype and any strides; A, dt_bias (heads,). Outputs dA_cumsum
(batch, heads, chunks, 2, Q) float32, the planes of :mod:`.log_decays` (or, for the bidirectional
op, (batch, heads, chunks, Q) float32 natural sums rounded once), and dt_out (batch, heads, chunks,
Q) float32; d dt (batch, L, heads) contiguous, in dt's dtype, addressed by its own strides. One program owns (batch, chunk, BLOCK_H heads).

Bytes moved: reads batch*L*heads dt elements, writes 12 bytes per element (a sum's two planes, a
float32 step); negligible
next to x, B, C (headdim and dstate times larger). The backward reads the partial slots of d(dt' A):
(Q / 64 + 2 dstate / 64 + a little) float32 values per element of dt at chunk 256.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import LOG2E, cdiv, rounded_product, sigmoid, softplus

BLOCK_H = 8


@triton.jit
def step_and_slope(dt, bias, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr):
    """dt + bias, softplus'ed, clamped. Returns the step and its derivative d step / d dt."""
    v = dt + bias
    slope = tl.full(v.shape, 1.0, tl.float32)
    if DT_SOFTPLUS:
        slope = tl.where(v <= 20.0, sigmoid(v), 1.0)
        v = tl.where(v <= 20.0, softplus(v), v)
    slope = tl.where((v < dt_min) | (v > dt_max), 0.0, slope)
    # a NaN step stays NaN (torch.clamp's behaviour): Triton's min and max drop NaN by default
    v = tl.minimum(tl.maximum(v, dt_min, propagate_nan=tl.PropagateNan.ALL), dt_max, propagate_nan=tl.PropagateNan.ALL)
    return v, slope


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def add_or_restart(total, restarted, value, restarts):
    """The combine of a segmented sum: an element that starts a run drops what came before it (a
    select, so a NaN or inf before the start stays out)."""
    return tl.where(restarts != 0, value, total + value), restarted | restarts


@lean_launch
@triton.jit
def chunk_cumsum_kernel(dt_ptr, A_ptr, bias_ptr, seq_idx_ptr, dA_cumsum_ptr, dt_out_ptr,
                        length, heads, n_chunks, stride_dt_b, stride_dt_l, stride_dt_h,
                        stride_seq_b, stride_seq_l, dt_min, dt_max,
                        HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                        PLANES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask = (h[:, None] < heads) & (t[None, :] < length)
    dt = tl.load(dt_ptr + pid_b.to(tl.int64) * stride_dt_b + t[None, :].to(tl.int64) * stride_dt_l
                 + h[:, None] * stride_dt_h, mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    dt, _ = step_and_slope(dt, bias[:, None], dt_min, dt_max, DT_SOFTPLUS)
    dt = tl.where(mask, dt, 0.0)
    A = tl.load(A_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    # The sums are formed in float64 and stored as two float32 planes. Every weight is exp of a
    # difference of two sums, a_t - a_s, and near a decaying chunk's end both are large: a float32
    # scan's tree left each an ulp of |a| off (3e-5 at |a| = 325), a float32 final state 6x
    # mamba_ssm's error on an H100 (README, "What 71461 was"), and even sums rounded once to
    # float32 put up to an ulp of |a| into a_t - a_s. With the low part kept (:mod:`.log_decays`),
    # an exponent is as exact as float32 can hold it, however large |a| has grown. The products of
    # two float32 values are exact in float64.
    dA = dt.to(tl.float64) * A.to(tl.float64)[:, None]
    if HAS_SEQ_IDX:
        # a position whose sequence differs from its predecessor's starts a run (not the chunk's
        # first position, whose sum starts anyway; past L the ids read alike and dt' = 0)
        seq_row = seq_idx_ptr + pid_b.to(tl.int64) * stride_seq_b
        in_seq = t < length
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=in_seq, other=0)
        seq_before = tl.load(seq_row + (t - 1).to(tl.int64) * stride_seq_l,
                             mask=in_seq & (t > pid_c * CHUNK), other=0)
        restarts = tl.where(in_seq & (t > pid_c * CHUNK) & (seq_t != seq_before), 1, 0)
        restarts = tl.broadcast_to(restarts[None, :], (BLOCK_H, CHUNK))
        dA_cumsum, _ = tl.associative_scan((dA, restarts), 1, add_or_restart)
    else:
        dA_cumsum = tl.cumsum(dA, axis=1)
    chunk = (pid_b * heads + h[:, None]).to(tl.int64) * n_chunks + pid_c
    out = chunk * CHUNK + tl.arange(0, CHUNK)[None, :]
    h_mask = h[:, None] < heads
    if PLANES:  # hi and lo of a * log2(e) (lo 0 where hi is infinite: exp2 of -inf stays 0, not NaN)
        scaled = dA_cumsum * LOG2E
        hi = scaled.to(tl.float32)
        lo = tl.where(tl.abs(hi) < float("inf"), (scaled - hi.to(tl.float64)).to(tl.float32), 0.0)
        planes = chunk * (2 * CHUNK) + tl.arange(0, CHUNK)[None, :]
        tl.store(dA_cumsum_ptr + planes, hi, mask=h_mask)
        tl.store(dA_cumsum_ptr + planes + CHUNK, lo, mask=h_mask)
    else:
        tl.store(dA_cumsum_ptr + out, dA_cumsum.to(tl.float32), mask=h_mask)
    tl.store(dt_out_ptr + out, dt, mask=h_mask)


@triton.jit
def slot_sum(ptr, chunk, positions, mask, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """The sum over SLOTS per-position slots of the chunks ``chunk`` (one per head) at CHUNK
    ``positions``, in slot order: (BLOCK_H, CHUNK), 0 where ``mask`` is false."""
    total = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    for j in range(SLOTS):
        total += tl.load(ptr + (chunk[:, None] * SLOTS + j) * CHUNK + positions[None, :], mask=mask, other=0.0)
    return total


@triton.jit
def carry_sum(ptr, chunk, h_ok, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The sum over SLOTS per-chunk slots, in slot order: (BLOCK_H,)."""
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(SLOTS):
        total += tl.load(ptr + chunk * SLOTS + j, mask=h_ok, other=0.0)
    return total


@triton.jit
def spanned_tiles(pairs_ptr, chunk, k, h_ok, TILES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """For k in row block b: the pairs of the tiles (i, j) with j < b < i, all of which straddle k.
    A tile's sum over all its pairs is what its slot j holds at the first position of block i."""
    ROWS: tl.constexpr = CHUNK // TILES
    block = k // ROWS
    total = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    for i in tl.static_range(2, TILES):
        for j in tl.static_range(0, i - 1):
            tile = tl.load(pairs_ptr + (chunk * TILES + j) * CHUNK + i * ROWS, mask=h_ok, other=0.0)
            total += tl.where((block[None, :] > j) & (block[None, :] < i), tile[:, None], 0.0)
    return total


@triton.jit
def log_decay_step_gradient(pairs_ptr, from_start_ptr, to_end_ptr, carry_ptr, chunk, h_ok,
                            TILES: tl.constexpr, SLOTS: tl.constexpr, CARRY_SLOTS: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """d(dt'_k A) of the chunks ``chunk`` (BLOCK_H of them, one per head), (BLOCK_H, CHUNK), from
    the slots of :class:`.chunk_scan_bwd.DecayGradients`, each kind summed over its own range of
    positions (none subtracted from another), the slots added in a fixed order."""
    k = tl.arange(0, CHUNK)
    every = h_ok[:, None]
    pairs = slot_sum(pairs_ptr, chunk, k, every, TILES, CHUNK, BLOCK_H) + spanned_tiles(
        pairs_ptr, chunk, k, h_ok, TILES, CHUNK, BLOCK_H)
    # exp(a_r) counts for the steps k <= r: a reverse cumulative sum
    from_start = tl.associative_scan(slot_sum(from_start_ptr, chunk, k, every, SLOTS, CHUNK, BLOCK_H), 1, add,
                                     reverse=True)
    # exp(a_last - a_r) for the steps k > r: a cumulative sum of the terms shifted one position on
    to_end = tl.associative_scan(slot_sum(to_end_ptr, chunk, k - 1, every & (k[None, :] >= 1), SLOTS, CHUNK,
                                          BLOCK_H), 1, add)
    return pairs + from_start + to_end + carry_sum(carry_ptr, chunk, h_ok, CARRY_SLOTS, BLOCK_H)[:, None]


@triton.jit
def step_gradients(d_dA, dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, grad_dt_ptr, grad_A_part_ptr,
                   grad_bias_part_ptr, pid_b, pid_c, h, length, heads, n_chunks,
                   stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                   dt_min, dt_max, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """From d(dt'_k A) (``d_dA``) of one (batch, chunk) and BLOCK_H heads: writes
    d dt (through the clamp, softplus and bias; addressed by d dt's own strides) and this program's
    partial sums of dA and d dt_bias (one slot per (batch, chunk, head), summed afterwards)."""
    t = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask = (h[:, None] < heads) & (t[None, :] < length)
    buf = ((pid_b * heads + h[:, None]).to(tl.int64) * n_chunks + pid_c) * CHUNK + tl.arange(0, CHUNK)[None, :]
    A = tl.load(A_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    step = tl.load(dt_out_ptr + buf, mask=mask, other=0.0)
    d_step = tl.load(direct_ptr + buf, mask=mask, other=0.0) + d_dA * A[:, None]
    dt = tl.load(dt_ptr + pid_b.to(tl.int64) * stride_dt_b + t[None, :].to(tl.int64) * stride_dt_l
                 + h[:, None] * stride_dt_h, mask=mask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    _, slope = step_and_slope(dt, bias[:, None], dt_min, dt_max, DT_SOFTPLUS)
    d_dt = tl.where(mask, d_step * slope, 0.0)
    tl.store(grad_dt_ptr + pid_b.to(tl.int64) * stride_grad_b + t[None, :].to(tl.int64) * stride_grad_l
             + h[:, None] * stride_grad_h, d_dt.to(grad_dt_ptr.dtype.element_ty), mask=mask)
    part = (pid_b * n_chunks + pid_c).to(tl.int64) * heads + h
    tl.store(grad_A_part_ptr + part, tl.sum(rounded_product(d_dA, step), axis=1), mask=h < heads)
    if HAS_BIAS:
        tl.store(grad_bias_part_ptr + part, tl.sum(d_dt, axis=1), mask=h < heads)


@lean_launch
@triton.jit
def dt_backward_kernel(dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, pairs_ptr, from_start_ptr, to_end_ptr,
                       carry_ptr, grad_dt_ptr, grad_A_part_ptr, grad_bias_part_ptr,
                       length, heads, n_chunks, stride_dt_b, stride_dt_l, stride_dt_h,
                       stride_grad_b, stride_grad_l, stride_grad_h, dt_min, dt_max,
                       HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, TILES: tl.constexpr,
                       SLOTS: tl.constexpr, CARRY_SLOTS: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """d(dt'_k A) gathered from its slots, with its cumulative sums in registers, then d dt and the
    partial sums of dA and d dt_bias."""
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    chunk = (pid_b * heads + h).to(tl.int64) * n_chunks + pid_c
    # padded positions past L are read too: their slots hold zeros
    d_dA = log_decay_step_gradient(pairs_ptr, from_start_ptr, to_end_ptr, carry_ptr, chunk, h < heads, TILES,
                                   SLOTS, CARRY_SLOTS, CHUNK, BLOCK_H)
    step_gradients(d_dA, dt_ptr, A_ptr, bias_ptr, dt_out_ptr, direct_ptr, grad_dt_ptr, grad_A_part_ptr,
                   grad_bias_part_ptr, pid_b, pid_c, h, length, heads, n_chunks,
                   stride_dt_b, stride_dt_l, stride_dt_h, stride_grad_b, stride_grad_l, stride_grad_h,
                   dt_min, dt_max, HAS_BIAS, DT_SOFTPLUS, CHUNK, BLOCK_H)


def chunk_cumsum(dt, A, chunk_size, *, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                 seq_idx=None, initial_states=False, planes=True):
    """dt (batch, L, heads) -> (dA_cumsum, dt_out): the sums as the float32 planes of
    :mod:`.log_decays`, (batch, heads, chunks, 2, chunk_size) (``planes=False``: float32 sums, each
    rounded once, (batch, heads, chunks, chunk_size), for consumers that subtract in float32), and
    the steps (batch, heads, chunks, chunk_size) float32;
    with ``seq_idx`` (batch, L, nondecreasing) the sums restart where the sequence changes, but not
    from negative ids into id 0 when ``initial_states`` (see the module docstring).

    A and dt_bias must be contiguous (the public function makes them so)."""
    if seq_idx is not None and initial_states:
        seq_idx = seq_idx.clamp(min=0)
    batch, length, heads = dt.shape
    n_chunks = cdiv(length, chunk_size)
    dA_cumsum = outputs.empty((batch, heads, n_chunks, *((2,) if planes else ()), chunk_size), torch.float32,
                              dt.device)
    dt_out = outputs.empty((batch, heads, n_chunks, chunk_size), torch.float32, dt.device)
    grid = (batch, n_chunks, cdiv(heads, BLOCK_H))
    chunk_cumsum_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, seq_idx if seq_idx is not None else dt, dA_cumsum, dt_out,
        length, heads, n_chunks, *dt.stride(), *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        float(dt_limit[0]), float(dt_limit[1]), HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_SEQ_IDX=seq_idx is not None, PLANES=planes, CHUNK=chunk_size, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return dA_cumsum, dt_out


def step_gradient_buffers(dt, dt_bias, n_chunks):
    """d dt (dt's shape and dtype, contiguous) and the partial-sum slots of dA and d dt_bias."""
    batch, _, heads = dt.shape
    grad_dt = outputs.empty(dt.shape, dt.dtype, dt.device)
    grad_A_part = outputs.empty((batch, n_chunks, heads), torch.float32, dt.device)
    grad_bias_part = outputs.empty((batch, n_chunks, heads), torch.float32, dt.device) if dt_bias is not None else None
    return grad_dt, grad_A_part, grad_bias_part


def dt_backward(dt, A, dt_out, decay, *, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Gradients (d dt, dA, d dt_bias or None) from ``decay``, the
    :class:`.chunk_scan_bwd.DecayGradients` of the backward kernels (the terms of d(dt' A) in slots, and the
    direct d dt'). d dt has dt's shape and dtype (contiguous); dA and d dt_bias are float32."""
    batch, length, heads = dt.shape
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    grad_dt, grad_A_part, grad_bias_part = step_gradient_buffers(dt, dt_bias, n_chunks)
    grid = (batch, n_chunks, cdiv(heads, BLOCK_H))
    dt_backward_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, decay.direct, decay.pairs, decay.from_start,
        decay.to_end, decay.carry, grad_dt, grad_A_part, grad_bias_part if dt_bias is not None else grad_A_part,
        length, heads, n_chunks, *dt.stride(), *grad_dt.stride(), float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, TILES=decay.pairs.shape[3],
        SLOTS=decay.from_start.shape[3], CARRY_SLOTS=decay.carry.shape[3], CHUNK=chunk_size, BLOCK_H=BLOCK_H,
        num_warps=4,
    )
    grad_A = grad_A_part.sum(dim=(0, 1))
    grad_bias = grad_bias_part.sum(dim=(0, 1)) if dt_bias is not None else None
    return grad_dt, grad_A, grad_bias
