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
    loses the low digits of small x): t = (1 - e) / (1 + e) with e = exp(-2|x|), where 1 - e is
    computed as (1 - e) * 2|x| / -log(e) below |x| = 1/2, which cancels the rounding of e (Kahan's
    expm1)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    small = a < 0.5
    log_e = tl.log(tl.where(small & (e != 1.0), e, 0.5))  # 0.5: any number away from 0 and 1
    one_minus_e = tl.where(small, tl.where(e == 1.0, 2.0 * a, (1.0 - e) * (2.0 * a) / -log_e), 1.0 - e)
    t = one_minus_e / (2.0 - one_minus_e)
    return tl.where(x < 0, -t, t)


@triton.jit
def approximate_tanh(x):
    """The GPU's one-instruction ``tanh.approx.f32`` (relative error about 2^-11): FlashAttention's
    choice for the cap, accurate enough for logits of 16-bit inputs, whose P is rounded to 16 bits."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def logits2(qk, distance, qk_scale, cap2, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """(s, t) for a tile of products qk: s the base-2 logits, t = tanh(scale * qk / c) when soft-capped
    (the backward pass needs 1 - t^2) and qk itself otherwise. ``SOFTCAP`` is a :func:`softcap_mode`.
    ``distance`` is a tile (or a broadcastable pair of vectors) of query-key distances, read only
    with ALiBi."""
    if SOFTCAP == APPROXIMATE_TANH:
        t = approximate_tanh(qk * qk_scale)
        s = t * cap2
    elif SOFTCAP == EXACT_TANH:
        t = tanh(qk * qk_scale)
        s = t * cap2
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        s = s - slope2 * tl.abs(distance).to(tl.float32)
    return s, t


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
