"""Packed sequences of different lengths (flash_attn's ``varlen`` layout), as chapter 7's kernels
read them: the device helpers they share under ``VARLEN``, and the check of the offsets.

Layout
    The sequences of a batch are concatenated along one axis: q (total_q, heads, d) holds sequence
    b's queries in rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]), and k, v (total_k, kv_heads, d) its
    keys and values in rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]); cu_seqlens_* are int32
    (batch + 1,), 0 first, non-decreasing. Nothing is padded, so no work is spent on padding.
    A kernel launched over packed sequences gets the longest lengths, max_seqlen_q and
    max_seqlen_k, where it gets the lengths of dense inputs: its grid covers the longest sequence,
    ``cdiv(max_seqlen, BLOCK) x (batch * heads)``. Each program reads its sequence's rows from
    cu_seqlens (:func:`sequence_rows`), moves its base pointers to the first of them, and a tile
    that starts past its sequence's end does nothing. The lengths therefore stay on the device:
    the host never reads them (that would wait for the GPU).

Rows no sequence owns
    Rows [cu_seqlens[batch], total) of a packed tensor belong to no sequence (flash_attn leaves
    its outputs there unwritten). The kernels write them: out, dq, dk and dv there are 0 (out and
    the loss do not depend on those rows of q, k, v) and lse +inf, as for a query that sees no
    key (:func:`fill_unowned_rows`). All the programs of a launch share that work; with the usual
    packing, cu_seqlens[-1] == total, it costs each program one load and one comparison.

Offsets the host did not check
    :func:`check_packing` checks cu_seqlens against the packed sizes and the maxima on the device,
    without waiting for it; it is skipped while torch.compile traces or a CUDA graph captures.
    Whatever cu_seqlens then holds, :func:`sequence_rows` clamps each sequence's rows into
    [0, total], so no program reads or writes outside the packed tensors. A sequence longer than
    max_seqlen_q keeps the rows past it unwritten in out, lse and dq (the grid ends there); one
    with more keys than max_seqlen_k, in dk and dv; and the results of such a sequence are not
    attention's.
"""
import torch
import triton
import triton.language as tl

from ..launch import lean_launch


@triton.jit
def sequence_rows(cu_seqlens_ptr, batch, total):
    """(start, length) of sequence ``batch``: its rows [start, start + length) of a packed tensor of
    ``total`` rows, clamped into [0, total] (an unchecked cu_seqlens cannot move a program outside
    the tensor)."""
    start = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batch), 0), total)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batch + 1), start), total)
    return start, end - start


@triton.jit
def fill_unowned_rows(ptr, stride_row, cu_seqlens_ptr, batches, total, width, program, programs,
                      VALUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write VALUE to the rows [cu_seqlens[batches], total) of one head (``ptr`` at its row 0,
    ``width`` columns): the rows past the last sequence. Program ``program`` of ``programs`` takes
    every programs-th block of BLOCK_M of them, so a long tail is spread over the whole launch."""
    first = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + batches), 0), total)
    cols = tl.arange(0, BLOCK_D)
    fill = tl.full([BLOCK_M, BLOCK_D], VALUE, ptr.dtype.element_ty)
    for start in range(first + program * BLOCK_M, total, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        tl.store(ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], fill,
                 mask=(rows[:, None] < total) & (cols[None, :] < width))


@triton.jit
def cu_seqlens_valid(cu_seqlens_ptr, batch, total, longest, BLOCK: tl.constexpr):
    """Whether cu_seqlens (batch + 1,) starts at 0, never decreases, ends at most at ``total`` and
    holds no sequence longer than ``longest``. 64-bit differences: wild int32 offsets cannot wrap
    into a valid-looking length."""
    valid = (tl.load(cu_seqlens_ptr) == 0) & (tl.load(cu_seqlens_ptr + batch) <= total)
    for start in range(0, batch, BLOCK):
        i = start + tl.arange(0, BLOCK)
        lo = tl.load(cu_seqlens_ptr + i, mask=i < batch, other=0).to(tl.int64)
        hi = tl.load(cu_seqlens_ptr + i + 1, mask=i < batch, other=0).to(tl.int64)
        fits = ((hi >= lo) & (hi - lo <= longest)).to(tl.int32)
        valid = valid & (tl.min(fits, 0) > 0)
    return valid


@lean_launch
@triton.jit
def packing_check_kernel(cu_seqlens_q_ptr, cu_seqlens_k_ptr, valid_ptr, batch, total_q, total_k, max_seqlen_q,
                         max_seqlen_k, BLOCK: tl.constexpr):
    """Grid (1,): valid[0] and valid[1] say whether cu_seqlens_q and cu_seqlens_k are valid."""
    tl.store(valid_ptr, cu_seqlens_valid(cu_seqlens_q_ptr, batch, total_q, max_seqlen_q, BLOCK).to(tl.int32))
    tl.store(valid_ptr + 1, cu_seqlens_valid(cu_seqlens_k_ptr, batch, total_k, max_seqlen_k, BLOCK).to(tl.int32))


def check_packing(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                  max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The checks of cu_seqlens that read its values, on the device and without waiting for it: one
    small kernel and two ``torch._assert_async`` (on a GPU a failed one stops the stream with its
    message, a device-side assert; on the CPU it raises at once). The caller skips them while
    torch.compile traces or a CUDA graph captures (:func:`..library.traced_or_captured`)."""
    valid = torch.empty(2, dtype=torch.int32, device=cu_seqlens_q.device)
    packing_check_kernel[(1,)](cu_seqlens_q, cu_seqlens_k, valid, cu_seqlens_q.shape[0] - 1, total_q, total_k,
                               max_seqlen_q, max_seqlen_k, BLOCK=128)
    for i, (side, total, longest) in enumerate((("q", total_q, max_seqlen_q), ("k", total_k, max_seqlen_k))):
        torch._assert_async(valid[i], f"cu_seqlens_{side} must start at 0, never decrease and end at most at "
                                      f"total_{side} = {total} (the rows of {side}), and no sequence may be longer "
                                      f"than max_seqlen_{side} = {longest}")


def packed_strides(*tensors):
    """The (batch, row, head) strides of each packed (total, heads, d) tensor: one batch row (stride
    0), whose sequences the kernels find through cu_seqlens."""
    return [s for t in tensors for s in (0, t.stride(0), t.stride(1))]
