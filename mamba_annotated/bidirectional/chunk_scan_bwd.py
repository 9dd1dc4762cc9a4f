"""Chapter 6, backward kernels: dx, the direct step gradients, dD; dG and the decays' gradients; dB, dC.

Notation of :mod:`.decays`: in chunk c of head h, W(t, s) = G[t, s] w(t, s) is M's entry without
the skip; dy the gradient of y (before the gate); H, H' the states entering the chunk from the left
and the right, dS, dS' their gradients (:mod:`.state_passing`, run the other way).

dx kernel, for each column position s (its rows) and all of headdim (the sums over t in three runs,
as the forward output kernel's, with the weights off the row block's band factored the same way):
    F_s = exp(a_last - a_s) [own] B_s dS  +  sum_{t: forward} G[t, s] exp(r_t - a_s) dy_t
    R_s = exp(e_s) [own'] B'_s dS'  +  sum_{t: reverse} G[t, s] exp(e_s - rho_t) dy_t  (+ Gd_s dy_s)
    dx_s = dt_s F_s + dt'_s R_s + D dy_s;  d dt_s (direct) = x_s . F_s;  d dt'_s (direct) = x_s . R_s
    and the state terms of the column decays: d a_s = -dt_s x_s . (F_s's state term), which
    a_last gets with a plus sign (exp(a_last - a_s)), and d e_s = dt'_s x_s . (R_s's state term).
dG kernel, for one (t, s) tile of a chunk, looping over the heads of a group (they share the
scores): dG[t, s] = sum_h w(t, s) (dy_t . x_s), and per head, of V = G * that term, its sums over
the pairs that straddle each step (chapter 5's form, which nothing subtracts from): a forward
pair holds the steps t >= k > s in its exponent r_t - a_s, a reverse pair the steps s > k >= t
in e_s - rho_t (both only the steps strictly between t and s with the shift); and its row sums, which the step
kernel adds to a tile's slot sums with the shift (a tile's whole sum). Gd's gradient
dGd_t = sum_h dt'_t (dy_t . x_t) on the diagonal tiles. Slots per tile (i, j) as chapter 5's:
forward (i > j) the rows' part (t >= k, a reverse cumulative sum) in slot j of block i, the
columns' part (s < k, stored one position on) in slot i of block j, and the tile's total for the
blocks between, read from slot j at the first position of block i; reverse (i < j) the rows'
part (t <= k) in slot j of block i, the columns' part (s > k, stored one position back) in slot i
of block j, the total from slot j at the last position of block i.
dBC kernel, for rows r and a block of dstate (q_r = C_r or C_{r-1}, q'_r = C'_r or C'_{r+1}):
    dq_r  = sum_h exp(r_r) [own] dy_r H  +  sum_{s: forward} dG[r, s] B_s
    dq'_r = sum_h exp(b_last - rho_r) [own'] dy_r H'  +  sum_{s: reverse} dG[r, s] B'_s  (+ dGd_r B'_r)
    dB_r  = sum_h exp(a_last - a_r) dt_r [own] x_r dS  +  sum_{t: forward} dG[t, r] q_t
    dB'_r = sum_h exp(e_r) dt'_r [own'] x_r dS'  +  sum_{t: reverse} dG[t, r] q'_t  (+ dGd_r q'_r)
    and per head the state terms of the row decays, d r_r += q_r . (its dq_r term), d rho_r -=
    q'_r . (its dq'_r term) (which b_last gets with a plus sign). The carries' terms
    <dS, exp(a_last) H>, <dS', exp(b_last) H'> (H_{c+1} = gamma_c H_c + S_c holds a_last(c)) come
    from the reverse state passing (:mod:`.state_passing`), in float32.
:mod:`.step_backward` turns these into the gradients of dt, dt_rev, A and dt_bias.

Deterministic: no atomic adds. Every program writes its partial sums to slots of its own, whose
layout the launch fixes (the dG and dBC kernels are not autotuned), and they are added in a fixed
order. With the shift, dq_t belongs to C_{t-1} and dq'_t to C'_{t+1}: the dBC kernel stores both
in float32 and :mod:`.backward` adds them one row over.

Shapes as the forward kernels. x, dy, B, C, B', C' are addressed by their own strides; dx, dB, dC
are allocated contiguous. Per-position float32 outputs (batch, heads, chunks, Q): the dx kernel's
four planes (DIRECT ... STATE_COLUMN_REV), the dG kernel's slots (4, batch, heads, chunks,
Q / TILE, Q), the dBC kernel's state terms (2, batch, heads, chunks, dstate blocks, Q) and carries
(2, batch, heads, chunks, dstate blocks).
Bytes moved: like chapter 5's backward, with both triangles of each diagonal block (twice the
score work) and two states per chunk instead of one.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..ssd.tuning import autotune, config
from ..ssd.chunk_scan import flagged_row_blocks, is_flagged
from ..ssd.chunk_scan_bwd import dx_checked_config
from ..triton_ops import (LOG2E, block_size, cdiv, dot_precision, drop_hidden_nonfinite, drop_hidden_nonfinite_split,
                          is_nonfinite, mm, rounded_product)
from .decays import pair_weight, row_decays

# the dx kernel's per-position outputs, planes of one buffer: d dt' direct (of both directions when
# they share the step), d dt'_rev direct, the state terms of d a_s and d e_s
DIRECT, DIRECT_REV, STATE_COLUMN, STATE_COLUMN_REV = range(4)
# the dG kernel's slots: the sums over the pairs that straddle each step (forward, reverse), and
# the row sums of its tile (forward, reverse; written and read with the shift only)
PAIRS, PAIRS_REV, ROW, ROW_REV = range(4)
TILE = 16 if INTERPRETED else 64  # the dG kernel's row blocks (capped at the chunk): fixed at launch
# the dBC kernel's launch for 16-bit inputs of headdim <= 64 (a Mamba-2 layer's): rows and dstate
# columns per program, warps, pipeline stages; read at each call, so that
# benchmarks/sweep_bidirectional_dbc.py can set them in turn
DBC_ROWS, DBC_BLOCK_N, DBC_WARPS, DBC_STAGES = 64, 64, 8, 3


def row_sum_planes(diag, shift):
    """The dG kernel's row-sum planes of ``diag``; without the shift, which neither writes nor reads
    them, two planes that stand in as pointers."""
    return (diag[ROW], diag[ROW_REV]) if shift else (diag[PAIRS], diag[PAIRS_REV])


@dataclass
class DecaySlots:
    """The backward kernels' partial sums of the decay and step gradients, all float32."""
    rows: torch.Tensor      # (4, batch, heads, chunks, Q): the dx kernel's (DIRECT ... STATE_COLUMN_REV)
    diag: torch.Tensor      # (4 with the shift, else 2, batch, heads, chunks, Q // TILE, Q): the dG kernel's
                            # (PAIRS, PAIRS_REV, and with the shift ROW, ROW_REV)
    state: torch.Tensor     # (2, batch, heads, chunks, n-blocks, Q): the dBC kernel's state terms of d r, d rho
    carry: torch.Tensor     # (2, batch, heads, chunks, blocks): <dS, gamma H> and <dS', gamma' H'> (state passing)


