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
    mu = a * lam of the step beyond. (H200, (12288, T) bfloat16: the backward ran 8% faster than
    with the shifted load of a; moving a and h one step through shared memory with tl.gather
    instead ran 30% slower.)

Shapes: a, b, h, grad_h (rows, L) contiguous; h0 (rows,); totals and segment end states
(rows, num_segments) float32. Offsets are 64-bit: rows * L may pass 2^31.

Bytes moved (element size s, one segment per row): forward reads a, b and writes h: 3*rows*L*s;
backward reads a, h, dh and writes da, db: 5*rows*L*s. With several segments, phase 1 adds one
more read of a and b (and of nothing else). Accumulation is float32 whatever the input dtype.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..runtime import DEVICE, size
from .combine import first_order_combine

# 1024 steps x 4 warps: 8 elements per thread, few registers, many rows in flight per SM. On an
# H200 (float32, 12288 x 65536, forward) every BLOCK from 512 to 4096 with 2-8 warps reached 96-98%
# of the copy floor (512 x 8 warps: 72%); this one measured best among them. On CPU small blocks
# keep the interpreter quick.
BLOCK = size(gpu=1024, cpu=64)
NUM_WARPS = 4
# The backward pass takes twice the block. Its cost is the reverse scan, not memory: on an H200
# ((12288, T) rows, a kernel with the same loads and stores but no scan reached 95% of the floor
# in bfloat16, against 58% with it; and the forward pass itself drops from 97% to 44% of its
# floor with reverse=True). Larger blocks halve the per-block carry work: float32 at T=100000 went
# from 89.4% to 90.6% of the floor, bfloat16 at T=65536 from 58.5% to 60.4%. What did not help
# there: reversed-index loads with an ascending scan (56%), one row of 8 steps per thread with a
# scan over rows (43%), two rows per program (59%), software pipelining of the block loop (57%).
BACKWARD_BLOCK = size(gpu=2048, cpu=64)


@triton.jit
def _block_pairs(a_ptr, b_ptr, row_start, t, length):
    """The (decay, input) pairs at positions t; the identity (1, 0) where t is past the end."""
    inside = t < length
    decay = tl.load(a_ptr + row_start + t, mask=inside, other=1.0)
    x = tl.load(b_ptr + row_start + t, mask=inside, other=0.0)
    return decay.to(tl.float32), x.to(tl.float32)


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
def _last_in_scan_order(values, idx, DESCENDING: tl.constexpr, BLOCK: tl.constexpr):
    last = 0 if DESCENDING else BLOCK - 1
    return tl.sum(tl.where(idx == last, values, 0.0), axis=0)


@triton.jit
def _scan_block(decay, x, carry, ADJOINT: tl.constexpr, DESCENDING: tl.constexpr):
    """(states, block map (A, B) up to each position) for one block and the carry entering it.

    ADJOINT scans (a, 1, g) triples with ``adjoint_combine``: the carry is then mu = a * lam of the
    step beyond the block, and the map acts on mu, so a is read where it lies (aligned loads)."""
    if ADJOINT:
        ones = tl.full(decay.shape, 1.0, tl.float32)
        _, prod, local = tl.associative_scan((decay, ones, x), 0, adjoint_combine, reverse=DESCENDING)
        return local + prod * carry, decay * prod, decay * local
    decay_cum, local = tl.associative_scan((decay, x), 0, first_order_combine, reverse=DESCENDING)
    return local + decay_cum * carry, decay_cum, local


