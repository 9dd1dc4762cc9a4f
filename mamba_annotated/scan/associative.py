"""Chapter 2: the linear recurrence as one associative scan over (a, b) pairs.

Algorithm
    Forward:  the pairs (a_t, b_t) are affine maps h -> a_t*h + b_t; ``tl.associative_scan`` over
              the tuple (a, b) with :func:`first_order_combine` returns, at every t, the composition
              of maps 0..t, i.e. (prod a, h_t). The initial state folds into the first element:
              b_first <- b_first + a_first*h0. ``REVERSE`` scans from the end (h_t = a_t*h_{t+1} + b_t).
    Backward: with g_t = dLoss/dh_t the adjoint lam_t = g_t + a_{t+1}*lam_{t+1} is the same scan
              run the other way over the pairs (a_{t+1}, g_t); then db_t = lam_t,
              da_t = lam_t*h_{t-1} (h_{-1} = h0) and dh0 = a_0*lam_0. ``REVERSE`` mirrors every index.

Parallelism: one program per row holds the whole row in one block of BLOCK >= L elements, so the
scan runs in O(log L) depth inside the program. Lengths are capped at MAX_LENGTH (registers);
chapter 4 lifts the cap by chaining blocks.

Shapes: a, b, h (rows, L) contiguous; h0 (rows,). Padding past L is the identity (1, 0).

Bytes moved (element size s): forward reads a, b and writes h: 3*rows*L*s. Backward reads a, h,
dh and writes da, db: 5*rows*L*s. Accumulation is float32 whatever the input dtype.
"""
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import next_power_of_2
from .combine import first_order_combine

MAX_LENGTH = 1 << 16


