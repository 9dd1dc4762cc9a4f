"""Chapter 6, kernel 5: the outputs, the full diagonal block plus the states from both sides.

Algorithm, for t in chunk c of head h (group g), with :mod:`.decays`' notation:
    y_t = exp(r_t) q_t . H_c                        the forward state, entering from the left
        + exp(b_last - rho_t) q'_t . H'_c           the reverse state, entering from the right
        + sum_{s in chunk c} G[t, s] w(t, s) x_s    the diagonal block, both triangles
        + Gd_t dt'_t x_t                            the reverse diagonal (without the shift)
        + D x_t;   out_t = y_t * silu(z_t) when z is given,
    w(t, s) = exp(r_t - a_s) dt_s for s <= t (s < t with the shift), exp(e_s - rho_t) dt'_s for
    s > t. With seq_idx, s counts only in t's sequence, and each state only where t belongs to it
    (:mod:`.chunk_states`): H_c to the sequence of the position before the chunk, H'_c to that of
    the chunk's last position.

Parallelism: one program per (batch, chunk, head) x (BLOCK_M rows) x (BLOCK_P of headdim). Unlike
chapter 5's chunk scan, the loop over s runs over the whole chunk: the block above the diagonal is
the reverse direction's. Only the columns of the row block's own band mix the triangles and pay
one exponential per weight; left and right of it each weight is a product of a row factor and a
column factor (one exponential per column). Both matmuls run in the input dtype, as chapter 5's.

Shapes: x, z (batch, L, heads, headdim), any strides; out, y contiguous; C, C' (batch, L, groups,
dstate), any strides; G (batch, chunks, groups, Q, Q), Gd (batch, chunks, groups, Q) float32;
H, H' (batch, chunks, heads, headdim, dstate) in x's dtype; cumsums and
steps (batch, heads, chunks, Q) float32. Bytes moved: x once per row block (Q / BLOCK_M times,
mostly from L2), C and C' (the same tensor when shared), both states, G, and writes out (and y
before the gate, when z is given).
"""
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..ssd.tuning import autotune, config
from ..triton_ops import LOG2E, cdiv, dot_precision, drop_hidden_nonfinite, mm, sigmoid
from .decays import pair_weight, row_decays

CONFIGS = [config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=3),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=64),
           config(BLOCK_M=64, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_stages=2),
           config(BLOCK_M=128, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32, num_warps=8),
           config(BLOCK_M=64, BLOCK_P=32, BLOCK_N=64, BLOCK_K=32),
           config(BLOCK_M=32, BLOCK_P=64, BLOCK_N=64, BLOCK_K=32)]
CPU_CONFIG = config(BLOCK_M=16, BLOCK_P=16, BLOCK_N=16, BLOCK_K=16)
# the band loop starts at a row block's edge and must end at the next one
assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_K"] == 0 for c in CONFIGS + [CPU_CONFIG]), "BLOCK_K | BLOCK_M"


