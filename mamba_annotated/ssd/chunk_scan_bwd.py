"""Chapter 5, backward kernels: dx, d dt (direct part), dD, dB, dC and the step gradients
d(dt'_k A), chunk by chunk.

Notation: in chunk c of head h, L[t, s] = exp(a_t - a_s) for s <= t in one sequence (else 0),
dy the gradient of y (before the gate), dS = dS_c the gradient of the chunk state S_c and H = H_c
the state entering the chunk (both from :mod:`.state_passing`).

dx kernel, for each position s (rows) and all of headdim:
    G_s   = exp(a_last - a_s) [s in the last sequence] * dS B_s  +  sum_{t >= s} CB[t, s] L[t, s] dy_t
    dx_s  = dt_s G_s + D dy_s;   d dt_s (direct) = x_s . G_s;   dD += dy_s * x_s (partial sums, one per 16 rows)
dCB kernel, for one (t, s) tile of a chunk, looping over the heads of a group (they share B and C,
so their gradients add up):
    dCB[t, s] = sum_h L[t, s] dt_s (dy_t . x_s)            (the gradient of C_t . B_s)
    and, per head, W = CB * (that head's term), its shares of the step gradients (below).
dBC kernel, for each position r (rows) and a block of dstate:
    dC_r  = sum_h exp(a_r) [r in H's sequence] * dy_r H  +  sum_{s <= r} dCB[r, s] B_s
    dB_r  = sum_h exp(a_last - a_r) dt_r [r in the last sequence] * x_r dS  +  sum_{t >= r} dCB[t, r] C_t
    and, per head, the state terms of the step gradients (below) and the carry <dS_c, gamma_c H_c>.

The step gradients. a_t = sum_{k <= t} dt'_k A enters every term as exp(a_t - a_s) (a pair t >= s
of the diagonal block, weight W[t, s]), exp(a_r) (the state entering the chunk, read at r) or
exp(a_last - a_r) (row r's part of the chunk state). So d(dt'_k A), the gradient of one step,
collects the terms whose exponent holds that step:
    d(dt'_k A) = sum_{t >= k > s} W[t, s]                     the pairs that straddle k
               + sum_{r >= k} C_r . (exp(a_r) dy_r H)          the state entering, read at r >= k
               + sum_{r < k} B_r . (exp(a_last - a_r) dt_r x_r dS)   row r's share of S_c
               + <dS_c, gamma_c H_c>                          the carry, gamma_c = exp(a_last)
                                                              (from the reverse state passing)
Each sum has terms of one sign of the exponent only. Written instead as d a_t = C_t . dC_t - B_t . dB_t
(+ <dS_c, H_{c+1}> at the last slot) and reverse-summed, the same value comes out as a difference
of sums over nearly the whole chunk, whose terms near the diagonal are the largest and cancel, and
the error of dA grew with the chunk (chapter 5 gives the numbers).
The dCB kernel stores, per tile (i, j) and head, into slots of the pairs tensor (Q / BLOCK_M of
them per position):
    k in the column block j: sum over the tile's pairs with s < k (t >= k holds for every row of a
        tile left of the diagonal; on the diagonal tile only rows t >= k count): slot i, stored one
        position on from the column u = k - 1 that the in-register cumulative sum ends at;
    k in the row block i of a tile left of the diagonal: sum over its rows t >= k (slot j);
    k in a block strictly between j and i: every pair of the tile, which ``dt_backward`` reads from
        slot j at the first position of block i.
The dBC kernel stores the two state terms per position r in slots of their own, and ``dt_backward``
sums them over r >= k and r < k.

Deterministic: no atomic adds. Each program stores its shares in slots of its own
(:class:`DecayGradients`): the dCB kernel, whose row block is fixed at launch (not tuned), as
above, so that every slot of every position is written by exactly one program; the dBC kernel one
slot per (position, SLOT_N-wide block of dstate), SLOT_N being the narrowest dstate block the tuner
tries, so every configuration writes every slot (its wider blocks are summed per SLOT_N) and a
trial run of another configuration leaves no stale value. ``dt_backward`` adds the slots in a fixed
order, so the gradients are the same bits on every run with the same configurations (the tuner's
choice is cached per process).

Shapes as the forward kernels. Inputs x, dy, B, C are addressed by their own strides (they may be
views); dx, dB, dC are allocated contiguous and addressed by theirs. Outputs: dx (x's dtype), d dt
direct (batch, heads, chunks, Q) float32, dCB laid out as CB (:mod:`.chunk_state`: the squares on
and below the diagonal), dB, dC (B's shape and dtype), and the slots of the step gradients. H and dS (batch, chunks,
heads, headdim, dstate) come in the inputs' dtype (or the state dtype): the matmuls round them to it.
Bytes moved: dx reads x, dy, B, CB and dS; dCB reads x and dy once per tile (about (Q/BLOCK + 1)/2
times, mostly from L2) and writes cb_length(Q) float32 per chunk and group; dBC reads x, dy, H and dS once
per dstate block, dCB, B and C, and writes dB, dC. The slots of the step gradients are
(Q / 64 + 2 dstate / 64) float32 values per (position, head) at chunk 256 on a GPU, a fraction of
x's size.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import block_size, cdiv, dot_precision, drop_hidden_nonfinite, is_nonfinite, mm, rounded_product
from .chunk_scan import flagged_row_blocks, is_flagged
from .chunk_state import SCAN_ROWS, cb_chunk, cb_offsets, check_row_blocks, check_square_blocks
from .log_decays import decay, decay_between, load_sums
from .tuning import autotune, config


@dataclass
class DecayGradients:
    """The gradient of the log-decay steps, d(dt'_k A), as the backward kernels leave it: in three
    kinds of sums that no later step subtracts from one another (see the module docstring), in
    slots that one program each writes (no atomics), added in a fixed order by ``dt_backward``;
    and d dt' direct, from the dx kernel. All float32."""
    direct: torch.Tensor      # (batch, heads, chunks, Q): d dt' direct
    pairs: torch.Tensor       # (batch, heads, chunks, Q // DCB_ROWS, Q): the dCB kernel's sums over t >= k > s
    from_start: torch.Tensor  # (batch, heads, chunks, slots, Q): C_r . dC_r state terms, summed over r >= k
    to_end: torch.Tensor      # (batch, heads, chunks, slots, Q): B_r . dB_r state terms, summed over r < k
    carry: torch.Tensor       # (batch, heads, chunks, blocks): <dS_c, gamma_c H_c> in partial sums, for every k


# Row blocks of at most SCAN_ROWS (the tuner picked 64 rows, steps of 32, on an H200): the loop
# below reads whole CB tiles and needs every entry finite (see chunk_scan's diagonal loop). Steps
# divide the row block: the loop runs from a row block's edge to the chunk's end, and a step of 64
# after a row block of 32 read CB rows of the next chunk (NaN in dx on an H100 at chunk 128).
DX_CONFIGS = [config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64), config(BLOCK_M=64, BLOCK_K=64, BLOCK_N=64, num_warps=8, num_stages=2),
              config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64, num_stages=4), config(BLOCK_M=32, BLOCK_K=32, BLOCK_N=64)]
