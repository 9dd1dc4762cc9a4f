"""Chapter 7: the attention backward pass, rebuilt tile by tile from one float per query row.

Algorithm
    With S = scale * Q K^T, P = softmax(S) = exp(S - lse) and O = P V, the gradients are
        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q,
    where delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i (one float per query row). The forward pass
    stored lse; any tile of P is recomputed as exp2(S * log2(e) - lse * log2(e)), so nothing of size
    N x N is ever written. The recomputation takes the scaled scores as they are, so it holds for
    any scale, zero and negative included; a row that saw no key has lse = +inf and so P = 0.

Kernels
    preprocess: delta = rowsum(dO * O) and the base-2 lse, both (batch, heads, seqlen_q) float32.
    dK/dV: a program owns BLOCK_N keys of one (batch, kv head) and walks the query blocks of every
        query head of its group, accumulating dK and dV in registers: no two programs write the same
        element, so the result is deterministic and needs no atomics.
    dQ: a program owns BLOCK_M queries of one (batch, head) and walks the key blocks; it, too, is
        the only writer of its elements. The backward pass is therefore bitwise reproducible.
    Windows (causal is the window (unbounded, 0); see :mod:`.forward`): tiles that no pair of
    the window reaches are skipped; each loop tests per block whether an edge of the window
    crosses it, and only then applies the mask (one loop per kernel: Triton gives every loop its
    own pipeline buffers in shared memory). Soft-capping multiplies dS by 1 - tanh^2 of the
    capped argument; ALiBi's bias does not depend on q or k and leaves dS as it is. Dropout
    regenerates the forward pass's mask from its seed (:func:`.scores.dropout_keep`): with
    Z = keep / (1 - p), out = (P * Z) V, so dV = (P * Z)^T dO and the gradient of P is
    (dO V^T) * Z, while delta = rowsum(dO * O) holds as before. Two other schedules of the same
    loops, one kernel and dQ by atomics, are chapter 7's foils (:mod:`.teaching`).

Packed sequences (VARLEN, :mod:`.packed`)
    As in the forward pass: the grids cover the longest sequence, each program moves to its
    sequence's rows and works with its lengths, and a key block (dK/dV) or query block (dQ) that
    starts past its sequence's end returns at once. The preprocess kernel is unchanged: lse,
    delta and lse2 are (heads, total_q), to it one sequence of total_q rows. dQ rows past the last
    sequence, and dK, dV rows past it, are written 0: out does not depend on those rows.

Shapes: q, dq (batch, seqlen_q, heads, d), k, v, dk, dv (batch, seqlen_k, kv_heads, d), out and
dout like q; any strides with the last one 1 (each tensor is addressed with its own strides), none
empty. lse (batch, heads, seqlen_q) float32.

Bytes moved (element size s, H heads, KVH kv heads): the dK/dV kernel reads k, v once and q, dO,
lse, delta once per key block (2*B*Nq*H*d*s*ceil(Nk/BLOCK_N), mostly from L2), writes dk, dv; the
dQ kernel reads q, dO once and k, v once per query block, writes dq. FLOPs: dK/dV kernel 4 matmuls
(S, dP, dV, dK), dQ kernel 3 (S, dP, dQ): 7 * 2*B*H*Nq*Nk*d in all against 5 for the minimum,
half that causal.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import LOG2E, block_size, cdiv, dot_precision, mm
from .packed import fill_unowned_rows, packed_strides, sequence_rows
from .scores import (alibi_slope2, alibi_strides, dropout_keep, key_range, logit_scales, logits2, softcap_mode,
                     visible)


def backward_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tiles, warps and stages of the two loops, from a small table measured on an H200 (Triton 3.6):
    "dkdv" (BLOCK_N keys owned x BLOCK_M queries walked) and "dq" (BLOCK_M queries owned x BLOCK_N
    keys walked), tuned with ``benchmarks/bench_attention.py --tune``.

    A dK/dV program holds k, v and two float32 accumulators of BLOCK_N x d in registers, so its
    key tile shrinks as d grows; the tile it walks stays small so the pipeline fits in shared
    memory. The interpreter gets small unequal tiles (its cost grows with the tile; the tests then
    cover BLOCK_M != BLOCK_N).
    """
    if INTERPRETED:
        return dict(dkdv=dict(BLOCK_N=32, BLOCK_M=16, num_warps=4, num_stages=1),
                    dq=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1))
    d = block_size(head_dim)
    if dtype == torch.float32:
        tile = 64 if d <= 128 else 32
        return dict(dkdv=dict(BLOCK_N=tile, BLOCK_M=tile // 2, num_warps=4, num_stages=1),
                    dq=dict(BLOCK_M=tile, BLOCK_N=tile // 2, num_warps=4, num_stages=1))
    if d <= 64:  # each loop its own tiles: the sweep preferred this to one tiling for both
        return dict(dkdv=dict(BLOCK_N=128, BLOCK_M=32, num_warps=4, num_stages=3),
                    dq=dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))
    if d <= 128:  # the sweep found no difference between the two tilings here
        return dict(dkdv=dict(BLOCK_N=64, BLOCK_M=64, num_warps=4, num_stages=2),
                    dq=dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))
    return dict(dkdv=dict(BLOCK_N=64, BLOCK_M=32, num_warps=8, num_stages=1),
                dq=dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1))


