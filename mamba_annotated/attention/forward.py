"""Chapter 7: the attention forward pass, one sweep over the keys with an online softmax.

Algorithm (FlashAttention-2)
    A program owns BLOCK_M query rows of one (batch, head) and walks the keys BLOCK_N at a time,
    keeping per row the running maximum m of the scores, the running sum l of exp(s - m) and the
    running output acc = sum_j exp(s_j - m) v_j. When a key block raises the maximum, the old l and
    acc are rescaled by exp(m_old - m_new). At the end out = acc / l, and the row's log-sum-exp
    lse = m + log(l) is stored: one float per query row is all the backward pass needs to rebuild
    the probabilities P = exp(S - lse) of any tile.
    Exponentials are base 2 (exp2 is one instruction): the scores are scaled by scale * log2(e),
    fused with the subtraction of the maximum into one multiply-add. That takes the maximum of the
    raw scores and scales it afterwards, which is right only for a positive scale; a scale <= 0
    (SCALE_FIRST, chosen on the host) scales the scores before the mask and the maximum instead,
    since -inf times a scale <= 0 is NaN or +inf.

Masking, windows, soft-capping, ALiBi (:mod:`.scores`)
    Query i sees key j iff -right <= distance <= left, distance = i + (seqlen_k - seqlen_q) - j
    (the diagonal aligned to the bottom-right corner, as in FlashAttention >= 2.1); an unbounded
    side is not tested (WINDOW_LEFT / WINDOW_RIGHT, chosen on the host). Causal attention is the
    window (unbounded, 0). A program loads only the key blocks [lo, hi) that some row of its tile
    sees, so a window costs what it covers, not seqlen_k; of those, only the blocks an edge of the
    window (or the end of the keys) crosses pay for the mask. The bounds masks (seqlen not a
    multiple of the block, head_dim not a power of two) are compiled in only when needed (EVEN_*
    constexprs). It is one loop with a scalar test per block, not an unmasked loop followed by a
    masked one: with Triton 3.6 two loops got two sets of pipeline buffers (256 KiB of shared
    memory at head dim 128, over the limit) and, at head dim 64, 255 registers with 200 spilled,
    which made causal attention several times slower than this loop. Causal programs start with
    the last query block, which sees the most keys. A row that sees no key gets out = 0 and, as in
    flash_attn, lse = +inf, so that the backward pass rebuilds its P as exp(S - inf) = 0.
    Soft-capping replaces the logit scale * q.k by c * tanh(scale * q.k / c), and ALiBi subtracts
    slope * |distance|; both form the logits whole before the maximum (SCALE_FIRST).

Dropout
    Dropout zeroes each probability with probability dropout_p and scales the others by
    1 / (1 - dropout_p): the running sum l still adds every p (the softmax is normalised before
    dropout), the accumulator only the kept ones, and out = acc / (l * (1 - dropout_p)). Which
    pairs are kept is a function of a seed and the pair's index (:func:`.scores.dropout_keep`),
    so nothing is stored: the backward pass draws the same mask again.

Non-finite inputs
    A NaN or inf in q, k or v reaches exactly the rows that see it. The mask's select keeps a bad
    score out of the rows that do not, but a bad value in v would still reach them through the
    product, as 0 x NaN. Testing v inside the sweep slowed causal attention by 40 % (the v tile
    stops being the matmul's operand alone and leaves the pipeline), so the sweep
    (:func:`attend_key_blocks`) first runs as if v were finite, and a masked tile that ends with a
    non-finite value is swept again, checked and unpipelined: the blocks that pay for the mask
    drop non-finite values of v and make the rows that see one NaN
    (:func:`..triton_ops.drop_hidden_nonfinite`). The usual inputs pay one reduction per tile
    (``book/data/nonfinite_check_cost.json`` has the measurements).

Packed sequences (VARLEN, :mod:`.packed`)
    flash_attn's varlen layout: sequences of different lengths one after another in q (total_q,
    heads, head_dim) and k, v (total_k, kv_heads, head_dim), cu_seqlens giving each one's first
    row. The grid covers the longest sequence, cdiv(max_seqlen_q, BLOCK_M) x (batch * heads); a
    program reads its sequence's rows from cu_seqlens, moves its pointers to the first of them
    and runs the code above on that sequence alone, with its own lengths (bounds masks, the
    bottom-right diagonal, the key range); a tile that starts past the sequence's end returns at
    once. lse is flash_attn's packed (heads, total_q). The dropout counter indexes (batch, heads,
    max_seqlen_q, max_seqlen_k), the layout of the S_dmask a call returns, in every kernel of the
    op. With VARLEN off, none of it is compiled in (the dense kernel compiles to the same
    instructions as without it).

Shapes: q (batch, seqlen_q, heads, head_dim), k, v (batch, seqlen_k, kv_heads, head_dim), any
strides with the last one 1, none empty; query head h reads key/value head h // (heads // kv_heads)
(grouped-query attention). out like q (contiguous); lse (batch, heads, seqlen_q) float32. Head dims
that are not powers of two are padded to BLOCK_D = next_power_of_2(head_dim) by masked loads.
Offsets are 64-bit: batch and row offsets are formed in int64 and pointers advance by one block per
step.

Bytes moved (element size s, H heads): q and out once, 2*B*Nq*H*d*s; k and v once per query block,
2*B*Nk*H*d*s*ceil(Nq/BLOCK_M) (mostly hits in L2); lse 4*B*H*Nq. FLOPs 4*B*H*Nq*Nk*d, about half
that causal, about 4*B*H*Nq*w*d for a window w keys wide: the kernel is bound by computation, not
by memory.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import LN2, any_nonfinite, block_size, cdiv, dot_precision, drop_hidden_nonfinite, mm
from .packed import fill_unowned_rows, packed_strides, sequence_rows
from .scores import (alibi_slope2, alibi_strides, dropout_keep, key_range, logit_scales, logits2, softcap_mode,
                     visible)


def forward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes, warps and pipeline stages, from a small table measured on an H200 (Triton 3.6)
    with ``benchmarks/bench_attention.py --tune`` (bfloat16, batch 4, 16 heads, N = 4096).

    BLOCK_M = 128 query rows amortise each key tile over many rows; larger head dims and float32
    shrink the key tile so that the pipeline's stages still fit in shared memory and the
    accumulator in registers. The interpreter gets small blocks (its cost grows with the tile) that
    differ (32 x 16) so the tests exercise BLOCK_M != BLOCK_N.
    """
    if INTERPRETED:
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    d = block_size(head_dim)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32 if d <= 128 else 16, num_warps=4, num_stages=2)
    if d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if d <= 128:  # a 128-key tile beat a 64-key one in the sweep; 4 stages no longer fit in shared memory
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


