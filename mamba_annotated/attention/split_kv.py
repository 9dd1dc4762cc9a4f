"""Attention of a few queries over a long KV cache, the keys split among programs ("flash decoding").

Why split
    A decoding step has one query row per head, or a few. The forward kernel of :mod:`.forward`
    gives each program a tile of query rows of one (batch, head) and walks every key: at batch 1
    with 8 kv heads that is a handful of programs, each streaming a whole cache of 100,000 keys,
    while the GPU has over a hundred SMs. Here the keys of each sequence are cut into
    ``num_splits`` contiguous ranges and every range gets its own program. Each program runs the
    online softmax of :mod:`.forward` over its range and writes a partial result: the output
    normalised over its own keys, out_s, and their log-sum-exp, lse_s. A second kernel merges the
    partials of a row (the exercise of chapter 7, "attention over K1 + K2 from attention over K1
    and over K2"):

        lse = log sum_s exp(lse_s),      out = sum_s exp(lse_s - lse) out_s.

    A range that holds no key the row sees contributes exp(-inf) = 0. With one split the first
    kernel writes the final output itself and the merge is not launched.

Parallelism
    Grid (kv_heads x query-row blocks, batch, splits): the first axis, the one whose size may pass
    65,535 (a long prompt's query rows), is the one CUDA lets grow to 2^31 - 1. The query heads that share a kv head read
    the same keys, so they are packed into the rows of one tile (grouped-query attention): the
    tile's rows are (query i, head g of the group) for r = i * group + g, and every key block loaded
    serves them all. At a decoding step (one query, 32 heads over 8 kv heads) a tile holds the 4
    query heads of one kv head, padded to 16 rows for ``tl.dot``.

Which keys a row sees
    Sequence b holds its keys at the logical positions [key_start_b, key_end_b) (key_start is
    flash_attn's cache_leftpad, key_end is cache_seqlens + the appended keys). Query i and the key
    at position j are ``distance = i + key_end - seqlen_q - j`` apart (bottom-right aligned, as in
    :mod:`.scores`, with the sequence's own key count); the window (left, right) lets the row see
    the key iff -right <= distance <= left. A tile first narrows the keys to the range some of its
    rows see, then splits that range in block-aligned parts, so a window costs what it covers.
    Positions outside [key_start, key_end) are never loaded: whatever the cache holds there (stale
    keys, NaN) cannot reach the output. Inside, a key that some rows of the tile do not see is
    masked for them; a NaN or inf in its value would still reach them through the product as
    0 x NaN, so with a window every block goes through :func:`..triton_ops.drop_hidden_nonfinite`
    (the rows that do see such a value are made NaN at the end, as the plain product makes them).
    A decoding step (one query, causal or not) has no such mask: the right side of a window is
    dropped on the host where it cannot hide a key (right >= seqlen_q - 1).

Cache layouts (LAYOUT)
    "contiguous": k_cache (batch, capacity, kv_heads, d), sequence b in row b; "indexed": row
    cache_batch_idx[b]; "paged": k_cache (num_blocks, page_size, kv_heads, d), the key at position j
    of sequence b in page block_table[b, j // page_size], row j % page_size. Pages of any size
    (flash_attn asks for multiples of 256): each key of a block finds its own page, one gather of
    BLOCK_N table entries per block.

Non-finite partials
    A split whose keys include a NaN or an inf that a row sees ends that row's partial as NaN (its
    sum l is NaN: NaN is neither 0, the mark of a split that saw nothing, nor finite). The merge
    keeps NaN in: its largest lse only shifts the exponentials (``tl.max`` skips a NaN, on the GPU
    and in the interpreter alike, but the NaN partial's own weight exp(NaN - largest) is NaN and
    makes the sum NaN), and no partial is dropped by a test on its lse, which NaN would fail. A row whose merged weights sum
    to exactly 0 saw no key at all: out = 0 and lse = +inf (flash_attn's convention).

Shapes: q (batch, seqlen_q, heads, d), any strides with the last one 1; the caches any strides;
out (batch, seqlen_q, heads, d) contiguous in q's dtype, lse (batch, heads, seqlen_q) float32;
the partials (splits, batch, seqlen_q, heads, d) and (splits, batch, heads, seqlen_q) float32.
Offsets that can pass 2^31 (cache rows, pages, partials) are formed in int64.

Bytes moved (element size s): the keys and values each sequence sees, once: 2 * sum_b L_b *
kv_heads * d * s (the cache itself, at a decoding step), plus q and out; with splits, the
partials written and read once more, 2 * splits * batch * seqlen_q * heads * (d + 1) * 4. FLOPs
4 * batch * seqlen_q * heads * L * d: the kernel is bound by memory, the bytes of the cache.
"""
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED, sm_count
from ..triton_ops import LN2, LOG2E, block_size, cdiv, dot_precision, drop_hidden_nonfinite, mm
from .scores import alibi_strides, logit_scales, logits2, softcap_mode, visible

