"""Chapter 6, kernel 3: the chunk states of both directions from one read of x and B.

Algorithm, for chunk c of head h (group g), positions t of the chunk:
    forward:  S_c  = sum_t exp(a_last - a_t) dt_t  x_t B_t^T    what the chunk adds to the state at
                                                                 its end (chapter 5's chunk state)
    reverse:  S'_c = sum_t exp(e_t) dt'_t x_t B'_t^T             what it adds to the state at its
                                                                 start, for the chunks before it
and, in the backward pass (``grad``), the twins on dy, what chunk c's outputs send to the two
states that reach it:
    dH_c  = sum_t exp(r_t) dy_t q_t^T                (q_t = C_t, or C_{t-1} with the shift)
    dH'_c = sum_t exp(b_last - rho_t) dy_t q'_t^T    (q'_t = C'_t, or C'_{t+1})
(:mod:`.decays` defines a, b, e, r, rho.) One program computes both, reading u = x (or dy) once,
and B once where the reverse direction shares it (twice with seq_idx: the two states keep
different positions, each load masked to its own).

Packed sequences: a state belongs to the sequence of the last position of the chunk it enters
(chapter 5's convention; for the reverse direction, the chunk to the left). So S_c keeps the
positions in the sequence of c's last position, S'_c those in the sequence of the position before
c, and in the backward pass dH_c (dH'_c) keeps the rows that read the state from the left (right).
Ids are compared for equality only: a negative id is a sequence like any other.

Parallelism: one program per (batch, chunk, head) x (BLOCK_P of headdim, BLOCK_N of dstate).
Shapes: u (batch, L, heads, headdim), v, v' (batch, L, groups, dstate), any strides; the cumsums
and steps (batch, heads, chunks, Q) float32; out (2, batch, chunks, heads, headdim, dstate)
float32, the forward direction first. Bytes moved: u and v once per (head, p-block) (v twice with
seq_idx); writes two float32 states per chunk and head (with Q = 256 and headdim = 64, dstate =
128, as much as x in bfloat16).
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..ssd.tuning import autotune, config
from ..triton_ops import cdiv, dot_precision, mm, sequence_run
from .decays import row_decays


@lean_launch
@autotune([config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=32, num_stages=4),
           config(BLOCK_P=64, BLOCK_N=64, BLOCK_K=64),
           config(BLOCK_P=64, BLOCK_N=128, BLOCK_K=64, num_warps=8),
           config(BLOCK_P=32, BLOCK_N=64, BLOCK_K=64)],
          config(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), key=["headdim", "dstate", "CHUNK", "GRAD", "SHARED_V"])
@triton.jit
def chunk_states_kernel(u_ptr, v_ptr, vr_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr, A_ptr, seq_idx_ptr, out_ptr,
                        length, heads, groups, n_chunks, headdim, dstate, direction_size,
                        stride_u_b, stride_u_l, stride_u_h, stride_u_p,
                        stride_v_b, stride_v_l, stride_v_g, stride_v_n,
                        stride_vr_b, stride_vr_l, stride_vr_g, stride_vr_n,
                        stride_seq_b, stride_seq_l,
                        GRAD: tl.constexpr, SHIFT: tl.constexpr, OFFSET: tl.constexpr, SHARED_V: tl.constexpr,
                        HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
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
    vr_base = vr_ptr + b.to(tl.int64) * stride_vr_b + g * stride_vr_g
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    A = tl.load(A_ptr + h).to(tl.float32)
    a_last = tl.load(a_ptr + chunk_base + CHUNK - 1)
    b_last = tl.load(b_ptr + chunk_base + CHUNK - 1)
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    # each state's positions: with seq_idx those of its sequence, the chunk's last one's or the one
    # carried in (0 before the first chunk), each one run [first, stop) (seq_idx never decreases;
    # triton_ops.sequence_run), found before the loop so that the loop's loads wait on no load of ids
    first, stop, first_r, stop_r = 0, CHUNK, 0, CHUNK
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_last = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)
        seq_before = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
        # GRAD: dH_c keeps the rows that read the carried state, dH'_c those of the chunk's last sequence
        owner, owner_r = (seq_before, seq_last) if GRAD else (seq_last, seq_before)
        first, stop = sequence_run(seq_row, stride_seq_l, c * CHUNK, chunk_end, owner, CHUNK)
        first_r, stop_r = sequence_run(seq_row, stride_seq_l, c * CHUNK, chunk_end, owner_r, CHUNK)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = c * CHUNK + k
        in_chunk = t < chunk_end
        a = tl.load(a_ptr + chunk_base + k)
        dt = tl.load(dt_ptr + chunk_base + k)
        bb = tl.load(b_ptr + chunk_base + k)
        dtr = tl.load(dtr_ptr + chunk_base + k)
        if GRAD:
            r, rho = row_decays(a, dt, bb, dtr, A, SHIFT)
            w = tl.exp(r)
            w_r = tl.exp(b_last - rho)
        else:
            w = tl.exp(a_last - a) * dt
            w_r = tl.exp(bb - A * dtr) * dtr
        row_v, row_r = t - OFFSET, t + OFFSET  # the rows of v and v_r each position reads
        v_rows = in_chunk & (row_v >= 0)
        v_r_rows = in_chunk & (row_r < length)
        if HAS_SEQ_IDX:
            # each dot's v of another sequence loads as zeros (a weight of 0 alone would let a NaN
            # or inf there in, 0 x NaN): masked loads rather than selects after them, so that the
            # tiles go straight to shared memory for the dots (as chapter 5's chunk_state)
            keep, keep_r = (k >= first) & (k < stop), (k >= first_r) & (k < stop_r)
            v_rows = v_rows & keep
            v_r_rows = v_r_rows & keep_r
        uT = tl.load(u_base + t[None, :].to(tl.int64) * stride_u_l + p[:, None] * stride_u_p,
                     mask=in_chunk[None, :] & (p[:, None] < headdim), other=0.0)
        v = tl.load(v_base + row_v[:, None].to(tl.int64) * stride_v_l + n[None, :] * stride_v_n,
                    mask=v_rows[:, None] & (n[None, :] < dstate), other=0.0)
        if SHARED_V and not HAS_SEQ_IDX:
            v_r = v
        else:  # with seq_idx the dots keep different positions of a shared v (then OFFSET = 0): two loads
            v_r = tl.load(vr_base + row_r[:, None].to(tl.int64) * stride_vr_l + n[None, :] * stride_vr_n,
                          mask=v_r_rows[:, None] & (n[None, :] < dstate), other=0.0)
        # the weights scale u, the dots' first operand, read from registers (as chapter 5's chunk_state)
        uw = (uT.to(tl.float32) * w[None, :]).to(uT.dtype)
        uw_r = (uT.to(tl.float32) * w_r[None, :]).to(uT.dtype)
        if HAS_SEQ_IDX:  # selects, since a weight may be inf across a boundary (0 x inf); uw is in registers
            uw = tl.where(keep[None, :], uw, 0.0)
            uw_r = tl.where(keep_r[None, :], uw_r, 0.0)
        acc += mm(uw, v, PRECISION)
        acc_r += mm(uw_r, v_r, PRECISION)
    out = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate + p[:, None] * dstate + n[None, :]
    mask = (p[:, None] < headdim) & (n[None, :] < dstate)
    tl.store(out_ptr + out, acc, mask=mask)
    tl.store(out_ptr + direction_size + out, acc_r, mask=mask)


def chunk_states(u, v, v_rev, a, dt_out, b, dt_rev_out, A, *, seq_idx=None, shift=False, grad=False):
    """Both directions' chunk states (u = x, v = B, v_rev = B') or, with ``grad``, the gradients
    sent to the states (u = dy, v = C, v_rev = C'): (2, batch, chunks, heads, headdim, dstate)
    float32, forward then reverse. v_rev may be v (the same tensor: one load serves both)."""
    batch, length, heads, headdim = u.shape
    groups, dstate = v.shape[2], v.shape[3]
    n_chunks, chunk_size = a.shape[2], a.shape[3]
    out = outputs.empty((2, batch, n_chunks, heads, headdim, dstate), torch.float32, u.device)
    grid = lambda META: (batch * n_chunks * heads,  # noqa: E731
                         cdiv(headdim, META["BLOCK_P"]) * cdiv(dstate, META["BLOCK_N"]))
    chunk_states_kernel[grid](
        u, v, v_rev, a, dt_out, b, dt_rev_out, A, seq_idx if seq_idx is not None else a, out,
        length, heads, groups, n_chunks, headdim, dstate, out[0].numel(),
        *u.stride(), *v.stride(), *v_rev.stride(), *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        # the backward rows read C_{t-1} (forward) and C'_{t+1} (reverse) with the shift
        GRAD=grad, SHIFT=int(shift), OFFSET=int(grad and shift), SHARED_V=v_rev is v and not (grad and shift),
        HAS_SEQ_IDX=seq_idx is not None, CHUNK=chunk_size, PRECISION=dot_precision(u.dtype),
    )
    return out