@triton.jit
def chained_scan_kernel(a_ptr, b_ptr, init_ptr, ends_ptr, out_ptr, h_ptr, h0_ptr, grad_a_ptr,
                        length, num_segments, blocks_per_segment,
                        HAS_INIT: tl.constexpr, FROM_ENDS: tl.constexpr, ADJOINT: tl.constexpr,
                        HAS_H0: tl.constexpr, DESCENDING: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_start = row.to(tl.int64) * length
    idx = tl.arange(0, BLOCK)

    # carry_in: the state entering this segment (init for the first segment in scan order)
    carry = tl.zeros([], dtype=tl.float32)
    if HAS_INIT:
        carry = tl.load(init_ptr + row).to(tl.float32)
    if FROM_ENDS:
        previous = segment + 1 if DESCENDING else segment - 1
        has_previous = (previous >= 0) & (previous < num_segments)
        end = tl.load(ends_ptr + row.to(tl.int64) * num_segments + previous, mask=has_previous, other=0.0)
        carry = tl.where(has_previous, end, carry)
    if ADJOINT:
        if HAS_H0:
            h0 = tl.load(h0_ptr + row).to(tl.float32)
        else:
            h0 = 0.0

    first_block = segment * blocks_per_segment
    n_blocks = tl.minimum(blocks_per_segment, tl.cdiv(length, BLOCK) - first_block)
    for j in range(n_blocks):
        if DESCENDING:
            block = first_block + n_blocks - 1 - j
        else:
            block = first_block + j
        t = block * BLOCK + idx
        decay, x = _block_pairs(a_ptr, b_ptr, row_start, t, length)
        state, _, _ = _scan_block(decay, x, carry, ADJOINT, DESCENDING)
        inside = t < length
        tl.store(out_ptr + row_start + t, state.to(out_ptr.dtype.element_ty), mask=inside)
        if ADJOINT:
            # da_t = lam_t * h_{t-s}: the forward state one forward step earlier, h0 before the start
            t_earlier = t + 1 if not DESCENDING else t - 1
            has_earlier = (t_earlier >= 0) & (t_earlier < length)
            h_earlier = tl.load(h_ptr + row_start + t_earlier, mask=has_earlier, other=0.0).to(tl.float32)
            h_earlier = tl.where(has_earlier, h_earlier, h0)
            tl.store(grad_a_ptr + row_start + t, (state * h_earlier).to(grad_a_ptr.dtype.element_ty), mask=inside)
        if ADJOINT:  # the next block's carry is mu = a * lam of this block's last step in scan order
            carry = _last_in_scan_order(decay * state, idx, DESCENDING, BLOCK)
        else:
            carry = _last_in_scan_order(state, idx, DESCENDING, BLOCK)


@triton.jit
def segment_totals_kernel(a_ptr, b_ptr, totals_a_ptr, totals_b_ptr, length, num_segments, blocks_per_segment,
                          ADJOINT: tl.constexpr, DESCENDING: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_start = row.to(tl.int64) * length
    idx = tl.arange(0, BLOCK)
    total_a = tl.full([], 1.0, dtype=tl.float32)  # the identity map
    total_b = tl.zeros([], dtype=tl.float32)
    first_block = segment * blocks_per_segment
    n_blocks = tl.minimum(blocks_per_segment, tl.cdiv(length, BLOCK) - first_block)
    for j in range(n_blocks):
        if DESCENDING:
            block = first_block + n_blocks - 1 - j
        else:
            block = first_block + j
        decay, x = _block_pairs(a_ptr, b_ptr, row_start, block * BLOCK + idx, length)
        _, map_a, map_b = _scan_block(decay, x, 0.0, ADJOINT, DESCENDING)
        block_a = _last_in_scan_order(map_a, idx, DESCENDING, BLOCK)
        block_b = _last_in_scan_order(map_b, idx, DESCENDING, BLOCK)
        total_a, total_b = first_order_combine(total_a, total_b, block_a, block_b)
    out = row.to(tl.int64) * num_segments + segment
    tl.store(totals_a_ptr + out, total_a)
    tl.store(totals_b_ptr + out, total_b)


def _target_programs():
    """Programs that keep every SM busy; on the interpreter one program per row is cheapest."""
    if DEVICE.type != "cuda":
        return 1
    return 8 * torch.cuda.get_device_properties(DEVICE).multi_processor_count


def plan(rows, length, block=None, blocks_per_segment=None, max_block=BLOCK):
    """(block, blocks_per_segment, num_segments): one segment per row unless rows are too few."""
    block = block or min(max_block, triton.next_power_of_2(length))  # short rows: no idle lanes
    n_blocks = triton.cdiv(length, block)
    if blocks_per_segment is None:
        segments = min(n_blocks, triton.cdiv(_target_programs(), rows))
        blocks_per_segment = triton.cdiv(n_blocks, segments)
    return block, blocks_per_segment, triton.cdiv(n_blocks, blocks_per_segment)


def _scan(a, b, init, out, *, adjoint, descending, h=None, h0=None, grad_a=None,
          block=None, blocks_per_segment=None):
    """Scan rows of (a, b) into ``out`` in the given direction, in one or three phases."""
    rows, length = a.shape
    block, blocks_per_segment, num_segments = plan(rows, length, block, blocks_per_segment,
                                                   max_block=BACKWARD_BLOCK if adjoint else BLOCK)
    ends = None
    if num_segments > 1:
        totals_a = outputs.empty((rows, num_segments), torch.float32, a.device)
        totals_b = outputs.empty((rows, num_segments), torch.float32, a.device)
        segment_totals_kernel[(rows, num_segments)](  # phase 1
            a, b, totals_a, totals_b, length, num_segments, blocks_per_segment,
            ADJOINT=adjoint, DESCENDING=descending, BLOCK=block, num_warps=NUM_WARPS)
        # phase 2: the totals are a (rows, num_segments) recurrence of their own; one segment each
        totals_block = min(block, triton.next_power_of_2(num_segments))
        ends = _scan(totals_a, totals_b, init, outputs.empty(totals_a.shape, torch.float32, a.device),
                     adjoint=False, descending=descending, block=totals_block,
                     blocks_per_segment=triton.cdiv(num_segments, totals_block))
    dummy = a  # stands in for pointers a constexpr flag says are unused
    chained_scan_kernel[(rows, num_segments)](
        a, b, init if init is not None else dummy, ends if ends is not None else dummy, out,
        h if h is not None else dummy, h0 if h0 is not None else dummy, grad_a if grad_a is not None else dummy,
        length, num_segments, blocks_per_segment,
        HAS_INIT=init is not None, FROM_ENDS=ends is not None, ADJOINT=adjoint, HAS_H0=h0 is not None,
        DESCENDING=descending, BLOCK=block, num_warps=NUM_WARPS)
    return out


def linear_scan_forward(a, b, h0=None, reverse=False, block=None, blocks_per_segment=None):
    """a, b: (rows, L) contiguous, same dtype, any L; h0: (rows,) or None. Returns h like a.

    ``block`` and ``blocks_per_segment`` override the plan (tests use them to reach every path)."""
    h = outputs.empty(a.shape, a.dtype, a.device)
    return _scan(a, b, h0, h, adjoint=False, descending=reverse, block=block, blocks_per_segment=blocks_per_segment)


def linear_scan_backward(a, h, h0, grad_h, reverse=False, block=None, blocks_per_segment=None):
    """Gradients (da, db, dh0) of the forward pass that produced ``h``; dh0 is None without h0."""
    grad_a = outputs.empty(a.shape, a.dtype, a.device)
    grad_b = outputs.empty(a.shape, a.dtype, a.device)
    _scan(a, grad_h, None, grad_b, adjoint=True, descending=not reverse, h=h, h0=h0, grad_a=grad_a,
          block=block, blocks_per_segment=blocks_per_segment)
    grad_h0 = None
    if h0 is not None:
        first = -1 if reverse else 0  # dh0 = a_first * lam_first: the first forward step's decay
        grad_h0 = (a[:, first].float() * grad_b[:, first].float()).to(h0.dtype)
    return grad_a, grad_b, grad_h0