LAYOUTS = ("contiguous", "indexed", "paged")
MAX_SPLITS = 128

# Tuned on an H200 (Triton 3.6) with ``benchmarks/bench_decoding.py --tune``, 32 heads over 8, head dim
# 128, bfloat16. Split (batch 1, 131072 cached keys): 64-key tiles, 4 warps, 3 stages were within 0.1 %
# of the best of 27 configurations (data/decoding_tune.json). Unsplit, where each program streams a
# whole sequence (the large batches, data/decoding_tune_large_batch.json): at batch 64 (4096 and 16384
# keys) that configuration took 13-15 % more time than the best of 36, and 128-key tiles with 4 warps
# and 3 stages were within 1 % of it (split at batch 1 they had taken 9 % more than 64-key tiles).
SPLIT_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)
UNSPLIT_CONFIG = dict(BLOCK_N=128, num_warps=4, num_stages=3)
# what the pipeline's buffers of key and value tiles may take of the 227 KiB of shared memory an H100
# or H200 gives a program (the rest: the query tile and the compiler's scratch)
TILE_BUFFER_BYTES = 192 * 1024


def decoding_config(head_dim: int, dtype: torch.dtype, split: bool) -> dict:
    """BLOCK_N, num_warps and num_stages of :func:`split_kv_attention`, for a launch with more than
    one split or with one: SPLIT_CONFIG or UNSPLIT_CONFIG, fitted to shared memory
    (:func:`fit_shared_memory`). The interpreter gets a key tile of 16 (its cost grows with the
    tile; the tests' short caches then span several)."""
    if INTERPRETED:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    return fit_shared_memory(SPLIT_CONFIG if split else UNSPLIT_CONFIG, head_dim, dtype)


def fit_shared_memory(config: dict, head_dim: int, dtype: torch.dtype) -> dict:
    """``config`` with its key tile halved until the pipeline's buffers fit in TILE_BUFFER_BYTES:
    Triton keeps num_stages - 1 buffers of a key tile and a value tile in shared memory. Float32 at
    head dims past 128 (256-column tiles) with 64-key tiles in 3 stages asked 276 KiB (the GPU
    sweep's seed 723150), and takes 32-key tiles."""
    config = dict(config)
    tile_bytes = 2 * block_size(head_dim) * torch.finfo(dtype).bits // 8  # one key row and one value row
    while (config["num_stages"] - 1) * config["BLOCK_N"] * tile_bytes > TILE_BUFFER_BYTES and config["BLOCK_N"] > 16:
        config["BLOCK_N"] //= 2
    return config


def rows_per_tile(rows: int) -> int:
    """BLOCK_M for ``rows`` = seqlen_q x (heads per kv head) query rows: all of them up to 64,
    at least 16 (``tl.dot``'s smallest tile)."""
    return block_size(rows, smallest=16, largest=64)


