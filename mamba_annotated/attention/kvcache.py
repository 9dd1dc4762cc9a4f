"""flash_attn's ``flash_attn_with_kvcache``: append new keys and values to a KV cache in place,
rotate, and attend over each sequence's cache with the split-KV kernels (:mod:`.split_kv`).

``attend_with_kvcache`` is the computation on checked arguments; ``attention_with_kvcache_op``
registers it with torch.library as a custom op that mutates k_cache and v_cache, with a fake
function, so that ``torch.compile(fullgraph=True)`` traces a call; ``attention_with_kvcache`` is
the public function, flash_attn's signature, which checks its arguments and calls one of them.

A decoding loop calls the op once per layer and token with the same shapes, strides and options
each time; only the tensors' contents and addresses change. What follows from those alone (the
argument checks, the split count, the index checks' messages) is worked out at the first call of
each kind and kept in dictionaries keyed by them (:func:`call_key`, :func:`plan_key`), because at
batch 1 the device finishes a step faster than Python can launch it, and working them out again
cost tens of microseconds of host time per call (chapter 7 and data/decoding_host_ab.json give
the measurements). The index tensors' values are not in the keys: they are checked on the device
at every call.
"""
import numbers
from typing import NamedTuple, Optional

import torch

from ..library import NAMESPACE, last_dim_contiguous, traced_or_captured
from ..validation import check_tensor
from .api import check_alibi_slopes, check_real, check_softcap, resolve_window, MAX_HEAD_DIM, MIN_HEAD_DIM
from .index_checks import CHECKS, index_flags
from .rotary import rotate
from .split_kv import MAX_SPLITS, decoding_config, default_splits, remember, rows_per_tile, split_kv_attention

INDEX_DTYPES = (torch.int32,)


