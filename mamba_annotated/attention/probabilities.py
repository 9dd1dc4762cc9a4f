"""The attention probabilities with the dropout mask marked, as flash_attn returns them for tests.

``attention(..., dropout_p > 0, return_attn_probs=True)`` returns, besides out and lse, the
(batch, heads, seqlen_q, seqlen_k) matrix of probabilities P = exp(logits - lse) in q's dtype,
each entry that dropout zeroed negated (flash_attn's S_dmask convention: ``S_dmask >= 0`` is the
keep mask, ``S_dmask.abs()`` the probabilities). A test can then apply the very mask of the
forward and backward kernels to a float64 reference. Entries a window hides are 0.

The kernel rebuilds each tile the way the backward pass does (logits from q.k, the stored lse,
the window, :func:`.scores.dropout_keep`), so the mask it marks is the one the other kernels
drew. It writes N x N numbers: for tests and teaching, not for training.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..triton_ops import LOG2E, block_size, cdiv, dot_precision, mm
from .scores import alibi_slope2, alibi_strides, dropout_keep, logit_scales, logits2, softcap_mode, visible

BLOCK_M, BLOCK_N = 32, 32


@triton.jit
def attention_probabilities_kernel(q_ptr, k_ptr, lse_ptr, alibi_ptr, seed_ptr, probs_ptr,
                                   stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                                   stride_ab, stride_ah, seqlen_q, seqlen_k, heads, group, head_dim,
                                   qk_scale, cap2, window_left, window_right, dropout_p,
                                   WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                                   ALIBI: tl.constexpr, PRECISION: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (query blocks, key blocks, batch * heads): one tile of the marked probabilities."""
    bh = tl.program_id(2)
    batch = bh // heads
    head = bh % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + rows.to(tl.int64)[:, None] * stride_qm
                + offs_d[None, :], mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < head_dim), other=0.0)
    k = tl.load(k_ptr + batch.to(tl.int64) * stride_kb + (head // group) * stride_kh
                + keys.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=(keys[:, None] < seqlen_k) & (offs_d[None, :] < head_dim), other=0.0)
    row_base = bh.to(tl.int64) * seqlen_q
    lse2 = tl.load(lse_ptr + row_base + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    distance = rows[:, None] + (seqlen_k - seqlen_q) - keys[None, :]
    slope2 = alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI)
    s, _ = logits2(mm(q, tl.trans(k), PRECISION), distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
    seen = visible(distance, keys[None, :], seqlen_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT)
    p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)
    keep = dropout_keep(tl.load(seed_ptr), row_base, rows[:, None], keys[None, :], seqlen_k, dropout_p)
    probs_ptrs = probs_ptr + (row_base + rows[:, None]) * seqlen_k + keys[None, :]
    tl.store(probs_ptrs, tl.where(keep, p, -p).to(probs_ptr.dtype.element_ty),
             mask=(rows[:, None] < seqlen_q) & (keys[None, :] < seqlen_k))


def marked_probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, window_left: int,
                         window_right: int, softcap: float, alibi_slopes, dropout_p: float,
                         dropout_seed: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) in q's dtype: the probabilities of the forward pass that
    returned ``lse`` with ``dropout_seed``, negated where dropout zeroed them. q, k with last
    strides 1; arguments as :func:`.forward.attention_forward`."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    probs = outputs.empty((batch, heads, seqlen_q, seqlen_k), q.dtype, q.device)
    if probs.numel() == 0:
        return probs
    grid = (cdiv(seqlen_q, BLOCK_M), cdiv(seqlen_k, BLOCK_N), batch * heads)
    attention_probabilities_kernel[grid](
        q, k, lse, lse if alibi_slopes is None else alibi_slopes, dropout_seed, probs,
        *q.stride()[:3], *k.stride()[:3], *alibi_strides(alibi_slopes), seqlen_q, seqlen_k, heads,
        heads // kv_heads, head_dim, *logit_scales(softmax_scale, softcap), window_left, window_right,
        float(dropout_p), WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
        SOFTCAP=softcap_mode(softcap, q.dtype), ALIBI=alibi_slopes is not None, PRECISION=dot_precision(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_size(head_dim))
    return probs