@triton.jit
def diagonal_step(acc, hidden_nonfinite, w, G_base, x_base, m, k, s, chunk_end, p, p_ok, seq_row, seq_t,
                  stride_x_l, stride_x_p, stride_seq_l,
                  HAS_SEQ_IDX: tl.constexpr, SKIP_DIAGONAL: tl.constexpr, CHECK_X: tl.constexpr,
                  CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """acc + (G * w) x over the columns s (chunk positions k) of one step: the weights w of rows m,
    zeroed past the chunk's end, with seq_idx across sequences, and with SKIP_DIAGONAL (the shift,
    in the band of the row block) where s is the row's own position, whose weight is 0 but whose
    score (its B, or the previous sequence's last C) may be non-finite. With CHECK_X the x tile
    goes through :func:`..triton_ops.drop_hidden_nonfinite` (hidden_nonfinite updated): a NaN or
    inf of an x that a row skips would still enter through the product."""
    s_ok = s < chunk_end
    keep = s_ok[None, :]
    if SKIP_DIAGONAL:
        keep = keep & (m[:, None] != k[None, :])
    if HAS_SEQ_IDX:
        seq_s = tl.load(seq_row + s.to(tl.int64) * stride_seq_l, mask=s_ok, other=-2)
        keep = keep & (seq_t[:, None] == seq_s[None, :])
    G = tl.load(G_base + m[:, None] * CHUNK + k[None, :])
    xs = tl.load(x_base + s[:, None].to(tl.int64) * stride_x_l + p[None, :] * stride_x_p,
                 mask=s_ok[:, None] & p_ok[None, :], other=0.0)
    if CHECK_X:
        xs, hidden_nonfinite = drop_hidden_nonfinite(xs, keep, hidden_nonfinite)
    return acc + mm(tl.where(keep, G * w, 0.0).to(xs.dtype), xs, PRECISION), hidden_nonfinite


@lean_launch
@autotune(CONFIGS, CPU_CONFIG, key=["headdim", "dstate", "CHUNK", "HAS_Z", "SHIFT"])
@triton.jit
def chunk_outputs_kernel(G_ptr, Gd_ptr, x_ptr, z_ptr, C_ptr, Cr_ptr, H_ptr, Hr_ptr, a_ptr, dt_ptr, b_ptr, dtr_ptr,
                         A_ptr, D_ptr, seq_idx_ptr, out_ptr, y_ptr,
                         length, heads, groups, n_chunks, headdim, dstate,
                         stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                         stride_z_b, stride_z_l, stride_z_h, stride_z_p,
                         stride_out_b, stride_out_l, stride_out_h, stride_out_p,
                         stride_c_b, stride_c_l, stride_c_g, stride_c_n,
                         stride_cr_b, stride_cr_l, stride_cr_g, stride_cr_n,
                         stride_seq_b, stride_seq_l,
                         HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                         HAS_SEQ_IDX: tl.constexpr, SHIFT: tl.constexpr, CHECK_BAND_X: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # the row blocks of one (chunk, head) run side by side, so the x blocks they share hit in L2
    n_m = CHUNK // BLOCK_M
    pid_m = tl.program_id(0) % n_m
    pid = tl.program_id(0) // n_m
    h = pid % heads
    c = (pid // heads) % n_chunks
    b = pid // (heads * n_chunks)
    g = h // (heads // groups)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    t = c * CHUNK + m
    chunk_end = tl.minimum((c + 1) * CHUNK, length)
    row_ok = t < chunk_end
    p_ok = p < headdim
    x_base = x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    cr_base = Cr_ptr + b.to(tl.int64) * stride_cr_b + g * stride_cr_g
    chunk_base = ((b * heads + h) * n_chunks + c).to(tl.int64) * CHUNK
    A = tl.load(A_ptr + h).to(tl.float32)
    dtr_t = tl.load(dtr_ptr + chunk_base + m)
    r_t, rho_t = row_decays(tl.load(a_ptr + chunk_base + m), tl.load(dt_ptr + chunk_base + m),
                            tl.load(b_ptr + chunk_base + m), dtr_t, A, SHIFT)
    b_last = tl.load(b_ptr + chunk_base + CHUNK - 1)
    seq_row, seq_t = seq_idx_ptr, m  # (placeholders that diagonal_step ignores without seq_idx)
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
        seq_t = tl.load(seq_row + t.to(tl.int64) * stride_seq_l, mask=row_ok, other=-1)
        seq_before = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
        seq_last = tl.load(seq_row + (chunk_end - 1) * stride_seq_l)

    # the two states: q_t . H_c from the left, q'_t . H'_c from the right
    acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    state_base = ((b * n_chunks + c) * heads + h).to(tl.int64) * headdim * dstate
    q_row, qr_row = t - SHIFT, t + SHIFT
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < dstate
        q = tl.load(c_base + q_row[:, None].to(tl.int64) * stride_c_l + n[None, :] * stride_c_n,
                    mask=(row_ok & (q_row >= 0))[:, None] & n_ok[None, :], other=0.0)
        q_r = tl.load(cr_base + qr_row[:, None].to(tl.int64) * stride_cr_l + n[None, :] * stride_cr_n,
                      mask=(row_ok & (qr_row < length))[:, None] & n_ok[None, :], other=0.0)
        state = p[None, :] * dstate + n[:, None]
        state_mask = p_ok[None, :] & n_ok[:, None]
        HT = tl.load(H_ptr + state_base + state, mask=state_mask, other=0.0)
        HrT = tl.load(Hr_ptr + state_base + state, mask=state_mask, other=0.0)
        acc += mm(q, HT.to(q.dtype), PRECISION)
        acc_r += mm(q_r, HrT.to(q_r.dtype), PRECISION)
    acc = acc * tl.exp(r_t)[:, None]
    acc_r = acc_r * tl.exp(b_last - rho_t)[:, None]
    if HAS_SEQ_IDX:  # selects, not multiplies by 0: a state may hold a NaN of another sequence
        acc = tl.where((seq_t == seq_before)[:, None], acc, 0.0)
        acc_r = tl.where((seq_t == seq_last)[:, None], acc_r, 0.0)
    acc += acc_r
    hidden_nonfinite = tl.zeros([BLOCK_M], dtype=tl.int32)

    # the diagonal block, in three runs of columns s: those before the row block are all forward,
    # those after it all reverse, and only the band of the row block itself mixes the triangles
    m_first = pid_m * BLOCK_M
    block = ((b * n_chunks + c) * groups + g).to(tl.int64)
    G_base = G_ptr + block * CHUNK * CHUNK
    # Off the band a weight factors through a reference position between rows and columns:
    # exp(r_t - a_s) = exp(r_t - a_ref) exp(a_ref - a_s), a_ref = a at the row block's first row
    # minus one, and exp(e_s - rho_t) = exp(e_s - e_ref) exp(e_ref - rho_t), e_ref = e at the row
    # after the block. Within a sequence the cumulative sums are monotone and the reference lies
    # between row and column, so both factors' exponents have the sign of A (no factor overflows
    # where the weight does not); across a boundary the sums restart and a factor may overflow,
    # but diagonal_step drops those weights by a select. A tile of BLOCK_M x BLOCK_K weights
    # costs BLOCK_K exponentials instead of BLOCK_M * BLOCK_K.
    a_ref = tl.load(a_ptr + chunk_base + tl.maximum(m_first - 1, 0))
    to_rows = tl.exp2((r_t - a_ref) * LOG2E)
    for k0 in range(0, m_first, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        from_columns = tl.exp2((a_ref - tl.load(a_ptr + chunk_base + k)) * LOG2E) * tl.load(dt_ptr + chunk_base + k)
        w = to_rows[:, None] * from_columns[None, :]
        acc, hidden_nonfinite = diagonal_step(acc, hidden_nonfinite, w, G_base, x_base, m, k, c * CHUNK + k,
                                              chunk_end, p, p_ok, seq_row, seq_t, stride_x_l, stride_x_p,
                                              stride_seq_l, HAS_SEQ_IDX, False, HAS_SEQ_IDX, CHUNK,
                                              PRECISION)
    for k0 in range(m_first, m_first + BLOCK_M, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        dtr_s = tl.load(dtr_ptr + chunk_base + k)
        e_s = tl.load(b_ptr + chunk_base + k) - A * dtr_s
        w, _ = pair_weight(m[:, None], k[None, :], r_t[:, None], rho_t[:, None],
                           tl.load(a_ptr + chunk_base + k)[None, :], e_s[None, :],
                           tl.load(dt_ptr + chunk_base + k)[None, :], dtr_s[None, :], True, SHIFT)
        acc, hidden_nonfinite = diagonal_step(acc, hidden_nonfinite, w, G_base, x_base, m, k, c * CHUNK + k,
                                              chunk_end, p, p_ok, seq_row, seq_t, stride_x_l, stride_x_p,
                                              stride_seq_l, HAS_SEQ_IDX, SHIFT, CHECK_BAND_X, CHUNK,
                                              PRECISION)
    after = tl.minimum(m_first + BLOCK_M, CHUNK - 1)  # (unused when the row block ends the chunk)
    e_ref = tl.load(b_ptr + chunk_base + after) - A * tl.load(dtr_ptr + chunk_base + after)
    to_rows = tl.exp2((e_ref - rho_t) * LOG2E)
    for k0 in range(m_first + BLOCK_M, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        dtr_s = tl.load(dtr_ptr + chunk_base + k)
        from_columns = tl.exp2((tl.load(b_ptr + chunk_base + k) - A * dtr_s - e_ref) * LOG2E) * dtr_s
        w = to_rows[:, None] * from_columns[None, :]
        acc, hidden_nonfinite = diagonal_step(acc, hidden_nonfinite, w, G_base, x_base, m, k, c * CHUNK + k,
                                              chunk_end, p, p_ok, seq_row, seq_t, stride_x_l, stride_x_p,
                                              stride_seq_l, HAS_SEQ_IDX, False, HAS_SEQ_IDX, CHUNK,
                                              PRECISION)

    acc = tl.where((hidden_nonfinite > 0)[:, None], float("nan"), acc)
    mask = row_ok[:, None] & p_ok[None, :]
    rows = t[:, None].to(tl.int64)
    xt = tl.load(x_base + rows * stride_x_l + p[None, :] * stride_x_p, mask=mask, other=0.0).to(tl.float32)
    if not SHIFT:
        acc += (tl.load(Gd_ptr + block * CHUNK + m) * dtr_t)[:, None] * xt
    if HAS_D:
        if D_PER_CHANNEL:
            acc += xt * tl.load(D_ptr + h * headdim + p, mask=p_ok, other=0.0).to(tl.float32)[None, :]
        else:
            acc += xt * tl.load(D_ptr + h).to(tl.float32)
    # out and y are allocated alike (contiguous, x's shape): one set of strides addresses both
    out_offs = b.to(tl.int64) * stride_out_b + h * stride_out_h + rows * stride_out_l + p[None, :] * stride_out_p
    if HAS_Z:
        tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        zt = tl.load(z_ptr + b.to(tl.int64) * stride_z_b + h * stride_z_h + rows * stride_z_l + p[None, :] * stride_z_p,
                     mask=mask, other=0.0).to(tl.float32)
        acc *= zt * sigmoid(zt)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def chunk_outputs(G, Gd, x, C, C_rev, H_in, H_in_rev, a, dt_out, b, dt_rev_out, A, *, z=None, D=None, seq_idx=None,
                  shift=False):
    """Returns (out, y): out like x (contiguous); y (before the gate) like out when z is given, else
    None. H_in, H_in_rev: (batch, chunks, heads, headdim, dstate), contiguous, the states entering
    each chunk from the left and from the right. x, z, C, C_rev and seq_idx are addressed by their own strides; A and D
    must be contiguous."""
    batch, length, heads, headdim = x.shape
    groups, dstate = C.shape[2], C.shape[3]
    n_chunks, chunk_size = a.shape[2], a.shape[3]
    out = outputs.empty(x.shape, x.dtype, x.device)
    y = outputs.empty(x.shape, x.dtype, x.device) if z is not None else None
    grid = lambda META: (batch * n_chunks * heads * (chunk_size // META["BLOCK_M"]),  # noqa: E731
                         cdiv(headdim, META["BLOCK_P"]))
    chunk_outputs_kernel[grid](
        G, Gd if Gd is not None else G, x, z if z is not None else x, C, C_rev, H_in, H_in_rev, a, dt_out, b,
        dt_rev_out, A, D if D is not None else a, seq_idx if seq_idx is not None else a, out,
        y if y is not None else out, length, heads, groups, n_chunks, headdim, dstate, *x.stride(),
        *(z.stride() if z is not None else (0, 0, 0, 0)), *out.stride(), *C.stride(), *C_rev.stride(),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2, HAS_Z=z is not None,
        HAS_SEQ_IDX=seq_idx is not None, SHIFT=int(shift),
        # With the shift the band skips each row's own x_t, so a NaN or inf there would reach y_t as
        # 0 x NaN; but with D, y_t reads x_t anyway (D x_t), in the same channels, so only packed
        # sequences need the check then (x of another sequence). An inf of x_t comes out NaN there.
        CHECK_BAND_X=seq_idx is not None or (shift and D is None),
        CHUNK=chunk_size, PRECISION=dot_precision(x.dtype),
    )
    return out, y