@triton.jit
def transposed_tiles(G_base, dy_base, w, forward, m, k, t, chunk_end, p, p_ok, seq_row, seq_s, stride_dy_l,
                     stride_dy_p, stride_seq_l, hidden, hidden_rev, HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr,
                     CHUNK: tl.constexpr, CHECKED: tl.constexpr):
    """The tiles of one step over the rows t (chunk positions k), for the columns m: G[t, s] w as
    an (s, t) tile, zeroed past the chunk's end and, with seq_idx, across sequences; and dy_t. The
    zeroing is a select after the product: the cumulative sums restart at each sequence boundary,
    so a factored weight across one can overflow, and 0 x inf is NaN. dy enters the caller's
    product, where a select cannot reach: CHECKED drops the NaN and inf of dy that a column does
    not see (another sequence's, and with the shift its own step's) and counts those it does, in
    ``hidden`` where ``forward`` (the pairs the forward accumulator takes) holds, else in
    ``hidden_rev``."""
    t_ok = t < chunk_end
    if SHIFT:
        keep = t_ok[None, :] & (m[:, None] != k[None, :])
    else:
        keep = t_ok[None, :] & (m[:, None] >= 0)
    if HAS_SEQ_IDX:
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=t_ok, other=-2)
        keep = keep & (seq_s[:, None] == seq_t[None, :])
    GT = tl.load(G_base + k[None, :] * CHUNK + m[:, None])      # G[t, s] as an (s, t) tile
    dyt = tl.load(dy_base + t[:, None].to(tl.int64) * stride_dy_l + p[None, :] * stride_dy_p,
                  mask=t_ok[:, None] & p_ok[None, :], other=0.0)
    if CHECKED:
        dyt, hidden, hidden_rev = drop_hidden_nonfinite_split(dyt, keep, forward, hidden, hidden_rev)
    return tl.where(keep, GT * w, 0.0), dyt, hidden, hidden_rev


@triton.jit
def state_rows(seq_row, seq_r, row_ok, c, chunk_end, length, stride_seq_l, CHUNK: tl.constexpr):
    """With seq_idx, the rows r of chunk c (ids ``seq_r``) that have state terms: (those of the chunk's
    last sequence when it goes on into the next chunk, which the states at the chunk's end belong to;
    those of the sequence carried in from the previous chunk, which the states at its start belong
    to). Neither holds in chunk 0's carried-in case or the last chunk's carried-out one (this op
    takes no initial state and returns no final one), nor for a row past L, whatever the ids: there
    the states are zero, and a select, not the zero, keeps a NaN of the row's dy or x out."""
    seq_last = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)
    seq_next = tl.load(seq_row + chunk_end * stride_seq_l, mask=chunk_end < length, other=0)
    seq_before = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
    goes_on = (chunk_end < length) & (seq_next == seq_last)
    return (seq_r == seq_last) & goes_on & row_ok, (seq_r == seq_before) & (c > 0) & row_ok


# Two warps on 32 rows came out ahead of the rest at the speed bar's first shape, where the same
# tile with four warps was among the slowest (book/data/kernel_config_probe.json). Why was not
# measured; fewer registers per program, so more programs per SM, is the likely reason
DX_CONFIGS = [config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64), config(BLOCK_M=64, BLOCK_K=64, BLOCK_N=64, num_warps=8),
              config(BLOCK_M=64, BLOCK_K=32, BLOCK_N=64, num_stages=4), config(BLOCK_M=32, BLOCK_K=32, BLOCK_N=64),
              config(BLOCK_M=32, BLOCK_K=32, BLOCK_N=64, num_warps=2)]
DX_CPU_CONFIG = config(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16)
# the band loop starts at a row block's edge and must end at the next one
assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_K"] == 0 for c in DX_CONFIGS + [DX_CPU_CONFIG]), "BLOCK_K | BLOCK_M"


