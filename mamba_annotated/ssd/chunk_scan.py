"""Chapter 5, kernel 5: the outputs, diagonal blocks plus the passed-in state, skip and gate.

Algorithm, for t in chunk c of head h (group g):
    y_t = exp(a_t) * C_t . H_c                                   (off-diagonal blocks: the state
                                                                  entering the chunk, decayed to t)
        + sum_{s <= t in chunk c} CB[t, s] * exp(a_t - a_s) * dt_s * x_s   (diagonal block,
                                                                  quadratic, like causal attention)
        + D * x_t;   out_t = y_t * silu(z_t) when z is given.
    With seq_idx, s only counts when it is in t's sequence, and the state term only when t is
    in the carried state's sequence (that of the previous chunk's last position; id 0 for the
    first chunk, so initial_states reach the positions of sequence 0, as in mamba_ssm); a row
    block with no such row skips the state term's loads and matmuls, and a row block whose rows
    and the keys before them hold one sequence runs the diagonal loop of the unpacked case, with no
    ids loaded or compared in it.

Parallelism: one program per (batch, chunk, head) x (BLOCK_M rows of the chunk) x (BLOCK_P of
headdim), the row blocks of one chunk and head adjacent in launch order. Its loop over s, in
steps of BLOCK_K (which divides BLOCK_M), stops at the diagonal, so the causal half of the block
is skipped.
Both matmuls run in the input dtype (the float32 weights are rounded to it): on the tensor cores
for 16-bit inputs; float32 inputs multiply as torch.get_float32_matmul_precision() asks (exactly
by default; :func:`..triton_ops.dot_precision`).

Shapes: x, z (batch, L, heads, headdim), any strides; out, y the same, contiguous; C (batch, L,
groups, dstate), any strides; CB (batch, chunks, groups, cb_length(Q)) float32, its squares on and
below the diagonal (:mod:`.chunk_state`); H_in (batch, chunks, heads,
headdim, dstate) in the state dtype; dA_cumsum (batch, heads, chunks, 2, Q) float32, the planes of
:mod:`.log_decays`; dt_out (batch, heads, chunks, Q) float32.

Bytes moved: reads x (once per row block at or after its own: (Q/BLOCK_M + 1)/2 times on
average, mostly from L2), C, H_in, CB, and writes out (and y before the gate, when z is given).
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import cdiv, dot_precision, drop_hidden_nonfinite, is_nonfinite, mm, sigmoid
from .chunk_state import cb_chunk, cb_offsets, check_row_blocks
from .log_decays import load_sums
from .tuning import autotune, config


# Steps of the diagonal loop smaller than BLOCK_M come first: the tuner picks steps of 32 with 3
# stages on an H200 (bfloat16, chunk 256, headdim 64, dstate 128); chapter 5's performance notes
# give the measurements. Row blocks of 128 are not offered: their CB tiles would span two of
# the squares CB is stored in (.chunk_state).
CONFIGS = [config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=3),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=4),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=64),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=16, num_stages=4),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=2),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=4),
           config(BLOCK_M=64, BLOCK_P=32, BLOCK_N=64, BLOCK_K=32),
           config(BLOCK_M=32, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32)]
CPU_CONFIG = config(BLOCK_M=16, BLOCK_P=16, BLOCK_N=16, BLOCK_K=16)
check_row_blocks(CONFIGS + [CPU_CONFIG], "chunk_scan")


@triton.jit
def diagonal_block(acc, hidden_nonfinite, CB_base, x_base, dA_cumsum_ptr, dt_ptr, seq_row, seq_t, hi_t, chunk, c,
                   pid_m, m, p, chunk_base, chunk_end, p_ok, stride_x_l, stride_x_p, stride_seq_l,
                   MIXED: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DROP_HIDDEN_NONFINITE: tl.constexpr, STAGES: tl.constexpr):
    """``acc`` plus the diagonal block's terms, the sum over s <= t in the chunk; with MIXED only
    the s of t's own sequence (``seq_t`` holds the rows' ids). Returns (acc, hidden_nonfinite).

    The loop stops at the diagonal, and its body runs Q^2/2 times per chunk and head, so it is kept
    to a few instructions per weight: the decay as exp2 of log2(e)-scaled sums (tl.exp would scale
    every element), one select for the causal mask, and no test of s against the chunk's end: for a
    row t inside it, s <= t is inside too, and rows past the end are never stored. The select
    alone zeroes the weights above the diagonal, and it comes after the products, so whatever the
    decay or CB is there (an overflowed exp2, a NaN of a later position) never reaches row t. Those
    CB entries are still read, so they are stored: chunk_cb stores each diagonal square of
    SCAN_ROWS rows whole, and BLOCK_M divides SCAN_ROWS. The select cannot do the same for x,
    which enters through the product: a NaN in x at a later step (or, with MIXED, in another
    sequence) would give 0 x NaN in row t, so in the checked pass (see chunk_scan_kernel) the
    blocks that hide some x from some row drop non-finite x (drop_hidden_nonfinite, which counts
    in ``hidden_nonfinite`` the rows that do see one: they become NaN at the end)."""
    for k0 in tl.range(0, (pid_m + 1) * BLOCK_M, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        s = c * CHUNK + k
        CB = tl.load(CB_base + cb_offsets(m[:, None], k[None, :], pid_m * BLOCK_M, k0, CHUNK))
        hi_s, lo_s = load_sums(dA_cumsum_ptr, chunk, k, CHUNK)
        dt_s = tl.load(dt_ptr + chunk_base + k) * tl.exp2(-lo_s)
        keep = m[:, None] >= k[None, :]
        if MIXED:
            seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=s < chunk_end, other=-2)
            keep &= seq_t[:, None] == seq_s[None, :]
        # the select comes last: a NaN or inf in a later step's dt or B (in CB) stays out of row t
        weight = tl.where(keep, CB * tl.exp2(hi_t[:, None] - hi_s[None, :]) * dt_s[None, :], 0.0)
        xs = tl.load(x_base + s[:, None].to(tl.int64) * stride_x_l + p[None, :] * stride_x_p,
                     mask=(s[:, None] < chunk_end) & p_ok[None, :], other=0.0)
        if DROP_HIDDEN_NONFINITE:
            if MIXED or k0 + BLOCK_K > pid_m * BLOCK_M:  # the blocks where keep is not all True
                xs, hidden_nonfinite = drop_hidden_nonfinite(xs, keep, hidden_nonfinite)
        acc += mm(weight.to(xs.dtype), xs, PRECISION)
    return acc, hidden_nonfinite


@triton.jit
def output_rows(CB_ptr, x_base, c_base, H_ptr, dA_cumsum_ptr, dt_ptr, seq_row, b, c, h, g,
                pid_m, m, p, t, chunk_base, chunk_end, row_ok, p_ok, heads, groups, n_chunks, headdim, dstate,
                stride_x_l, stride_x_p, stride_c_l, stride_c_n, stride_seq_l,
                HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                DROP_HIDDEN_NONFINITE: tl.constexpr, STAGES: tl.constexpr):
    """y before D and the gate for the (BLOCK_M, BLOCK_P) tile, float32. With DROP_HIDDEN_NONFINITE
    the diagonal loop keeps a NaN or inf of x out of the rows that do not see it; STAGES None
    pipelines that loop as the launch asks."""
    # the sums' planes, hi + lo in log2 units (.log_decays): the weights take exp2 of hi
    # differences, the lo parts enter as the column factor exp2(-lo_s) folded into dt_s and the
    # row factor exp2(lo_t) applied to the finished rows
    chunk = chunk_base // CHUNK
    hi_t, lo_t = load_sums(dA_cumsum_ptr, chunk, m, CHUNK)
    # off-diagonal blocks: C_t . H_c, decayed from the chunk start to t
    n_stop = dstate
    seq_t = t  # the rows' ids with seq_idx; without, only a stand-in that no loop reads
    if HAS_SEQ_IDX:
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        seq_carry = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
        # a block of rows none of which continues the carried sequence (one that starts in this
        # chunk) reads no state at all: half the chunks when sequences are two chunks long
        n_stop = tl.where(tl.max((seq_t == seq_carry).to(tl.int32), 0) > 0, dstate, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    H_base = H_ptr + ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate
    for n0 in range(0, n_stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        Ct = tl.load(c_base + t[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                     mask=row_ok[:, None] & (n[None, :] < dstate), other=0.0)
        HT = tl.load(H_base + p[None, :] * dstate + n[:, None],
                     mask=p_ok[None, :] & (n[:, None] < dstate), other=0.0)
        acc += mm(Ct, HT.to(Ct.dtype), PRECISION)
    if HAS_SEQ_IDX:  # a select, not a multiply by 0: the carried state may hold a NaN of another sequence
        acc = tl.where((seq_t == seq_carry)[:, None], acc * tl.exp2(hi_t)[:, None], 0.0)
    else:
        acc *= tl.exp2(hi_t)[:, None]

    # diagonal block (diagonal_block). With seq_idx, a row block whose rows and keys hold one
    # sequence (the ids at the chunk's first position and at the block's last row agree: seq_idx
    # never decreases) runs the loop without ids, as if unpacked; only a block where a sequence
    # starts compares ids in every step. Both loops are compiled into the kernel.
    hidden_nonfinite = tl.zeros([BLOCK_M], dtype=tl.int32)
    CB_base = cb_chunk(CB_ptr, (b * n_chunks + c) * groups + g, CHUNK)
    mixed = False
    if HAS_SEQ_IDX:
        last_row = tl.minimum(c * CHUNK + (pid_m + 1) * BLOCK_M, chunk_end) - 1
        mixed = (tl.load(seq_row + (c * CHUNK).to(tl.int64) * stride_seq_l)
                 != tl.load(seq_row + last_row.to(tl.int64) * stride_seq_l))
    if mixed:
        acc, hidden_nonfinite = diagonal_block(
            acc, hidden_nonfinite, CB_base, x_base, dA_cumsum_ptr, dt_ptr, seq_row, seq_t, hi_t, chunk, c, pid_m,
            m, p, chunk_base, chunk_end, p_ok, stride_x_l, stride_x_p, stride_seq_l, True, CHUNK, BLOCK_M,
            BLOCK_K, PRECISION, DROP_HIDDEN_NONFINITE, STAGES)
    else:
        acc, hidden_nonfinite = diagonal_block(
            acc, hidden_nonfinite, CB_base, x_base, dA_cumsum_ptr, dt_ptr, seq_row, seq_t, hi_t, chunk, c, pid_m,
            m, p, chunk_base, chunk_end, p_ok, stride_x_l, stride_x_p, stride_seq_l, False, CHUNK, BLOCK_M,
            BLOCK_K, PRECISION, DROP_HIDDEN_NONFINITE, STAGES)
    acc *= tl.exp2(lo_t)[:, None]
    return tl.where((hidden_nonfinite > 0)[:, None], float("nan"), acc)


@triton.jit
def tile_coordinates(tile, heads, n_chunks, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(row block, batch, chunk, head) of row tile ``tile``, numbered with the row blocks of one
    (chunk, head) side by side, so that programs that share x blocks run together and hit in L2."""
    n_m = CHUNK // BLOCK_M
    pid = tile // n_m
    return tile % n_m, pid // (heads * n_chunks), (pid // heads) % n_chunks, pid % heads