def warps_for(block):
    return max(1, min(16, block // 256))  # about 8 elements per thread


@lean_launch
@triton.jit
def tuple_scan_fwd_kernel(a_ptr, b_ptr, h0_ptr, h_ptr, length,
                          HAS_H0: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    inside = t < length
    row_start = tl.program_id(0).to(tl.int64) * length
    a = tl.load(a_ptr + row_start + t, mask=inside, other=1.0).to(tl.float32)
    b = tl.load(b_ptr + row_start + t, mask=inside, other=0.0).to(tl.float32)
    if HAS_H0:
        first = length - 1 if REVERSE else 0
        h0 = tl.load(h0_ptr + tl.program_id(0)).to(tl.float32)
        b = tl.where(t == first, b + a * h0, b)
    _, h = tl.associative_scan((a, b), 0, first_order_combine, reverse=REVERSE)
    tl.store(h_ptr + row_start + t, h.to(h_ptr.dtype.element_ty), mask=inside)


@lean_launch
@triton.jit
def tuple_scan_bwd_kernel(a_ptr, h_ptr, h0_ptr, grad_h_ptr, grad_a_ptr, grad_b_ptr, grad_h0_ptr, length,
                          HAS_H0: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    inside = t < length
    row = tl.program_id(0)
    row_start = row.to(tl.int64) * length
    # the forward step s is +1 (or -1 for REVERSE): lam_t = g_t + a_{t+s} lam_{t+s}
    if REVERSE:
        later, earlier, first = t - 1, t + 1, length - 1
    else:
        later, earlier, first = t + 1, t - 1, 0
    has_later = (later >= 0) & (later < length)
    has_earlier = (earlier >= 0) & (earlier < length)
    a_later = tl.load(a_ptr + row_start + later, mask=has_later, other=0.0).to(tl.float32)
    g = tl.load(grad_h_ptr + row_start + t, mask=inside, other=0.0).to(tl.float32)
    _, lam = tl.associative_scan((a_later, g), 0, first_order_combine, reverse=not REVERSE)
    if HAS_H0:
        h0 = tl.load(h0_ptr + row).to(tl.float32)
    else:
        h0 = 0.0
    h_earlier = tl.load(h_ptr + row_start + earlier, mask=has_earlier, other=0.0).to(tl.float32)
    h_earlier = tl.where(has_earlier, h_earlier, h0)
    tl.store(grad_b_ptr + row_start + t, lam.to(grad_b_ptr.dtype.element_ty), mask=inside)
    tl.store(grad_a_ptr + row_start + t, (lam * h_earlier).to(grad_a_ptr.dtype.element_ty), mask=inside)
    if HAS_H0:
        a_first = tl.load(a_ptr + row_start + first).to(tl.float32)
        lam_first = tl.sum(tl.where(t == first, lam, 0.0), axis=0)
        tl.store(grad_h0_ptr + row, (a_first * lam_first).to(grad_h0_ptr.dtype.element_ty))


@lean_launch
@triton.jit
def combine_bracketings_kernel(a_ptr, b_ptr, left_ptr, right_ptr, N: tl.constexpr):
    """For triples x, y, z (rows 0, 1, 2 of a and b): (x o y) o z into left, x o (y o z) into right."""
    i = tl.arange(0, N)
    ax, bx = tl.load(a_ptr + i), tl.load(b_ptr + i)
    ay, by = tl.load(a_ptr + N + i), tl.load(b_ptr + N + i)
    az, bz = tl.load(a_ptr + 2 * N + i), tl.load(b_ptr + 2 * N + i)
    a_xy, b_xy = first_order_combine(ax, bx, ay, by)
    a_l, b_l = first_order_combine(a_xy, b_xy, az, bz)
    a_yz, b_yz = first_order_combine(ay, by, az, bz)
    a_r, b_r = first_order_combine(ax, bx, a_yz, b_yz)
    tl.store(left_ptr + i, a_l)
    tl.store(left_ptr + N + i, b_l)
    tl.store(right_ptr + i, a_r)
    tl.store(right_ptr + N + i, b_r)


def _block(length):
    if length > MAX_LENGTH:
        raise ValueError(f"the one-block tuple scan takes at most {MAX_LENGTH} steps; got {length} "
                         "(linear_scan chains blocks for any length)")
    return next_power_of_2(length)


def tuple_scan_forward(a, b, h0=None, *, reverse=False):
    """a, b: (rows, L) contiguous, same dtype, L <= MAX_LENGTH; h0: (rows,) or None. Returns h like a."""
    rows, length = a.shape
    block = _block(length)
    h = outputs.empty(a.shape, a.dtype, a.device)
    tuple_scan_fwd_kernel[(rows,)](a, b, h0 if h0 is not None else a, h, length,
                                   HAS_H0=h0 is not None, REVERSE=reverse, BLOCK=block,
                                   num_warps=warps_for(block))
    return h


def tuple_scan_backward(a, h, h0, grad_h, *, reverse=False):
    """Gradients (da, db, dh0) of the forward pass that produced ``h``; dh0 is None without h0."""
    rows, length = a.shape
    block = _block(length)
    grad_a = outputs.empty(a.shape, a.dtype, a.device)
    grad_b = outputs.empty(a.shape, a.dtype, a.device)
    grad_h0 = outputs.empty(h0.shape, h0.dtype, h0.device) if h0 is not None else None
    tuple_scan_bwd_kernel[(rows,)](a, h, h0 if h0 is not None else a, grad_h, grad_a, grad_b,
                                   grad_h0 if h0 is not None else grad_a, length,
                                   HAS_H0=h0 is not None, REVERSE=reverse, BLOCK=block,
                                   num_warps=warps_for(block))
    return grad_a, grad_b, grad_h0


def combine_both_bracketings(a, b):
    """a, b: (3, N) float32, N a power of two: rows are x, y, z. Returns ((x o y) o z, x o (y o z)),
    each as a (2, N) tensor of (a, b), computed by the Triton combine itself."""
    n = a.shape[1]
    left = outputs.empty((2, n), a.dtype, a.device)
    right = outputs.empty((2, n), a.dtype, a.device)
    combine_bracketings_kernel[(1,)](a.contiguous(), b.contiguous(), left, right, N=n)
    return left, right
