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


def rotate_ref(x, cos, sin, positions, interleaved):
    """Rotary embedding in float64 (see :mod:`.rotary` for the pairs), rounded to x's dtype: x
    (batch, L, heads, d), ``positions`` (batch, L) rows of the (seqlen_ro, rotary_dim / 2) tables."""
    half = cos.shape[1]
    angle_cos = cos.double()[positions][:, :, None]
    angle_sin = sin.double()[positions][:, :, None]
    rot = x[..., :2 * half].double()
    if interleaved:
        x_a, x_b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x_a * angle_cos - x_b * angle_sin, x_b * angle_cos + x_a * angle_sin], -1).flatten(-2)
    else:
        x_a, x_b = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x_a * angle_cos - x_b * angle_sin, x_b * angle_cos + x_a * angle_sin], -1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], -1)


def kvcache_sequences(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=False, window=(-1, -1),
                      rotary_interleaved=True):
    """What flash_attn's ``flash_attn_with_kvcache`` attends over, written out sequence by sequence:
    (queries, keys, values, k_cache after, v_cache after), the first three lists of one tensor per
    sequence b: its queries (1, seqlen_q, heads, d), rotated if rotary tables are given, and its keys
    and values (1, L_b, kv_heads, d) read from the cache after the append.

    The rules, from flash_attn 2.8 (``flash_attn_interface.py`` and ``csrc/flash_attn/src``):
    sequence b lives in cache row cache_batch_idx[b] (b without it), or in the pages
    block_table[b, p // page_size], row p % page_size, of a paged cache; it holds positions
    [cache_leftpad[b], cache_seqlens[b]) (0 and the cache's capacity when not given); new keys
    and values go to positions cache_seqlens[b] + t, the keys rotated at those positions; the
    queries are rotated at cache_seqlens[b] + i when the attention is causal or local (``window``
    as flash_attn resolves it, not (-1, -1)), else all at cache_seqlens[b]. Rotation is exact in
    float64, then rounded to the inputs' dtype (:func:`rotate_ref`), as the op rounds it.
    """
    batch, seqlen_q = q.shape[:2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    ends = [capacity] * batch if cache_seqlens is None else (
        [int(cache_seqlens)] * batch if isinstance(cache_seqlens, int) else cache_seqlens.tolist())
    starts = [0] * batch if cache_leftpad is None else cache_leftpad.tolist()
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()

    def location(b, p):
        """(cache row or page, row within it) of position p of sequence b."""
        if paged:
            return int(block_table[b, p // page_size]), p % page_size
        return rows[b], p

    rotary = rotary_cos is not None
    new = 0 if k is None else k.shape[1]
    if k is not None:
        if rotary:
            positions = torch.tensor(ends, device=q.device)[:, None] + torch.arange(new, device=q.device)
            k = rotate_ref(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        for b in range(batch):
            for t in range(new):
                k_cache[location(b, ends[b] + t)] = k[b, t]
                v_cache[location(b, ends[b] + t)] = v[b, t]
    if rotary:
        per_row = causal or window != (-1, -1)
        positions = torch.tensor(ends, device=q.device)[:, None] + (
            torch.arange(seqlen_q, device=q.device) if per_row else torch.zeros(seqlen_q, dtype=torch.long,
                                                                               device=q.device))
        q = rotate_ref(q, rotary_cos, rotary_sin, positions, rotary_interleaved)
    def gather(cache, b):
        """(1, L_b, kv_heads, d): sequence b's positions [start, end + new) of ``cache``."""
        where = [location(b, p) for p in range(starts[b], ends[b] + new)]
        rows = torch.stack([cache[w] for w in where]) if where else cache.new_zeros((0, *cache.shape[2:]))
        return rows[None]

    queries = [q[b:b + 1] for b in range(batch)]
    keys = [gather(k_cache, b) for b in range(batch)]
    values = [gather(v_cache, b) for b in range(batch)]
    return queries, keys, values, k_cache, v_cache


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                      window=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, attend=None):
    """The float64 ground truth of ``attention_with_kvcache``: (out, lse, k_cache after, v_cache
    after), out (batch, seqlen_q, heads, d) and lse (batch, heads, seqlen_q) float64, the caches in
    their dtype. Each sequence of :func:`kvcache_sequences` goes through :func:`attention_ref`, its
    queries and keys bottom-right aligned with its own key count. ``window`` is (left, right) as
    flash_attn resolves ``window_size`` (against the cache's capacity). ``attend`` replaces
    attention_ref (:func:`naive_attention` gives the same computation in the inputs' dtype)."""
    attend = attend or attention_ref
    queries, keys, values, k_after, v_after = kvcache_sequences(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        causal, window, rotary_interleaved)
    outs, lses = [], []
    for b, (q_b, k_b, v_b) in enumerate(zip(queries, keys, values)):
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        out, lse = attend(q_b, k_b, v_b, causal, softmax_scale, window, softcap, slopes)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_after, v_after


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, window=(-1, -1),
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_mask=None, attend=None):
    """The ground truth of ``attention_varlen``: each packed sequence through :func:`attention_ref`
    on its own (its diagonal bottom-right aligned with its own lengths), the results packed again.
    q (total_q, heads, d), k, v (total_k, kv_heads, d), cu_seqlens int32 (batch + 1,); ``window``
    as flash_attn resolves it (against max_seqlen_k); ``alibi_slopes`` (heads,) or (batch, heads);
    ``dropout_mask`` (batch, heads, max_q, max_k) bool, sequence b's in [b, :, :L_q, :L_k].
    Returns (out (total_q, heads, d), lse (heads, total_q)) in float64, rows past the last sequence
    0 and +inf; ``attend`` replaces attention_ref (:func:`naive_attention`: the same computation in
    the inputs' dtype, whose results keep that dtype)."""
    attend = attend or attention_ref
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b, (start_q, end_q, start_k, end_k) in enumerate(zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])):
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        mask = None if dropout_mask is None else dropout_mask[b:b + 1, :, :end_q - start_q, :end_k - start_k]
        out, lse = attend(q[None, start_q:end_q], k[None, start_k:end_k], v[None, start_k:end_k], causal, softmax_scale,
                          window, softcap, slopes, dropout_p, mask)
        outs.append(out[0])
        lses.append(lse[0])
    out, lse = attend(q[None, :0], k[None, :0], v[None, :0], causal, softmax_scale, window, softcap, None, dropout_p,
                      None)  # no row: the dtypes of the results
    unowned = q.shape[0] - bounds_q[-1]
    outs.append(out.new_zeros((unowned, *q.shape[1:])))
    lses.append(lse.new_full((q.shape[1], unowned), math.inf))
    return torch.cat(outs), torch.cat(lses, dim=1)