def default_splits(batch: int, kv_heads: int, seqlen_k: int, device: torch.device, *, block_n: int,
                   row_blocks: int = 1) -> int:
    """The number of splits that ``num_splits=0`` asks for: 1 when the batch's tiles alone come close
    to two programs per SM (a split costs a partial written and read back), else the most splits
    whose programs number at most two per SM, with at least two key blocks per split, and at most
    MAX_SPLITS. The rule follows a sweep of split counts on an H200 (data/decoding_splits.json):
    at batch 4, 131072 keys, 8 kv heads, 8 splits (256 programs on 132 SMs) took 499 us and 9
    splits (288) 545 us; at batch 1 and 16 the counts near it differ by a few per cent either way.
    ``seqlen_k`` is the longest a sequence can be (the cache's capacity: the lengths themselves are
    on the device)."""
    tiles = batch * kv_heads * row_blocks
    sms = sm_count() if device.type == "cuda" else 1
    if tiles * 5 >= sms * 8:  # at least 80 % of two programs per SM without splitting
        return 1
    key_blocks = cdiv(max(seqlen_k, 1), block_n)
    return max(1, min(MAX_SPLITS, 2 * sms // max(tiles, 1), key_blocks // 2))


@lean_launch
@triton.jit
def split_kv_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, key_start_ptr, key_end_ptr, pages_ptr, alibi_ptr,
        stride_qb, stride_qm, stride_qh,
        stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
        stride_pb, stride_pn, stride_ob, stride_om, stride_oh, stride_ab, stride_ah,
        batch, seqlen_q, heads, group, head_dim, page_size, num_splits,
        qk_scale, cap2, window_left, window_right,
        WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
        SCALE_FIRST: tl.constexpr, LEFTPAD: tl.constexpr, LAYOUT: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    split = tl.program_id(2)
    b = tl.program_id(1)
    rows_total = seqlen_q * group
    row_blocks = tl.cdiv(rows_total, BLOCK_M)
    kv_head = tl.program_id(0) // row_blocks
    row0 = (tl.program_id(0) % row_blocks) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_valid = rows < rows_total
    query = rows // group                   # the tile's rows: (query, head of the group), head fastest
    head = kv_head * group + rows % group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim

    key_end = tl.load(key_end_ptr + b)
    key_start = 0
    if LEFTPAD:
        key_start = tl.load(key_start_ptr + b)
    causal_offset = key_end - seqlen_q
    # the keys some row of the tile may see, then this split's block-aligned share of them
    lo = key_start
    hi = key_end
    if WINDOW_RIGHT:
        last_query = (tl.minimum(row0 + BLOCK_M, rows_total) - 1) // group
        hi = tl.minimum(hi, last_query + causal_offset + window_right + 1)
    if WINDOW_LEFT:
        lo = tl.maximum(lo, row0 // group + causal_offset - window_left)
    hi = tl.maximum(hi, lo)
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    split_lo = tl.minimum(hi, lo + split * per_split)
    split_hi = tl.minimum(hi, split_lo + per_split)

    q_ptrs = (q_ptr + b.to(tl.int64) * stride_qb + query.to(tl.int64)[:, None] * stride_qm
              + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if ALIBI:  # one slope per row (its head), times log2(e)
        slope2 = tl.load(alibi_ptr + b * stride_ab + head * stride_ah, mask=row_valid, other=0.0)[:, None] * LOG2E
    else:
        slope2 = 0.0
    if SCALE_FIRST:  # the logits formed whole (scale <= 0, softcap or ALiBi): see forward.py
        exponent_scale = 1.0
    else:
        exponent_scale = qk_scale

    if LAYOUT == "paged":
        table = pages_ptr + b.to(tl.int64) * stride_pb
        cache_row = 0
    elif LAYOUT == "indexed":
        table = pages_ptr
        cache_row = tl.load(pages_ptr + b * stride_pb).to(tl.int64)
    else:
        table = pages_ptr
        cache_row = b.to(tl.int64)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hidden_nonfinite = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start_n in tl.range(split_lo, split_hi, BLOCK_N):
        keys = start_n + offs_n
        key_valid = keys < split_hi
        if LAYOUT == "paged":
            page = tl.load(table + (keys // page_size) * stride_pn, mask=key_valid, other=0).to(tl.int64)
            within = (keys % page_size).to(tl.int64)
            k_rows = page * stride_kp + within * stride_kn
            v_rows = page * stride_vp + within * stride_vn
        else:
            k_rows = cache_row * stride_kp + keys.to(tl.int64) * stride_kn
            v_rows = cache_row * stride_vp + keys.to(tl.int64) * stride_vn
        kv_mask = key_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + k_rows[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None], mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k), PRECISION)  # raw scores q.k, float32
        distance = query[:, None] + causal_offset - keys[None, :]
        if SCALE_FIRST:
            s, _ = logits2(s, distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
        seen = visible(distance, keys[None, :], split_hi, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT)
        s = tl.where(seen, s, float("-inf"))
        if WINDOW_LEFT or WINDOW_RIGHT:  # keys hidden from some rows: keep their NaN out of those rows
            v, hidden_nonfinite = drop_hidden_nonfinite(v, seen, hidden_nonfinite)
        m_new = tl.maximum(m_i, tl.max(s, 1) * exponent_scale)
        # a row that has seen no key yet has m = -inf: shift by 0 so that all its p are 0
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * exponent_scale - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    empty_row = l_i == 0.0  # no key of this split seen (NaN is not 0: a NaN row stays NaN)
    l_safe = tl.where(empty_row, 1.0, l_i)
    out = acc / l_safe[:, None]
    out = tl.where((hidden_nonfinite > 0)[:, None], float("nan"), out)
    lse = (m_i + tl.log2(l_safe)) * LN2  # base 2 -> natural
    store_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:  # a partial: out normalised over this split's keys; lse -inf where it saw none
        partial_row = ((split.to(tl.int64) * batch + b) * seqlen_q + query) * heads + head
        tl.store(out_ptr + partial_row[:, None] * head_dim + offs_d[None, :], out, mask=store_mask)
        lse_index = ((split.to(tl.int64) * batch + b) * heads + head) * seqlen_q + query
        tl.store(lse_ptr + lse_index, tl.where(empty_row, float("-inf"), lse), mask=row_valid)
    else:
        out_ptrs = (out_ptr + b.to(tl.int64) * stride_ob + query.to(tl.int64)[:, None] * stride_om
                    + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :])
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
        lse_index = (b.to(tl.int64) * heads + head) * seqlen_q + query
        tl.store(lse_ptr + lse_index, tl.where(empty_row, float("inf"), lse), mask=row_valid)


@lean_launch
@triton.jit
def merge_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr, stride_ob, stride_om, stride_oh,
                        batch, seqlen_q, heads, head_dim, num_splits,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch, query, head) row: lse = log sum_s exp(lse_s), out = sum_s
    exp(lse_s - lse) out_s, in float32; out rounded once to its dtype."""
    row = tl.program_id(0)  # batch * seqlen_q + query
    head = tl.program_id(1)
    b = row // seqlen_q
    query = row % seqlen_q
    splits = tl.arange(0, BLOCK_S).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    split_valid = splits < num_splits
    lse_s = tl.load(partial_lse_ptr + ((splits * batch + b) * heads + head) * seqlen_q + query,
                    mask=split_valid, other=float("-inf"))
    largest = tl.max(lse_s, 0)
    shift = tl.where(largest == float("-inf"), 0.0, largest)  # every split empty: all weights exp(-inf) = 0
    weights = tl.exp2((lse_s - shift) * LOG2E)  # a NaN partial keeps its NaN weight
    total = tl.sum(weights, 0)
    empty_row = total == 0.0
    total_safe = tl.where(empty_row, 1.0, total)
    partial_rows = ((splits * batch + b) * seqlen_q + query) * heads + head
    partial = tl.load(partial_out_ptr + partial_rows[:, None] * head_dim + offs_d[None, :],
                      mask=split_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    out = tl.sum(weights[:, None] * partial, 0) / total_safe
    lse = tl.where(empty_row, float("inf"), shift + tl.log(total_safe))
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + query.to(tl.int64) * stride_om + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)
    tl.store(lse_ptr + (b.to(tl.int64) * heads + head) * seqlen_q + query, lse)


class SplitLaunch(NamedTuple):
    """What :func:`split_kv_attention`'s launches take that follows from shapes and options alone."""
    split: bool               # more than one split: partials, then the merge kernel
    group: int                # query heads per kv head
    page_size: int
    qk_scale: float
    cap2: float
    grid: tuple
    constants: dict           # the attention kernel's constexpr arguments and launch options
    merge_grid: tuple
    merge_constants: dict


# launch plans by their arguments (:func:`launch_plan`): a decoding loop repeats a few kinds of call,
# and working the plan out again cost the host more than launching the kernels did
LAUNCH_PLANS: dict = {}
# entries a dictionary of remembered checks or plans holds before it starts afresh (:func:`remember`)
MAX_REMEMBERED = 1024


def remember(memo: dict, key, value):
    """memo[key] = value, returned: the decoding path's dictionaries of checks and plans worked out
    once per kind of call (here and in :mod:`.kvcache`). One of MAX_REMEMBERED entries is emptied
    first, so that arguments that change at every call cannot grow it without end."""
    if len(memo) >= MAX_REMEMBERED:
        memo.clear()
    memo[key] = value
    return value


def launch_plan(q, k_cache, *, layout, leftpad, alibi, softmax_scale, window, softcap, num_splits, config):
    """The :class:`SplitLaunch` of a call of :func:`split_kv_attention` (its arguments in words),
    from LAUNCH_PLANS when one of the same kind was planned. The float32 dot precision is read at
    every call (the global setting may change between calls)."""
    precision = dot_precision(q.dtype)
    # the window's sides enter the constants only as bounded or not (their values are launch
    # arguments); the scale's sign too, which 0.0 == -0.0 would hide
    key = (q.shape, q.dtype, k_cache.shape, layout, leftpad, alibi, softmax_scale, math.copysign(1.0, softmax_scale),
           window[0] >= 0, window[1] >= 0, softcap, num_splits, precision,
           None if config is None else tuple(config.items()))
    plan = LAUNCH_PLANS.get(key)
    if plan is not None:
        return plan
    batch, seqlen_q, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    cfg = dict(config or decoding_config(head_dim, q.dtype, split=num_splits > 1))
    block_m = rows_per_tile(seqlen_q * group)
    block_d = block_size(head_dim)
    qk_scale, cap2 = logit_scales(softmax_scale, softcap)
    constants = dict(WINDOW_LEFT=window[0] >= 0, WINDOW_RIGHT=window[1] >= 0, SOFTCAP=softcap_mode(softcap, q.dtype),
                     ALIBI=alibi, SCALE_FIRST=softmax_scale <= 0 or softcap > 0 or alibi, LEFTPAD=leftpad,
                     LAYOUT=layout, SPLIT=num_splits > 1, PRECISION=precision, BLOCK_M=block_m, BLOCK_D=block_d,
                     **cfg)
    plan = SplitLaunch(
        split=num_splits > 1, group=group, page_size=k_cache.shape[1] if layout == "paged" else 1,
        qk_scale=qk_scale, cap2=cap2, grid=(k_cache.shape[2] * cdiv(seqlen_q * group, block_m), batch, num_splits),
        constants=constants, merge_grid=(batch * seqlen_q, heads),
        merge_constants=dict(BLOCK_S=block_size(num_splits, smallest=2), BLOCK_D=block_d, num_warps=4))
    return remember(LAUNCH_PLANS, key, plan)


def split_kv_attention(q, k_cache, v_cache, *, key_end, key_start=None, pages=None, layout="contiguous",
                       softmax_scale, window=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=1, config=None):
    """Attention of q over the keys each sequence holds in the cache (module docstring).

    q (batch, seqlen_q, heads, d) with last stride 1, nothing empty; k_cache, v_cache in ``layout``
    (``LAYOUTS``), any strides; ``key_end`` (batch,) int32, contiguous: one past each sequence's
    last key; ``key_start`` (batch,) int32, contiguous, or None (0): its first key; ``pages``: cache_batch_idx (batch,)
    ("indexed") or block_table (batch, pages) ("paged"), int32, or None ("contiguous").
    ``softmax_scale`` any finite float; ``window`` (left, right), -1 for an unbounded side;
    ``softcap`` > 0 or 0; ``alibi_slopes`` float32 (heads,) or (batch, heads) or None;
    ``num_splits`` >= 1. The index tensors must be in range (:mod:`.kvcache` checks them).
    Returns out (batch, seqlen_q, heads, d) contiguous in q's dtype and lse (batch, heads,
    seqlen_q) float32. ``config`` overrides :func:`decoding_config` (the benchmark's sweep).
    """
    batch, seqlen_q, heads, head_dim = q.shape
    plan = launch_plan(q, k_cache, layout=layout, leftpad=key_start is not None, alibi=alibi_slopes is not None,
                       softmax_scale=softmax_scale, window=window, softcap=softcap, num_splits=num_splits,
                       config=config)
    out = outputs.empty(q.shape, q.dtype, q.device)
    lse = outputs.empty((batch, heads, seqlen_q), torch.float32, q.device)
    if plan.split:
        partial_out = outputs.empty((num_splits, batch, seqlen_q, heads, head_dim), torch.float32, q.device)
        partial_lse = outputs.empty((num_splits, batch, heads, seqlen_q), torch.float32, q.device)
    else:
        partial_out, partial_lse = out, lse
    if pages is None:
        pages_strides = (0, 0)
    elif layout == "paged":
        pages_strides = pages.stride()
    else:
        pages_strides = (pages.stride(0), 0)
    split_kv_attention_kernel[plan.grid](
        q, k_cache, v_cache, partial_out, partial_lse, key_end if key_start is None else key_start, key_end,
        key_end if pages is None else pages, key_end if alibi_slopes is None else alibi_slopes,
        *q.stride()[:3], *k_cache.stride(), *v_cache.stride(), *pages_strides, *out.stride()[:3],
        *alibi_strides(alibi_slopes),
        batch, seqlen_q, heads, plan.group, head_dim, plan.page_size, num_splits, plan.qk_scale, plan.cap2, *window,
        **plan.constants,
    )
    if plan.split:
        merge_splits_kernel[plan.merge_grid](
            partial_out, partial_lse, out, lse, *out.stride()[:3], batch, seqlen_q, heads, head_dim, num_splits,
            **plan.merge_constants)
    return out, lse
