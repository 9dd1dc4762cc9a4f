"""What becomes of a tile of products q.k before the softmax, shared by the forward and backward
kernels of chapter 7: the scale, tanh soft-capping, the ALiBi bias and the window mask.

Every rule is written in terms of the *distance* of a (query i, key j) pair from the diagonal,
``distance = i + (seqlen_k - seqlen_q) - j``, the diagonal aligned to the bottom-right corner as
in flash_attn: distance 0 is the key at the query's own position, positive distances lie in its
past. Then
    window (left, right)   query i sees key j iff -right <= distance <= left; a side that is not
                           bounded is not tested. Causal attention is right = 0, left unbounded.
    softcap c > 0          the natural logit is c * tanh(scale * q.k / c) instead of scale * q.k
    ALiBi slope m          the logit gets -m * |distance| added
    dropout p              after the softmax, each probability is kept with probability 1 - p
                           and scaled by 1 / (1 - p), or zeroed (:func:`dropout_keep`)

The kernels take exponentials base 2, so :func:`logits2` returns the logits times log2(e): the
host folds log2(e) into ``qk_scale`` (no softcap) or into ``cap2 = c * log2(e)`` (softcap, where
``qk_scale = scale / c`` is the argument of tanh) and into the kernel's ALiBi slope.
"""
import torch
import triton
import triton.language as tl

from ..runtime import INTERPRETED
from ..triton_ops import LOG2E

# How the cap's tanh is computed (the kernels' SOFTCAP constexpr): not at all, exactly, or by the
# GPU's approximate instruction
NO_SOFTCAP, EXACT_TANH, APPROXIMATE_TANH = (tl.constexpr(mode) for mode in range(3))


@triton.jit
def tanh(x):
    """tanh to float32 rounding for every x (the interpreter has no libdevice, and 1 - 2 / (e^2x + 1)
    loses the low digits of small x). With e = exp(-2|x|): below |x| = 1/2, t = (1 - e) / (1 + e)
    where 1 - e is computed as (1 - e) * 2|x| / -log(e), which cancels the rounding of e (Kahan's
    expm1); above, t = 1 - 2e / (1 + e), whose last subtraction is the only rounding of any size
    near saturation (dividing 1 - e by 1 + e there cost up to 1.5 units in the last place, which
    a cap of 50 magnifies in the logits)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    small = a < 0.5
    log_e = tl.log(tl.where(small & (e != 1.0), e, 0.5))  # 0.5: any number away from 0 and 1
    one_minus_e = tl.where(e == 1.0, 2.0 * a, (1.0 - e) * (2.0 * a) / -log_e)
    t = tl.where(small, one_minus_e / (2.0 - one_minus_e), 1.0 - 2.0 * e / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def tanh_derivative(x):
    """1 - tanh(x)^2, written 4e / (1 + e)^2 with e = exp(-2|x|): where tanh saturates, 1 - t^2 would
    subtract two numbers near 1 and keep only the rounding error of t."""
    e = tl.exp(-2.0 * tl.abs(x))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def approximate_tanh(x):
    """The GPU's one-instruction ``tanh.approx.f32`` (relative error about 2^-11): FlashAttention's
    choice for the cap, accurate enough for logits of 16-bit inputs, whose P is rounded to 16 bits."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def logits2(qk, distance, qk_scale, cap2, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """(s, dcap) for a tile of products qk: s the base-2 logits and, when soft-capped, dcap the
    derivative of the cap, 1 - tanh^2(scale * qk / c), by which the backward pass multiplies dS
    (qk itself otherwise, never read; the forward pass reads neither, and the compiler drops it).
    ``SOFTCAP`` is a :func:`softcap_mode`. ``distance`` is a tile (or a broadcastable pair of
    vectors) of query-key distances, read only with ALiBi."""
    if SOFTCAP == APPROXIMATE_TANH:  # the approximation's own error dwarfs the cancellation in 1 - t^2
        t = approximate_tanh(qk * qk_scale)
        s = t * cap2
        dcap = 1.0 - t * t
    elif SOFTCAP == EXACT_TANH:
        s = tanh(qk * qk_scale) * cap2
        dcap = tanh_derivative(qk * qk_scale)
    else:
        s = qk * qk_scale
        dcap = qk
    if ALIBI:
        s = s - slope2 * tl.abs(distance).to(tl.float32)
    return s, dcap


@triton.jit
def visible(distance, key, seqlen_k, window_left, window_right,
            WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Whether each (query, key) pair is seen: the key exists and lies in the window."""
    seen = key < seqlen_k
    if WINDOW_RIGHT:
        seen = seen & (distance >= -window_right)
    if WINDOW_LEFT:
        seen = seen & (distance <= window_left)
    return seen


