"""Chapter 6, kernel 2: the scores of the full diagonal blocks, both triangles in one pass.

Algorithm, for t, s in chunk c and group g (chunk-local rows i, columns j):
    G[i, j] = q_t . B_s     for j <= i   (forward; q_t = C_t, or C_{t-1} with the shift)
    G[i, j] = q'_t . B'_s   for j >  i   (reverse; q'_t = C'_t, or C'_{t+1} with the shift)
    Gd[i]   = C'_t . B'_t                (the reverse diagonal, without the shift only)
Where the reverse direction shares B and C (Bi-Mamba2) and there is no shift, the two products
are one C.B^T and the block is that product, computed once. Each tile computes only the products
its triangle needs (tiles on the diagonal both); every entry of G is written and finite, because
the kernels that read it mask weights, not scores.

Parallelism: one program per (batch, chunk, group) x (row tile, column tile). Shapes: C, B, C', B'
(batch, L, groups, dstate), any strides; G (batch, chunks, groups, Q, Q) float32; Gd (batch,
chunks, groups, Q) float32. Bytes moved: B and C once per tile pair (mostly from L2); writes Q*Q
float32 per chunk and group (chapter 5's chunk_cb stores only the squares on and below the diagonal).
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import block_size, cdiv, dot_precision, mm


@triton.jit
def scores_tile(q_ptr, k_ptr, t, s, length, dstate, stride_q_l, stride_q_n, stride_k_l, stride_k_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """q_t . k_s for a tile of rows t and columns s (zero outside [0, L))."""
    acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    t_ok = (t >= 0) & (t < length)
    s_ok = s < length
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        qt = tl.load(q_ptr + t[:, None].to(tl.int64) * stride_q_l + n[None, :] * stride_q_n,
                     mask=t_ok[:, None] & (n[None, :] < dstate), other=0.0)
        ks = tl.load(k_ptr + s[None, :].to(tl.int64) * stride_k_l + n[:, None] * stride_k_n,
                     mask=s_ok[None, :] & (n[:, None] < dstate), other=0.0)
        acc += mm(qt, ks, PRECISION)
    return acc


@lean_launch
@triton.jit
def chunk_scores_kernel(C_ptr, B_ptr, Cr_ptr, Br_ptr, G_ptr, Gd_ptr, length, groups, n_chunks, dstate,
                        stride_c_b, stride_c_l, stride_c_g, stride_c_n,
                        stride_b_b, stride_b_l, stride_b_g, stride_b_n,
                        stride_cr_b, stride_cr_l, stride_cr_g, stride_cr_n,
                        stride_br_b, stride_br_l, stride_br_g, stride_br_n,
                        SHIFT: tl.constexpr, SHARED: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    g = pid % groups
    c = (pid // groups) % n_chunks
    b = pid // (groups * n_chunks)
    pid_i, pid_j = tl.program_id(1), tl.program_id(2)
    i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)
    t = c * CHUNK + i
    s = c * CHUNK + j
    c_base = C_ptr + b.to(tl.int64) * stride_c_b + g * stride_c_g
    b_base = B_ptr + b.to(tl.int64) * stride_b_b + g * stride_b_g
    if SHARED:  # one C.B^T serves both triangles (no shift, shared B and C)
        forward = scores_tile(c_base, b_base, t, s, length, dstate, stride_c_l, stride_c_n, stride_b_l,
                              stride_b_n, BLOCK_M, BLOCK_N, PRECISION)
        reverse = forward
    else:
        forward = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
        reverse = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
        if pid_j <= pid_i:
            forward = scores_tile(c_base, b_base, t - SHIFT, s, length, dstate, stride_c_l, stride_c_n,
                                  stride_b_l, stride_b_n, BLOCK_M, BLOCK_N, PRECISION)
        if pid_j >= pid_i:
            reverse = scores_tile(Cr_ptr + b.to(tl.int64) * stride_cr_b + g * stride_cr_g,
                                  Br_ptr + b.to(tl.int64) * stride_br_b + g * stride_br_g, t + SHIFT, s, length,
                                  dstate, stride_cr_l, stride_cr_n, stride_br_l, stride_br_n, BLOCK_M, BLOCK_N,
                                  PRECISION)
    block = ((b * n_chunks + c) * groups + g).to(tl.int64)
    G = tl.where(j[None, :] <= i[:, None], forward, reverse)
    tl.store(G_ptr + block * CHUNK * CHUNK + i[:, None] * CHUNK + j[None, :], G)
    if not SHIFT:
        if pid_i == pid_j:
            diagonal = tl.sum(tl.where(i[:, None] == j[None, :], reverse, 0.0), axis=1)
            tl.store(Gd_ptr + block * CHUNK + i, diagonal)


def chunk_scores(C, B, C_rev, B_rev, chunk_size, *, shift):
    """(G, Gd): G (batch, chunks, groups, Q, Q) float32, Gd (batch, chunks, groups, Q) float32 or
    None with the shift. C_rev, B_rev may be C, B (the same tensors: the shared case)."""
    batch, length, groups, dstate = C.shape
    n_chunks = cdiv(length, chunk_size)
    G = outputs.empty((batch, n_chunks, groups, chunk_size, chunk_size), torch.float32, C.device)
    Gd = None if shift else outputs.empty((batch, n_chunks, groups, chunk_size), torch.float32, C.device)
    block = 16 if INTERPRETED else min(64, chunk_size)
    grid = (batch * n_chunks * groups, chunk_size // block, chunk_size // block)
    chunk_scores_kernel[grid](
        C, B, C_rev, B_rev, G, Gd if Gd is not None else G, length, groups, n_chunks, dstate,
        *C.stride(), *B.stride(), *C_rev.stride(), *B_rev.stride(),
        SHIFT=int(shift), SHARED=not shift and C_rev is C and B_rev is B, CHUNK=chunk_size, BLOCK_M=block,
        BLOCK_N=block_size(dstate, largest=16 if INTERPRETED else 64), PRECISION=dot_precision(C.dtype),
        num_warps=4,
    )
    return G, Gd
