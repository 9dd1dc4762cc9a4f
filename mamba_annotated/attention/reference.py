"""Attention written out in plain PyTorch: the N x N score matrix, materialised.

``naive_attention`` is the ground truth of chapter 7 when run in float64, and, run in a 16-bit
dtype, the yardstick of the accuracy rule in :mod:`mamba_annotated.testing`: a kernel's error
against the float64 result may be at most twice the error of this same computation done in the
kernel's dtype.
"""
import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: j <= i + seqlen_k - seqlen_q.

    The diagonal is aligned to the bottom-right corner, as in FlashAttention >= 2.1: the last query
    sees every key. With seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see no key at all.
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def naive_attention(q, k, v, causal=False, softmax_scale=None):
    """softmax(scale * q k^T) v in q's dtype; returns (out, lse) in flash_attn's layout.

    q (batch, seqlen_q, heads, d); k, v (batch, seqlen_k, kv_heads, d) with kv_heads dividing heads.
    out like q; lse (batch, heads, seqlen_q), the natural-log sum of exp(scores) of each query row.
    A row that sees no key (causal with seqlen_q > seqlen_k, or no keys at all) gets out = 0 and,
    as in flash_attn, lse = +inf: then exp(S - lse) = 0 for every score.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # (batch, heads, seqlen, d): each group of heads // kv_heads query heads shares one key/value head
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    k_ = k_.repeat_interleave(heads // kv_heads, dim=1)
    v_ = v_.repeat_interleave(heads // kv_heads, dim=1)
    scores = scale * (q_ @ k_.transpose(-1, -2))
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # a row that sees no key
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: 0/0 -> 0
    out = (probs @ v_).transpose(1, 2)
    return out, lse


def attention_ref(q, k, v, causal=False, softmax_scale=None):
    """The float64 ground truth: naive_attention on float64 copies; returns (out, lse) in float64."""
    out, lse = naive_attention(q.double(), k.double(), v.double(), causal, softmax_scale)
    return out, lse