@lean_launch
@triton.jit
def attention_bwd_preprocess_kernel(out_ptr, dout_ptr, lse_ptr, delta_ptr, lse2_ptr,
                                    stride_ob, stride_om, stride_oh, stride_db, stride_dm, stride_dh,
                                    seqlen_q, heads, head_dim,
                                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(out_ptr + batch.to(tl.int64) * stride_ob + head * stride_oh + rows * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + batch.to(tl.int64) * stride_db + head * stride_dh + rows * stride_dm + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    row_ptrs = tl.program_id(1).to(tl.int64) * seqlen_q + offs_m
    lse = tl.load(lse_ptr + row_ptrs, mask=offs_m < seqlen_q, other=0.0)
    tl.store(delta_ptr + row_ptrs, tl.sum(o * do, 1), mask=offs_m < seqlen_q)
    # natural -> base 2; a row that saw no key keeps lse = +inf, so its rebuilt P is exactly 0
    tl.store(lse2_ptr + row_ptrs, lse * LOG2E, mask=offs_m < seqlen_q)


@triton.jit
def dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptrs, delta_ptrs, lo, hi, mask_until, mask_from,
                      offs_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale, cap2, slope2,
                      window_left, window_right, seed, row_base, max_seqlen_k, dropout_p, stride_qm, stride_dom,
                      WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                      ALIBI: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add the query blocks [lo, hi) of one head to this key block's dk, dv (transposed tiles:
    keys down, queries across). The blocks that start before mask_until (a row right of the
    window's right edge for the block's last key) or end after mask_from (a row whose window
    starts after the block's first key) are masked. Pointers point at block lo."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        if EVEN_M and EVEN_D:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        else:
            row_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
            q = tl.load(q_ptrs, mask=row_mask, other=0.0)
            do = tl.load(do_ptrs, mask=row_mask, other=0.0)
        if EVEN_M:
            lse2 = tl.load(lse2_ptrs)
            delta = tl.load(delta_ptrs)
        else:  # a row past the end gets lse2 = +inf, so its P is 0
            lse2 = tl.load(lse2_ptrs, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptrs, mask=rows < seqlen_q, other=0.0)
        # keys past seqlen_k were loaded as zeros: their dk, dv rows are never stored
        distance = rows[None, :] + causal_offset - offs_n[:, None]
        s_t, dcap_t = logits2(mm(k, tl.trans(q), PRECISION), distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
        p_t = tl.exp2(s_t - lse2[None, :])
        if WINDOW_LEFT or WINDOW_RIGHT:
            needs_mask = start_m < mask_until
            if WINDOW_LEFT:
                needs_mask = needs_mask | (start_m + BLOCK_M > mask_from)
            if needs_mask:  # a runtime test per block, the mask only where the window's edges cross it
                p_t = tl.where(visible(distance, offs_n[:, None], seqlen_k, window_left, window_right,
                                       WINDOW_LEFT, WINDOW_RIGHT), p_t, 0.0)
        dp_t = mm(v, tl.trans(do), PRECISION)
        if DROPOUT:  # out used the kept p / (1 - dropout_p): so do dV and the gradient of P
            keep_t = dropout_keep(seed, row_base, rows[None, :], offs_n[:, None], max_seqlen_k, dropout_p)
            dv += mm(tl.where(keep_t, p_t / (1.0 - dropout_p), 0.0).to(do.dtype), do, PRECISION)
            dp_t = tl.where(keep_t, dp_t / (1.0 - dropout_p), 0.0)
        else:
            dv += mm(p_t.to(do.dtype), do, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            ds_t = ds_t * dcap_t
        dk += mm(ds_t.to(q.dtype), q, PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse2_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def dkdv_program(key_block, batch, kv_head, q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr,
                 alibi_ptr, seed_ptr,
                 stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                 stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_ab, stride_ah,
                 seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, total_q, heads, group, head_dim, qk_scale, cap2,
                 softmax_scale, window_left, window_right, dropout_p,
                 VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """dk, dv of keys [key_block * BLOCK_N, + BLOCK_N) of one (batch, kv head), summed over its group.
    ``max_seqlen_q``, ``max_seqlen_k``: the sizes the dropout counter is laid out over (the lengths,
    unless packed). VARLEN: the pointers are at the sequence's first rows (lse2 and delta too, which
    are (heads, total_q)), seqlen_q and seqlen_k its own lengths."""
    start_n = key_block * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    causal_offset = seqlen_k - seqlen_q
    key_tile = tl.arange(0, BLOCK_N)[:, None]
    k_ptrs = (k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh + start_n.to(tl.int64) * stride_kn
              + key_tile * stride_kn + offs_d[None, :])
    v_ptrs = (v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh + start_n.to(tl.int64) * stride_vn
              + key_tile * stride_vn + offs_d[None, :])
    key_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
    if EVEN_N and EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=key_mask, other=0.0)
        v = tl.load(v_ptrs, mask=key_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seed = 0  # read only with dropout
    if DROPOUT:
        seed = tl.load(seed_ptr)

    # Query blocks [lo, hi) see some key of this block (query i sees key j iff
    # j - off - right <= i <= j - off + left, off = seqlen_k - seqlen_q); those that start before
    # mask_until or end after mask_from hold a row that does not see all of them. One loop, not
    # two: a second loop would get its own pipeline buffers in shared memory.
    lo = 0
    hi = seqlen_q
    mask_until = 0
    mask_from = seqlen_q
    if WINDOW_RIGHT:
        lo = tl.maximum(0, start_n - causal_offset - window_right) // BLOCK_M * BLOCK_M
        mask_until = start_n + BLOCK_N - 1 - causal_offset - window_right
    if WINDOW_LEFT:
        hi = tl.minimum(seqlen_q, tl.maximum(0, start_n + BLOCK_N - causal_offset + window_left))
        mask_from = start_n - causal_offset + window_left + 1
    for g in range(group):
        head = kv_head * group + g
        slope2 = alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI)
        row_tile = lo + tl.arange(0, BLOCK_M)[:, None].to(tl.int64)
        q_ptrs = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + row_tile * stride_qm + offs_d[None, :]
        do_ptrs = dout_ptr + batch.to(tl.int64) * stride_dob + head * stride_doh + row_tile * stride_dom + offs_d[None, :]
        row_base = (batch * heads + head).to(tl.int64) * max_seqlen_q  # the dropout counter's first row
        if VARLEN:
            lse_rows = head.to(tl.int64) * total_q
        else:  # lse2, delta (batch, heads, seqlen_q): laid out as the dropout counter
            lse_rows = row_base
        lse2_ptrs = lse2_ptr + lse_rows + lo + offs_m
        delta_ptrs = delta_ptr + lse_rows + lo + offs_m
        dk, dv = dkdv_query_blocks(
            dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptrs, delta_ptrs, lo, hi, mask_until, mask_from,
            offs_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale, cap2, slope2,
            window_left, window_right, seed, row_base, max_seqlen_k, dropout_p, stride_qm, stride_dom,
            WINDOW_LEFT=WINDOW_LEFT, WINDOW_RIGHT=WINDOW_RIGHT, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
            EVEN_M=EVEN_M, EVEN_D=EVEN_D, PRECISION=PRECISION, BLOCK_M=BLOCK_M)

    dk_ptrs = (dk_ptr + batch.to(tl.int64) * stride_dkb + kv_head * stride_dkh + start_n.to(tl.int64) * stride_dkn
               + key_tile * stride_dkn + offs_d[None, :])
    dv_ptrs = (dv_ptr + batch.to(tl.int64) * stride_dvb + kv_head * stride_dvh + start_n.to(tl.int64) * stride_dvn
               + key_tile * stride_dvn + offs_d[None, :])
    dk = dk * softmax_scale
    if EVEN_N and EVEN_D:
        tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty))
    else:
        tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=key_mask)
        tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=key_mask)


@triton.jit
def dq_key_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo, hi, mask_from, mask_until, offs_m, offs_n, offs_d,
                  seqlen_k, head_dim, causal_offset, qk_scale, cap2, slope2, window_left, window_right,
                  seed, row_base, max_seqlen_k, dropout_p, stride_kn, stride_vn,
                  WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                  DROPOUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add the key blocks [lo, hi) to this query block's dq; the blocks that reach past mask_from
    or start before mask_until are masked, as in the forward pass. Pointers point at block lo."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if EVEN_N and EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        distance = offs_m[:, None] + causal_offset - cols[None, :]
        s, dcap = logits2(mm(q, tl.trans(k), PRECISION), distance, qk_scale, cap2, slope2, SOFTCAP, ALIBI)
        p = tl.exp2(s - lse2[:, None])
        if WINDOW_LEFT or WINDOW_RIGHT or not EVEN_N:
            needs_mask = start_n + BLOCK_N > mask_from
            if WINDOW_LEFT:
                needs_mask = needs_mask | (start_n < mask_until)
            if needs_mask:  # a runtime test per block, the mask only where needed
                # A key past the end loads as zeros, and its P = exp2(-lse2) overflows where every
                # score of the row is very negative: inf * 0 would be NaN in dq.
                p = tl.where(visible(distance, cols[None, :], seqlen_k, window_left, window_right,
                                     WINDOW_LEFT, WINDOW_RIGHT), p, 0.0)
        dp = mm(do, tl.trans(v), PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, row_base, offs_m[:, None], cols[None, :], max_seqlen_k, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            ds = ds * dcap
        dq += mm(ds.to(k.dtype), k, PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def dq_program(query_block, batch, head, q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dq_ptr, alibi_ptr,
               seed_ptr,
               stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
               stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
               stride_dqb, stride_dqm, stride_dqh, stride_ab, stride_ah,
               seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, total_q, heads, group, head_dim, qk_scale, cap2,
               softmax_scale, window_left, window_right, dropout_p,
               VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
               EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """dq of queries [query_block * BLOCK_M, + BLOCK_M) of one (batch, head); the other arguments as
    :func:`dkdv_program`'s."""
    start_m = query_block * BLOCK_M
    kv_head = head // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    causal_offset = seqlen_k - seqlen_q
    slope2 = alibi_slope2(alibi_ptr, batch, head, stride_ab, stride_ah, ALIBI)
    row_tile = start_m.to(tl.int64) + tl.arange(0, BLOCK_M)[:, None]
    q_ptrs = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + row_tile * stride_qm + offs_d[None, :]
    do_ptrs = dout_ptr + batch.to(tl.int64) * stride_dob + head * stride_doh + row_tile * stride_dom + offs_d[None, :]
    row_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    if EVEN_M and EVEN_D:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
    else:
        q = tl.load(q_ptrs, mask=row_mask, other=0.0)
        do = tl.load(do_ptrs, mask=row_mask, other=0.0)
    row_base = (batch * heads + head).to(tl.int64) * max_seqlen_q  # the dropout counter's first row
    if VARLEN:
        row_ptrs = head.to(tl.int64) * total_q + offs_m
    else:  # lse2, delta (batch, heads, seqlen_q): laid out as the dropout counter
        row_ptrs = row_base + offs_m
    lse2 = tl.load(lse2_ptr + row_ptrs, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(delta_ptr + row_ptrs, mask=offs_m < seqlen_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    seed = 0  # read only with dropout
    if DROPOUT:
        seed = tl.load(seed_ptr)
    lo, hi, mask_from, mask_until = key_range(start_m, seqlen_k, causal_offset, window_left, window_right,
                                              WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)  # as in the forward pass
    key_tile = (lo + offs_n)[:, None]
    k_ptrs = k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh + key_tile * stride_kn + offs_d[None, :]
    v_ptrs = v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh + key_tile * stride_vn + offs_d[None, :]
    dq = dq_key_blocks(
        dq, q, do, lse2, delta, k_ptrs, v_ptrs, lo, hi, mask_from, mask_until, offs_m, offs_n, offs_d, seqlen_k,
        head_dim, causal_offset, qk_scale, cap2, slope2, window_left, window_right, seed, row_base, max_seqlen_k,
        dropout_p, stride_kn, stride_vn, WINDOW_LEFT=WINDOW_LEFT, WINDOW_RIGHT=WINDOW_RIGHT, SOFTCAP=SOFTCAP,
        ALIBI=ALIBI,
        DROPOUT=DROPOUT,
        EVEN_N=EVEN_N, EVEN_D=EVEN_D, PRECISION=PRECISION, BLOCK_N=BLOCK_N)

    dq_ptrs = dq_ptr + batch.to(tl.int64) * stride_dqb + head * stride_dqh + row_tile * stride_dqm + offs_d[None, :]
    dq = dq * softmax_scale
    if EVEN_M and EVEN_D:
        tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty))
    else:
        tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def at_sequence_start(q_ptr, dout_ptr, lse2_ptr, delta_ptr, k_ptr, v_ptr, q_start, k_start, stride_qm, stride_dom,
                      stride_kn, stride_vn):
    """The inputs both backward kernels read, moved to one packed sequence's first rows: q, dout,
    lse2 and delta at query row ``q_start``, k and v at key row ``k_start``."""
    q_start64, k_start64 = q_start.to(tl.int64), k_start.to(tl.int64)
    return (q_ptr + q_start64 * stride_qm, dout_ptr + q_start64 * stride_dom, lse2_ptr + q_start,
            delta_ptr + q_start, k_ptr + k_start64 * stride_kn, v_ptr + k_start64 * stride_vn)


@lean_launch
@triton.jit
def attention_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, alibi_ptr, seed_ptr,
                              cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                              stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                              stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                              stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                              stride_ab, stride_ah,
                              seqlen_q, seqlen_k, total_q, total_k, heads, kv_heads, head_dim, qk_scale, cap2,
                              softmax_scale, window_left, window_right, dropout_p,
                              VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
                              EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (key blocks, batch * kv_heads). VARLEN: packed sequences (:mod:`.packed`), seqlen_q and
    seqlen_k their longest lengths."""
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    max_seqlen_q = seqlen_q
    max_seqlen_k = seqlen_k
    if VARLEN:  # from here on seqlen_q, seqlen_k are this sequence's own, the pointers at its first rows
        batches = tl.num_programs(1) // kv_heads
        program = tl.program_id(0) + tl.num_programs(0) * batch  # of the programs of this kv head
        fill_unowned_rows(dk_ptr + kv_head * stride_dkh, stride_dkn, cu_seqlens_k_ptr, batches, total_k, head_dim,
                          program, tl.num_programs(0) * batches, 0.0, BLOCK_N, BLOCK_D)
        fill_unowned_rows(dv_ptr + kv_head * stride_dvh, stride_dvn, cu_seqlens_k_ptr, batches, total_k, head_dim,
                          program, tl.num_programs(0) * batches, 0.0, BLOCK_N, BLOCK_D)
        q_start, seqlen_q = sequence_rows(cu_seqlens_q_ptr, batch, total_q)
        k_start, seqlen_k = sequence_rows(cu_seqlens_k_ptr, batch, total_k)
        if tl.program_id(0) * BLOCK_N >= seqlen_k:  # the grid covers the longest sequence
            return
        q_ptr, dout_ptr, lse2_ptr, delta_ptr, k_ptr, v_ptr = at_sequence_start(
            q_ptr, dout_ptr, lse2_ptr, delta_ptr, k_ptr, v_ptr, q_start, k_start, stride_qm, stride_dom, stride_kn,
            stride_vn)
        dk_ptr += k_start.to(tl.int64) * stride_dkn
        dv_ptr += k_start.to(tl.int64) * stride_dvn
    dkdv_program(tl.program_id(0), batch, kv_head,
                 q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, alibi_ptr, seed_ptr,
                 stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                 stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_ab, stride_ah,
                 seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, total_q, heads, heads // kv_heads, head_dim, qk_scale,
                 cap2, softmax_scale, window_left, window_right, dropout_p, VARLEN, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                 ALIBI, DROPOUT, EVEN_M, EVEN_N, EVEN_D, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)


@lean_launch
@triton.jit
def attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dq_ptr, alibi_ptr, seed_ptr,
                            cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                            stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                            stride_dqb, stride_dqm, stride_dqh, stride_ab, stride_ah,
                            seqlen_q, seqlen_k, total_q, total_k, heads, kv_heads, head_dim, qk_scale, cap2,
                            softmax_scale, window_left, window_right, dropout_p,
                            VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
                            EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (query blocks, batch * heads). VARLEN: packed sequences (:mod:`.packed`), seqlen_q and
    seqlen_k their longest lengths."""
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    max_seqlen_q = seqlen_q
    max_seqlen_k = seqlen_k
    if VARLEN:  # from here on seqlen_q, seqlen_k are this sequence's own, the pointers at its first rows
        batches = tl.num_programs(1) // heads
        fill_unowned_rows(dq_ptr + head * stride_dqh, stride_dqm, cu_seqlens_q_ptr, batches, total_q, head_dim,
                          tl.program_id(0) + tl.num_programs(0) * batch, tl.num_programs(0) * batches, 0.0,
                          BLOCK_M, BLOCK_D)
        q_start, seqlen_q = sequence_rows(cu_seqlens_q_ptr, batch, total_q)
        k_start, seqlen_k = sequence_rows(cu_seqlens_k_ptr, batch, total_k)
        if tl.program_id(0) * BLOCK_M >= seqlen_q:  # the grid covers the longest sequence
            return
        q_ptr, dout_ptr, lse2_ptr, delta_ptr, k_ptr, v_ptr = at_sequence_start(
            q_ptr, dout_ptr, lse2_ptr, delta_ptr, k_ptr, v_ptr, q_start, k_start, stride_qm, stride_dom, stride_kn,
            stride_vn)
        dq_ptr += q_start.to(tl.int64) * stride_dqm
    dq_program(tl.program_id(0), batch, head,
               q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dq_ptr, alibi_ptr, seed_ptr,
               stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
               stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
               stride_dqb, stride_dqm, stride_dqh, stride_ab, stride_ah,
               seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, total_q, heads, heads // kv_heads, head_dim, qk_scale,
               cap2, softmax_scale, window_left, window_right, dropout_p, VARLEN, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
               ALIBI, DROPOUT, EVEN_M, EVEN_N, EVEN_D, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)


def batch_row_head_strides(*tensors):
    """The (batch, row, head) strides of each (batch, seqlen, heads, d) tensor, in order: every
    tensor a kernel addresses is passed its own."""
    return [s for t in tensors for s in t.stride()[:3]]


def backward_preprocess(out, dout, lse):
    """delta = rowsum(dout * out) and lse in base 2, both (batch, heads, seqlen_q) float32."""
    batch, seqlen_q, heads, head_dim = out.shape
    block_d = block_size(head_dim)
    delta = outputs.empty((batch, heads, seqlen_q), torch.float32, out.device)
    lse2 = outputs.empty((batch, heads, seqlen_q), torch.float32, out.device)
    block_m = 16 if block_d > 128 else 64  # rows x d of two tensors in registers
    attention_bwd_preprocess_kernel[(cdiv(seqlen_q, block_m), batch * heads)](
        out, dout, lse, delta, lse2, *batch_row_head_strides(out, dout), seqlen_q, heads, head_dim,
        BLOCK_M=block_m, BLOCK_D=block_d)
    return delta, lse2


def attention_backward(q, k, v, out, lse, dout, *, softmax_scale, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                       dropout_p=0.0, dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                       max_seqlen_k=0, config=None):
    """Gradients (dq, dk, dv) of the forward pass that returned (out, lse), each contiguous in its
    input's dtype; bitwise reproducible. Shapes and arguments as :func:`.forward.attention_forward`,
    packed sequences too (dq, dk, dv 0 in the rows past the last sequence); ``config`` overrides
    :func:`backward_config`."""
    varlen = cu_seqlens_q is not None
    if varlen:  # the grids and the dropout counter are laid out over the longest sequence
        (total_q, heads, head_dim), (total_k, kv_heads) = q.shape, k.shape[:2]
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        # delta and lse2 as lse, (heads, total_q): the preprocess kernel sees one sequence of total_q rows
        delta, lse2 = backward_preprocess(out[None], dout[None], lse[None])
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        total_q = total_k = 0
        delta, lse2 = backward_preprocess(out, dout, lse)
    cfg = config or backward_config(head_dim, q.dtype)
    dkdv_cfg, dq_cfg = dict(cfg["dkdv"]), dict(cfg["dq"])
    bn, bm = dkdv_cfg.pop("BLOCK_N"), dkdv_cfg.pop("BLOCK_M")
    bm2, bn2 = dq_cfg.pop("BLOCK_M"), dq_cfg.pop("BLOCK_N")
    block_d = block_size(head_dim)

    dq = outputs.empty(q.shape, q.dtype, q.device)
    dk = outputs.empty(k.shape, k.dtype, k.device)
    dv = outputs.empty(v.shape, v.dtype, v.device)
    alibi = lse if alibi_slopes is None else alibi_slopes  # pointers never read without ALiBi, without dropout
    seed = lse if dropout_seed is None else dropout_seed
    strides = packed_strides if varlen else batch_row_head_strides
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if varlen else (lse, lse)  # (pointers not read unpacked)
    sizes = (seqlen_q, seqlen_k, total_q, total_k, heads, kv_heads, head_dim, *logit_scales(softmax_scale, softcap),
             softmax_scale, *window, float(dropout_p))
    flags = dict(VARLEN=varlen, WINDOW_LEFT=window[0] >= 0, WINDOW_RIGHT=window[1] >= 0,
                 SOFTCAP=softcap_mode(softcap, q.dtype), ALIBI=alibi_slopes is not None, DROPOUT=dropout_p > 0,
                 EVEN_D=head_dim == block_d, PRECISION=dot_precision(q.dtype), BLOCK_D=block_d)
    attention_bwd_dkdv_kernel[(cdiv(seqlen_k, bn), batch * kv_heads)](
        q, k, v, dout, lse2, delta, dk, dv, alibi, seed, *cu_seqlens, *strides(q, k, v, dout, dk, dv),
        *alibi_strides(alibi_slopes), *sizes,
        EVEN_M=not varlen and seqlen_q % bm == 0, EVEN_N=not varlen and seqlen_k % bn == 0, BLOCK_M=bm, BLOCK_N=bn,
        **flags, **dkdv_cfg)
    attention_bwd_dq_kernel[(cdiv(seqlen_q, bm2), batch * heads)](
        q, k, v, dout, lse2, delta, dq, alibi, seed, *cu_seqlens, *strides(q, k, v, dout, dq),
        *alibi_strides(alibi_slopes), *sizes,
        EVEN_M=not varlen and seqlen_q % bm2 == 0, EVEN_N=not varlen and seqlen_k % bn2 == 0, BLOCK_M=bm2,
        BLOCK_N=bn2, **flags, **dq_cfg)
    return dq, dk, dv
