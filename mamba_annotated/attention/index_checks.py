"""The range checks of :func:`.kvcache.attention_with_kvcache`'s index tensors, in one launch.

The index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) live on the device:
reading them on the host would stop the host until the GPU has caught up, at every decoding step.
So they are checked on the device, and a failed check stops the stream with a message
(``torch._assert_async``: a device-side assert on a GPU; on the CPU it raises at once).

Written with PyTorch's elementwise ops, each check was four or five small kernels (two compares,
an and, an all, the assert): at batch 1 and 131,072 cached keys the checks of cache_seqlens alone
cost the public call about 18 us of GPU time beside 141 us of attention (data/decoding_bench.json),
and tens of microseconds of host time at small caches. Here one program reads every index once and
writes one flag per check (1: every index in range), and one ``torch._assert_async`` per check
the call needs then reads its flag: two launches for a plain decoding step.

What is checked, for each sequence b (``ends`` is cache_seqlens, or the capacity without it):
    cache_seqlens      0 <= cache_seqlens[b] <= capacity - seqlen_new
    cache_leftpad      0 <= cache_leftpad[b] <= ends[b]
    cache_batch_idx    0 <= cache_batch_idx[b] < the cache's rows
    block_table        the entries of the pages the sequence reads, [leftpad // page_size,
                       ceil((ends + seqlen_new) / page_size)), index the cache's pages; the other
                       entries may hold anything (a server's -1 padding)
    rotary             cache_seqlens[b] + seqlen_q <= seqlen_ro (the queries' rotary positions)
"""
import torch
import triton
import triton.language as tl

from ..launch import lean_launch
from ..triton_ops import block_size

# the flags' order; the caller words each check's message
CHECKS = ("cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table", "rotary")


@lean_launch
@triton.jit
def kvcache_index_check_kernel(seqlens_ptr, leftpad_ptr, batch_idx_ptr, table_ptr, flags_ptr,
                               batch, capacity, new, cache_rows, stride_tb, stride_tn, table_cols, page_size,
                               rotary_limit,
                               SEQLENS: tl.constexpr, LEFTPAD: tl.constexpr, BATCH_IDX: tl.constexpr,
                               TABLE: tl.constexpr, ROTARY: tl.constexpr, BLOCK_B: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    """One program: flags[i] = 1 where check CHECKS[i] holds for every sequence (0 where it fails;
    1 for a check not asked for)."""
    bad_seqlens = tl.zeros([BLOCK_B], dtype=tl.int32)
    bad_leftpad = tl.zeros([BLOCK_B], dtype=tl.int32)
    bad_batch_idx = tl.zeros([BLOCK_B], dtype=tl.int32)
    bad_rotary = tl.zeros([BLOCK_B], dtype=tl.int32)
    bad_table = tl.zeros([BLOCK_B, BLOCK_C], dtype=tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        valid = rows < batch
        ends = tl.full([BLOCK_B], capacity, dtype=tl.int64)
        if SEQLENS:
            ends = tl.load(seqlens_ptr + rows, mask=valid, other=0).to(tl.int64)
            bad_seqlens |= (valid & ((ends < 0) | (ends > capacity - new))).to(tl.int32)
            if ROTARY:
                bad_rotary |= (valid & (ends > rotary_limit)).to(tl.int32)
        starts = tl.zeros([BLOCK_B], dtype=tl.int64)
        if LEFTPAD:
            starts = tl.load(leftpad_ptr + rows, mask=valid, other=0).to(tl.int64)
            bad_leftpad |= (valid & ((starts < 0) | (starts > ends))).to(tl.int32)
        if BATCH_IDX:
            cache_row = tl.load(batch_idx_ptr + rows, mask=valid, other=0)
            bad_batch_idx |= (valid & ((cache_row < 0) | (cache_row >= cache_rows))).to(tl.int32)
        if TABLE:
            # the pages [first, last) that the sequence's positions [starts, ends + new) fall in;
            # clamped at 0 so that a negative index (refused above) reads no entry before the row
            first = tl.maximum(starts, 0) // page_size
            last = (tl.maximum(ends + new, 0) + page_size - 1) // page_size
            for c0 in range(0, table_cols, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                read = (valid[:, None] & (cols[None, :] < table_cols) & (cols[None, :] >= first[:, None])
                        & (cols[None, :] < last[:, None]))
                entries = tl.load(table_ptr + rows.to(tl.int64)[:, None] * stride_tb + cols[None, :] * stride_tn,
                                  mask=read, other=0)
                bad_table |= (read & ((entries < 0) | (entries >= cache_rows))).to(tl.int32)
    tl.store(flags_ptr + 0, (tl.max(bad_seqlens, 0) == 0).to(tl.int32))
    tl.store(flags_ptr + 1, (tl.max(bad_leftpad, 0) == 0).to(tl.int32))
    tl.store(flags_ptr + 2, (tl.max(bad_batch_idx, 0) == 0).to(tl.int32))
    tl.store(flags_ptr + 3, (tl.max(tl.max(bad_table, 1), 0) == 0).to(tl.int32))
    tl.store(flags_ptr + 4, (tl.max(bad_rotary, 0) == 0).to(tl.int32))


def index_flags(*, batch: int, capacity: int, new: int, cache_rows: int, cache_seqlens=None, cache_leftpad=None,
                cache_batch_idx=None, block_table=None, page_size: int = 1, rotary_limit=None) -> torch.Tensor:
    """flags (len(CHECKS),) int32 on the indices' device, from one launch of the check kernel: 1 where
    every index passes the check (module docstring), 0 where one fails. ``rotary_limit`` (seqlen_ro
    - seqlen_q, or None for no rotary check) bounds cache_seqlens. The (batch,) tensors are read
    densely (contiguous, as :func:`.kvcache.attention_with_kvcache` passes them); the block table
    through its strides."""
    present = next(t for t in (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) if t is not None)
    flags = torch.empty(len(CHECKS), dtype=torch.int32, device=present.device)
    table_strides = block_table.stride() if block_table is not None else (0, 0)
    table_cols = block_table.shape[1] if block_table is not None else 0
    kvcache_index_check_kernel[(1,)](
        present if cache_seqlens is None else cache_seqlens, present if cache_leftpad is None else cache_leftpad,
        present if cache_batch_idx is None else cache_batch_idx, present if block_table is None else block_table,
        flags, batch, capacity, new, cache_rows, *table_strides, table_cols, page_size,
        0 if rotary_limit is None else rotary_limit,
        SEQLENS=cache_seqlens is not None, LEFTPAD=cache_leftpad is not None, BATCH_IDX=cache_batch_idx is not None,
        TABLE=block_table is not None and block_table.numel() > 0, ROTARY=rotary_limit is not None,
        BLOCK_B=block_size(batch, smallest=1, largest=64), BLOCK_C=block_size(table_cols, smallest=1, largest=64),
        num_warps=4)
    return flags