@triton.jit
def dx_tile(G_ptr, Gd_ptr, x_ptr, dy_ptr, B_ptr, Br_ptr, dS_ptr, dSr_ptr, a_ptr, dt_ptr, b_ptr,
            dtr_ptr, A_ptr, D_ptr, seq_idx_ptr, dx_ptr, direct_ptr, direct_rev_ptr,
            state_column_ptr, state_column_rev_ptr, dD_part_ptr, flags_ptr,
            length, heads, groups, n_chunks, headdim, dstate,
            stride_x_b, stride_x_l, stride_x_h, stride_x_p,
            stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
            stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
            stride_b_b, stride_b_l, stride_b_g, stride_b_n,
            stride_br_b, stride_br_l, stride_br_g, stride_br_n,
            stride_seq_b, stride_seq_l,
            HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
            HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_STEP: tl.constexpr,
            CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
            pid, pid_m, CHECKED: tl.constexpr):
    """dx, the per-position planes and dD's partial sums of row block ``pid_m`` of (batch, chunk,
    head) ``pid``. Unchecked, as if dy were finite, it marks in ``flags`` (batch, heads, L) the
    rows that come out non-finite; checked, it keeps each NaN or inf of dy to the rows that see it
    (chapter 5's dx kernel does the same)."""
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
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    A = tl.load(A_ptr + h).to(tl.float32)
    a_s = tl.load(a_ptr + chunk_base + m)
    dt_s = tl.load(dt_ptr + chunk_base + m)
    dtr_s = tl.load(dtr_ptr + chunk_base + m)
    e_s = tl.load(b_ptr + chunk_base + m) - A * dtr_s
    to_end = tl.exp(tl.load(a_ptr + chunk_base + CHUNK - 1) - a_s)
    from_start = tl.exp(e_s)
    seq_row, seq_s = seq_idx_ptr, m  # (placeholders that transposed_tiles ignores without seq_idx)
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        own_last, own_before = state_rows(seq_row, seq_s, row_ok, c, chunk_end, length, stride_seq_l, CHUNK)

    # through the chunk states: dS B_s decayed from s to the chunk's end, dS' B'_s to its start
    F = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    R = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    state_base = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < dstate
        Bs = tl.load(B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g + s[:, None].to(tl.int64) * stride_b_l
                     + n[None, :] * stride_b_n, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        Brs = tl.load(Br_ptr + b.to(tl.int64) * stride_br_b + g * stride_br_g + s[:, None].to(tl.int64) * stride_br_l
                      + n[None, :] * stride_br_n, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        state = state_base + p[None, :] * dstate + n[:, None]
        state_mask = p_ok[None, :] & n_ok[:, None]
        F += mm(Bs, tl.load(dS_ptr + state, mask=state_mask, other=0.0).to(Bs.dtype), PRECISION)
        R += mm(Brs, tl.load(dSr_ptr + state, mask=state_mask, other=0.0).to(Brs.dtype), PRECISION)
    if HAS_SEQ_IDX:  # selects, not a multiply by 0: dS and dS' may hold another sequence's NaN
        F = tl.where(own_last[:, None], F * to_end[:, None], 0.0)
        R = tl.where(own_before[:, None], R * from_start[:, None], 0.0)
    else:
        F *= to_end[:, None]
        R *= from_start[:, None]
    mask = row_ok[:, None] & p_ok[None, :]
    rows = s[:, None].to(tl.int64)
    xs = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + rows * stride_x_l + p[None, :] * stride_x_p,
                 mask=mask, other=0.0).to(tl.float32)
    state_column = -dt_s * tl.sum(rounded_product(F, xs), axis=1)
    state_column_rev = dtr_s * tl.sum(rounded_product(R, xs), axis=1)
    if HAS_SEQ_IDX:  # a row of another sequence has no state term, whatever its x (0 x NaN is NaN)
        state_column = tl.where(own_last, state_column, 0.0)
        state_column_rev = tl.where(own_before, state_column_rev, 0.0)
    if SHARED_STEP:
        # one step for both directions: dx and the direct step gradient take F + R only, so from here
        # on one accumulator takes both directions' products (and the band one product, not two)
        F += R

    # through the diagonal block: the rows t of column s in three runs, those before the row block
    # all reverse, those after it all forward, the band of the row block itself both (as
    # chunk_outputs' loop, whose factored weights these are, transposed)
    m_first = pid_m * BLOCK_M
    # the checked pass's counts of hidden non-finite dy, per accumulator; the runs before and after
    # the row block feed one accumulator each
    hidden, hidden_rev = tl.zeros([BLOCK_M], dtype=tl.int32), tl.zeros([BLOCK_M], dtype=tl.int32)
    reverse_only, forward_only = m[:, None] < 0, m[:, None] >= 0
    G_base = G_ptr + ((b * n_chunks + c) * groups + g).to(tl.int64) * CHUNK * CHUNK
    e_ref = tl.load(b_ptr + chunk_base + m_first) - A * tl.load(dtr_ptr + chunk_base + m_first)
    to_columns = tl.exp2((e_s - e_ref) * LOG2E)
    for k0 in range(0, m_first, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        _, rho_t = row_decays(tl.load(a_ptr + chunk_base + k), tl.load(dt_ptr + chunk_base + k),
                              tl.load(b_ptr + chunk_base + k), tl.load(dtr_ptr + chunk_base + k), A, SHIFT)
        w = to_columns[:, None] * tl.exp2((e_ref - rho_t) * LOG2E)[None, :]
        W, dyt, hidden, hidden_rev = transposed_tiles(G_base, dy_base, w, reverse_only, m, k, c * CHUNK + k,
                                                      chunk_end, p, p_ok, seq_row, seq_s, stride_dy_l, stride_dy_p,
                                                      stride_seq_l, hidden, hidden_rev, HAS_SEQ_IDX, SHIFT, CHUNK,
                                                      CHECKED)
        if SHARED_STEP:
            F += mm(W.to(dyt.dtype), dyt, PRECISION)
        else:
            R += mm(W.to(dyt.dtype), dyt, PRECISION)
    for k0 in range(m_first, m_first + BLOCK_M, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        r_t, rho_t = row_decays(tl.load(a_ptr + chunk_base + k), tl.load(dt_ptr + chunk_base + k),
                                tl.load(b_ptr + chunk_base + k), tl.load(dtr_ptr + chunk_base + k), A, SHIFT)
        w, forward = pair_weight(k[None, :], m[:, None], r_t[None, :], rho_t[None, :], a_s[:, None], e_s[:, None],
                                 1.0, 1.0, True, SHIFT)
        W, dyt, hidden, hidden_rev = transposed_tiles(G_base, dy_base, w, forward, m, k, c * CHUNK + k, chunk_end,
                                                      p, p_ok, seq_row, seq_s, stride_dy_l, stride_dy_p,
                                                      stride_seq_l, hidden, hidden_rev, HAS_SEQ_IDX, SHIFT, CHUNK,
                                                      CHECKED)
        if SHARED_STEP:
            F += mm(W.to(dyt.dtype), dyt, PRECISION)
        else:
            F += mm(tl.where(forward, W, 0.0).to(dyt.dtype), dyt, PRECISION)
            R += mm(tl.where(forward, 0.0, W).to(dyt.dtype), dyt, PRECISION)
    a_ref = tl.load(a_ptr + chunk_base + m_first + BLOCK_M - 1)
    to_columns = tl.exp2((a_ref - a_s) * LOG2E)
    for k0 in range(m_first + BLOCK_M, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        r_t, _ = row_decays(tl.load(a_ptr + chunk_base + k), tl.load(dt_ptr + chunk_base + k),
                            tl.load(b_ptr + chunk_base + k), tl.load(dtr_ptr + chunk_base + k), A, SHIFT)
        w = to_columns[:, None] * tl.exp2((r_t - a_ref) * LOG2E)[None, :]
        W, dyt, hidden, hidden_rev = transposed_tiles(G_base, dy_base, w, forward_only, m, k, c * CHUNK + k,
                                                      chunk_end, p, p_ok, seq_row, seq_s, stride_dy_l, stride_dy_p,
                                                      stride_seq_l, hidden, hidden_rev, HAS_SEQ_IDX, SHIFT, CHUNK,
                                                      CHECKED)
        F += mm(W.to(dyt.dtype), dyt, PRECISION)

    if SHARED_STEP:
        if CHECKED:
            F = tl.where((hidden + hidden_rev > 0)[:, None], float("nan"), F)
        else:  # a reduction along the row; one program owns each row, so every flag is written, 0 or 1
            row_nonfinite = tl.max(is_nonfinite(F).to(tl.int32), 1) > 0
            tl.store(flags_ptr + (b * heads + h).to(tl.int64) * length + s, row_nonfinite.to(tl.int8), mask=row_ok)
    elif CHECKED:
        F = tl.where((hidden > 0)[:, None], float("nan"), F)
        R = tl.where((hidden_rev > 0)[:, None], float("nan"), R)
    else:
        row_nonfinite = tl.max(is_nonfinite(F + R).to(tl.int32), 1) > 0
        tl.store(flags_ptr + (b * heads + h).to(tl.int64) * length + s, row_nonfinite.to(tl.int8), mask=row_ok)
    dys = tl.load(dy_base + rows * stride_dy_l + p[None, :] * stride_dy_p, mask=mask, other=0.0).to(tl.float32)
    out = chunk_base + m
    if SHARED_STEP:  # the step's direct gradient takes both directions (DIRECT_REV is not read then)
        if not SHIFT:
            Gd_s = tl.load(Gd_ptr + ((b * n_chunks + c) * groups + g).to(tl.int64) * CHUNK + m)
            F += Gd_s[:, None] * dys
        tl.store(direct_ptr + out, tl.sum(rounded_product(F, xs), axis=1))
        dx = F * dt_s[:, None]
    else:
        if not SHIFT:
            Gd_s = tl.load(Gd_ptr + ((b * n_chunks + c) * groups + g).to(tl.int64) * CHUNK + m)
            R += Gd_s[:, None] * dys
        tl.store(direct_ptr + out, tl.sum(rounded_product(F, xs), axis=1))
        tl.store(direct_rev_ptr + out, tl.sum(rounded_product(R, xs), axis=1))
        dx = F * dt_s[:, None] + R * dtr_s[:, None]
    tl.store(state_column_ptr + out, state_column)
    tl.store(state_column_rev_ptr + out, state_column_rev)
    if HAS_D:
        if D_PER_CHANNEL:
            dx += dys * tl.load(D_ptr + h * headdim + p, mask=p_ok, other=0.0).to(tl.float32)[None, :]
        else:
            dx += dys * tl.load(D_ptr + h).to(tl.float32)
        if SUM_D:  # one partial sum per 16 rows of the chunk, whatever BLOCK_M is (chapter 5's layout)
            sums = tl.sum(tl.reshape(rounded_product(dys, xs), (BLOCK_M // 16, 16, BLOCK_P)), axis=1)
            slot = pid.to(tl.int64) * (CHUNK // 16) + pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
            tl.store(dD_part_ptr + slot[:, None] * headdim + p[None, :], sums, mask=p_ok[None, :])
    tl.store(dx_ptr + b.to(tl.int64) * stride_dx_b + h * stride_dx_h + rows * stride_dx_l + p[None, :] * stride_dx_p,
             dx.to(dx_ptr.dtype.element_ty), mask=mask)


@lean_launch
@autotune(DX_CONFIGS, DX_CPU_CONFIG, key=["headdim", "dstate", "CHUNK", "SHIFT"])
@triton.jit
def chunk_scan_bwd_dx_kernel(G_ptr, Gd_ptr, x_ptr, dy_ptr, B_ptr, Br_ptr, dS_ptr, dSr_ptr, a_ptr, dt_ptr, b_ptr,
                             dtr_ptr, A_ptr, D_ptr, seq_idx_ptr, dx_ptr, direct_ptr, direct_rev_ptr,
                             state_column_ptr, state_column_rev_ptr, dD_part_ptr, flags_ptr,
                             length, heads, groups, n_chunks, headdim, dstate,
                             stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                             stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                             stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                             stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                             stride_br_b, stride_br_l, stride_br_g, stride_br_n,
                             stride_seq_b, stride_seq_l,
                             HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                             HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_STEP: tl.constexpr,
                             CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    dx_tile(G_ptr, Gd_ptr, x_ptr, dy_ptr, B_ptr, Br_ptr, dS_ptr, dSr_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, D_ptr,
            seq_idx_ptr, dx_ptr, direct_ptr, direct_rev_ptr, state_column_ptr, state_column_rev_ptr, dD_part_ptr,
            flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
            stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
            stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p, stride_b_b, stride_b_l, stride_b_g, stride_b_n,
            stride_br_b, stride_br_l, stride_br_g, stride_br_n, stride_seq_b, stride_seq_l,
            HAS_D, SUM_D, D_PER_CHANNEL, HAS_SEQ_IDX, SHIFT, SHARED_STEP, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N,
            PRECISION, tl.program_id(0), tl.program_id(1), CHECKED=False)


@lean_launch
@triton.jit
def chunk_scan_bwd_dx_checked_kernel(G_ptr, Gd_ptr, x_ptr, dy_ptr, B_ptr, Br_ptr, dS_ptr, dSr_ptr, a_ptr, dt_ptr, b_ptr,
                                     dtr_ptr, A_ptr, D_ptr, seq_idx_ptr, dx_ptr, direct_ptr, direct_rev_ptr,
                                     state_column_ptr, state_column_rev_ptr, dD_part_ptr, flags_ptr,
                                     length, heads, groups, n_chunks, headdim, dstate,
                                     stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                                     stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                                     stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                                     stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                                     stride_br_b, stride_br_l, stride_br_g, stride_br_n,
                                     stride_seq_b, stride_seq_l,
                                     HAS_D: tl.constexpr, SUM_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                                     HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_STEP: tl.constexpr,
                                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                                     n_tiles, TILES: tl.constexpr):
    """chunk_scan_bwd_dx_kernel's row blocks again, checked, where some row came out non-finite
    (chapter 5's :func:`~..ssd.chunk_scan_bwd.chunk_scan_bwd_dx_checked_kernel`)."""
    n_m = CHUNK // BLOCK_M
    first = tl.program_id(0) * TILES
    tile_flagged = flagged_row_blocks(flags_ptr, first, n_tiles, length, heads, n_chunks, CHUNK, BLOCK_M, TILES)
    if tl.max(tile_flagged, 0) > 0:
        for i in range(TILES):
            if is_flagged(tile_flagged, i, TILES):
                dx_tile(G_ptr, Gd_ptr, x_ptr, dy_ptr, B_ptr, Br_ptr, dS_ptr, dSr_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr,
                        A_ptr, D_ptr, seq_idx_ptr, dx_ptr, direct_ptr, direct_rev_ptr, state_column_ptr,
                        state_column_rev_ptr, dD_part_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                        stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h,
                        stride_dy_p, stride_dx_b, stride_dx_l, stride_dx_h, stride_dx_p,
                        stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_br_b, stride_br_l, stride_br_g,
                        stride_br_n, stride_seq_b, stride_seq_l, HAS_D, SUM_D, D_PER_CHANNEL, HAS_SEQ_IDX, SHIFT,
                        SHARED_STEP, CHUNK, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, PRECISION,
                        (first + i) // n_m, (first + i) % n_m, CHECKED=True)


@triton.jit
def store_row_sums(row_ptr, row_rev_ptr, offsets, forward_sums, reverse_sums):
    """The dG kernel's row sums of a tile, forward and reverse pairs apart. Only the shift needs
    them: its pair sums leave each row's own step out, and the step kernel adds these to make a
    tile's whole sum for the steps between its blocks (step_backward.py)."""
    tl.store(row_ptr + offsets, forward_sums)
    tl.store(row_rev_ptr + offsets, reverse_sums)


@lean_launch
@autotune([config(HEAD_STAGES=3), config(HEAD_STAGES=4), config(HEAD_STAGES=2), config(HEAD_STAGES=3, num_warps=8),
           config(HEAD_STAGES=2, num_warps=8, num_stages=2)],
          config(HEAD_STAGES=1), key=["headdim", "CHUNK", "BLOCK_M", "SHIFT", "OFF_DIAGONAL", "HAS_SEQ_IDX"])
@triton.jit
def chunk_scan_bwd_dscores_kernel(G_ptr, x_ptr, dy_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr,
                                  dG_ptr, dGd_ptr, pairs_ptr, pairs_rev_ptr, row_ptr, row_rev_ptr,
                                  length, heads, groups, n_chunks, headdim,
                                  stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                                  stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                                  stride_seq_b, stride_seq_l,
                                  HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, OFF_DIAGONAL: tl.constexpr,
                                  CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                                  HEAD_STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """dG[t, s] = sum over the heads of a group of w(t, s) (dy_t . x_s), one (t, s) tile per
    program; each head's sums of G * (its term) over the pairs that straddle each step, and its
    row sums, go to slots of the tile (see the module docstring). Launched twice: the diagonal
    tiles (both triangles, and Gd's gradient), then with OFF_DIAGONAL the others, each wholly
    forward (below the diagonal) or wholly reverse (above it).

    Off the diagonal the weight factors: with R_t = r_t, S_s = a_s (forward) or R_t = -rho_t,
    S_s = -e_s (reverse), w(t, s) = exp(R_t - S_s) step_s = exp(R_t - S_ref) * exp(S_ref - S_s)
    step_s, S_ref taken at the column of the tile nearest the rows. For a pair of one sequence
    both exponents then have the sign of A (the cumulative sums are monotone within a sequence),
    so neither factor overflows where w does not; across a boundary the sums restart, a factor
    may overflow, and the select on ``keep`` drops the term. 2 BLOCK_M exponentials per head
    instead of BLOCK_M^2, which bound this kernel on the diagonal tiles. The loop over heads is
    software-pipelined (``tl.range`` stages)."""
    n_m = CHUNK // BLOCK_M
    if OFF_DIAGONAL:  # program_id(1) counts the n_m * (n_m - 1) tiles off the diagonal, row by row
        pid_i = tl.program_id(1) // (n_m - 1)
        pid_j = tl.program_id(1) % (n_m - 1)
        pid_j += (pid_j >= pid_i).to(pid_j.dtype)
    else:
        pid_i = tl.program_id(1)
        pid_j = pid_i
    pid = tl.program_id(0)
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    heads_per_group = heads // groups
    i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    t, s = c * CHUNK + i, c * CHUNK + j
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    t_ok, s_ok, p_ok = t < chunk_end, s < chunk_end, p < headdim
    keep = t_ok[:, None] & s_ok[None, :]
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=t_ok, other=-1)
        seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=s_ok, other=-2)
        keep &= seq_t[:, None] == seq_s[None, :]
    block = ((b * n_chunks + c) * groups + g).to(tl.int64)
    tile = block * CHUNK * CHUNK + i[:, None] * CHUNK + j[None, :]
    G = tl.where(keep, tl.load(G_ptr + tile), 0.0)  # a NaN in B or C of another sequence stays out of W = G * term
    forward_tile = pid_i > pid_j
    ref = pid_j * BLOCK_M + tl.where(forward_tile, BLOCK_M - 1, 0)  # the tile's column nearest its rows
    dG = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    dGd = tl.zeros([BLOCK_M], dtype=tl.float32)
    for hh in tl.range(0, heads_per_group, num_stages=HEAD_STAGES):
        h = g * heads_per_group + hh
        chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
        A = tl.load(A_ptr + h).to(tl.float32)
        slots = chunk_base * n_m
        dyt = tl.load(dy_ptr + b.to(tl.int64) * stride_dy_b + h * stride_dy_h + t[:, None].to(tl.int64) * stride_dy_l
                      + p[None, :] * stride_dy_p, mask=t_ok[:, None] & p_ok[None, :], other=0.0)
        xsT = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + s[None, :].to(tl.int64) * stride_x_l
                      + p[:, None] * stride_x_p, mask=s_ok[None, :] & p_ok[:, None], other=0.0)
        r_t, rho_t = row_decays(tl.load(a_ptr + chunk_base + i), tl.load(dt_ptr + chunk_base + i),
                                tl.load(b_ptr + chunk_base + i), tl.load(dtr_ptr + chunk_base + i), A, SHIFT)
        a_s = tl.load(a_ptr + chunk_base + j)
        dt_s = tl.load(dt_ptr + chunk_base + j)
        dtr_s = tl.load(dtr_ptr + chunk_base + j)
        e_s = tl.load(b_ptr + chunk_base + j) - A * dtr_s
        dyx = mm(dyt, xsT, PRECISION)
        if OFF_DIAGONAL:
            S_ref = tl.where(forward_tile, tl.load(a_ptr + chunk_base + ref),
                             A * tl.load(dtr_ptr + chunk_base + ref) - tl.load(b_ptr + chunk_base + ref))
            R_t = tl.where(forward_tile, r_t, -rho_t)
            S_s = tl.where(forward_tile, a_s, -e_s)
            row_factor = tl.where(t_ok, tl.exp2((R_t - S_ref) * LOG2E), 0.0)
            column_factor = tl.where(s_ok, tl.exp2((S_ref - S_s) * LOG2E) * tl.where(forward_tile, dt_s, dtr_s), 0.0)
            term = dyx * column_factor[None, :] * row_factor[:, None]
            if HAS_SEQ_IDX:
                term = tl.where(keep, term, 0.0)
            dG += term
            W = term * G
            row_sums = tl.sum(W, axis=1)
            if SHIFT:  # a tile's row sums, for the step kernel's tile totals (below)
                store_row_sums(row_ptr, row_rev_ptr, slots + pid_j * CHUNK + i,
                               tl.where(forward_tile, row_sums, 0.0), tl.where(forward_tile, 0.0, row_sums))
            if forward_tile:  # every pair straddles the steps between its row block's start and t
                # (before t with the shift: the row's own step is not in its decay, so row t's sums
                # go to the step before it, and the block's last step takes none)
                below = tl.cumsum(row_sums, axis=0, reverse=True)
                if SHIFT:
                    tl.store(pairs_ptr + slots + pid_j * CHUNK + i - 1, below, mask=i - 1 >= pid_i * BLOCK_M)
                    tl.store(pairs_ptr + slots + pid_j * CHUNK + (pid_i + 1) * BLOCK_M - 1, 0.0)
                else:
                    tl.store(pairs_ptr + slots + pid_j * CHUNK + i, below)
                tl.store(pairs_ptr + slots + pid_i * CHUNK + j + 1, tl.cumsum(tl.sum(W, axis=0), axis=0),
                         mask=j + 1 < (pid_j + 1) * BLOCK_M)
                tl.store(pairs_ptr + slots + pid_i * CHUNK + pid_j * BLOCK_M, 0.0)
            else:  # reverse: the steps k with s > k >= t (s > k > t with the shift)
                above = tl.cumsum(row_sums, axis=0)
                if SHIFT:
                    tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + i + 1, above, mask=i + 1 < (pid_i + 1) * BLOCK_M)
                    tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + pid_i * BLOCK_M, 0.0)
                else:
                    tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + i, above)
                tl.store(pairs_rev_ptr + slots + pid_i * CHUNK + j - 1, tl.cumsum(tl.sum(W, axis=0), axis=0,
                                                                                  reverse=True),
                         mask=j - 1 >= pid_j * BLOCK_M)
                tl.store(pairs_rev_ptr + slots + pid_i * CHUNK + (pid_j + 1) * BLOCK_M - 1, 0.0)
        else:
            w, forward = pair_weight(i[:, None], j[None, :], r_t[:, None], rho_t[:, None], a_s[None, :],
                                     e_s[None, :], dt_s[None, :], dtr_s[None, :], keep, SHIFT)
            # a select after the product, as off the diagonal: w is 0 across a sequence boundary,
            # and a NaN or inf of dy_t (or x_s) fills row t (column s) of dyx
            if HAS_SEQ_IDX:
                term = tl.where(keep, dyx * w, 0.0)
            else:
                term = dyx * w
            dG += term
            W = term * G
            W_forward, W_reverse = tl.where(forward, W, 0.0), tl.where(forward, 0.0, W)
            if SHIFT:
                store_row_sums(row_ptr, row_rev_ptr, slots + pid_j * CHUNK + i, tl.sum(W_forward, axis=1),
                               tl.sum(W_reverse, axis=1))
            # forward pairs straddle k = u + 1 where t > u >= s (u a column); reverse pairs the k
            # with s > k >= t (k a row): sums over a triangle of the tile's cumulative sums. With
            # the shift a row's own step is in neither decay: forward pairs straddle k = u + 1 < t,
            # reverse pairs the k with s > k > t, summed here by column (k = u - 1, s >= u), so that
            # no sum takes row k's own pairs and no difference of two sums is needed
            straddle = tl.sum(tl.where(i[:, None] > j[None, :] + SHIFT, tl.cumsum(W_forward, axis=1), 0.0), axis=0)
            tl.store(pairs_ptr + slots + pid_i * CHUNK + j + 1, straddle, mask=j + 1 < (pid_j + 1) * BLOCK_M)
            tl.store(pairs_ptr + slots + pid_i * CHUNK + pid_j * BLOCK_M, 0.0)
            if SHIFT:
                straddle_rev = tl.sum(tl.where(i[:, None] + 1 < j[None, :], tl.cumsum(W_reverse, axis=1, reverse=True),
                                               0.0), axis=0)
                tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + j - 1, straddle_rev, mask=j - 1 >= pid_j * BLOCK_M)
                tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + (pid_j + 1) * BLOCK_M - 1, 0.0)
            else:
                straddle_rev = tl.sum(tl.where(j[None, :] > i[:, None], tl.cumsum(W_reverse, axis=0), 0.0), axis=1)
                tl.store(pairs_rev_ptr + slots + pid_j * CHUNK + i, straddle_rev)
            if not SHIFT:
                dGd += tl.load(dtr_ptr + chunk_base + i) * tl.sum(tl.where(i[:, None] == j[None, :], dyx, 0.0), axis=1)
    tl.store(dG_ptr + tile, dG)
    if not SHIFT and not OFF_DIAGONAL:
        tl.store(dGd_ptr + block * CHUNK + i, dGd)


@triton.jit
def dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, Br_ptr, Cr_ptr, H_ptr, Hr_ptr, dS_ptr, dSr_ptr,
             dG_ptr, dGd_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr,
             dB_ptr, dC_ptr, dBr_ptr, dCr_ptr, state_ptr, state_rev_ptr, flags_ptr,
             length, heads, groups, n_chunks, headdim, dstate, n_slots,
             stride_x_b, stride_x_l, stride_x_h, stride_x_p,
             stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
             stride_b_b, stride_b_l, stride_b_g, stride_b_n,
             stride_c_b, stride_c_l, stride_c_g, stride_c_n,
             stride_br_b, stride_br_l, stride_br_g, stride_br_n,
             stride_cr_b, stride_cr_l, stride_cr_g, stride_cr_n,
             stride_d_b, stride_d_l, stride_d_g, stride_d_n,
             stride_seq_b, stride_seq_l,
             HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_B: tl.constexpr,
             SHARED_C: tl.constexpr, ONE_PAIR: tl.constexpr, CHUNK: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
             PRECISION: tl.constexpr,
             pid, pid_mn, CHECKED: tl.constexpr):
    """dB, dC (and dB', dC') of rows r for one block of dstate: the state terms per head, then the
    diagonal-block terms once per group from dG. The four gradient outputs are allocated alike
    (one set of strides, stride_d_*); with the shift, dC and dC' receive the query gradients dq, dq'
    (float32), which :mod:`.backward` moves one row over. ONE_PAIR (B and C shared by both
    directions, no shift): both directions' terms go to one pair of accumulators, dq and dB, and
    the diagonal block's two triangles are one product each, where the other forms keep four.
    Unchecked, as if B and C were finite, it marks in ``flags`` (batch, groups, L, n_slots) the rows
    that come out non-finite in this program's slot of dstate; checked, it keeps each NaN or inf of
    B and C (and B', C') to the rows that read it."""
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
    b_base = B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    br_base = Br_ptr + b.to(tl.int64) * stride_br_b + g * stride_br_g
    cr_base = Cr_ptr + b.to(tl.int64) * stride_cr_b + g * stride_cr_g
    q_row, qr_row = r - SHIFT, r + SHIFT
    # in the inputs' dtype until used (the same values, half the registers of float32 copies)
    q = tl.load(c_base + q_row[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                mask=(row_ok & (q_row >= 0))[:, None] & n_ok[None, :], other=0.0)
    q_r = tl.load(cr_base + qr_row[:, None].to(tl.int64) * stride_cr_l + n[None, :] * stride_cr_n,
                  mask=(row_ok & (qr_row < length))[:, None] & n_ok[None, :], other=0.0)
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_r = tl.load(seq_row + r.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        last, before = state_rows(seq_row, seq_r, row_ok, c, chunk_end, length, stride_seq_l, CHUNK)
    dq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dB = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dB_r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    state_mask = p_ok[:, None] & n_ok[None, :]
    pr_mask = row_ok[:, None] & p_ok[None, :]
    for hh in range(heads_per_group):
        h = g * heads_per_group + hh
        chunk = (b * heads + h) * n_chunks + c
        chunk_base = chunk.to(tl.int64) * CHUNK
        A = tl.load(A_ptr + h).to(tl.float32)
        a = tl.load(a_ptr + chunk_base + m)
        dt = tl.load(dt_ptr + chunk_base + m)
        bb = tl.load(b_ptr + chunk_base + m)
        dtr = tl.load(dtr_ptr + chunk_base + m)
        a_last = tl.load(a_ptr + chunk_base + CHUNK - 1)
        b_last = tl.load(b_ptr + chunk_base + CHUNK - 1)
        r_r, rho_r = row_decays(a, dt, bb, dtr, A, SHIFT)
        from_left = tl.exp(r_r)
        from_right = tl.exp(b_last - rho_r)
        to_end = tl.exp(a_last - a) * dt
        to_start = tl.exp(bb - A * dtr) * dtr
        dyr = tl.load(dy_ptr + b.to(tl.int64) * stride_dy_b + h * stride_dy_h + r[:, None].to(tl.int64) * stride_dy_l
                      + p[None, :] * stride_dy_p, mask=pr_mask, other=0.0)
        xr = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + r[:, None].to(tl.int64) * stride_x_l
                     + p[None, :] * stride_x_p, mask=pr_mask, other=0.0)
        state = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate + p[:, None] * dstate + n[None, :]
        H = tl.load(H_ptr + state, mask=state_mask, other=0.0)
        Hr = tl.load(Hr_ptr + state, mask=state_mask, other=0.0)
        dS = tl.load(dS_ptr + state, mask=state_mask, other=0.0)
        dSr = tl.load(dSr_ptr + state, mask=state_mask, other=0.0)
        dq_h = mm(dyr, H.to(dyr.dtype), PRECISION) * from_left[:, None]
        dqr_h = mm(dyr, Hr.to(dyr.dtype), PRECISION) * from_right[:, None]
        dB_h = mm(xr, dS.to(xr.dtype), PRECISION) * to_end[:, None]
        dBr_h = mm(xr, dSr.to(xr.dtype), PRECISION) * to_start[:, None]
        if HAS_SEQ_IDX:  # selects, not a multiply by 0: a row's dy or x, or a state, may hold another sequence's NaN
            dq_h, dBr_h = tl.where(before[:, None], dq_h, 0.0), tl.where(before[:, None], dBr_h, 0.0)
            dqr_h, dB_h = tl.where(last[:, None], dqr_h, 0.0), tl.where(last[:, None], dB_h, 0.0)
        if ONE_PAIR:
            dq += dq_h + dqr_h
            dB += dB_h + dBr_h
        else:
            dq += dq_h
            dq_r += dqr_h
            dB += dB_h
            dB_r += dBr_h
        slot = chunk.to(tl.int64) * n_slots + pid_n
        state_term = tl.sum(rounded_product(q.to(tl.float32), dq_h), axis=1)
        state_term_rev = -tl.sum(rounded_product(q_r.to(tl.float32), dqr_h), axis=1)
        if HAS_SEQ_IDX:  # and after those products: a row without a state term may hold a NaN in C
            state_term = tl.where(before, state_term, 0.0)
            state_term_rev = tl.where(last, state_term_rev, 0.0)
        if not CHECKED:  # (the checked launch recomputes only the gradients of B and C)
            tl.store(state_ptr + slot * CHUNK + m, state_term)
            tl.store(state_rev_ptr + slot * CHUNK + m, state_term_rev)

    # the diagonal blocks, once per group: the forward triangle with B and q, the reverse with B' and q'.
    # B and C enter the products, so a NaN in a B_u or query that row r does not read (the other
    # triangle's, another sequence's) would reach it as 0 x NaN: the checked launch drops those
    # values and makes NaN the rows that do read one, per accumulator (chapter 5's does the same)
    dG_base = dG_ptr + ((b * n_chunks + c) * groups + g).to(tl.int64) * CHUNK * CHUNK
    hidden_q = tl.zeros([BLOCK_M], dtype=tl.int32)
    hidden_qr = tl.zeros([BLOCK_M], dtype=tl.int32)
    hidden_B = tl.zeros([BLOCK_M], dtype=tl.int32)
    hidden_Br = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, CHUNK, BLOCK_M):
        k = k0 + tl.arange(0, BLOCK_M)
        u = c * CHUNK + k
        u_ok = u < chunk_end
        un_mask = u_ok[:, None] & n_ok[None, :]
        if SHIFT:
            forward = k[None, :] < m[:, None]       # (r, u): u before r
            forward_T = k[None, :] > m[:, None]     # (r, u): r before u
        else:
            forward = k[None, :] <= m[:, None]
            forward_T = k[None, :] >= m[:, None]
        tile = tl.load(dG_base + m[:, None] * CHUNK + k[None, :])       # dG[r, u]
        tileT = tl.load(dG_base + k[None, :] * CHUNK + m[:, None])      # dG[u, r]
        Bu = tl.load(b_base + u[:, None].to(tl.int64) * stride_b_l + n[None, :] * stride_b_n, mask=un_mask, other=0.0)
        qu_row, qru_row = u - SHIFT, u + SHIFT
        qu = tl.load(c_base + qu_row[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                     mask=(u_ok & (qu_row >= 0))[:, None] & n_ok[None, :], other=0.0)
        if CHECKED:
            seen = u_ok[None, :] & row_ok[:, None]
            if HAS_SEQ_IDX:
                seq_u = tl.load(seq_row + u.to(tl.int64) * stride_seq_l, mask=u_ok, other=-2)
                seen &= seq_r[:, None] == seq_u[None, :]
        if ONE_PAIR:  # the forward triangle (u <= r) and the reverse one (u > r) read the same B and C
            if CHECKED:
                Bu, hidden_q = drop_hidden_nonfinite(Bu, seen, hidden_q)
                qu, hidden_B = drop_hidden_nonfinite(qu, seen, hidden_B)
            dq += mm(tile.to(Bu.dtype), Bu, PRECISION)
            dB += mm(tileT.to(qu.dtype), qu, PRECISION)
        else:
            Bru = tl.load(br_base + u[:, None].to(tl.int64) * stride_br_l + n[None, :] * stride_br_n, mask=un_mask,
                          other=0.0)
            qru = tl.load(cr_base + qru_row[:, None].to(tl.int64) * stride_cr_l + n[None, :] * stride_cr_n,
                          mask=(u_ok & (qru_row < length))[:, None] & n_ok[None, :], other=0.0)
            if CHECKED:
                Bu, hidden_q = drop_hidden_nonfinite(Bu, seen & forward, hidden_q)
                Bru, hidden_qr = drop_hidden_nonfinite(Bru, seen & (k[None, :] > m[:, None]), hidden_qr)
                qu, hidden_B = drop_hidden_nonfinite(qu, seen & forward_T, hidden_B)
                qru, hidden_Br = drop_hidden_nonfinite(qru, seen & (k[None, :] < m[:, None]), hidden_Br)
            dq += mm(tl.where(forward, tile, 0.0).to(Bu.dtype), Bu, PRECISION)
            dq_r += mm(tl.where(k[None, :] > m[:, None], tile, 0.0).to(Bru.dtype), Bru, PRECISION)
            dB += mm(tl.where(forward_T, tileT, 0.0).to(qu.dtype), qu, PRECISION)
            dB_r += mm(tl.where(k[None, :] < m[:, None], tileT, 0.0).to(qru.dtype), qru, PRECISION)
    if CHECKED:
        dq = tl.where((hidden_q > 0)[:, None], float("nan"), dq)
        dq_r = tl.where((hidden_qr > 0)[:, None], float("nan"), dq_r)
        dB = tl.where((hidden_B > 0)[:, None], float("nan"), dB)
        dB_r = tl.where((hidden_Br > 0)[:, None], float("nan"), dB_r)
    if not SHIFT:  # the reverse diagonal: Gd_r = C'_r . B'_r
        dGd = tl.load(dGd_ptr + ((b * n_chunks + c) * groups + g).to(tl.int64) * CHUNK + m)
        Brr = tl.load(br_base + r[:, None].to(tl.int64) * stride_br_l + n[None, :] * stride_br_n,
                      mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if ONE_PAIR:
            dq += dGd[:, None] * Brr
            dB += dGd[:, None] * q_r.to(tl.float32)
        else:
            dq_r += dGd[:, None] * Brr
            dB_r += dGd[:, None] * q_r.to(tl.float32)
    if not ONE_PAIR:
        if SHARED_B:
            dB += dB_r
        if SHARED_C and not SHIFT:
            dq += dq_r
    if not CHECKED:  # per row, for this program's slot of dstate: every flag is written, 0 or 1
        bad = is_nonfinite(dq) | is_nonfinite(dB) | is_nonfinite(dq_r) | is_nonfinite(dB_r)
        flag_rows = ((b * groups + g).to(tl.int64) * length + r) * n_slots + pid_n
        tl.store(flags_ptr + flag_rows, (tl.max(bad.to(tl.int32), 1) > 0).to(tl.int8), mask=row_ok)
    rn_mask = row_ok[:, None] & n_ok[None, :]
    out = b.to(tl.int64) * stride_d_b + g * stride_d_g + r[:, None].to(tl.int64) * stride_d_l + n[None, :] * stride_d_n
    tl.store(dB_ptr + out, dB.to(dB_ptr.dtype.element_ty), mask=rn_mask)
    tl.store(dC_ptr + out, dq.to(dC_ptr.dtype.element_ty), mask=rn_mask)
    if not SHARED_B:
        tl.store(dBr_ptr + out, dB_r.to(dBr_ptr.dtype.element_ty), mask=rn_mask)
    if SHIFT or not SHARED_C:
        tl.store(dCr_ptr + out, dq_r.to(dCr_ptr.dtype.element_ty), mask=rn_mask)


@lean_launch
@triton.jit
def chunk_scan_bwd_dbc_kernel(
        x_ptr, dy_ptr, B_ptr, C_ptr, Br_ptr, Cr_ptr, H_ptr, Hr_ptr, dS_ptr, dSr_ptr,
        dG_ptr, dGd_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr,
        dB_ptr, dC_ptr, dBr_ptr, dCr_ptr, state_ptr, state_rev_ptr, flags_ptr,
        length, heads, groups, n_chunks, headdim, dstate, n_slots,
        stride_x_b, stride_x_l, stride_x_h, stride_x_p,
        stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
        stride_b_b, stride_b_l, stride_b_g, stride_b_n,
        stride_c_b, stride_c_l, stride_c_g, stride_c_n,
        stride_br_b, stride_br_l, stride_br_g, stride_br_n,
        stride_cr_b, stride_cr_l, stride_cr_g, stride_cr_n,
        stride_d_b, stride_d_l, stride_d_g, stride_d_n,
        stride_seq_b, stride_seq_l,
        HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_B: tl.constexpr,
        SHARED_C: tl.constexpr, ONE_PAIR: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr):
    dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, Br_ptr, Cr_ptr, H_ptr, Hr_ptr, dS_ptr, dSr_ptr, dG_ptr, dGd_ptr, a_ptr,
             dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr, dB_ptr, dC_ptr, dBr_ptr, dCr_ptr, state_ptr,
             state_rev_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate, n_slots,
             stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
             stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_c_b, stride_c_l, stride_c_g, stride_c_n,
             stride_br_b, stride_br_l, stride_br_g, stride_br_n, stride_cr_b, stride_cr_l, stride_cr_g,
             stride_cr_n, stride_d_b, stride_d_l, stride_d_g, stride_d_n, stride_seq_b, stride_seq_l,
             HAS_SEQ_IDX, SHIFT, SHARED_B, SHARED_C, ONE_PAIR, CHUNK, BLOCK_M, BLOCK_P, BLOCK_N, PRECISION,
             tl.program_id(0), tl.program_id(1), False)


@lean_launch
@triton.jit
def chunk_scan_bwd_dbc_checked_kernel(
        x_ptr, dy_ptr, B_ptr, C_ptr, Br_ptr, Cr_ptr, H_ptr, Hr_ptr, dS_ptr, dSr_ptr,
        dG_ptr, dGd_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr,
        dB_ptr, dC_ptr, dBr_ptr, dCr_ptr, state_ptr, state_rev_ptr, flags_ptr,
        length, heads, groups, n_chunks, headdim, dstate, n_slots,
        stride_x_b, stride_x_l, stride_x_h, stride_x_p,
        stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
        stride_b_b, stride_b_l, stride_b_g, stride_b_n,
        stride_c_b, stride_c_l, stride_c_g, stride_c_n,
        stride_br_b, stride_br_l, stride_br_g, stride_br_n,
        stride_cr_b, stride_cr_l, stride_cr_g, stride_cr_n,
        stride_d_b, stride_d_l, stride_d_g, stride_d_n,
        stride_seq_b, stride_seq_l,
        HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, SHARED_B: tl.constexpr,
        SHARED_C: tl.constexpr, ONE_PAIR: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr):
    """The row blocks of :func:`dbc_tile` with a flagged row, again, checked; the others read their
    flags and leave."""
    pid, pid_mn = tl.program_id(0), tl.program_id(1)
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    n_m = CHUNK // BLOCK_M
    r = c * CHUNK + (pid_mn % n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    flags = tl.load(flags_ptr + ((b * groups + g).to(tl.int64) * length + r) * n_slots + pid_mn // n_m,
                    mask=r < length, other=0)
    if tl.max(flags, 0) > 0:
        dbc_tile(x_ptr, dy_ptr, B_ptr, C_ptr, Br_ptr, Cr_ptr, H_ptr, Hr_ptr, dS_ptr, dSr_ptr, dG_ptr, dGd_ptr, a_ptr,
                 dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr, dB_ptr, dC_ptr, dBr_ptr, dCr_ptr, state_ptr,
                 state_rev_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate, n_slots,
                 stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_dy_b, stride_dy_l, stride_dy_h, stride_dy_p,
                 stride_b_b, stride_b_l, stride_b_g, stride_b_n, stride_c_b, stride_c_l, stride_c_g, stride_c_n,
                 stride_br_b, stride_br_l, stride_br_g, stride_br_n, stride_cr_b, stride_cr_l, stride_cr_g,
                 stride_cr_n, stride_d_b, stride_d_l, stride_d_g, stride_d_n, stride_seq_b, stride_seq_l,
                 HAS_SEQ_IDX, SHIFT, SHARED_B, SHARED_C, ONE_PAIR, CHUNK, BLOCK_M, BLOCK_P, BLOCK_N, PRECISION,
                 pid, pid_mn, True)


def chunk_scan_bwd_dx(G, Gd, x, dy, B, B_rev, dS, dS_rev, a, dt_out, b, dt_rev_out, A, *, D=None, seq_idx=None,
                      shift=False, shared_step=True, sum_D=True):
    """Returns dx (x's shape and dtype, contiguous), the per-position planes (4, batch, heads,
    chunks, Q) float32 (DIRECT ... STATE_COLUMN_REV) and dD (like D; None without D or with
    ``sum_D`` False, as in chapter 5's :func:`~..ssd.chunk_scan_bwd.chunk_scan_bwd_dx`)."""
    sum_D = sum_D and D is not None
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks, chunk_size = a.shape[2], a.shape[3]
    dx = outputs.empty(x.shape, x.dtype, x.device)
    rows = outputs.empty((4,) + tuple(a.shape), torch.float32, x.device)
    dD_part = outputs.empty((batch * n_chunks * heads, chunk_size // 16, headdim), torch.float32,
                            x.device) if sum_D else None
    flags = outputs.empty((batch, heads, length), torch.int8, x.device)  # the first launch writes every row's
    args = (G, Gd if Gd is not None else G, x, dy, B, B_rev, dS, dS_rev, a, dt_out, b, dt_rev_out, A,
            D if D is not None else a, seq_idx if seq_idx is not None else a, dx, rows[DIRECT], rows[DIRECT_REV],
            rows[STATE_COLUMN], rows[STATE_COLUMN_REV], dD_part if sum_D else rows, flags,
            length, heads, groups, n_chunks, headdim, dstate,
            *x.stride(), *dy.stride(), *dx.stride(), *B.stride(), *B_rev.stride(),
            *(seq_idx.stride() if seq_idx is not None else (0, 0)))
    options = dict(HAS_D=D is not None, SUM_D=sum_D, D_PER_CHANNEL=D is not None and D.dim() == 2,
                   HAS_SEQ_IDX=seq_idx is not None, SHIFT=int(shift), SHARED_STEP=shared_step, CHUNK=chunk_size,
                   BLOCK_P=block_size(headdim, largest=128), PRECISION=dot_precision(x.dtype))
    grid = lambda META: (batch * n_chunks * heads, chunk_size // META["BLOCK_M"])  # noqa: E731
    chunk_scan_bwd_dx_kernel[grid](*args, **options)
    # the rows that came out non-finite again, checked (chapter 5's two launches)
    checked = dx_checked_config(chunk_size, DX_CONFIGS[0], DX_CPU_CONFIG)
    n_tiles = batch * n_chunks * heads * (chunk_size // checked["BLOCK_M"])
    chunk_scan_bwd_dx_checked_kernel[(cdiv(n_tiles, checked["TILES"]),)](*args, **options, n_tiles=n_tiles,
                                                                          **checked)
    dD = None
    if sum_D:
        dD = dD_part.view(batch, n_chunks, heads, -1, headdim).sum(dim=(0, 1, 3))
        dD = (dD if D.dim() == 2 else dD.sum(dim=-1)).to(D.dtype)
    return dx, rows, dD


def chunk_scan_bwd_dbc(x, dy, B, C, B_rev, C_rev, G, H, H_rev, dS, dS_rev, a, dt_out, b, dt_rev_out, A, *,
                       seq_idx=None, shift=False):
    """Returns (dB, dC, dB_rev or None, dC_rev or None, slots): the gradients of B, C (and of B',
    C' where they are not B, C), in B's shape and dtype, contiguous; with the shift dC and dC_rev
    are float32 query gradients that :mod:`.backward` moves one row over. ``slots``: the
    (diag, state) partial sums of :class:`DecaySlots`."""
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks, chunk_size = a.shape[2], a.shape[3]
    tile = min(TILE, chunk_size)
    seq_args = (seq_idx if seq_idx is not None else a,)
    seq_strides = seq_idx.stride() if seq_idx is not None else (0, 0)
    block_p = block_size(headdim, largest=128)
    dG = outputs.empty(G.shape, torch.float32, x.device)
    dGd = None if shift else outputs.empty((batch, n_chunks, groups, chunk_size), torch.float32, x.device)
    # the row-sum planes only with the shift (2 x 21 MB at the benchmark's first shape without it)
    diag = outputs.empty((4 if shift else 2,) + tuple(a.shape[:3]) + (chunk_size // tile, chunk_size), torch.float32,
                         x.device)
    tiles = chunk_size // tile
    for off_diagonal, n_tiles in ((False, tiles), (True, tiles * (tiles - 1))):
        if n_tiles:
            chunk_scan_bwd_dscores_kernel[(batch * n_chunks * groups, n_tiles)](
                G, x, dy, a, dt_out, b, dt_rev_out, A, *seq_args, dG, dGd if dGd is not None else dG, diag[PAIRS],
                diag[PAIRS_REV], *row_sum_planes(diag, shift), length, heads, groups, n_chunks, headdim,
                *x.stride(), *dy.stride(), *seq_strides, HAS_SEQ_IDX=seq_idx is not None, SHIFT=int(shift),
                OFF_DIAGONAL=off_diagonal, CHUNK=chunk_size, BLOCK_M=tile, BLOCK_P=block_p,
                PRECISION=dot_precision(x.dtype))
    # The dBC launch. For 16-bit inputs of headdim <= 64, 64 rows keep four float32 accumulators
    # (two with ONE_PAIR) and two query tiles in registers through the loops; float32 tiles or a
    # wider headdim spilled 17 KB per thread there (ptxas, sm_90), so they take 32 rows; float32
    # tiles of a headdim above 64 overflowed shared memory with the loops pipelined in three stages
    # (327 KB asked of an H100's 227 KB at chunk 256): one stage and narrower state slots there
    wide_float32 = x.element_size() == 4 and headdim > 64
    if INTERPRETED:
        rows, widest_n, warps, stages = tile, 16, 8, 3
    elif x.element_size() == 2 and headdim <= 64:
        rows, widest_n, warps, stages = min(DBC_ROWS, chunk_size), DBC_BLOCK_N, DBC_WARPS, DBC_STAGES
    else:
        rows, widest_n, warps, stages = min(32, chunk_size), 32 if wide_float32 else 64, 8, 1 if wide_float32 else 3
    block_n = block_size(dstate, largest=widest_n)
    n_slots = cdiv(dstate, block_n)
    state = outputs.empty((2,) + tuple(a.shape[:3]) + (n_slots, chunk_size), torch.float32, x.device)
    query_dtype = torch.float32 if shift else C.dtype
    shared_b, shared_c = B_rev is B, C_rev is C
    dB = outputs.empty(B.shape, B.dtype, B.device)
    dC = outputs.empty(C.shape, query_dtype, C.device)
    dB_rev = None if shared_b else outputs.empty(B.shape, B.dtype, B.device)
    dC_rev = None if shared_c and not shift else outputs.empty(C.shape, query_dtype, C.device)
    flags = outputs.empty((batch, groups, length, n_slots), torch.int8, x.device)  # the first launch writes each
    args = (x, dy, B, C, B_rev, C_rev, H, H_rev, dS, dS_rev, dG, dGd if dGd is not None else dG, a, dt_out, b,
            dt_rev_out, A, *seq_args, dB, dC, dB_rev if dB_rev is not None else dB,
            dC_rev if dC_rev is not None else dC, state[0], state[1], flags,
            length, heads, groups, n_chunks, headdim, dstate, n_slots,
            *x.stride(), *dy.stride(), *B.stride(), *C.stride(), *B_rev.stride(), *C_rev.stride(), *dB.stride(),
            *seq_strides)
    options = dict(HAS_SEQ_IDX=seq_idx is not None, SHIFT=int(shift), SHARED_B=shared_b, SHARED_C=shared_c,
                   ONE_PAIR=shared_b and shared_c and not shift, CHUNK=chunk_size, BLOCK_M=rows, BLOCK_P=block_p,
                   BLOCK_N=block_n, PRECISION=dot_precision(x.dtype))
    grid = (batch * n_chunks * groups, (chunk_size // rows) * n_slots)
    chunk_scan_bwd_dbc_kernel[grid](*args, **options, num_warps=warps, num_stages=stages)
    # the row blocks with a row that came out non-finite again, checked (chapter 5's two launches)
    chunk_scan_bwd_dbc_checked_kernel[grid](*args, **options, num_warps=8, num_stages=1)
    return dB, dC, dB_rev, dC_rev, (diag, state)
