"""Public attention function: input checks and the autograd Function around chapter 7's kernels."""
import math
import numbers

import torch

from ..validation import check_tensor
from .backward import METHODS, attention_backward
from .forward import attention_forward

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def check_attention_inputs(q, k, v, softmax_scale):
    """q (batch, seqlen_q, heads, d); k, v (batch, seqlen_k, kv_heads, d); kv_heads divides heads."""
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    check_tensor("v", v, ndim=4)
    batch, seqlen_q, heads, head_dim = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must have shape (batch={batch}, seqlen_k, kv_heads, head_dim={head_dim}) "
                         f"to match q {tuple(q.shape)}; got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}; got {tuple(v.shape)}")
    if heads % k.shape[2] != 0:
        raise ValueError(f"the kv_heads of k and v ({k.shape[2]}) must divide the heads of q ({heads})")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (last dimension of q, k, v) must be between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM}; got {head_dim}")
    for name, t in (("q", q), ("k", k)):
        if 0 in t.shape:
            raise ValueError(f"{name} must not be empty; got shape {tuple(t.shape)}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(softmax_scale).__name__}")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, method):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out, lse = attention_forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.method = causal, softmax_scale, method
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, _last_dim_contiguous(grad_out),
                                        ctx.causal, ctx.softmax_scale, ctx.method)
        return dq, dk, dv, None, None, None


def attention_variant(q, k, v, causal=False, softmax_scale=None, return_lse=False, backward="split"):
    """:func:`attention` with a choice of backward kernels, for the chapter and the benchmark:
    "split" (the default: dK/dV kernel + dQ kernel), "fused" (one kernel, two loops) or "atomic"
    (dQ by float32 atomics; not bitwise reproducible)."""
    check_attention_inputs(q, k, v, softmax_scale)
    if backward not in METHODS:
        raise ValueError(f"backward must be one of {METHODS}; got {backward!r}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = Attention.apply(q, k, v, bool(causal), scale, backward)
    return (out, lse) if return_lse else out


def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """softmax(softmax_scale * q k^T) v without materialising the scores (chapter 7).

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim) with kv_heads
    dividing heads (grouped-query attention: query head h uses key/value head h // (heads // kv_heads)),
    as in ``flash_attn_func``. float16, bfloat16 or float32 (float32 dots are exact IEEE unless
    ``torch.set_float32_matmul_precision("high")`` allows TF32); 16 <= head_dim <= 256, any.
    ``softmax_scale`` defaults to 1 / sqrt(head_dim). ``causal=True`` lets query i see key j iff
    j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner, as flash-attn >= 2.1); a query
    that sees no key gets a zero output and lse = -inf.
    Returns out like q, and with ``return_lse`` also lse (batch, heads, seqlen_q) float32, the
    natural-log sum of exp(scores) per query row. Differentiable in q, k, v; the backward pass is
    deterministic.
    """
    return attention_variant(q, k, v, causal, softmax_scale, return_lse)
