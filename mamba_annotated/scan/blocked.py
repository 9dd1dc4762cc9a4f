"""Chapter 4: scans of any length, by chaining blocks with carries.

Algorithm
    A row of L steps is cut into blocks of BLOCK steps (aligned at t = 0; the last one is padded
    with the identity (1, 0)), and the blocks into segments of ``blocks_per_segment`` blocks.
    One program owns one (row, segment) and walks its blocks in scan order, keeping a running
    carry: scan the block's (a, b) pairs with ``tl.associative_scan``, which gives the cumulative
    decay A_t and the block-local state B_t; then h_t = B_t + A_t * carry_in, and the block's last
    state (in scan order) is the next block's carry_in.

    * One segment per row (the chained walk, "approach b"): the carry never leaves registers and
      a, b are read once. Best when rows alone fill the GPU (e.g. 8 x 1536 channels).
    * Several segments per row (three phases, "approach a"): (1) ``segment_totals_kernel`` reduces
      each segment to its composed map (A, B); (2) the chained kernel itself scans those totals
      along each row (with h0), giving the state at the end of every segment; (3) the chained
      kernel re-scans each segment with the previous segment's end state as carry_in. a, b are
      read twice, but a single long row now runs on many SMs at once.

    The backward pass is the same machinery in ADJOINT mode: the scan runs the other way for
    lam_t = g_t + a_{t+s} lam_{t+s} (s = +1 forward, -1 reverse), giving lam_t = db_t, and the last
    phase also writes da_t = lam_t * h_{t-s} (h0 at the boundary). The decay a_{t+s} belongs to the
    step beyond t. Rather than load a one step off (a misaligned load, which is not vectorised), the
    scan runs over triples (a_t, 1, g_t) with ``adjoint_combine``: a run applies its own first decay
    only when it is joined to the run before it, and the carry between blocks and segments is
    mu = a * lam of the step beyond. (Both alternatives, the shifted load of a and moving a and h
    one step through shared memory with tl.gather, ran slower: chapter 4's performance notes.)

    Descending scans (reverse=True, and the backward of the forward direction) do not use
    ``tl.associative_scan(..., reverse=True)``: Triton implements it by reversing the values across
    the lanes of a warp with shuffles, even along an axis that one thread holds (three times the
    shuffles of an ascending scan when compiled for sm_90), and those shuffles, not the memory,
    then bound the bfloat16 backward. Instead the block is a tile of rows of ROW consecutive steps (one 16-byte
    vector per thread): each thread scans its row from the end in registers (``tl.flip``, an
    ascending scan, ``tl.flip`` back: no shuffles), and the carry entering row r is the composition
    of the maps of the rows after it, one scan over rows of one value per thread. Row r gets the
    map of row r+1 by loading row r+1 again (from cache, mostly) rather than by moving a value
    between threads (chapter 4's performance notes give the gain).

Shapes: a, b, h, grad_h (rows, L) contiguous; h0 (rows,); totals and segment end states
(rows, num_segments) float32. Offsets are 64-bit: rows * L may pass 2^31.

Bytes moved (element size s, one segment per row): forward reads a, b and writes h: 3*rows*L*s;
backward reads a, h, dh and writes da, db: 5*rows*L*s. With several segments, phase 1 adds one
more read of a and b (and of nothing else). Accumulation is float32 whatever the input dtype.
"""
import functools

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import DEVICE, size, sm_count
from ..triton_ops import cdiv, next_power_of_2
from .combine import first_order_combine

# (largest block, warps) of each kind of scan, chosen by a sweep on an H200 beside accelerated_scan
# (chapter 4's performance notes): long blocks for ascending float32 scans (fewer carry hand-offs),
# half as long for 16-bit ones (the same bytes per thread), short row tiles for descending scans and
# the backward (their row walk holds more per thread). On CPU small blocks keep the interpreter quick.
ASCENDING_FLOAT32 = size(gpu=(8192, 8), cpu=(64, 4))
ASCENDING_16BIT = size(gpu=(4096, 4), cpu=(64, 4))
DESCENDING = size(gpu=(1024, 4), cpu=(64, 4))
BACKWARD = size(gpu=(2048, 4), cpu=(64, 4))