DX_CPU_CONFIG = config(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16)
check_row_blocks(DX_CONFIGS + [DX_CPU_CONFIG], "chunk_scan_bwd_dx")


@triton.jit
def dx_tile(CB_ptr, x_ptr, dy_ptr, B_ptr, dS_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, dx_ptr, ddt_ptr,
            dD_part_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
            stride_x_b, stride_x_l, stride_x_h, stride_x_p,
            stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
            stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
            stride_b_b, stride_b_l, stride_b_g, stride_b_n,
            stride_seq_b, stride_seq_l,
            HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
            HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, pid, pid_m, CHECKED: tl.constexpr):
    """dx, d dt direct and dD's partial sums of row block ``pid_m`` of (batch, chunk, head) ``pid``.
    Unchecked, as if dy were finite, it marks in ``flags`` (batch, heads, L) the rows that come out
    non-finite; checked, it keeps each NaN or inf of dy to the rows that see it (as the forward
    chunk scan does for x)."""
    h = pid % heads
    c = (pid // heads) % n_chunks
    b = pid // (heads * n_chunks)
    g = h // (heads // groups)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    s = c * CHUNK + m
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    row_ok = s < chunk_end
    p_ok = p < headdim
    dy_base = dy_ptr + b.to(tl.int64) * stride_dy_b + h * stride_dy_h
    b_base = B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    chunk = chunk_base // CHUNK
    hi_s, lo_s = load_sums(dA_cumsum_ptr, chunk, m, CHUNK)
    hi_last, lo_last = load_sums(dA_cumsum_ptr, chunk, CHUNK - 1, CHUNK)
    to_end = decay_between(hi_last, lo_last, hi_s, lo_s) * tl.exp2(lo_s)  # exp2(-lo_s) below is for the diagonal block
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        seq_last = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)

    # through the chunk state: dS B_s, decayed from s to the chunk end
    acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    dS_base = dS_ptr + ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        Bs = tl.load(b_base + s[:, None].to(tl.int64) * stride_b_l + n[None, :] * stride_b_n,
                     mask=row_ok[:, None] & (n[None, :] < dstate), other=0.0)
        dST = tl.load(dS_base + p[None, :] * dstate + n[:, None], mask=p_ok[None, :] & (n[:, None] < dstate), other=0.0)
        acc += mm(Bs, dST.to(Bs.dtype), PRECISION)
    if HAS_SEQ_IDX:  # a select, not a multiply by 0: dS may hold a NaN of the chunk's last sequence
        acc = tl.where(((seq_s == seq_last) & (seq_last >= 0) & row_ok)[:, None], acc * to_end[:, None], 0.0)
    else:
        acc *= to_end[:, None]

    # through the diagonal block: sum over t >= s, starting at the diagonal. The loop body is the
    # chunk scan's, transposed, and as lean: t past the chunk's end needs no test, because dy is
    # zero there and every CB, a and dt slot of the padded chunk is finite. The sums' planes as in
    # the chunk scan (.log_decays): exp2(lo_t) scales column t of the tile, exp2(-lo_s) the
    # finished row s. dy enters through the product, so a NaN of a step that row s does not see
    # (another sequence's, or an earlier step's) would give row s 0 x NaN: the checked pass drops
    # them (drop_hidden_nonfinite) and makes NaN the rows that do see one.
    hidden_nonfinite = tl.zeros([BLOCK_M], dtype=tl.int32)
    CB_base = cb_chunk(CB_ptr, (b * n_chunks + c) * groups + g, CHUNK)
    for k0 in range(pid_m * BLOCK_M, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = c * CHUNK + k
        CBT = tl.load(CB_base + cb_offsets(k[None, :], m[:, None], k0, pid_m * BLOCK_M, CHUNK))  # CB[t, s], (s, t) tile
        hi_t, lo_t = load_sums(dA_cumsum_ptr, chunk, k, CHUNK)
        keep = k[None, :] >= m[:, None]
        if HAS_SEQ_IDX:
            seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=t < chunk_end, other=-2)
            keep &= seq_s[:, None] == seq_t[None, :]
        # the select comes after the products, as in the chunk scan: a NaN or inf in CB (a B or C
        # the row does not see) or an overflowed exp2 above the diagonal stays out of row s
        weights = tl.where(keep, CBT * tl.exp2(hi_t[None, :] - hi_s[:, None]) * tl.exp2(lo_t)[None, :], 0.0)
        dyt = tl.load(dy_base + t[:, None].to(tl.int64) * stride_dy_l + p[None, :] * stride_dy_p,
                      mask=(t[:, None] < chunk_end) & p_ok[None, :], other=0.0)
        if CHECKED:
            dyt, hidden_nonfinite = drop_hidden_nonfinite(dyt, keep, hidden_nonfinite)
        acc += mm(weights.to(dyt.dtype), dyt, PRECISION)
    acc *= tl.exp2(-lo_s)[:, None]
    if CHECKED:
        acc = tl.where((hidden_nonfinite > 0)[:, None], float("nan"), acc)
    else:  # a reduction along the row; one program owns each row, so every flag is written, 0 or 1
        row_nonfinite = tl.max(is_nonfinite(acc).to(tl.int32), 1) > 0
        tl.store(flags_ptr + (b * heads + h).to(tl.int64) * length + s, row_nonfinite.to(tl.int8), mask=row_ok)

    mask = row_ok[:, None] & p_ok[None, :]
    rows = s[:, None].to(tl.int64)
    xs = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + rows * stride_x_l + p[None, :] * stride_x_p,
                 mask=mask, other=0.0).to(tl.float32)
    dt_s = tl.load(dt_ptr + chunk_base + m)
    tl.store(ddt_ptr + chunk_base + m, tl.sum(rounded_product(acc, xs), axis=1))
    dx = acc * dt_s[:, None]
    if HAS_D:
        dys = tl.load(dy_base + rows * stride_dy_l + p[None, :] * stride_dy_p, mask=mask, other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            D = tl.load(D_ptr + h * headdim + p, mask=p_ok, other=0.0).to(tl.float32)
            dx += dys * D[None, :]
        else:
            dx += dys * tl.load(D_ptr + h).to(tl.float32)
        if SUM_D:
            # one partial sum per 16 rows of the chunk, whatever BLOCK_M is: every configuration writes
            # every slot, so none keeps a stale value from the autotuner's trial runs of another one
            sums = tl.sum(tl.reshape(rounded_product(dys, xs), (BLOCK_M // 16, 16, BLOCK_P)), axis=1)
            slot = pid.to(tl.int64) * (CHUNK // 16) + pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
            tl.store(dD_part_ptr + slot[:, None] * headdim + p[None, :], sums, mask=p_ok[None, :])
    tl.store(dx_ptr + b.to(tl.int64) * stride_dx_b + h * stride_dx_h + rows * stride_dx_l + p[None, :] * stride_dx_p,
             dx.to(dx_ptr.dtype.element_ty), mask=mask)


@lean_launch
@autotune(DX_CONFIGS, DX_CPU_CONFIG, key=["headdim", "dstate", "CHUNK"])
@triton.jit
def chunk_scan_bwd_dx_kernel(CB_ptr, x_ptr, dy_ptr, B_ptr, dS_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr,
                             dx_ptr, ddt_ptr, dD_part_ptr, flags_ptr,
                             length, heads, groups, n_chunks, headdim, dstate,
                             stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                             stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                             stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                             stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                             stride_seq_b, stride_seq_l,
                             HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                             HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                             PRECISION: tl.constexpr):
    dx_tile(CB_ptr, x_ptr, dy_ptr, B_ptr, dS_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, dx_ptr, ddt_ptr,
            dD_part_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
            stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
            stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p, stride_b_b, stride_b_l, stride_b_g, stride_b_n,
            stride_seq_b, stride_seq_l, HAS_D, SUM_D, D_PER_CHANNEL, HAS_SEQ_IDX, CHUNK, BLOCK_M, BLOCK_K,
            BLOCK_P, BLOCK_N, PRECISION, tl.program_id(0), tl.program_id(1), CHECKED=False)


@lean_launch
@triton.jit
def chunk_scan_bwd_dx_checked_kernel(CB_ptr, x_ptr, dy_ptr, B_ptr, dS_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr,
                                     dx_ptr, ddt_ptr, dD_part_ptr, flags_ptr,
                                     length, heads, groups, n_chunks, headdim, dstate,
                                     stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                                     stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                                     stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                                     stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                                     stride_seq_b, stride_seq_l,
                                     HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                                     HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                                     PRECISION: tl.constexpr, n_tiles, TILES: tl.constexpr):
    """chunk_scan_bwd_dx_kernel's row blocks again, checked, where some row came out non-finite;
    TILES row blocks per program (numbered as the first launch's programs, row blocks fastest),
    whose flags it reads in one load (the forward's scheme, :func:`.chunk_scan.chunk_scan_checked_kernel`)."""
    n_m = CHUNK // BLOCK_M
    first = tl.program_id(0) * TILES
    tile_flagged = flagged_row_blocks(flags_ptr, first, n_tiles, length, heads, n_chunks, CHUNK, BLOCK_M, TILES)
    if tl.max(tile_flagged, 0) > 0:
        for i in range(TILES):
            if is_flagged(tile_flagged, i, TILES):
                dx_tile(CB_ptr, x_ptr, dy_ptr, B_ptr, dS_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, dx_ptr,
                        ddt_ptr, dD_part_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                        stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h,
                        stride_dy_p, stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                        stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_seq_b, stride_seq_l,
                        HAS_D, SUM_D, D_PER_CHANNEL, HAS_SEQ_IDX, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N,
                        PRECISION, (first + i) // n_m, (first + i) % n_m, CHECKED=True)


DCB_ROWS = 16 if INTERPRETED else 64  # the dCB kernel's row block (capped at the chunk), fixed at launch
if SCAN_ROWS % DCB_ROWS:  # its (t, s) tiles of CB and dCB must each lie in one of CB's squares
    raise AssertionError(f"the dCB kernel's row block ({DCB_ROWS}) must divide SCAN_ROWS = {SCAN_ROWS}")


@lean_launch
@autotune([config(HEAD_STAGES=3), config(HEAD_STAGES=4), config(HEAD_STAGES=2),
           config(HEAD_STAGES=2, num_warps=8, num_stages=2)],
          config(HEAD_STAGES=1), key=["headdim", "CHUNK", "BLOCK_M"])
@triton.jit
def chunk_scan_bwd_dcb_kernel(x_ptr, dy_ptr, CB_ptr, dA_cumsum_ptr, dt_ptr, seq_idx_ptr, dCB_ptr, pairs_ptr,
                              length, heads, groups, n_chunks, headdim,
                              stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                              stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                              stride_seq_b, stride_seq_l,
                              HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_P: tl.constexpr, HEAD_STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """dCB[t, s] = sum over the heads of a group of L[t, s] dt_s (dy_t . x_s), one (t, s) tile per
    program; each head's W = CB * (its term) gives the step gradients its sums over the pairs that
    straddle each step, stored in the slots of that tile (see the module docstring).

    The loop over heads is software-pipelined (``tl.range`` stages): the next heads' tiles load
    while this one computes."""
    n_m = CHUNK // BLOCK_M
    pid_t = tl.program_id(1) // n_m
    pid_s = tl.program_id(1) % n_m
    if pid_s > pid_t:
        return  # above the diagonal
    pid = tl.program_id(0)
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    heads_per_group = heads // groups
    mt = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    ms = pid_s * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    t, s = c * CHUNK + mt, c * CHUNK + ms
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    t_ok, s_ok, p_ok = t < chunk_end, s < chunk_end, p < headdim
    keep = (mt[:, None] >= ms[None, :]) & t_ok[:, None] & s_ok[None, :]
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=t_ok, other=-1)
        seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=s_ok, other=-2)
        keep &= seq_t[:, None] == seq_s[None, :]
    cb_tile = cb_offsets(mt[:, None], ms[None, :], pid_t * BLOCK_M, pid_s * BLOCK_M, CHUNK)
    chunk_cb_index = (b * n_chunks + c) * groups + g
    CB = tl.where(keep, tl.load(cb_chunk(CB_ptr, chunk_cb_index, CHUNK) + cb_tile), 0.0)
    off_diagonal = (mt * 0 + pid_t) > pid_s
    dCB = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    for i in tl.range(0, heads_per_group, num_stages=HEAD_STAGES):
        h = g * heads_per_group + i
        chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
        dyt = tl.load(dy_ptr + b.to(tl.int64) * stride_dy_b + h * stride_dy_h + t[:, None].to(tl.int64) * stride_dy_l
                      + p[None, :] * stride_dy_p, mask=t_ok[:, None] & p_ok[None, :], other=0.0)
        xsT = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + s[None, :].to(tl.int64) * stride_x_l
                      + p[:, None] * stride_x_p, mask=s_ok[None, :] & p_ok[:, None], other=0.0)
        # the sums' planes as in the chunk scan (.log_decays): exp2 of the hi differences, the lo
        # parts as a row and a column factor
        chunk = chunk_base // CHUNK
        hi_t, lo_t = load_sums(dA_cumsum_ptr, chunk, mt, CHUNK)
        hi_s, lo_s = load_sums(dA_cumsum_ptr, chunk, ms, CHUNK)
        dt_s = tl.load(dt_ptr + chunk_base + ms) * tl.exp2(-lo_s)
        weights = tl.exp2(hi_t[:, None] - hi_s[None, :]) * tl.exp2(lo_t)[:, None]
        # the select comes after the product: a NaN or inf in dy_t (or x_s) fills row t (column s)
        # of it, and must stay out of the pairs of other sequences and above the diagonal
        term = tl.where(keep, mm(dyt, xsT, PRECISION) * weights * dt_s[None, :], 0.0)
        dCB += term
        # W[t, s] counts for d(dt'_k A) where t >= k > s. With u = k - 1 the column index, the
        # pairs below row u and left of column u + 1: on the diagonal tile t > u >= s, a sum over
        # a triangle of the row-wise cumulative sums; on a tile left of the diagonal every row
        # (t >= k holds at every k in the column block), so the column sums' cumulative sum
        W = term * CB
        if pid_t == pid_s:
            below = tl.sum(tl.where(mt[:, None] > ms[None, :], tl.cumsum(W, axis=1), 0.0), axis=0)
        else:
            below = tl.cumsum(tl.sum(W, axis=0), axis=0)
        slots = pairs_ptr + chunk_base * n_m
        tl.store(slots + pid_t * CHUNK + ms + 1, below, mask=ms + 1 < (pid_s + 1) * BLOCK_M)
        tl.store(slots + pid_t * CHUNK + pid_s * BLOCK_M, 0.0)
        # and for k in the row block of a tile left of the diagonal (s < k holds for all its columns)
        from_row = tl.cumsum(tl.sum(W, axis=1), axis=0, reverse=True)
        tl.store(slots + pid_s * CHUNK + mt, from_row, mask=off_diagonal)
    tl.store(cb_chunk(dCB_ptr, chunk_cb_index, CHUNK) + cb_tile, dCB)


DBC_CONFIGS = [config(BLOCK_M=64, BLOCK_K=64, BLOCK_N=64, num_stages=2),
               config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64), config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64, num_stages=4),
               config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=128, num_warps=8),
               config(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64),
               config(BLOCK_M=64, BLOCK_K=64, BLOCK_N=128, num_warps=8, num_stages=2)]
DBC_CPU_CONFIG = config(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16)
check_square_blocks(DBC_CONFIGS + [DBC_CPU_CONFIG], "chunk_scan_bwd_dbc")  # (32, 64) is fine: one square


@triton.jit
def dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, H_ptr, dS_ptr, dCB_ptr, dA_cumsum_ptr, dt_ptr,
             seq_idx_ptr, dB_ptr, dC_ptr, from_start_ptr, to_end_ptr, flags_ptr,
             length, heads, groups, n_chunks, headdim, dstate, n_slots,
             stride_x_b, stride_x_l, stride_x_h, stride_x_p,
             stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
             stride_b_b, stride_b_l, stride_b_g, stride_b_n,
             stride_c_b, stride_c_l, stride_c_g, stride_c_n,
             stride_d_b, stride_d_l, stride_d_g, stride_d_n,
             stride_seq_b, stride_seq_l,
             HAS_SEQ_IDX: tl.constexpr, HAS_INITIAL_STATES: tl.constexpr, CHUNK: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
             BLOCK_N: tl.constexpr, SLOT_N: tl.constexpr, PRECISION: tl.constexpr,
             pid, pid_mn, CHECKED: tl.constexpr):
    """dB and dC of rows r: the state terms per head (summed over the group's heads; their shares of
    the step gradients go to this program's slots), then the diagonal-block terms
    once per group from dCB. dB and dC are allocated alike: one set of strides (stride_d_*).
    Unchecked, as if B and C were finite, it marks in ``flags`` (batch, groups, L, n_slots) the
    rows and slots of dstate that come out non-finite; checked, it keeps each NaN or inf of B and C
    to the rows that read it."""
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    n_m = CHUNK // BLOCK_M
    pid_m, pid_n = pid_mn % n_m, pid_mn // n_m
    heads_per_group = heads // groups
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    r = c * CHUNK + m
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    row_ok, n_ok, p_ok = r < chunk_end, n < dstate, p < headdim
    rn_mask = row_ok[:, None] & n_ok[None, :]
    b_base = B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    Br = tl.load(b_base + r[:, None].to(tl.int64) * stride_b_l + n[None, :] * stride_b_n, mask=rn_mask,
                 other=0.0).to(tl.float32)
    Cr = tl.load(c_base + r[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n, mask=rn_mask,
                 other=0.0).to(tl.float32)
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_r = tl.load(seq_row + r.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        seq_last = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)
        seq_carry = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
        # the rows the state entering the chunk belongs to: in chunk 0 those of id 0 when an initial
        # state is given (as upstream), else none, whatever the ids (the state is zero, its term 0 x dy)
        carried = (seq_r == seq_carry) & ((c > 0) | HAS_INITIAL_STATES)
    # this program's slots of the step gradients: dstate blocks of SLOT_N, of which BLOCK_N spans BLOCK_N // SLOT_N
    SLOTS: tl.constexpr = BLOCK_N // SLOT_N
    slot = pid_n * SLOTS + tl.arange(0, SLOTS)
    slot_ok = slot < n_slots
    dB = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dC = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    state_mask = p_ok[:, None] & n_ok[None, :]
    for i in range(heads_per_group):
        h = g * heads_per_group + i
        chunk = (b * heads + h) * n_chunks + c
        chunk_base = chunk.to(tl.int64) * CHUNK
        state_offs = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate + p[:, None] * dstate + n[None, :]
        hi_r, lo_r = load_sums(dA_cumsum_ptr, chunk, m, CHUNK)
        hi_last, lo_last = load_sums(dA_cumsum_ptr, chunk, CHUNK - 1, CHUNK)
        start_decay = decay(hi_r, lo_r)
        end_decay = decay_between(hi_last, lo_last, hi_r, lo_r) * tl.load(dt_ptr + chunk_base + m)
        pr_mask = row_ok[:, None] & p_ok[None, :]
        dyr = tl.load(dy_ptr + b.to(tl.int64) * stride_dy_b + h * stride_dy_h + r[:, None].to(tl.int64) * stride_dy_l
                      + p[None, :] * stride_dy_p, mask=pr_mask, other=0.0)
        xr = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + r[:, None].to(tl.int64) * stride_x_l
                     + p[None, :] * stride_x_p, mask=pr_mask, other=0.0)
        H = tl.load(H_ptr + state_offs, mask=state_mask, other=0.0)
        dS = tl.load(dS_ptr + state_offs, mask=state_mask, other=0.0)
        dC_h = mm(dyr, H.to(dyr.dtype), PRECISION) * start_decay[:, None]
        dB_h = mm(xr, dS.to(xr.dtype), PRECISION) * end_decay[:, None]
        if HAS_SEQ_IDX:  # selects, not a multiply by 0: a row's dy or x, or a state, may hold another sequence's NaN
            dC_h = tl.where(carried[:, None], dC_h, 0.0)
            dB_h = tl.where(((seq_r == seq_last) & (seq_last >= 0))[:, None], dB_h, 0.0)
        # the state terms' shares: exp(a_r) counts for every step k <= r, exp(a_last - a_r) for
        # the steps between r and the chunk's end (k > r): kept apart, each summed over its own range
        from_start = tl.sum(tl.reshape(rounded_product(Cr, dC_h), (BLOCK_M, SLOTS, SLOT_N)), axis=2)
        to_end = tl.sum(tl.reshape(rounded_product(Br, dB_h), (BLOCK_M, SLOTS, SLOT_N)), axis=2)
        if HAS_SEQ_IDX:  # and after those products: a row without a state term may hold a NaN in B or C
            from_start = tl.where(carried[:, None], from_start, 0.0)
            to_end = tl.where(((seq_r == seq_last) & (seq_last >= 0))[:, None], to_end, 0.0)
        if not CHECKED:  # (the checked launch recomputes only dB and dC)
            slot_rows = (chunk.to(tl.int64) * n_slots + slot[None, :]) * CHUNK + m[:, None]
            tl.store(from_start_ptr + slot_rows, from_start, mask=slot_ok[None, :])
            tl.store(to_end_ptr + slot_rows, to_end, mask=slot_ok[None, :])
        dC += dC_h
        dB += dB_h
    # diagonal blocks, once per group: dC_r += sum_{s <= r} dCB[r, s] B_s, dB_r += sum_{t >= r} dCB[t, r] C_t.
    # B and C enter through the products, so a NaN in a B_s or C_t that row r does not read (a later
    # step, another sequence) would reach it as 0 x NaN: the checked launch drops those values and
    # makes NaN the rows that do read one (chapter 5's forward chunk scan does the same for x)
    cb_base = cb_chunk(dCB_ptr, (b * n_chunks + c) * groups + g, CHUNK)
    hidden_C = tl.zeros([BLOCK_M], dtype=tl.int32)
    hidden_B = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        u = c * CHUNK + k
        u_ok = u < chunk_end
        if CHECKED:
            seen = u_ok[None, :] & row_ok[:, None]
            if HAS_SEQ_IDX:
                seq_u = tl.load(seq_row + u.to(tl.int64) * stride_seq_l, mask=u_ok, other=-2)
                seen &= seq_r[:, None] == seq_u[None, :]
        if k0 < (pid_m + 1) * BLOCK_M:
            tile = tl.load(cb_base + cb_offsets(m[:, None], k[None, :], pid_m * BLOCK_M, k0, CHUNK))
            tile = tl.where((k[None, :] <= m[:, None]) & u_ok[None, :], tile, 0.0)
            Bu = tl.load(b_base + u[:, None].to(tl.int64) * stride_b_l + n[None, :] * stride_b_n,
                         mask=u_ok[:, None] & n_ok[None, :], other=0.0)
            if CHECKED:
                Bu, hidden_C = drop_hidden_nonfinite(Bu, seen & (k[None, :] <= m[:, None]), hidden_C)
            dC += mm(tile.to(Bu.dtype), Bu, PRECISION)
        if k0 + BLOCK_K > pid_m * BLOCK_M:
            tileT = tl.load(cb_base + cb_offsets(k[None, :], m[:, None], k0, pid_m * BLOCK_M, CHUNK))
            tileT = tl.where((k[None, :] >= m[:, None]) & u_ok[None, :], tileT, 0.0)
            Cu = tl.load(c_base + u[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                         mask=u_ok[:, None] & n_ok[None, :], other=0.0)
            if CHECKED:
                Cu, hidden_B = drop_hidden_nonfinite(Cu, seen & (k[None, :] >= m[:, None]), hidden_B)
            dB += mm(tileT.to(Cu.dtype), Cu, PRECISION)
    if CHECKED:
        dC = tl.where((hidden_C > 0)[:, None], float("nan"), dC)
        dB = tl.where((hidden_B > 0)[:, None], float("nan"), dB)
    else:  # per row and slot of dstate: one program owns each, so every flag is written, 0 or 1
        bad = tl.reshape((is_nonfinite(dB) | is_nonfinite(dC)).to(tl.int32), (BLOCK_M, SLOTS, SLOT_N))
        flag_rows = ((b * groups + g).to(tl.int64) * length + r[:, None]) * n_slots + slot[None, :]
        tl.store(flags_ptr + flag_rows, (tl.max(bad, 2) > 0).to(tl.int8), mask=row_ok[:, None] & slot_ok[None, :])
    out = b.to(tl.int64) * stride_d_b + g * stride_d_g + r[:, None].to(tl.int64) * stride_d_l + n[None, :] * stride_d_n
    tl.store(dB_ptr + out, dB.to(dB_ptr.dtype.element_ty), mask=rn_mask)
    tl.store(dC_ptr + out, dC.to(dC_ptr.dtype.element_ty), mask=rn_mask)


@lean_launch
@autotune(DBC_CONFIGS, DBC_CPU_CONFIG, key=["headdim", "dstate", "CHUNK"])
@triton.jit
def chunk_scan_bwd_dbc_kernel(
        x_ptr, dy_ptr, B_ptr, C_ptr, H_ptr, dS_ptr, dCB_ptr, dA_cumsum_ptr, dt_ptr,
        seq_idx_ptr, dB_ptr, dC_ptr, from_start_ptr, to_end_ptr, flags_ptr,
        length, heads, groups, n_chunks, headdim, dstate, n_slots,
        stride_x_b, stride_x_l, stride_x_h, stride_x_p,
        stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
        stride_b_b, stride_b_l, stride_b_g, stride_b_n,
        stride_c_b, stride_c_l, stride_c_g, stride_c_n,
        stride_d_b, stride_d_l, stride_d_g, stride_d_n,
        stride_seq_b, stride_seq_l,
        HAS_SEQ_IDX: tl.constexpr, HAS_INITIAL_STATES: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr, SLOT_N: tl.constexpr, PRECISION: tl.constexpr):
    dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, H_ptr, dS_ptr, dCB_ptr, dA_cumsum_ptr, dt_ptr, seq_idx_ptr, dB_ptr, dC_ptr,
             from_start_ptr, to_end_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate, n_slots,
             stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
             stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_c_b, stride_c_l, stride_c_g, stride_c_n,
             stride_d_b, stride_d_l, stride_d_g, stride_d_n, stride_seq_b, stride_seq_l,
             HAS_SEQ_IDX, HAS_INITIAL_STATES, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, SLOT_N, PRECISION,
             tl.program_id(0), tl.program_id(1), False)


