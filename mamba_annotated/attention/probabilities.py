"""The attention probabilities with the dropout mask marked, as flash_attn returns them for tests.

``attention(..., dropout_p > 0, return_attn_probs=True)`` returns, besides out and lse, the
(batch, heads, seqlen_q, seqlen_k) matrix of probabilities P = exp(logits - lse) in q's dtype,
each entry that dropout zeroed negated (flash_attn's S_dmask convention: ``S_dmask >= 0`` is the
keep mask, ``S_dmask.abs()`` the probabilities). A test can then apply the very mask of the
forward and backward kernels to a float64 reference. Entries a window hides are 0. Packed
sequences (``attention_varlen``) get (batch, heads, max_seqlen_q, max_seqlen_k), sequence b's
probabilities in [b, :, :L_q, :L_k] and 0 around them: the layout of the dropout counter.

The kernel rebuilds each tile the way the backward pass does (logits from q.k, the stored lse,
the window, :func:`.scores.dropout_keep`), so the mask it marks is the one the other kernels
drew. It writes N x N numbers: for tests and teaching, not for training.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..triton_ops import LOG2E, block_size, cdiv, dot_precision, mm
from .packed import packed_strides, sequence_rows
from .scores import alibi_slope2, alibi_strides, dropout_keep, logit_scales, logits2, softcap_mode, visible

BLOCK_M, BLOCK_N = 32, 32


@triton.jit
def attention_probabilities_kernel(q_ptr, k_ptr, lse_ptr, alibi_ptr, seed_ptr, probs_ptr, cu_seqlens_q_ptr,
                                   cu_seqlens_k_ptr, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                                   stride_ab, stride_ah, seqlen_q, seqlen_k, total_q, total_k, heads, group, head_dim,
                                   qk_scale, cap2, window_left, window_right, dropout_p,
                                   VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PRECISION: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (query blocks, key blocks, batch * heads): one tile of the marked probabilities. VARLEN:
    packed sequences (:mod:`.packed`), seqlen_q and seqlen_k their longest lengths, the sizes of
    the probabilities' last two dims; a sequence's entries past its own lengths are 0."""
    bh = tl.program_id(2)
    batch = bh // heads
    head = bh % heads
    max_seqlen_q = seqlen_q  # the probabilities are (batch, heads, max_seqlen_q, max_seqlen_k)
    max_seqlen_k = seqlen_k
    row_base = bh.to(tl.int64) * max_seqlen_q
    if VARLEN:  # from here on seqlen_q, seqlen_k are this sequence's own, the pointers at its first rows
        q_start, seqlen_q = sequence_rows(cu_seqlens_q_ptr, batch, total_q)
        k_start, seqlen_k = sequence_rows(cu_seqlens_k_ptr, batch, total_k)
        q_ptr += q_start.to(tl.int64) * stride_qm
        k_ptr += k_start.to(tl.int64) * stride_kn
        lse_rows = lse_ptr + head.to(tl.int64) * total_q + q_start  # lse (heads, total_q)
    else:
        lse_rows = lse_ptr + row_base
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + rows.to(tl.int64)[:, None] * stride_qm
                + offs_d[None, :], mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < head_dim), other=0.0)
    k = tl.load(k_ptr + batch.to(tl.int64) * stride_kb + (head // group) * stride_kh
                + keys.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=(keys[:, None] < seqlen_k) & (offs_d[None, :] < head_dim), other=0.0)
    lse2 = tl.load(lse_rows + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    distance = rows[:, None] + (seqlen_k - seqlen_q) - keys[None, :]
    slope2 = alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI)
    s, _ = logits2(mm(q, tl.trans(k), PRECISION), distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
    seen = visible(distance, keys[None, :], seqlen_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT)
    p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)
    keep = dropout_keep(tl.load(seed_ptr), row_base, rows[:, None], keys[None, :], max_seqlen_k, dropout_p)
    probs_ptrs = probs_ptr + (row_base + rows[:, None]) * max_seqlen_k + keys[None, :]
    tl.store(probs_ptrs, tl.where(keep, p, -p).to(probs_ptr.dtype.element_ty),
             mask=(rows[:, None] < max_seqlen_q) & (keys[None, :] < max_seqlen_k))


def marked_probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, window_left: int,
                         window_right: int, softcap: float, alibi_slopes, dropout_p: float,
                         dropout_seed: torch.Tensor, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                         max_seqlen_k=0) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) in q's dtype: the probabilities of the forward pass that
    returned ``lse`` with ``dropout_seed``, negated where dropout zeroed them. q, k with last
    strides 1; arguments as :func:`.forward.attention_forward`, packed sequences too: then
    (batch, heads, max_seqlen_q, max_seqlen_k), sequence b's entries in [:L_q, :L_k], 0 elsewhere."""
    varlen = cu_seqlens_q is not None
    if varlen:
        (total_q, heads, head_dim), (total_k, kv_heads) = q.shape, k.shape[:2]
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        strides = packed_strides(q, k)
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        total_q = total_k = 0
        strides = (*q.stride()[:3], *k.stride()[:3])
    probs = outputs.empty((batch, heads, seqlen_q, seqlen_k), q.dtype, q.device)
    if probs.numel() == 0:
        return probs
    grid = (cdiv(seqlen_q, BLOCK_M), cdiv(seqlen_k, BLOCK_N), batch * heads)
    attention_probabilities_kernel[grid](
        q, k, lse, lse if alibi_slopes is None else alibi_slopes, dropout_seed, probs,
        cu_seqlens_q if varlen else lse, cu_seqlens_k if varlen else lse, *strides, *alibi_strides(alibi_slopes),
        seqlen_q, seqlen_k, total_q, total_k, heads, heads // kv_heads, head_dim,
        *logit_scales(softmax_scale, softcap), window_left, window_right, float(dropout_p), VARLEN=varlen,
        WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0, SOFTCAP=softcap_mode(softcap, q.dtype),
        ALIBI=alibi_slopes is not None, PRECISION=dot_precision(q.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=block_size(head_dim))
    return probs