def launch_shape(element_size, adjoint, descending):
    """(largest block, warps) for a scan of elements of this size (see the table above)."""
    if adjoint:
        return BACKWARD
    if descending:
        return DESCENDING
    return ASCENDING_FLOAT32 if element_size == 4 else ASCENDING_16BIT


@triton.jit
def _pairs_where(a_ptr, b_ptr, row_start, t, valid):
    """The (decay, input) pairs at positions t where ``valid``, the identity (1, 0) elsewhere."""
    decay = tl.load(a_ptr + row_start + t, mask=valid, other=1.0)
    x = tl.load(b_ptr + row_start + t, mask=valid, other=0.0)
    return decay.to(tl.float32), x.to(tl.float32)


@triton.jit
def _block_pairs(a_ptr, b_ptr, row_start, t, length):
    """The (decay, input) pairs at positions t; the identity (1, 0) where t is past the end."""
    return _pairs_where(a_ptr, b_ptr, row_start, t, t < length)


@triton.jit
def adjoint_combine(alpha_left, prod_left, sum_left, alpha_right, prod_right, sum_right):
    """The adjoint recurrence lam_t = g_t + a_{t+1} lam_{t+1} without a decay shifted by one step.

    A run of steps whose nearest step to the result is s (the right operand comes later in scan
    order) is (alpha = a_s, prod = the decays of the run's other steps, sum), meaning
    lam_s = sum + prod * mu, with mu = a * lam of the step just beyond the run. A single step is
    (a_t, 1, g_t); a_t is applied only when the run is joined to the one before it.
    """
    return alpha_right, prod_right * alpha_left * prod_left, sum_right + prod_right * alpha_left * sum_left


@triton.jit
def _segment_blocks(segment, blocks_per_segment, length, BLOCK: tl.constexpr):
    """(first block, number of blocks) of a segment; the last segment of a row may be short."""
    first_block = segment * blocks_per_segment
    return first_block, tl.minimum(blocks_per_segment, tl.cdiv(length, BLOCK) - first_block)


@triton.jit
def _block_in_scan_order(first_block, n_blocks, j, DESCENDING: tl.constexpr):
    """The segment's j-th block in scan order: from its end when DESCENDING."""
    if DESCENDING:
        block = first_block + n_blocks - 1 - j
    else:
        block = first_block + j
    return block