@lean_launch
@triton.jit
def chunk_scan_bwd_dbc_checked_kernel(
        x_ptr, dy_ptr, B_ptr, C_ptr, H_ptr, dS_ptr, dCB_ptr, dA_cumsum_ptr, dt_ptr,
        seq_idx_ptr, dB_ptr, dC_ptr, from_start_ptr, to_end_ptr, flags_ptr,
        length, heads, groups, n_chunks, headdim, dstate, n_slots,
        stride_x_b, stride_x_l, stride_x_h, stride_x_p,
        stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
        stride_b_b, stride_b_l, stride_b_g, stride_b_n,
        stride_c_b, stride_c_l, stride_c_g, stride_c_n,
        stride_d_b, stride_d_l, stride_d_g, stride_d_n,
        stride_seq_b, stride_seq_l,
        HAS_SEQ_IDX: tl.constexpr, HAS_INITIAL_STATES: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr, SLOT_N: tl.constexpr, PRECISION: tl.constexpr):
    """The tiles of :func:`dbc_tile` with a flagged row and slot, again, checked; the others read
    their flags and leave."""
    pid, pid_mn = tl.program_id(0), tl.program_id(1)
    g = pid % groups
    b = pid // (groups * n_chunks)
    c = (pid // groups) % n_chunks
    n_m = CHUNK // BLOCK_M
    r = c * CHUNK + (pid_mn % n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = (pid_mn // n_m) * (BLOCK_N // SLOT_N) + tl.arange(0, BLOCK_N // SLOT_N)
    flags = tl.load(flags_ptr + ((b * groups + g).to(tl.int64) * length + r[:, None]) * n_slots + slot[None, :],
                    mask=(r < length)[:, None] & (slot < n_slots)[None, :], other=0)
    if tl.max(tl.max(flags, 1), 0) > 0:
        dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, H_ptr, dS_ptr, dCB_ptr, dA_cumsum_ptr, dt_ptr, seq_idx_ptr, dB_ptr,
                 dC_ptr, from_start_ptr, to_end_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                 n_slots,
                 stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                 stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_c_b, stride_c_l, stride_c_g, stride_c_n,
                 stride_d_b, stride_d_l, stride_d_g, stride_d_n, stride_seq_b, stride_seq_l,
                 HAS_SEQ_IDX, HAS_INITIAL_STATES, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, SLOT_N, PRECISION,
                 pid, pid_mn, True)


def chunk_scan_bwd_dx(CB, x, dy, B, dS, dA_cumsum, dt_out, *, D=None, seq_idx=None, sum_D=True):
    """Returns dx (x's shape and dtype, contiguous), d dt direct (batch, heads, chunks, Q) float32
    and dD (like D; None without D or with ``sum_D`` False: the gate's backward sums it then, from
    the unrounded dy, :mod:`.gate`). x, dy, B and seq_idx are addressed by their own strides; D
    contiguous.

    Two launches and a flag per row, as the forward chunk scan (:func:`.chunk_scan.chunk_scan`):
    the first computes every row block as if dy were finite and flags the rows that come out
    non-finite, the second computes again, checked, the row blocks with a flagged row."""
    sum_D = sum_D and D is not None
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    dx = outputs.empty(x.shape, x.dtype, x.device)
    ddt = outputs.empty(dt_out.shape, torch.float32, x.device)
    # dD: one partial row per (chunk, head, 16 rows), summed here (a layout that does not depend
    # on the tuned BLOCK_M, so each run writes all of it)
    dD_part = outputs.empty((batch * n_chunks * heads, chunk_size // 16, headdim), torch.float32,
                            x.device) if sum_D else None
    flags = outputs.empty((batch, heads, length), torch.int8, x.device)  # the first launch writes every row's
    args = (CB, x, dy, B, dS, dA_cumsum, dt_out, D if D is not None else dt_out,
            seq_idx if seq_idx is not None else dt_out, dx, ddt, dD_part if sum_D else ddt, flags,
            length, heads, groups, n_chunks, headdim, dstate, *x.stride(), *dy.stride(), *dx.stride(), *B.stride(),
            *(seq_idx.stride() if seq_idx is not None else (0, 0)))
    options = dict(HAS_D=D is not None, SUM_D=sum_D, D_PER_CHANNEL=D is not None and D.dim() == 2,
                   HAS_SEQ_IDX=seq_idx is not None, CHUNK=chunk_size, BLOCK_P=block_size(headdim, largest=128),
                   PRECISION=dot_precision(x.dtype))
    grid = lambda META: (batch * n_chunks * heads, chunk_size // META["BLOCK_M"])  # noqa: E731
    chunk_scan_bwd_dx_kernel[grid](*args, **options)
    checked = dx_checked_config(chunk_size)
    n_tiles = batch * n_chunks * heads * (chunk_size // checked["BLOCK_M"])
    chunk_scan_bwd_dx_checked_kernel[(cdiv(n_tiles, checked["TILES"]),)](*args, **options, n_tiles=n_tiles,
                                                                          **checked)
    dD = None
    if sum_D:
        dD = dD_part.view(batch, n_chunks, heads, -1, headdim).sum(dim=(0, 1, 3))
        dD = (dD if D.dim() == 2 else dD.sum(dim=-1)).to(D.dtype)
    return dx, ddt, dD


def dx_checked_config(chunk_size: int, first=DX_CONFIGS[0], cpu=DX_CPU_CONFIG) -> dict:
    """Blocks of a dx kernel's checked pass (this chapter's, or chapter 6's with its own
    configurations): the first tuned configuration's (or the interpreter's), unpipelined, since it
    runs only for rare inputs; TILES row blocks' flags per program."""
    if INTERPRETED:
        return dict(cpu.kwargs, TILES=4, num_warps=4, num_stages=1)
    block_m = min(first.kwargs["BLOCK_M"], chunk_size)
    return dict(BLOCK_M=block_m, BLOCK_K=min(first.kwargs["BLOCK_K"], block_m), BLOCK_N=first.kwargs["BLOCK_N"],
                TILES=64, num_warps=4, num_stages=1)


def dbc_slot_width():
    """SLOT_N: the narrowest dstate block the dBC kernel's tuner tries (each wider one is a
    multiple of it), so every configuration writes the same slots."""
    widths = [c.kwargs["BLOCK_N"] for c in chunk_scan_bwd_dbc_kernel.configs]
    narrowest = min(widths)
    if any(w % narrowest for w in widths):
        raise AssertionError(f"chunk_scan_bwd_dbc: dstate blocks {widths} must be multiples of the narrowest")
    return narrowest


def chunk_scan_bwd_dbc(x, dy, B, C, CB, states_in, dS, dA_cumsum, dt_out, *, seq_idx=None, has_initial_states=False):
    """Returns dB, dC (B's shape and dtype, contiguous) and the slots of d(dt' A): (pairs, from_start,
    to_end) of :class:`DecayGradients` (its carry comes from :func:`.state_passing.state_passing_backward`).

    states_in: H_c, the states entering each chunk; dS: their gradients (both contiguous, in the
    inputs' dtype or float32; states_in of chunk 0 is the initial state, or zero without one:
    has_initial_states). x, dy, B, C and seq_idx are addressed by their own strides."""
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    seq_args = (seq_idx if seq_idx is not None else dt_out,)
    seq_strides = seq_idx.stride() if seq_idx is not None else (0, 0)
    rows = min(DCB_ROWS, chunk_size)
    dCB = outputs.empty(CB.shape, torch.float32, x.device)
    pairs = outputs.empty((batch, heads, n_chunks, chunk_size // rows, chunk_size), torch.float32, x.device)
    chunk_scan_bwd_dcb_kernel[(batch * n_chunks * groups, (chunk_size // rows) ** 2)](
        x, dy, CB, dA_cumsum, dt_out, *seq_args, dCB, pairs, length, heads, groups, n_chunks, headdim,
        *x.stride(), *dy.stride(), *seq_strides, HAS_SEQ_IDX=seq_idx is not None, CHUNK=chunk_size,
        BLOCK_M=rows, BLOCK_P=block_size(headdim, largest=128), PRECISION=dot_precision(x.dtype),
    )
    slot_n = dbc_slot_width()
    n_slots = cdiv(dstate, slot_n)
    from_start, to_end = (outputs.empty((batch, heads, n_chunks, n_slots, chunk_size), torch.float32, x.device)
                          for _ in range(2))
    dB = outputs.empty(B.shape, B.dtype, B.device)
    dC = outputs.empty(B.shape, C.dtype, C.device)
    flags = outputs.empty((batch, groups, length, n_slots), torch.int8, x.device)  # the first launch writes each
    args = (x, dy, B, C, states_in, dS, dCB, dA_cumsum, dt_out, *seq_args, dB, dC, from_start, to_end, flags,
            length, heads, groups, n_chunks, headdim, dstate, n_slots,
            *x.stride(), *dy.stride(), *B.stride(), *C.stride(), *dB.stride(), *seq_strides)
    options = dict(HAS_SEQ_IDX=seq_idx is not None, HAS_INITIAL_STATES=has_initial_states, CHUNK=chunk_size,
                   BLOCK_P=block_size(headdim, largest=128), SLOT_N=slot_n, PRECISION=dot_precision(x.dtype))
    grid = lambda META: (batch * n_chunks * groups,  # noqa: E731
                         (chunk_size // META["BLOCK_M"]) * cdiv(dstate, META["BLOCK_N"]))
    chunk_scan_bwd_dbc_kernel[grid](*args, **options)
    # the rows and slots that came out non-finite again, checked (the dx kernel's two launches)
    checked = dbc_checked_config(chunk_size, slot_n)
    chunk_scan_bwd_dbc_checked_kernel[(batch * n_chunks * groups, (chunk_size // checked["BLOCK_M"])
                                       * cdiv(dstate, checked["BLOCK_N"]))](*args, **options, **checked)
    return dB, dC, (pairs, from_start, to_end)


def dbc_checked_config(chunk_size: int, slot_n: int) -> dict:
    """Blocks of the dB/dC kernel's checked pass: the first tuned configuration's (or the
    interpreter's), unpipelined, since it runs only for rare inputs; its dstate block is one slot
    wide, the flags' width."""
    first = DBC_CPU_CONFIG if INTERPRETED else DBC_CONFIGS[0]
    block_m = min(first.kwargs["BLOCK_M"], chunk_size)
    return dict(BLOCK_M=block_m, BLOCK_K=min(first.kwargs["BLOCK_K"], block_m), BLOCK_N=slot_n,
                num_warps=4, num_stages=1)