@triton.jit
def attend_key_blocks(q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d, lo, hi, mask_from, mask_until,
                      seqlen_k, head_dim, causal_offset, qk_scale, cap2, slope2, window_left, window_right,
                      exponent_scale, seed, row_base, max_seqlen_k, dropout_p,
                      WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                      ALIBI: tl.constexpr, DROPOUT: tl.constexpr, SCALE_FIRST: tl.constexpr, EVEN_N: tl.constexpr,
                      EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, DROP_HIDDEN_NONFINITE: tl.constexpr, STAGES: tl.constexpr):
    """The sweep over the key blocks [lo, hi): returns (acc, m, l) of the online softmax and, with
    DROP_HIDDEN_NONFINITE, the count of non-finite values of v that each row sees
    (:func:`..triton_ops.drop_hidden_nonfinite`); STAGES None pipelines as the launch asks."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hidden_nonfinite = tl.zeros([BLOCK_M], dtype=tl.int32)
    offs_n = tl.arange(0, BLOCK_N)
    # One loop over the key blocks some row of the tile sees, with a runtime test per block for
    # the mask, not two loops: a second loop would get its own pipeline buffers in shared memory.
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        cols = start_n + offs_n
        if EVEN_N and EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k), PRECISION)  # raw scores q.k, float32
        distance = offs_m[:, None] + causal_offset - cols[None, :]
        if SCALE_FIRST:  # -inf * scale is NaN or +inf for a scale <= 0: scale before masking
            s, _ = logits2(s, distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
        if WINDOW_LEFT or WINDOW_RIGHT or not EVEN_N:
            needs_mask = start_n + BLOCK_N > mask_from
            if WINDOW_LEFT:
                needs_mask = needs_mask | (start_n < mask_until)
            if needs_mask:  # a runtime test per block, the mask only where needed
                seen = visible(distance, cols[None, :], seqlen_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT)
                s = tl.where(seen, s, float("-inf"))
                if DROP_HIDDEN_NONFINITE:
                    v, hidden_nonfinite = drop_hidden_nonfinite(v, seen, hidden_nonfinite)
        m_new = tl.maximum(m_i, tl.max(s, 1) * exponent_scale)
        # a row that has seen no key yet has m = -inf: shift by 0 so that all its p are 0
        if WINDOW_LEFT or WINDOW_RIGHT:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = tl.exp2(s * exponent_scale - m_shift[:, None])  # base-2 probabilities, unnormalised
        alpha = tl.exp2(m_i - m_shift)                       # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax's denominator sums every p, dropped or not
        if DROPOUT:  # the 1 / (1 - dropout_p) of the kept ones is applied to out at the end
            p = tl.where(dropout_keep(seed, row_base, offs_m[:, None], cols[None, :], max_seqlen_k, dropout_p), p, 0.0)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i, hidden_nonfinite


@lean_launch
@triton.jit
def attention_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, alibi_ptr, seed_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                         stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                         stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_ab, stride_ah,
                         seqlen_q, seqlen_k, total_q, total_k, heads, group, head_dim, qk_scale, cap2, window_left,
                         window_right, dropout_p,
                         VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, SCALE_FIRST: tl.constexpr,
                         EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    if WINDOW_RIGHT:  # causal: the longest rows start first; the short ones fill the tail of the launch
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    kv_head = head // group
    # the dropout counter indexes the probabilities (batch, heads, max_seqlen_q, max_seqlen_k): the
    # lengths themselves, unless the sequences are packed
    max_seqlen_q = seqlen_q
    max_seqlen_k = seqlen_k
    if VARLEN:  # packed sequences (:mod:`.packed`): from here on seqlen_q, seqlen_k are this sequence's own
        batches = tl.num_programs(1) // heads
        program = tl.program_id(0) + tl.num_programs(0) * batch  # of the programs of this head
        fill_unowned_rows(out_ptr + head * stride_oh, stride_om, cu_seqlens_q_ptr, batches, total_q, head_dim,
                          program, tl.num_programs(0) * batches, 0.0, BLOCK_M, BLOCK_D)
        fill_unowned_rows(lse_ptr + head.to(tl.int64) * total_q, 1, cu_seqlens_q_ptr, batches, total_q, 1,
                          program, tl.num_programs(0) * batches, float("inf"), BLOCK_M, 1)
        q_start, seqlen_q = sequence_rows(cu_seqlens_q_ptr, batch, total_q)
        k_start, seqlen_k = sequence_rows(cu_seqlens_k_ptr, batch, total_k)
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
        q_ptr += q_start.to(tl.int64) * stride_qm
        out_ptr += q_start.to(tl.int64) * stride_om
        lse_ptr += q_start
        k_ptr += k_start.to(tl.int64) * stride_kn
        v_ptr += k_start.to(tl.int64) * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    causal_offset = seqlen_k - seqlen_q
    slope2 = alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI)
    seed = 0
    row_base = 0
    if DROPOUT:
        seed = tl.load(seed_ptr)
        row_base = tl.program_id(1).to(tl.int64) * max_seqlen_q  # this (batch, head)'s first row of probabilities

    # 64-bit base offsets; within a tile the offsets are small
    q_ptrs = (q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + start_m.to(tl.int64) * stride_qm
              + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :])
    row_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    if EVEN_M and EVEN_D:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=row_mask, other=0.0)
    if SCALE_FIRST:  # the logits are formed whole (scale <= 0, softcap or ALiBi); the exponent takes them as they are
        exponent_scale = 1.0
    else:  # plain scores and scale > 0: the scale is fused into the exponent's multiply-add
        exponent_scale = qk_scale

    lo, hi, mask_from, mask_until = key_range(start_m, seqlen_k, causal_offset, window_left, window_right,
                                              WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    k_ptrs = (k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
              + (lo + offs_n)[:, None] * stride_kn + offs_d[None, :])
    v_ptrs = (v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
              + (lo + offs_n)[:, None] * stride_vn + offs_d[None, :])
    sweep_args = (q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d, lo, hi, mask_from, mask_until, seqlen_k,
                  head_dim, causal_offset, qk_scale, cap2, slope2, window_left, window_right, exponent_scale, seed,
                  row_base, max_seqlen_k, dropout_p)  # (a tuple holds no constexpr strings in Triton 3.6: spelled out)
    acc, m_i, l_i, hidden_nonfinite = attend_key_blocks(
        *sweep_args, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, DROPOUT, SCALE_FIRST, EVEN_N, EVEN_D, PRECISION,
        BLOCK_M, BLOCK_N, BLOCK_D, DROP_HIDDEN_NONFINITE=False, STAGES=None)
    if WINDOW_LEFT or WINDOW_RIGHT:
        # a tile that ends non-finite (a NaN of its own, or one the masked blocks' 0 x NaN carried
        # into rows that do not see it) is swept again, checked (see "Non-finite inputs" above)
        if any_nonfinite(acc):
            acc, m_i, l_i, hidden_nonfinite = attend_key_blocks(
                *sweep_args, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, DROPOUT, SCALE_FIRST, EVEN_N, EVEN_D, PRECISION,
                BLOCK_M, BLOCK_N, BLOCK_D, DROP_HIDDEN_NONFINITE=True, STAGES=1)

    empty_row = l_i == 0.0  # rows that see no key (causal with seqlen_q > seqlen_k, or a window off the keys)
    l_safe = tl.where(empty_row, 1.0, l_i)
    if DROPOUT:
        out = acc / (l_safe * (1.0 - dropout_p))[:, None]
    else:
        out = acc / l_safe[:, None]
    out = tl.where((hidden_nonfinite > 0)[:, None], float("nan"), out)
    lse = tl.where(empty_row, float("inf"), (m_i + tl.log2(l_safe)) * LN2)  # base 2 -> natural
    out_ptrs = (out_ptr + batch.to(tl.int64) * stride_ob + head * stride_oh + start_m.to(tl.int64) * stride_om
                + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :])
    if VARLEN:  # flash_attn's packed layout, (heads, total_q); lse_ptr is at the sequence's first row
        lse_ptrs = lse_ptr + head.to(tl.int64) * total_q + offs_m
    else:
        lse_ptrs = lse_ptr + tl.program_id(1).to(tl.int64) * seqlen_q + offs_m
    if EVEN_M and EVEN_D:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


def attention_forward(q, k, v, *, softmax_scale, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                      dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                      config=None):
    """q (B, Nq, H, d), k, v (B, Nk, KVH, d), none empty, last strides 1; ``softmax_scale`` any
    finite float; ``window`` (left, right) with -1 for an unbounded side (causal: (-1, 0));
    ``softcap`` > 0 or 0 for none; ``alibi_slopes`` float32 (H,) or (B, H), or None;
    ``dropout_p`` in [0, 1) with ``dropout_seed`` a one-element int64 tensor on q's device when
    dropout_p > 0 (read by the kernel, so drawing it costs no synchronisation). Returns out
    (B, Nq, H, d) contiguous and lse (B, H, Nq) float32; lse is that of the probabilities before
    dropout.

    Packed sequences (:mod:`.packed`): q (total_q, H, d), k, v (total_k, KVH, d) with
    ``cu_seqlens_q``, ``cu_seqlens_k`` contiguous int32 (B + 1,) and the longest lengths
    ``max_seqlen_q`` >= 1, ``max_seqlen_k`` >= 1; out (total_q, H, d) and lse (H, total_q), rows
    past the last sequence 0 and +inf.

    ``config`` overrides :func:`forward_config` (the benchmark's tuning sweep uses it).
    """
    varlen = cu_seqlens_q is not None
    if varlen:  # the grid and the dropout counter are laid out over the longest sequence
        (total_q, heads, head_dim), (total_k, kv_heads) = q.shape, k.shape[:2]
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse_shape = (heads, total_q)
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        total_q = total_k = 0
        lse_shape = (batch, heads, seqlen_q)
    cfg = dict(config or forward_config(head_dim, q.dtype))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_d = block_size(head_dim)
    out = outputs.empty(q.shape, q.dtype, q.device)
    lse = outputs.empty(lse_shape, torch.float32, q.device)
    strides = packed_strides(q, k, v, out) if varlen else (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                                           *out.stride()[:3])
    grid = (cdiv(seqlen_q, block_m), batch * heads)
    attention_fwd_kernel[grid](
        q, k, v, out, lse, lse if alibi_slopes is None else alibi_slopes, lse if dropout_seed is None else dropout_seed,
        cu_seqlens_q if varlen else lse, cu_seqlens_k if varlen else lse, *strides, *alibi_strides(alibi_slopes),
        seqlen_q, seqlen_k, total_q, total_k, heads, heads // kv_heads, head_dim, *logit_scales(softmax_scale, softcap),
        *window, float(dropout_p),
        VARLEN=varlen, WINDOW_LEFT=window[0] >= 0, WINDOW_RIGHT=window[1] >= 0, SOFTCAP=softcap_mode(softcap, q.dtype),
        ALIBI=alibi_slopes is not None, DROPOUT=dropout_p > 0,
        SCALE_FIRST=softmax_scale <= 0 or softcap > 0 or alibi_slopes is not None,
        EVEN_M=not varlen and seqlen_q % block_m == 0, EVEN_N=not varlen and seqlen_k % block_n == 0,
        EVEN_D=head_dim == block_d, PRECISION=dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, **cfg,
    )
    return out, lse