@triton.jit
def key_range(start_m, seqlen_k, causal_offset, window_left, window_right,
              WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, hi, mask_from, mask_until) for the query tile [start_m, start_m + BLOCK_M): the keys
    [lo, hi) are seen by some row of the tile, lo a multiple of BLOCK_N, so the blocks outside are
    never loaded and a window costs what it covers, not seqlen_k. A key block that reaches past
    mask_from (right of the window, or past the end of the keys, for the tile's first row) or
    starts before mask_until (left of the window for its last row) holds a pair that some row
    does not see: only those blocks need the mask."""
    lo = 0
    hi = seqlen_k
    mask_from = seqlen_k
    mask_until = 0
    if WINDOW_RIGHT:
        hi = tl.minimum(seqlen_k, tl.maximum(0, start_m + BLOCK_M + causal_offset + window_right))
        mask_from = tl.minimum(seqlen_k, start_m + causal_offset + window_right + 1)
    if WINDOW_LEFT:
        lo = tl.maximum(0, start_m + causal_offset - window_left) // BLOCK_N * BLOCK_N
        mask_until = start_m + BLOCK_M - 1 + causal_offset - window_left
    return lo, hi, mask_from, mask_until


@triton.jit
def dropout_keep(seed, row_base, rows, keys, seqlen_k, dropout_p):
    """Whether each (query row, key) pair keeps its probability under dropout. The pair's index
    i = (row_base + row) * seqlen_k + key in the (batch, heads, seqlen_q, seqlen_k) matrix of
    probabilities (packed sequences: (batch, heads, max_seqlen_q, max_seqlen_k), the kernels
    passing max_seqlen_k as seqlen_k), 64 bits wide, is the counter of Philox, a counter-based
    generator: a pure function of (seed, counter), so the backward kernels regenerate the very
    mask the forward pass used, whatever their tiles and in whichever orientation, and nothing of
    size N x N is stored.
    The counter goes in as two 32-bit words (low, high), which keeps Philox on 32-bit arithmetic:
    handed one 64-bit counter, some Triton versions run the 64-bit variant, whose 64-bit multiplies
    the GPU emulates. The pair is kept iff the top 24 bits of the first output word, read as a
    fraction u in [0, 1), satisfy u >= dropout_p. ``row_base`` is (batch * heads + head) * seqlen_q
    (max_seqlen_q) in 64 bits."""
    index = (row_base + rows) * seqlen_k + keys
    low = index.to(tl.uint32)  # truncates to the low 32 bits
    high = (index >> 32).to(tl.uint32)
    zero = low * 0
    word, _, _, _ = tl.philox(seed, low, high, zero, zero)
    return (word >> 8).to(tl.float32) * 5.9604644775390625e-08 >= dropout_p  # 2^-24: u on a grid of 2^24


@triton.jit
def alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI: tl.constexpr):
    """The ALiBi slope of one (batch, head), times log2(e); 0.0 without ALiBi (never read then)."""
    if ALIBI:
        slope2 = tl.load(alibi_ptr + batch * stride_ab + head * stride_ah).to(tl.float32) * LOG2E
    else:
        slope2 = 0.0
    return slope2


def softcap_mode(softcap: float, dtype: torch.dtype) -> int:
    """The kernels' SOFTCAP: none for softcap <= 0; the hardware tanh for 16-bit inputs on a GPU
    (one instruction instead of the exact :func:`tanh`'s exponential, logarithm and two divisions,
    on the units the softmax's exp2 keeps busy); the exact one for float32 and in the interpreter,
    which has no inline assembly."""
    if softcap <= 0:
        return NO_SOFTCAP.value
    return EXACT_TANH.value if INTERPRETED or dtype == torch.float32 else APPROXIMATE_TANH.value


def logit_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap2) of :func:`logits2`: without softcap, the logits are qk * scale * log2(e);
    with softcap c, they are tanh(qk * scale / c) * c * log2(e)."""
    if softcap > 0:
        return softmax_scale / softcap, softcap * LOG2E.value
    return softmax_scale * LOG2E.value, 0.0


def alibi_strides(alibi_slopes) -> tuple[int, int]:
    """(batch, head) strides of ALiBi slopes of shape (heads,) (the same slopes for every batch row)
    or (batch, heads); (0, 0) without them."""
    if alibi_slopes is None:
        return 0, 0
    if alibi_slopes.dim() == 1:
        return 0, alibi_slopes.stride(0)
    return alibi_slopes.stride(0), alibi_slopes.stride(1)
