"""Attention written out in plain PyTorch: the N x N score matrix, materialised.

``naive_attention`` is the ground truth of chapter 7 when run in float64, and, run in a 16-bit
dtype, the yardstick of the accuracy rule in :mod:`mamba_annotated.testing`: a kernel's error
against the float64 result may be at most twice the error of this same computation done in the
kernel's dtype.
"""
import math

import torch


def distances(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) int64: i + seqlen_k - seqlen_q - j, how far key j lies in query i's past,
    the diagonal aligned to the bottom-right corner as in FlashAttention >= 2.1."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return i + (seqlen_k - seqlen_q) - j


def window_mask(seqlen_q: int, seqlen_k: int, window=(-1, -1), device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: -right <= distance <= left, a
    side of ``window = (left, right)`` that is negative unbounded. Causal is (-1, 0): with
    seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries then see no key at all."""
    distance = distances(seqlen_q, seqlen_k, device)
    left, right = window
    seen = torch.ones_like(distance, dtype=torch.bool)
    if right >= 0:
        seen &= distance >= -right
    if left >= 0:
        seen &= distance <= left
    return seen


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: j <= i + seqlen_k - seqlen_q."""
    return window_mask(seqlen_q, seqlen_k, (-1, 0), device)


def geometric_alibi_slopes(n: int, device=None) -> torch.Tensor:
    """ALiBi's slopes for n heads, float32: the geometric series 2^(-8 h / n), h = 1..n, of its paper."""
    return 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float32, device=device) / n)


def attention_logits(q, k, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(batch, heads, seqlen_q, seqlen_k) logits in q's dtype, -inf where the window hides a key.

    q (batch, seqlen_q, heads, d); k (batch, seqlen_k, kv_heads, d) with kv_heads dividing heads.
    The logits are scale * q.k, or softcap * tanh(scale * q.k / softcap) when softcap > 0, minus
    slope * |distance| with ALiBi slopes ((heads,) or (batch, heads)); keys outside the window
    (left, right) (causal: right = 0) are masked."""
    heads, kv_heads = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # (batch, heads, seqlen, d): each group of heads // kv_heads query heads shares one key/value head
    q_ = q.transpose(1, 2)
    k_ = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = scale * (q_ @ k_.transpose(-1, -2))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).expand(q.shape[0], heads)[:, :, None, None]
        scores = scores - slopes * distances(q.shape[1], k.shape[1], q.device).abs().to(scores.dtype)
    left, right = window
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        scores = scores.masked_fill(~window_mask(q.shape[1], k.shape[1], (left, right), q.device), float("-inf"))
    return scores


def naive_attention(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                    dropout_p=0.0, dropout_mask=None):
    """softmax(logits) v in q's dtype (logits of :func:`attention_logits`); returns (out, lse) in
    flash_attn's layout: out like q, lse (batch, heads, seqlen_q), the natural-log sum of
    exp(logits) of each query row. A row that sees no key gets out = 0 and, as in flash_attn,
    lse = +inf: then exp(S - lse) = 0 for every score. With ``dropout_mask`` (bool, (batch,
    heads, seqlen_q, seqlen_k), True where a probability is kept) the probabilities are multiplied
    by dropout_mask / (1 - dropout_p) before v; lse is that of the probabilities before dropout.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    scores = attention_logits(q, k, causal, softmax_scale, window, softcap, alibi_slopes)
    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # a row that sees no key
    # an all-masked row: 0/0 -> 0 (a select on those rows alone: a NaN the inputs hold stays NaN)
    sees_no_key = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1).masked_fill(sees_no_key, 0.0)
    if dropout_mask is not None:
        probs = probs * dropout_mask / (1.0 - dropout_p)
    v_ = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    out = (probs @ v_).transpose(1, 2)
    return out, lse


def attention_ref(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, dropout_mask=None):
    """The float64 ground truth: naive_attention on float64 copies; returns (out, lse) in float64."""
    slopes = alibi_slopes.double() if alibi_slopes is not None else None
    return naive_attention(q.double(), k.double(), v.double(), causal, softmax_scale, window, softcap, slopes,
                           dropout_p, dropout_mask)
