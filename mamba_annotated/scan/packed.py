"""Chapter 3: the scan over one packed word instead of a tuple.

Algorithm
    Early Triton scanned a single tensor only, so the pair (a_t, b_t) was bit-packed into one
    integer: two float32 into a uint64 (a in the high 32 bits, b in the low 32), or two 16-bit
    floats into a uint32. The combine unpacks both words, composes the maps in float32
    (:func:`first_order_combine`) and packs the result again. For float32 the arithmetic is exactly
    the tuple scan's, so the results agree bit for bit; for 16-bit words every combine rounds its
    result back to 16 bits, so the scan also *accumulates* in 16 bits.

Parallelism: as in chapter 2, one program per row, the whole row in one block (L <= MAX_LENGTH),
zero initial state, forward direction: the smallest kernel that answers "does packing pay?".

Shapes: a, b, h (rows, L) contiguous, float32 (uint64 words) or float16/bfloat16 (uint32 words).

Bytes moved (element size s): reads a, b and writes h: 3*rows*L*s, as the tuple scan.
"""
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import next_power_of_2
from .associative import MAX_LENGTH, warps_for
from .combine import first_order_combine


@triton.jit
def pack_pair(a, b, FLOAT: tl.constexpr, HALF: tl.constexpr, WORD: tl.constexpr, BITS: tl.constexpr):
    """Round a and b to FLOAT, reinterpret their bits as unsigned HALF, join them: a high, b low."""
    a_bits = a.to(FLOAT).to(HALF, bitcast=True).to(WORD)
    b_bits = b.to(FLOAT).to(HALF, bitcast=True).to(WORD)
    return (a_bits << BITS) | b_bits


@triton.jit
def unpack_pair(word, FLOAT: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr):
    """The inverse of :func:`pack_pair`, returning float32 values."""
    a = (word >> BITS).to(HALF).to(FLOAT, bitcast=True)
    b = word.to(HALF).to(FLOAT, bitcast=True)  # the narrowing cast keeps the low bits
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def combine_words(left, right, FLOAT: tl.constexpr, HALF: tl.constexpr, WORD: tl.constexpr, BITS: tl.constexpr):
    """Unpack, compose the two maps in float32, pack again (rounding to FLOAT)."""
    a_left, b_left = unpack_pair(left, FLOAT, HALF, BITS)
    a_right, b_right = unpack_pair(right, FLOAT, HALF, BITS)
    a, b = first_order_combine(a_left, b_left, a_right, b_right)
    return pack_pair(a, b, FLOAT, HALF, WORD, BITS)


# tl.associative_scan passes only the operands, so each word layout gets its own combine
@triton.jit
def combine_float32_words(left, right):
    return combine_words(left, right, tl.float32, tl.uint32, tl.uint64, 32)


@triton.jit
def combine_bfloat16_words(left, right):
    return combine_words(left, right, tl.bfloat16, tl.uint16, tl.uint32, 16)


@triton.jit
def combine_float16_words(left, right):
    return combine_words(left, right, tl.float16, tl.uint16, tl.uint32, 16)


@lean_launch
@triton.jit
def packed_scan_kernel(a_ptr, b_ptr, h_ptr, length, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    inside = t < length
    row_start = tl.program_id(0).to(tl.int64) * length
    a = tl.load(a_ptr + row_start + t, mask=inside, other=1.0)
    b = tl.load(b_ptr + row_start + t, mask=inside, other=0.0)
    FLOAT: tl.constexpr = a_ptr.dtype.element_ty
    if FLOAT == tl.float32:
        words = pack_pair(a, b, tl.float32, tl.uint32, tl.uint64, 32)
        scanned = tl.associative_scan(words, 0, combine_float32_words)
        _, h = unpack_pair(scanned, tl.float32, tl.uint32, 32)
    elif FLOAT == tl.bfloat16:
        words = pack_pair(a, b, tl.bfloat16, tl.uint16, tl.uint32, 16)
        scanned = tl.associative_scan(words, 0, combine_bfloat16_words)
        _, h = unpack_pair(scanned, tl.bfloat16, tl.uint16, 16)
    else:
        words = pack_pair(a, b, tl.float16, tl.uint16, tl.uint32, 16)
        scanned = tl.associative_scan(words, 0, combine_float16_words)
        _, h = unpack_pair(scanned, tl.float16, tl.uint16, 16)
    tl.store(h_ptr + row_start + t, h.to(h_ptr.dtype.element_ty), mask=inside)


def packed_scan_forward(a, b):
    """a, b: (rows, L) contiguous, same dtype, L <= MAX_LENGTH. Returns h like a (zero initial state)."""
    rows, length = a.shape
    if length > MAX_LENGTH:
        raise ValueError(f"the one-block packed scan takes at most {MAX_LENGTH} steps; got {length}")
    block = next_power_of_2(length)
    h = outputs.empty(a.shape, a.dtype, a.device)
    packed_scan_kernel[(rows,)](a, b, h, length, BLOCK=block, num_warps=warps_for(block))
    return h