def cache_capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """The most positions a sequence can hold: the cache's length, or pages per sequence x page size."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def check_like_q(q, **tensors):
    """Each named tensor: 4-d, of q's dtype, on q's device."""
    for name, t in tensors.items():
        check_tensor(name, t, ndim=4)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")


def check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, num_splits):
    """Every check that needs no value of a tensor (no synchronisation): types, dtypes, devices,
    shapes, and what flash_attn asks of their combinations. Raises TypeError or ValueError naming
    the argument."""
    check_tensor("q", q, ndim=4)
    batch, seqlen_q, heads, head_dim = q.shape
    check_like_q(q, k_cache=k_cache, v_cache=v_cache)
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (last dimension of q, k_cache, v_cache) must be between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM}; got {head_dim}")
    kind = "(num_blocks, page_block_size, kv_heads, head_dim)" if block_table is not None else \
        "(batch_cache, seqlen_cache, kv_heads, head_dim)"
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have shape {kind} with head_dim={head_dim} (that of q); "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}; got {tuple(v_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if not (heads % kv_heads == 0 if kv_heads else heads == 0):
        raise ValueError(f"the kv_heads of k_cache and v_cache ({kv_heads}) must divide the heads of q ({heads})")

    if block_table is not None:
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch={batch}, max_blocks_per_seq); "
                             f"got {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (flash_attn refuses it too): "
                             "the block table already says where each sequence's keys are")
        if block_table.shape[1] and not k_cache.shape[0]:
            raise ValueError(f"k_cache holds no page (shape {tuple(k_cache.shape)}) for block_table of shape "
                             f"{tuple(block_table.shape)} to point into")
        if not k_cache.shape[1]:
            raise ValueError(f"k_cache's pages must hold at least one position (page_block_size >= 1); "
                             f"got shape {tuple(k_cache.shape)}")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache must have a row for each of the {batch} sequences of q (or cache_batch_idx to "
                         f"pick its rows); got shape {tuple(k_cache.shape)}")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            check_tensor(name, t, dtypes=INDEX_DTYPES, shape=(batch,))
    capacity = cache_capacity(k_cache, block_table)

    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together; got {'k' if k is not None else 'v'} alone")
    new = 0
    if k is not None:
        check_like_q(q, k=k, v=v)
        new = k.shape[1]
        if k.shape != (batch, new, kv_heads, head_dim):
            raise ValueError(f"k must have shape (batch={batch}, seqlen_new, kv_heads={kv_heads}, "
                             f"head_dim={head_dim}); got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}; got {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with k and v: it says where to append them")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
                raise ValueError(f"{name} is written in place (k and v are appended) and cannot be an expanded "
                                 f"view (a stride of 0): {tuple(t.stride())}")

    if cache_seqlens is not None:
        if isinstance(cache_seqlens, torch.Tensor):
            check_tensor("cache_seqlens", cache_seqlens, dtypes=INDEX_DTYPES, shape=(batch,))
        elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
            check_int_seqlens(cache_seqlens, new, capacity)
        else:
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape (batch,); "
                            f"got {type(cache_seqlens).__name__}")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"rotary_cos and rotary_sin must be given together; got "
                         f"{'rotary_cos' if rotary_cos is not None else 'rotary_sin'} alone")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate the new keys: they need k and v (as in flash_attn)")
        check_tensor("rotary_cos", rotary_cos, ndim=2)
        check_tensor("rotary_sin", rotary_sin, ndim=2)
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t.device != q.device:
                raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}; "
                             f"got {tuple(rotary_sin.shape)}")
        seqlen_ro, half = rotary_cos.shape
        if not 1 <= half <= head_dim // 2:
            raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= "
                             f"head_dim ({head_dim}); got {tuple(rotary_cos.shape)}")
        if seqlen_ro < capacity:
            raise ValueError(f"rotary_cos and rotary_sin must have a row for every position of the cache: "
                             f"seqlen_ro ({seqlen_ro}) must be at least the cache's capacity ({capacity}), "
                             f"as in flash_attn")

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int; got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 0 (a heuristic chooses) and {MAX_SPLITS}; got {num_splits}")


def check_int_seqlens(cache_seqlens: int, new: int, capacity: int) -> None:
    """An int cache_seqlens (every sequence's length) leaves room for the new keys."""
    if not 0 <= cache_seqlens <= capacity - new:
        raise ValueError(f"cache_seqlens ({cache_seqlens}) + seqlen_new ({new}) must be between 0 and the "
                         f"cache's capacity ({capacity})")


def check_bool(name, value):
    if isinstance(value, torch.Tensor) or not isinstance(value, (bool, numbers.Integral)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")


class DecodingPlan(NamedTuple):
    """What a call's launches need that follows from its arguments' shapes and options alone."""
    new: int                  # keys appended (k's length, 0 without k)
    capacity: int             # the most positions a sequence holds
    window: tuple             # (left, right) as the kernels take it
    num_splits: int           # the split count, resolved (>= 1)
    layout: str               # the cache's layout (:data:`.split_kv.LAYOUTS`)
    checks: tuple             # ((flag index, message), ...): the index checks this call needs
    rotary_limit: Optional[int]  # seqlen_ro - seqlen_q for the queries' rotary check, or None


# plans by :func:`plan_key` (a model's calls come in a few kinds)
PLANS: dict = {}


def plan_key(q, k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, window_left,
             window_right, rotate_per_row, num_splits) -> tuple:
    """What :func:`plan_decoding` reads of a call: shapes, dtype, device, which index tensors are
    given, the resolved window and split options (the arguments are checked already)."""
    return (q.shape, q.dtype, q.device, k_cache.shape, None if k is None else k.shape[1],
            None if rotary_cos is None else rotary_cos.shape[0], cache_seqlens is None, cache_batch_idx is None,
            cache_leftpad is None, None if block_table is None else block_table.shape, window_left, window_right,
            rotate_per_row, num_splits)


def plan_decoding(q, k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                  window_left, window_right, rotate_per_row, num_splits) -> DecodingPlan:
    """The :class:`DecodingPlan` of a call (checked arguments), from :data:`PLANS` when a call of the
    same kind has been planned."""
    key = plan_key(q, k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                   window_left, window_right, rotate_per_row, num_splits)
    plan = PLANS.get(key)
    if plan is not None:
        return plan
    batch, seqlen_q, heads, head_dim = q.shape
    new = 0 if k is None else k.shape[1]
    capacity = cache_capacity(k_cache, block_table)
    rows = k_cache.shape[0]
    # a right edge at or past seqlen_q - 1 hides no key from any query: the kernels drop it
    window = (window_left, window_right if window_right < seqlen_q - 1 else -1)
    block_n = decoding_config(head_dim, q.dtype, split=True)["BLOCK_N"]  # the tiles a split would stream
    if num_splits == 0:
        group = heads // k_cache.shape[2] if k_cache.shape[2] else 1
        row_blocks = -(-seqlen_q * group // rows_per_tile(seqlen_q * group))
        num_splits = default_splits(batch, k_cache.shape[2], capacity, q.device, row_blocks=row_blocks,
                                    block_n=block_n)
    num_splits = max(1, min(num_splits, -(-capacity // block_n)))  # no more splits than key blocks
    layout = "paged" if block_table is not None else "indexed" if cache_batch_idx is not None else "contiguous"
    rotary = rotary_cos is not None and rotate_per_row and seqlen_q > new
    checks = []
    if cache_seqlens is not None:
        checks.append((CHECKS.index("cache_seqlens"), f"cache_seqlens + seqlen_new ({new}) must be between 0 and the "
                                                       f"cache's capacity ({capacity}) for every sequence"))
    if cache_leftpad is not None:
        checks.append((CHECKS.index("cache_leftpad"), "cache_leftpad must be between 0 and cache_seqlens for every "
                                                       "sequence"))
    if cache_batch_idx is not None:
        checks.append((CHECKS.index("cache_batch_idx"), f"cache_batch_idx must index the rows of k_cache (0 <= index "
                                                         f"< {rows})"))
    if block_table is not None and block_table.numel():
        checks.append((CHECKS.index("block_table"), f"block_table's entries for the pages a sequence holds must index "
                                                     f"the pages of k_cache (0 <= entry < {rows})"))
    if rotary:
        checks.append((CHECKS.index("rotary"), f"rotary_cos and rotary_sin need a row for every query position, "
                                                f"cache_seqlens + seqlen_q ({seqlen_q}) <= seqlen_ro "
                                                f"({rotary_cos.shape[0]})"))
    plan = DecodingPlan(new, capacity, window, num_splits, layout, tuple(checks),
                        rotary_cos.shape[0] - seqlen_q if rotary else None)
    return remember(PLANS, key, plan)


def check_indices(plan: DecodingPlan, q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
    """The checks that read index tensors, on the device and without synchronising: one launch of
    :mod:`.index_checks`' kernel, then one ``torch._assert_async`` per check this call needs (on a
    GPU a failed one stops the stream with its message; on the CPU it raises at once). Skipped
    while torch.compile traces or a CUDA graph captures."""
    if not plan.checks:
        return
    flags = index_flags(batch=q.shape[0], capacity=plan.capacity, new=plan.new, cache_rows=k_cache.shape[0],
                        cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                        block_table=block_table, page_size=k_cache.shape[1], rotary_limit=plan.rotary_limit)
    for index, message in plan.checks:
        torch._assert_async(flags[index], message)


def append(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, cache_batch_idx, block_table) -> None:
    """Write ``new`` (batch, seqlen_new, kv_heads, d) into ``cache`` in place, at the positions
    (batch, seqlen_new) of each sequence: in cache row cache_batch_idx[b] (or b), or in the pages
    of block_table (one index_put: with repeated rows in cache_batch_idx one of the writes wins,
    as in flash_attn)."""
    if block_table is not None:
        page_size = cache.shape[1]
        pages = block_table.long().gather(1, positions // page_size)
        index = (pages, positions % page_size)
    else:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(new.shape[0], device=new.device)
        index = (rows[:, None].expand_as(positions), positions)
    cache.index_put_(index, new)


def attend_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                        v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor],
                        rotary_sin: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor],
                        cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                        block_table: Optional[torch.Tensor], softmax_scale: float, window_left: int,
                        window_right: int, softcap: float, rotary_interleaved: bool, rotate_per_row: bool,
                        alibi_slopes: Optional[torch.Tensor], num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on checked arguments (``cache_seqlens`` a tensor or None, the window resolved,
    ``rotate_per_row``: the queries rotated at cache_seqlens + i, else all at cache_seqlens):
    append, rotate, attend. Returns (out, lse); nothing is differentiated (no_grad)."""
    with torch.no_grad():
        batch, seqlen_q, heads, head_dim = q.shape
        plan = plan_decoding(q, k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             window_left, window_right, rotate_per_row, num_splits)
        new = plan.new
        if not traced_or_captured():
            check_indices(plan, q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
        if k is not None:
            positions = cache_seqlens.long()[:, None] + torch.arange(new, device=q.device)
            if rotary_cos is not None:
                k = rotate(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
            append(k_cache, k, positions, cache_batch_idx, block_table)
            append(v_cache, v, positions, cache_batch_idx, block_table)
        if rotary_cos is not None:
            offsets = (torch.arange(seqlen_q, device=q.device) if rotate_per_row
                       else torch.zeros(seqlen_q, dtype=torch.long, device=q.device))
            q = rotate(q, rotary_cos, rotary_sin, cache_seqlens.long()[:, None] + offsets, rotary_interleaved)
        if q.numel() == 0 or k_cache.shape[2] == 0:
            lse = torch.full((batch, heads, seqlen_q), float("inf"), dtype=torch.float32, device=q.device)
            return q.new_zeros(q.shape), lse
        # one past each sequence's last key, int32 (cache_seqlens is int32; a decoding step without
        # new keys launches nothing for it: each small op costs microseconds of host time)
        if cache_seqlens is None:
            key_end = torch.full((batch,), plan.capacity, dtype=torch.int32, device=q.device)
        else:
            key_end = cache_seqlens + new if new else cache_seqlens
        return split_kv_attention(last_dim_contiguous(q), k_cache, v_cache, key_end=key_end, key_start=cache_leftpad,
                                  pages=block_table if block_table is not None else cache_batch_idx,
                                  layout=plan.layout, softmax_scale=softmax_scale, window=plan.window, softcap=softcap,
                                  alibi_slopes=alibi_slopes, num_splits=plan.num_splits)


attention_with_kvcache_op = torch.library.custom_op(f"{NAMESPACE}::attention_with_kvcache", attend_with_kvcache,
                                                    mutates_args=("k_cache", "v_cache"))


@attention_with_kvcache_op.register_fake
def fake_attend_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, window_left, window_right, softcap,
                             rotary_interleaved, rotate_per_row, alibi_slopes, num_splits):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
               return_softmax_lse) -> tuple:
    """Every check of the public call that reads no tensor's values (raises TypeError or ValueError
    naming the argument); returns the options resolved: (window_left, window_right, softcap,
    rotate_per_row)."""
    check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, num_splits)
    check_bool("rotary_interleaved", rotary_interleaved)
    check_bool("return_softmax_lse", return_softmax_lse)
    softcap = check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, q)
    if softmax_scale is not None:
        check_real("softmax_scale", softmax_scale)
    window_left, window_right = resolve_window(causal, window_size, cache_capacity(k_cache, block_table))
    rotate_per_row = window_left >= 0 or window_right >= 0  # causal or local, as flash_attn decides it
    return window_left, window_right, softcap, rotate_per_row


# calls that passed :func:`check_call`, by :func:`call_key`, with its result
CHECKED_CALLS: dict = {}


def call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_softmax_lse) -> tuple:
    """The key of a public call in :data:`CHECKED_CALLS`: what :func:`check_call` reads. Of a tensor
    its type, shape, strides, dtype and device (not its values); of anything else its type and
    value (True == 1 == 1.0 in Python, not here), a tuple's element by element, a tuple subclass's
    too; whether ALiBi slopes that require a gradient meet grad mode (refused only then). An int
    cache_seqlens goes in by its type alone: a decoding loop that passes its position as an int
    would otherwise make a new key at every step (the public call checks its range every time).
    An unhashable argument makes the key unhashable."""
    tensors = [(type(t), t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t), t)
               for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                         block_table, alibi_slopes)]
    seqlens = (type(cache_seqlens), None if type(cache_seqlens) is int else
               cache_seqlens.shape if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens += (cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device)
    window = tuple(map(type, window_size)) if isinstance(window_size, tuple) else None
    return (*tensors, seqlens, type(softmax_scale), softmax_scale, type(causal), causal, type(window_size),
            window_size, window, type(softcap), softcap, type(rotary_interleaved), rotary_interleaved,
            type(num_splits), num_splits, type(return_softmax_lse), return_softmax_lse,
            isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad and torch.is_grad_enabled())


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                           cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                           alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, after appending k and v to it in place: flash_attn's
    ``flash_attn_with_kvcache`` (2.8), same arguments in the same order, same defaults and returns.

    q (batch, seqlen_q, heads, d); k_cache, v_cache (batch_cache, seqlen_cache, kv_heads, d), or
    with ``block_table`` (batch, max_blocks_per_seq) int32 a paged cache (num_blocks,
    page_block_size, kv_heads, d), sequence b's position p in page block_table[b, p //
    page_block_size] at row p % page_block_size; pages of any size (flash_attn asks for multiples
    of 256). kv_heads divides heads (grouped-query attention). float16, bfloat16 or float32, 16 <=
    d <= 256, any strides (the caches are read and written through theirs; a strided index tensor
    is copied).

    Sequence b holds the positions [cache_leftpad[b], cache_seqlens[b]) of cache row
    cache_batch_idx[b] (b without it; not with a block table, as in flash_attn). ``cache_seqlens``
    is an int (every sequence) or an int32 tensor (batch,); None means the whole cache.
    ``cache_leftpad`` (int32, (batch,)) is where each sequence starts (0 without it); positions
    before it are not attended. flash_attn refuses it with a block table; here it works there too.
    ``k``, ``v`` (batch, seqlen_new, kv_heads, d), when given, are written into the cache in place at
    positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 before the attention (they need
    cache_seqlens); the caller makes room (cache_seqlens + seqlen_new <= capacity, checked).
    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2), with k and v: rotary embeddings
    (:mod:`.rotary`; ``rotary_interleaved`` pairs channels (2c, 2c + 1), otherwise (c, c + rotary_dim
    / 2)) of the new keys at their positions and of q at cache_seqlens[b] + i when causal or local,
    else at cache_seqlens[b] for every query, as flash_attn; q and k are rounded to their dtype after
    the rotation. rotary_dim is any even number up to d (flash_attn: multiples of 16), the tables
    any float dtype (flash_attn: q's), seqlen_ro at least the cache's capacity (as flash_attn asks).

    The keys of sequence b number L_b = cache_seqlens[b] + seqlen_new - cache_leftpad[b]; query i
    and the key at position j are ``i + cache_seqlens[b] + seqlen_new - seqlen_q - j`` apart, the
    diagonal aligned to the bottom-right corner with L_b, as in ``attention``; ``causal``,
    ``window_size`` (read against the cache's capacity, as flash_attn reads it), ``softcap``,
    ``alibi_slopes`` ((heads,) or (batch, heads), -slope * |distance|) and ``softmax_scale`` (None:
    1 / sqrt(d)) as there. A query that sees no key gets out = 0 and lse = +inf.

    ``num_splits``: the keys of each sequence are split among this many programs whose partial
    results are merged by their log-sum-exps (:mod:`.split_kv`); 0 lets a heuristic choose (fill
    the GPU's SMs when the batch is small), 1 does not split; at most 128.

    Returns out (batch, seqlen_q, heads, d) in q's dtype, or with ``return_softmax_lse=True``
    (out, softmax_lse), softmax_lse (batch, heads, seqlen_q) float32. No backward pass (flash_attn
    has none): the outputs never require a gradient. Index tensors out of range (cache_seqlens +
    seqlen_new past the capacity, cache_batch_idx or block_table entries past k_cache, cache_leftpad
    past cache_seqlens) are refused on the device without synchronising (``torch._assert_async``).
    """
    compiling = torch.compiler.is_compiling()  # torch.compile traces the checks, not a dictionary
    key = options = None
    if not compiling:
        key = call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                       alibi_slopes, num_splits, return_softmax_lse)
        try:
            options = CHECKED_CALLS.get(key)
        except TypeError:  # an unhashable argument: this call is checked every time
            key = None
    if options is None:
        options = check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
        if key is not None:
            remember(CHECKED_CALLS, key, options)
    elif type(cache_seqlens) is int:  # in the key by its type alone
        check_int_seqlens(cache_seqlens, 0 if k is None else k.shape[1], cache_capacity(k_cache, block_table))
    window_left, window_right, softcap, rotate_per_row = options
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    # the index check and the attention kernels read these (batch,) tensors densely: a strided view (a
    # column of a per-sequence record) is copied, not misread (flash_attn's wrapper copies two of them)
    cache_seqlens, cache_batch_idx, cache_leftpad = (None if t is None else t.contiguous()
                                                     for t in (cache_seqlens, cache_batch_idx, cache_leftpad))
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, scale, window_left, window_right, softcap, bool(rotary_interleaved), rotate_per_row,
            alibi_slopes, int(num_splits))
    if compiling:
        out, lse = attention_with_kvcache_op(*(t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t
                                               for t in args))
    else:
        out, lse = attend_with_kvcache(*args)
    return (out, lse) if return_softmax_lse else out