@triton.jit
def _positions(block, BLOCK: tl.constexpr, ROW: tl.constexpr, DESCENDING: tl.constexpr):
    """The block's positions: a [BLOCK] vector ascending; descending, a [BLOCK // ROW, ROW] tile of
    rows of ROW consecutive steps (16 bytes, one thread's vector load), the layout that
    :func:`scan_rows_descending` needs."""
    if DESCENDING:
        t = block * BLOCK + tl.arange(0, BLOCK // ROW)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    else:
        t = block * BLOCK + tl.arange(0, BLOCK)
    return t


@triton.jit
def _last_in_scan_order(values, t, block_start, DESCENDING: tl.constexpr, BLOCK: tl.constexpr):
    if DESCENDING:  # the block's first step, in the (rows, ROW) tile
        last = tl.sum(tl.sum(tl.where(t == block_start, values, 0.0), axis=1), axis=0)
    else:
        last = tl.sum(tl.where(t == block_start + BLOCK - 1, values, 0.0), axis=0)
    return last


@triton.jit
def _row_suffixes(decay, x, ADJOINT: tl.constexpr):
    """Each row of the tile scanned from its end (axis 1, in one thread's registers): the map of
    steps k..ROW-1 at each k, (decay product, local state) for ADJOINT=False, (prod, local) on mu
    for ADJOINT. Flipped, scanned ascending and flipped back: reverse=True would exchange values
    across lanes even along an axis that one thread holds."""
    if ADJOINT:
        ones = tl.full(decay.shape, 1.0, tl.float32)
        _, mult, local = tl.associative_scan((tl.flip(decay, 1), ones, tl.flip(x, 1)), 1, adjoint_combine)
    else:
        mult, local = tl.associative_scan((tl.flip(decay, 1), tl.flip(x, 1)), 1, first_order_combine)
    return tl.flip(mult, 1), tl.flip(local, 1)


@triton.jit
def _row_maps(decay, mult, local, ADJOINT: tl.constexpr):
    """The map of each whole row on the carry beyond it (its value at the row's first step)."""
    first = tl.arange(0, decay.shape[1])[None, :] == 0
    if ADJOINT:  # on mu: the row's own first decay joins it
        mult = decay * mult
        local = decay * local
    return tl.sum(tl.where(first, mult, 0.0), axis=1), tl.sum(tl.where(first, local, 0.0), axis=1)


@triton.jit
def scan_rows_descending(a_ptr, b_ptr, row_start, t, length, decay, x, carry, ADJOINT: tl.constexpr):
    """A descending scan of a (rows, ROW) tile without one reverse=True scan across lanes.

    Each thread scans its own row in registers; the carry entering row r is then the composition
    of the maps of rows r+1, r+2, ... applied to the block's carry: one scan over rows, of one
    value per thread. Each row's successor map comes from the successor's own data, loaded again
    (from cache, mostly), so no value has to move one row over between threads.
    """
    mult, local = _row_suffixes(decay, x, ADJOINT)
    rows = tl.arange(0, t.shape[0])[:, None]
    t_next = t + t.shape[1]  # the last row's successor is past the block: the identity
    decay_next, x_next = _pairs_where(a_ptr, b_ptr, row_start, t_next,
                                      (t_next < length) & (rows < t.shape[0] - 1))
    mult_next, local_next = _row_suffixes(decay_next, x_next, ADJOINT)
    map_a, map_b = _row_maps(decay_next, mult_next, local_next, ADJOINT)
    after_a, after_b = tl.associative_scan((map_a, map_b), 0, first_order_combine, reverse=True)
    carry_in = after_b + after_a * carry  # entering each row: one value per row
    state = local + mult * carry_in[:, None]
    # each position's map on the block's carry (the segment totals need it; the compiler drops
    # it where unused), on mu for ADJOINT, as the carry between blocks
    map_a = mult * after_a[:, None]
    map_b = local + mult * after_b[:, None]
    if ADJOINT:
        map_a = decay * map_a
        map_b = decay * map_b
    return state, map_a, map_b


@triton.jit
def scan_block(a_ptr, b_ptr, row_start, t, length, carry, ADJOINT: tl.constexpr, DESCENDING: tl.constexpr):
    """(decays, states, block map (A, B) up to each position) for the block at positions t and the
    carry entering it.

    ADJOINT scans (a, 1, g) triples with ``adjoint_combine``: the carry is then mu = a * lam of the
    step beyond the block, and the map acts on mu, so a is read where it lies (aligned loads)."""
    decay, x = _block_pairs(a_ptr, b_ptr, row_start, t, length)
    if DESCENDING:
        state, map_a, map_b = scan_rows_descending(a_ptr, b_ptr, row_start, t, length, decay, x, carry, ADJOINT)
    elif ADJOINT:
        ones = tl.full(decay.shape, 1.0, tl.float32)
        _, prod, local = tl.associative_scan((decay, ones, x), 0, adjoint_combine)
        state, map_a, map_b = local + prod * carry, decay * prod, decay * local
    else:
        decay_cum, local = tl.associative_scan((decay, x), 0, first_order_combine)
        state, map_a, map_b = local + decay_cum * carry, decay_cum, local
    return decay, state, map_a, map_b


@lean_launch
@triton.jit
def chained_scan_kernel(a_ptr, b_ptr, init_ptr, ends_ptr, out_ptr, h_ptr, h0_ptr, grad_a_ptr,
                        length, num_segments, blocks_per_segment,
                        HAS_INIT: tl.constexpr, FROM_ENDS: tl.constexpr, ADJOINT: tl.constexpr,
                        HAS_H0: tl.constexpr, DESCENDING: tl.constexpr, BLOCK: tl.constexpr,
                        ROW: tl.constexpr):
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_start = row.to(tl.int64) * length

    # carry_in: the state entering this segment (init for the first segment in scan order)
    carry = tl.zeros([], dtype=tl.float32)
    if HAS_INIT:
        carry = tl.load(init_ptr + row).to(tl.float32)
    if FROM_ENDS:
        previous = segment + 1 if DESCENDING else segment - 1
        has_previous = (previous >= 0) & (previous < num_segments)
        end = tl.load(ends_ptr + row.to(tl.int64) * num_segments + previous, mask=has_previous, other=0.0)
        carry = tl.where(has_previous, end, carry)
    if HAS_H0:
        h0 = tl.load(h0_ptr + row).to(tl.float32)

    first_block, n_blocks = _segment_blocks(segment, blocks_per_segment, length, BLOCK)
    for j in range(n_blocks):
        block = _block_in_scan_order(first_block, n_blocks, j, DESCENDING)
        t = _positions(block, BLOCK, ROW, DESCENDING)
        decay, state, _, _ = scan_block(a_ptr, b_ptr, row_start, t, length, carry, ADJOINT, DESCENDING)
        inside = t < length
        tl.store(out_ptr + row_start + t, state.to(out_ptr.dtype.element_ty), mask=inside)
        if ADJOINT:
            # da_t = lam_t * h_{t-s}: the forward state one forward step earlier, h0 before the start
            if DESCENDING:
                t_earlier = t - 1
                has_earlier = (t_earlier >= 0) & inside
            else:
                t_earlier = t + 1
                has_earlier = t_earlier < length
            h_earlier = tl.load(h_ptr + row_start + t_earlier, mask=has_earlier, other=0.0).to(tl.float32)
            if HAS_H0:
                h_earlier = tl.where(has_earlier, h_earlier, h0)
            tl.store(grad_a_ptr + row_start + t, (state * h_earlier).to(grad_a_ptr.dtype.element_ty), mask=inside)
        if ADJOINT:  # the next block's carry is mu = a * lam of this block's last step in scan order
            carry = _last_in_scan_order(decay * state, t, block * BLOCK, DESCENDING, BLOCK)
        else:
            carry = _last_in_scan_order(state, t, block * BLOCK, DESCENDING, BLOCK)


@lean_launch
@triton.jit
def segment_totals_kernel(a_ptr, b_ptr, totals_a_ptr, totals_b_ptr, length, num_segments, blocks_per_segment,
                          ADJOINT: tl.constexpr, DESCENDING: tl.constexpr, BLOCK: tl.constexpr,
                          ROW: tl.constexpr):
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_start = row.to(tl.int64) * length
    total_a = tl.full([], 1.0, dtype=tl.float32)  # the identity map
    total_b = tl.zeros([], dtype=tl.float32)
    first_block, n_blocks = _segment_blocks(segment, blocks_per_segment, length, BLOCK)
    for j in range(n_blocks):
        block = _block_in_scan_order(first_block, n_blocks, j, DESCENDING)
        t = _positions(block, BLOCK, ROW, DESCENDING)
        _, _, map_a, map_b = scan_block(a_ptr, b_ptr, row_start, t, length, 0.0, ADJOINT, DESCENDING)
        block_a = _last_in_scan_order(map_a, t, block * BLOCK, DESCENDING, BLOCK)
        block_b = _last_in_scan_order(map_b, t, block * BLOCK, DESCENDING, BLOCK)
        total_a, total_b = first_order_combine(total_a, total_b, block_a, block_b)
    out = row.to(tl.int64) * num_segments + segment
    tl.store(totals_a_ptr + out, total_a)
    tl.store(totals_b_ptr + out, total_b)


def target_programs():
    """Programs that keep every SM busy; on the interpreter one program per row is cheapest."""
    return 8 * sm_count() if DEVICE.type == "cuda" else 1


# A row of this many blocks or fewer is walked by one program: cutting it into segments would add
# two launches, which take about as long as walking a few blocks, for little parallelism.
SHORT_ROW_BLOCKS = 4


def plan(rows, length, block=None, blocks_per_segment=None, max_block=ASCENDING_FLOAT32[0]):
    """(block, blocks_per_segment, num_segments): one segment per row unless rows are too few to
    fill the GPU and long enough to be worth cutting."""
    block = block or min(max_block, next_power_of_2(length))  # short rows: no idle lanes
    n_blocks = cdiv(length, block)
    if blocks_per_segment is None:
        segments = 1 if n_blocks <= SHORT_ROW_BLOCKS else min(n_blocks, cdiv(target_programs(), rows))
        blocks_per_segment = cdiv(n_blocks, segments)
    return block, blocks_per_segment, cdiv(n_blocks, blocks_per_segment)


@functools.lru_cache(maxsize=4096)
def launch_plan(rows, length, element_size, adjoint, descending, block, blocks_per_segment, num_warps):
    """(block, blocks_per_segment, num_segments, num_warps) from :func:`plan` and :func:`launch_shape`,
    with any override given, remembered: a model scans the same shapes at every step, and planning
    them again cost microseconds of host time at each call."""
    max_block, default_warps = launch_shape(element_size, adjoint, descending)
    return (*plan(rows, length, block, blocks_per_segment, max_block), num_warps or default_warps)


def _scan(a, b, init, out, *, adjoint, descending, h=None, h0=None, grad_a=None,
          block=None, blocks_per_segment=None, num_warps=None):
    """Scan rows of (a, b) into ``out`` in the given direction, in one or three phases. a, b (..., L)
    contiguous: their leading dimensions are the rows."""
    length = a.shape[-1]
    rows = a.numel() // length
    block, blocks_per_segment, num_segments, num_warps = launch_plan(
        rows, length, a.element_size(), adjoint, descending, block, blocks_per_segment, num_warps)
    row = min(16 // a.element_size(), block)  # descending tiles: one 16-byte vector per row
    ends = None
    if num_segments > 1:
        totals_a = outputs.empty((rows, num_segments), torch.float32, a.device)
        totals_b = outputs.empty((rows, num_segments), torch.float32, a.device)
        segment_totals_kernel[(rows, num_segments)](  # phase 1
            a, b, totals_a, totals_b, length, num_segments, blocks_per_segment,
            ADJOINT=adjoint, DESCENDING=descending, BLOCK=block, ROW=row, num_warps=num_warps)
        # phase 2: the totals are a (rows, num_segments) recurrence of their own; one segment each
        totals_block = min(block, next_power_of_2(num_segments))
        ends = _scan(totals_a, totals_b, init, outputs.empty(totals_a.shape, torch.float32, a.device),
                     adjoint=False, descending=descending, block=totals_block,
                     blocks_per_segment=cdiv(num_segments, totals_block))
    dummy = a  # stands in for pointers a constexpr flag says are unused
    chained_scan_kernel[(rows, num_segments)](
        a, b, init if init is not None else dummy, ends if ends is not None else dummy, out,
        h if h is not None else dummy, h0 if h0 is not None else dummy, grad_a if grad_a is not None else dummy,
        length, num_segments, blocks_per_segment,
        HAS_INIT=init is not None, FROM_ENDS=ends is not None, ADJOINT=adjoint, HAS_H0=h0 is not None,
        DESCENDING=descending, BLOCK=block, ROW=row, num_warps=num_warps)
    return out


def linear_scan_forward(a, b, h0=None, reverse=False, block=None, blocks_per_segment=None, num_warps=None):
    """a, b: (..., L) contiguous, same dtype, any L, the leading dimensions taken as rows; h0: (...)
    contiguous, or None. Returns h like a.

    ``block``, ``blocks_per_segment`` and ``num_warps`` override the plan (tests use them to reach
    every path, the benchmark to compare launch shapes)."""
    h = outputs.empty(a.shape, a.dtype, a.device)
    return _scan(a, b, h0, h, adjoint=False, descending=reverse, block=block, blocks_per_segment=blocks_per_segment,
                 num_warps=num_warps)


def linear_scan_backward(a, h, h0, grad_h, reverse=False, block=None, blocks_per_segment=None):
    """Gradients (da, db, dh0) of the forward pass that produced ``h``; dh0 is None without h0."""
    grad_a = outputs.empty(a.shape, a.dtype, a.device)
    grad_b = outputs.empty(a.shape, a.dtype, a.device)
    _scan(a, grad_h, None, grad_b, adjoint=True, descending=not reverse, h=h, h0=h0, grad_a=grad_a,
          block=block, blocks_per_segment=blocks_per_segment)
    grad_h0 = None
    if h0 is not None:
        first = -1 if reverse else 0  # dh0 = a_first * lam_first: the first forward step's decay
        grad_h0 = (a[..., first].float() * grad_b[..., first].float()).to(h0.dtype)
    return grad_a, grad_b, grad_h0
