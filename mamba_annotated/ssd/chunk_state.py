"""Chapter 5, kernels 2 and 3: C.B inside each chunk, and the state each chunk contributes.

Algorithm
    chunk_cb:    CB[c, g, t, s] = sum_n C[t, n] B[s, n] for t, s in chunk c and group g. Every
                 head of a group shares it, so it is computed once per group, not once per head.
    chunk_state: out[c, h, p, n] = sum_{t in chunk c} u[t, h, p] * w_t * v[t, g(h), n], a
                 (headdim x Q) @ (Q x dstate) matmul per (chunk, head), with one of two weights:
                 * TO_END:     w_t = exp(a_last - a_t) * dt_t, u = x, v = B: the chunk state S_c,
                               what the chunk adds to the SSM state at its end;
                 * FROM_START: w_t = exp(a_t), u = dy, v = C: the gradient that the outputs of
                               chunk c send to the state entering it (the backward pass's twin).
                 With seq_idx, positions of another sequence than the one the state belongs to
                 get w_t = 0: TO_END, the sequence of the chunk's last position (none at all if
                 its id is negative, mamba_ssm's padding); FROM_START, the carried sequence, that
                 of the position before the chunk (id 0 before the first chunk, as mamba_ssm).
                 The matmuls multiply as :func:`..triton_ops.dot_precision` says: float32 tiles
                 as torch.get_float32_matmul_precision() asks (exactly by default), 16-bit tiles
                 on the tensor cores, accumulating in float32.

Shapes: u (batch, L, heads, headdim); v (batch, L, groups, dstate); dA_cumsum, dt_out (batch,
heads, chunks, 2, Q) and (batch, heads, chunks, Q) float32 (the sums' planes, :mod:`.log_decays`,
and the steps); out (batch, chunks, heads, headdim, dstate) float32. CB (batch, chunks,
groups, cb_length(Q)) float32, stored in squares of SCAN_ROWS (64) rows and columns (or one square
of Q where Q is smaller): only the squares on the diagonal and left of it, all that the chunk scan
and the dx, dCB and dB/dC kernels read (their row blocks are no taller), one after another, a row
of squares at a time, each square row by row (:func:`cb_offsets`; :func:`unpacked_cb` lays them
out as a (Q, Q) matrix again). The entries of the diagonal squares above the diagonal are written
too, though a select after the products drops them, so that no kernel reads memory nobody wrote.

Bytes moved: chunk_state reads u and v once per (head, p-block) and writes headdim*dstate float32
per chunk and head: with Q = 256 that is 2x smaller than u. chunk_cb reads B and C once per
(t-block, s-block) pair and writes cb_length(Q) float32 per chunk and group: 10 of the 16 squares
at Q = 256.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import block_size, cdiv, dot_precision, mm, sequence_run
from .log_decays import decay, decay_between, load_sums
from .tuning import autotune, config


# the side of CB's squares, and the tallest row block of the kernels that read CB tiles whole
# (chunk scan, dx, dCB, dB/dC): their blocks divide it (check_square_blocks), so a tile of theirs
# stays in one square
SCAN_ROWS = 64
CB_SQUARE = tl.constexpr(SCAN_ROWS)


@triton.jit
def cb_chunk(CB_ptr, index, CHUNK: tl.constexpr):
    """The start of chunk ``index`` of CB ((batch row * chunks + chunk) * groups + group): its
    squares on and below the diagonal, cb_length(CHUNK) floats."""
    SQUARE: tl.constexpr = CB_SQUARE if CHUNK > CB_SQUARE else CHUNK
    SQUARES: tl.constexpr = CHUNK // SQUARE
    return CB_ptr + index.to(tl.int64) * (SQUARES * (SQUARES + 1) // 2 * SQUARE * SQUARE)


@triton.jit
def cb_offsets(rows, cols, row0, col0, CHUNK: tl.constexpr):
    """Offsets in a chunk's CB (:func:`cb_chunk`) of CB[rows, cols], positions in the chunk, for a
    tile whose first row and column are (row0, col0), on or below the diagonal square, and that
    stays in one square. ``rows`` and ``cols`` broadcast to the tile: ``rows[:, None]`` and
    ``cols[None, :]`` for CB's own layout, the other way round for its transpose. Square (i, j),
    j <= i, comes after the i rows of squares above it (i (i + 1) / 2 squares) and the j squares
    left of it, and holds its rows one after another, so CB[r, c] in it is at the square's start
    + (r - i SQUARE) SQUARE + (c - j SQUARE): a scalar for the tile, plus r SQUARE + c.

    The callers pass the position tensors they already hold, not aranges from the tile's corner:
    built from fresh aranges, the same offsets gave the backward's dx kernel a third more
    registers, and one block fewer per SM (book/data/packed_cb_ab.json)."""
    SQUARE: tl.constexpr = CB_SQUARE if CHUNK > CB_SQUARE else CHUNK
    i = row0 // SQUARE
    j = col0 // SQUARE
    square_start = (i * (i + 1) // 2 + j) * (SQUARE * SQUARE)
    return (square_start - i * SQUARE * SQUARE - j * SQUARE) + rows * SQUARE + cols


@lean_launch
@triton.jit
def chunk_cb_kernel(C_ptr, B_ptr, CB_ptr, length, groups, n_chunks, dstate,
                    stride_c_b, stride_c_l, stride_c_g, stride_c_n,
                    stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    pid_m, pid_k = tl.program_id(1), tl.program_id(2)
    SQUARE: tl.constexpr = CB_SQUARE if CHUNK > CB_SQUARE else CHUNK
    if pid_k * BLOCK_K >= tl.cdiv((pid_m + 1) * BLOCK_M, SQUARE) * SQUARE:
        return  # right of the diagonal square that holds these rows: not stored
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the chunk
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    t, s = c * CHUNK + rows, c * CHUNK + cols
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    b_base = B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        Ct = tl.load(c_base + t[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                     mask=(t[:, None] < length) & (n[None, :] < dstate), other=0.0)
        Bs = tl.load(b_base + s[None, :].to(tl.int64) * stride_b_l + n[:, None] * stride_b_n,
                     mask=(s[None, :] < length) & (n[:, None] < dstate), other=0.0)
        acc += mm(Ct, Bs, PRECISION)
    tile = cb_offsets(rows[:, None], cols[None, :], pid_m * BLOCK_M, pid_k * BLOCK_K, CHUNK)
    tl.store(cb_chunk(CB_ptr, (b * n_chunks + c) * groups + g, CHUNK) + tile, acc)


# First the whole dstate (up to 128) in one tile with 4 warps and steps of 32, the tuner's pick on
# an H200 (bfloat16, chunk 256, dstate 128) over steps of 64, 8 warps and half of dstate per tile.
@lean_launch
@autotune([config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=32, num_stages=4),
           config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=64),
           config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=64, num_stages=2),
           config(BLOCK_P=64, BLOCK_N=64, BLOCK_K=64),
           config(BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=4),
           config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=64, num_warps=8),
           config(BLOCK_P=32, BLOCK_N=64, BLOCK_K=64)],
          config(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), key=["headdim", "dstate", "CHUNK", "TO_END"])
@triton.jit
def chunk_state_kernel(u_ptr, v_ptr, dA_cumsum_ptr, dt_ptr, seq_idx_ptr, out_ptr,
                       length, heads, groups, n_chunks, headdim, dstate,
                       stride_u_b, stride_u_l, stride_u_h, stride_u_p,
                       stride_v_b, stride_v_l, stride_v_g, stride_v_n,
                       stride_seq_b, stride_seq_l,
                       TO_END: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % heads
    c = (pid // heads) % n_chunks
    b = pid // (heads * n_chunks)
    g = h // (heads // groups)
    n_p_blocks = tl.cdiv(headdim, BLOCK_P)
    p = (tl.program_id(1) % n_p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(1) // n_p_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    u_base = u_ptr + b.to(tl.int64) * stride_u_b + h * stride_u_h
    v_base = v_ptr + b.to(tl.int64) * stride_v_b + g * stride_v_g
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    hi_last, lo_last = load_sums(dA_cumsum_ptr, chunk_base // CHUNK, CHUNK - 1, CHUNK)
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    # the chunk positions [first, stop) whose terms the state keeps: all of them, or with seq_idx
    # those of the sequence the state belongs to: for TO_END the chunk's last sequence; otherwise
    # the sequence carried in from the position before the chunk (0 for the first chunk:
    # mamba_ssm's convention, initial_states belong to sequence 0). seq_idx never decreases along
    # L (the public op refuses one that does, except while torch.compile traces or a CUDA graph
    # captures), so those positions are one run. Found once per
    # program, the run leaves nothing in the loop that waits on a load of ids, so the tile loads
    # are pipelined as without seq_idx, and the steps outside it are skipped.
    first, stop = 0, CHUNK
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        if TO_END:
            seq_owner = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)
        else:
            seq_owner = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
        first, stop = sequence_run(seq_row, stride_seq_l, c * CHUNK, chunk_end, seq_owner, CHUNK)
        if TO_END:  # a chunk ending in a negative id (padding) adds nothing, as mamba_ssm
            first = tl.where(seq_owner >= 0, first, CHUNK)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(first // BLOCK_K * BLOCK_K, stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = c * CHUNK + k
        in_seq = t < chunk_end
        hi, lo = load_sums(dA_cumsum_ptr, chunk_base // CHUNK, k, CHUNK)
        if TO_END:
            w = decay_between(hi_last, lo_last, hi, lo) * tl.load(dt_ptr + chunk_base + k)
        else:
            w = decay(hi, lo)
        keep = in_seq
        if HAS_SEQ_IDX:
            keep &= (k >= first) & (k < stop)
        # v outside the run loads as zeros: a weight of 0 alone would let a NaN there in (0 x NaN)
        uT = tl.load(u_base + t[None, :].to(tl.int64) * stride_u_l + p[:, None] * stride_u_p,
                     mask=in_seq[None, :] & (p[:, None] < headdim), other=0.0)
        vt = tl.load(v_base + t[:, None].to(tl.int64) * stride_v_l + n[None, :] * stride_v_n,
                     mask=keep[:, None] & (n[None, :] < dstate), other=0.0)
        # the weight scales u, the dot's first operand, which it reads from registers; scaled v
        # would go back to shared memory first
        uw = (uT.to(tl.float32) * w[None, :]).to(uT.dtype)
        if HAS_SEQ_IDX:  # a select, since w may be inf across a boundary (0 x inf); uw is in registers anyway
            uw = tl.where(keep[None, :], uw, 0.0)
        acc += mm(uw, vt, PRECISION)
    out = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate
    tl.store(out_ptr + out + p[:, None] * dstate + n[None, :], acc,
             mask=(p[:, None] < headdim) & (n[None, :] < dstate))


def check_square_blocks(configs, kernel):
    """Every row block and step (BLOCK_M, BLOCK_K) of ``kernel`` divides SCAN_ROWS, so each tile it
    reads of CB (or dCB) lies in one of the squares they are stored in: a wider tile would read
    part of another square, or of another chunk, as if it were its own."""
    if any(SCAN_ROWS % c.kwargs[block] for c in configs for block in ("BLOCK_M", "BLOCK_K")):
        raise AssertionError(f"{kernel}: row blocks and steps must divide SCAN_ROWS = {SCAN_ROWS}")


def check_row_blocks(configs, kernel):
    """:func:`check_square_blocks`, and every step (BLOCK_K) of ``kernel``'s loop over the diagonal
    block divides its row block (BLOCK_M), so a loop that starts at a row block's edge ends at the
    chunk's."""
    check_square_blocks(configs, kernel)
    if any(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_K"] for c in configs):
        raise AssertionError(f"{kernel}: steps (BLOCK_K) must divide the row block (BLOCK_M)")


def cb_square(chunk_size: int) -> int:
    """The side of CB's squares: SCAN_ROWS, or the chunk where it is smaller."""
    return min(SCAN_ROWS, chunk_size)


def cb_length(chunk_size: int) -> int:
    """Floats per chunk and group in CB: the squares on and below the diagonal."""
    squares = chunk_size // cb_square(chunk_size)
    return squares * (squares + 1) // 2 * cb_square(chunk_size) ** 2


def unpacked_cb(CB: torch.Tensor, chunk_size: int, fill=float("nan")) -> torch.Tensor:
    """CB (..., cb_length(Q)) as (..., Q, Q) matrices, ``fill`` in the squares right of the
    diagonal, which are not stored (for the chapter and the tests; the kernels read the squares)."""
    side = cb_square(chunk_size)
    squares = chunk_size // side
    out = CB.new_full((*CB.shape[:-1], chunk_size, chunk_size), fill)
    for i in range(squares):
        for j in range(i + 1):
            start = (i * (i + 1) // 2 + j) * side * side
            out[..., i * side:(i + 1) * side, j * side:(j + 1) * side] = \
                CB[..., start:start + side * side].reshape(*CB.shape[:-1], side, side)
    return out


def chunk_cb(C, B, chunk_size):
    """C, B (batch, L, groups, dstate), any strides -> CB (batch, chunks, groups, cb_length(Q))
    float32: C_t . B_s in the squares on and below each chunk's diagonal (module docstring)."""
    batch, length, groups, dstate = C.shape
    n_chunks = cdiv(length, chunk_size)
    CB = outputs.empty((batch, n_chunks, groups, cb_length(chunk_size)), torch.float32, C.device)
    block = 16 if INTERPRETED else min(64, chunk_size)
    block_n = block_size(dstate, largest=16 if INTERPRETED else 64)
    grid = (batch * n_chunks * groups, chunk_size // block, chunk_size // block)
    chunk_cb_kernel[grid](C, B, CB, length, groups, n_chunks, dstate, *C.stride(), *B.stride(),
                          CHUNK=chunk_size, BLOCK_M=block, BLOCK_K=block, BLOCK_N=block_n,
                          PRECISION=dot_precision(C.dtype), num_warps=4)
    return CB


def chunk_state(u, v, dA_cumsum, dt_out, *, seq_idx=None, to_end):
    """The chunk states (``to_end``) or the state gradients (not ``to_end``); see the docstring.

    u, v and seq_idx are addressed by their own strides; the output is contiguous."""
    batch, length, heads, headdim = u.shape
    groups, dstate = v.shape[2], v.shape[3]
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    out = outputs.empty((batch, n_chunks, heads, headdim, dstate), torch.float32, u.device)
    grid = lambda META: (batch * n_chunks * heads,  # noqa: E731
                         cdiv(headdim, META["BLOCK_P"]) * cdiv(dstate, META["BLOCK_N"]))
    chunk_state_kernel[grid](
        u, v, dA_cumsum, dt_out, seq_idx if seq_idx is not None else dA_cumsum, out,
        length, heads, groups, n_chunks, headdim, dstate, *u.stride(), *v.stride(),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        TO_END=to_end, HAS_SEQ_IDX=seq_idx is not None, CHUNK=chunk_size, PRECISION=dot_precision(u.dtype),
    )
    return out