@triton.jit
def flagged_row_blocks(flags_ptr, first, n_tiles, length, heads, n_chunks, CHUNK: tl.constexpr,
                       BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """For the TILES row tiles from ``first`` on (numbered as :func:`tile_coordinates`), whether each
    holds a row flagged in ``flags`` (batch, heads, L): one load for all of them, so that a checked
    pass with no flag set reads and leaves."""
    tiles = first + tl.arange(0, TILES)
    pid_m, b, c, h = tile_coordinates(tiles, heads, n_chunks, CHUNK, BLOCK_M)
    t = (c * CHUNK + pid_m * BLOCK_M)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    flagged = tl.load(flags_ptr + (b * heads + h).to(tl.int64)[:, None] * length + t,
                      mask=(tiles < n_tiles)[:, None] & (t < length), other=0)
    return tl.max(flagged, 1)


@triton.jit
def is_flagged(tile_flagged, i, TILES: tl.constexpr):
    """Entry i of flagged_row_blocks' answer, as a scalar."""
    return tl.max(tl.where(tl.arange(0, TILES) == i, tile_flagged, 0), 0) > 0


@triton.jit
def write_tile(CB_ptr, x_ptr, z_ptr, C_ptr, H_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, out_ptr, y_ptr,
               flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
               stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_z_b, stride_z_l, stride_z_h, stride_z_p,
               stride_out_b, stride_out_l, stride_out_h, stride_out_p,
               stride_c_b, stride_c_l, stride_c_g, stride_c_n, stride_seq_b, stride_seq_l,
               HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
               HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               tile, p_block, CHECKED: tl.constexpr):
    """Computes and stores one (BLOCK_M, BLOCK_P) tile of out (and of y before the gate). Unchecked,
    as if x were finite, it marks in ``flags`` (batch, heads, L) the rows that come out non-finite;
    checked, it keeps each NaN or inf of x to the rows that see it."""
    pid_m, b, c, h = tile_coordinates(tile, heads, n_chunks, CHUNK, BLOCK_M)
    g = h // (heads // groups)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    t = c * CHUNK + m
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    row_ok = t < chunk_end
    p_ok = p < headdim
    x_base = x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
    acc = output_rows(CB_ptr, x_base, c_base, H_ptr, dA_cumsum_ptr, dt_ptr, seq_row, b, c, h, g,
                      pid_m, m, p, t, chunk_base, chunk_end, row_ok, p_ok, heads, groups, n_chunks, headdim, dstate,
                      stride_x_l, stride_x_p, stride_c_l, stride_c_n, stride_seq_l,
                      HAS_SEQ_IDX, CHUNK, BLOCK_M, BLOCK_P, BLOCK_N, BLOCK_K, PRECISION,
                      DROP_HIDDEN_NONFINITE=CHECKED, STAGES=1 if CHECKED else None)
    if not CHECKED:  # a reduction along the row, within a warp; every writer writes 1 (flags start at 0)
        row_nonfinite = tl.max(is_nonfinite(acc).to(tl.int32), 1) > 0
        tl.store(flags_ptr + (b * heads + h).to(tl.int64) * length + t, 1, mask=row_ok & row_nonfinite)

    mask = row_ok[:, None] & p_ok[None, :]
    rows = t[:, None].to(tl.int64)
    if HAS_D:
        if D_PER_CHANNEL:
            D = tl.load(D_ptr + h * headdim + p, mask=p_ok, other=0.0).to(tl.float32)
        else:
            D = tl.load(D_ptr + h).to(tl.float32)
        acc += tl.load(x_base + rows * stride_x_l + p[None, :] * stride_x_p, mask=mask, other=0.0).to(tl.float32) * D
    # out and y are allocated alike (contiguous, x's shape): one set of strides addresses both
    out_offs = b.to(tl.int64) * stride_out_b + h * stride_out_h + rows * stride_out_l + p[None, :] * stride_out_p
    if HAS_Z:
        tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        zt = tl.load(z_ptr + b.to(tl.int64) * stride_z_b + h * stride_z_h + rows * stride_z_l + p[None, :] * stride_z_p,
                     mask=mask, other=0.0).to(tl.float32)
        acc *= zt * sigmoid(zt)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@lean_launch
@autotune(CONFIGS, CPU_CONFIG, key=["headdim", "dstate", "CHUNK", "HAS_Z"])
@triton.jit
def chunk_scan_kernel(CB_ptr, x_ptr, z_ptr, C_ptr, H_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, out_ptr, y_ptr,
                      flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                      stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_z_b, stride_z_l, stride_z_h, stride_z_p,
                      stride_out_b, stride_out_l, stride_out_h, stride_out_p,
                      stride_c_b, stride_c_l, stride_c_g, stride_c_n, stride_seq_b, stride_seq_l,
                      HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                      HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    write_tile(CB_ptr, x_ptr, z_ptr, C_ptr, H_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, out_ptr, y_ptr,
               flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
               stride_x_b, stride_x_l, stride_x_h, stride_x_p, stride_z_b, stride_z_l, stride_z_h, stride_z_p,
               stride_out_b, stride_out_l, stride_out_h, stride_out_p,
               stride_c_b, stride_c_l, stride_c_g, stride_c_n, stride_seq_b, stride_seq_l,
               HAS_D, D_PER_CHANNEL, HAS_Z, HAS_SEQ_IDX, CHUNK, BLOCK_M, BLOCK_P, BLOCK_N, BLOCK_K, PRECISION,
               tl.program_id(0), tl.program_id(1), CHECKED=False)


@lean_launch
@triton.jit
def chunk_scan_checked_kernel(CB_ptr, x_ptr, z_ptr, C_ptr, H_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr,
                              out_ptr, y_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                              stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                              stride_z_b, stride_z_l, stride_z_h, stride_z_p,
                              stride_out_b, stride_out_l, stride_out_h, stride_out_p,
                              stride_c_b, stride_c_l, stride_c_g, stride_c_n, stride_seq_b, stride_seq_l,
                              HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                              HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr, n_tiles, TILES: tl.constexpr):
    """chunk_scan_kernel's tiles again, checked, where some row came out non-finite. A program
    looks after TILES row tiles (all of headdim each) and reads their flags in one load, so that
    the usual launch, with no flag set, is a few hundred programs that read and leave."""
    first = tl.program_id(0) * TILES
    tile_flagged = flagged_row_blocks(flags_ptr, first, n_tiles, length, heads, n_chunks, CHUNK, BLOCK_M, TILES)
    if tl.max(tile_flagged, 0) > 0:
        for i in range(TILES):
            if is_flagged(tile_flagged, i, TILES):
                for p_block in range(0, tl.cdiv(headdim, BLOCK_P)):
                    write_tile(CB_ptr, x_ptr, z_ptr, C_ptr, H_ptr, dA_cumsum_ptr, dt_ptr, D_ptr, seq_idx_ptr, out_ptr,
                               y_ptr, flags_ptr, length, heads, groups, n_chunks, headdim, dstate,
                               stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                               stride_z_b, stride_z_l, stride_z_h, stride_z_p,
                               stride_out_b, stride_out_l, stride_out_h, stride_out_p,
                               stride_c_b, stride_c_l, stride_c_g, stride_c_n, stride_seq_b, stride_seq_l,
                               HAS_D, D_PER_CHANNEL, HAS_Z, HAS_SEQ_IDX, CHUNK, BLOCK_M, BLOCK_P, BLOCK_N, BLOCK_K,
                               PRECISION, first + i, p_block, CHECKED=True)


def chunk_scan(CB, x, C, H_in, dA_cumsum, dt_out, *, z=None, D=None, seq_idx=None):
    """Returns (out, y): out like x (contiguous); y (before the gate) like out when z is given, else None.

    x, z, C and seq_idx are addressed by their own strides; D must be contiguous.

    Two launches (and a zeroed flag per row). The select on the weights cannot keep a NaN or inf
    of x out of the rows that do not see it: x enters through the product, and 0 x NaN = NaN.
    Testing x inside the diagonal loop, or compiling a checked second pass into the same kernel
    (its registers spill), cost several times more than this: chunk_scan_kernel computes every
    tile as if x were finite and flags the rows that come out non-finite (a NaN of their own, or
    one hidden from them), and chunk_scan_checked_kernel computes again, checked, the tiles with a
    flagged row. ``book/data/nonfinite_check_cost.json`` has the measurements.
    """
    batch, length, heads, headdim = x.shape
    groups, dstate = C.shape[2], C.shape[3]
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    out = outputs.empty(x.shape, x.dtype, x.device)
    y = outputs.empty(x.shape, x.dtype, x.device) if z is not None else None
    flags = torch.zeros((batch, heads, length), dtype=torch.int8, device=x.device)  # the first launch writes only 1s
    args = (CB, x, z if z is not None else x, C, H_in, dA_cumsum, dt_out,
            D if D is not None else dt_out, seq_idx if seq_idx is not None else dt_out, out,
            y if y is not None else out, flags,
            length, heads, groups, n_chunks, headdim, dstate, *x.stride(),
            *(z.stride() if z is not None else (0, 0, 0, 0)), *out.stride(), *C.stride(),
            *(seq_idx.stride() if seq_idx is not None else (0, 0)))
    options = dict(HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2, HAS_Z=z is not None,
                   HAS_SEQ_IDX=seq_idx is not None, CHUNK=chunk_size, PRECISION=dot_precision(x.dtype))
    grid = lambda META: (batch * n_chunks * heads * (chunk_size // META["BLOCK_M"]),  # noqa: E731
                         cdiv(headdim, META["BLOCK_P"]))
    chunk_scan_kernel[grid](*args, **options)
    checked = checked_config(chunk_size)
    n_tiles = batch * heads * n_chunks * (chunk_size // checked["BLOCK_M"])
    chunk_scan_checked_kernel[(cdiv(n_tiles, checked["TILES"]),)](*args, **options, n_tiles=n_tiles, **checked)
    return out, y


def checked_config(chunk_size: int) -> dict:
    """Blocks of the checked pass: unpipelined, since it runs only for rare inputs; TILES row tiles'
    flags per program."""
    if INTERPRETED:
        return dict(CPU_CONFIG.kwargs, TILES=4, num_warps=4, num_stages=1)
    block_m = min(64, chunk_size)
    return dict(BLOCK_M=block_m, BLOCK_P=64, BLOCK_N=64, BLOCK_K=min(32, block_m), TILES=64, num_warps=4, num_stages=1)
