"""Chapter 5: the state at the end of each packed sequence (``return_varlen_states``).

Algorithm, as mamba_ssm's ``chunk_state_varlen`` (batch 1; cu_seqlens holds where each of the
packed sequences starts and ends): for the sequence [start, end), let c be the chunk of its last
position and a the cumulative log-decay inside chunk c. Its state is

    sum_{k in [max(start, c Q), end)} exp(min(a_{end-1} - a_k, 0)) dt_k x_k B_k^T
    + exp(a_{end-1}) H_c                        only if the sequence started before chunk c,

the part of chunk c up to the sequence's end, plus the state entering chunk c decayed to the end.
H_c comes from the state passing, which knows the sequences only through seq_idx: without a
seq_idx that marks the same sequences, earlier sequences leak into H_c (as in mamba_ssm), and
initial_states reach the first sequence's state only when that sequence runs past the first chunk.
An empty sequence gets a zero state.

Parallelism: one program per (sequence, head) x (BLOCK_P of headdim, BLOCK_N of dstate); each
reads one chunk of x and B at most. Shapes: x (1, L, heads, headdim), B (1, L, groups, dstate),
any strides; dA_cumsum (1, heads, chunks, 2, Q), dt_out (1, heads, chunks, Q), float32 (the sums' planes,
:mod:`.log_decays`, and the steps); H_in (1, chunks, heads, headdim,
dstate), contiguous, in the state dtype; cu_seqlens (sequences + 1,) int32 or int64. The states
come out (sequences, heads, headdim, dstate) in H_in's dtype, as mamba_ssm's. Forward only.
Bytes moved: at most one chunk of x and B per sequence and head, and one state.
"""
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import block_size, cdiv, dot_precision, mm
from .log_decays import decay, load_sums


@lean_launch
@triton.jit
def varlen_states_kernel(x_ptr, B_ptr, dA_cumsum_ptr, dt_ptr, H_ptr, cu_seqlens_ptr, out_ptr,
                         length, heads, groups, n_chunks, headdim, dstate,
                         stride_x_l, stride_x_h, stride_x_p, stride_b_l, stride_b_g, stride_b_n,
                         CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    i, h = pid // heads, pid % heads
    g = h // (heads // groups)
    n_p_blocks = tl.cdiv(headdim, BLOCK_P)
    p = (tl.program_id(1) % n_p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(1) // n_p_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < headdim, n < dstate
    start = tl.load(cu_seqlens_ptr + i).to(tl.int32)
    end = tl.minimum(tl.load(cu_seqlens_ptr + i + 1).to(tl.int32), length)
    c = tl.maximum(end - 1, 0) // CHUNK
    chunk_base = (h * n_chunks + c).to(tl.int64) * CHUNK
    hi_end, lo_end = load_sums(dA_cumsum_ptr, chunk_base // CHUNK, tl.maximum(end - 1 - c * CHUNK, 0), CHUNK)
    first = tl.maximum(start, c * CHUNK)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = c * CHUNK + k
        in_seq = (t >= first) & (t < end)
        hi, lo = load_sums(dA_cumsum_ptr, chunk_base // CHUNK, k, CHUNK)
        exponent = tl.minimum((hi_end - hi) + (lo_end - lo), 0.0)
        w = tl.where(in_seq, tl.exp2(exponent) * tl.load(dt_ptr + chunk_base + k), 0.0)
        xT = tl.load(x_ptr + t[None, :].to(tl.int64) * stride_x_l + h * stride_x_h + p[:, None] * stride_x_p,
                     mask=in_seq[None, :] & p_ok[:, None], other=0.0)
        Bt = tl.load(B_ptr + t[:, None].to(tl.int64) * stride_b_l + g * stride_b_g + n[None, :] * stride_b_n,
                     mask=in_seq[:, None] & n_ok[None, :], other=0.0)
        acc += mm((xT.to(tl.float32) * w[None, :]).to(xT.dtype), Bt, PRECISION)
    state_offs = p[:, None] * dstate + n[None, :]
    if start < c * CHUNK:
        H = tl.load(H_ptr + (c * heads + h).to(tl.int64) * headdim * dstate + state_offs,
                    mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        acc += decay(hi_end, lo_end) * H.to(tl.float32)
    tl.store(out_ptr + pid.to(tl.int64) * headdim * dstate + state_offs, acc.to(out_ptr.dtype.element_ty),
             mask=p_ok[:, None] & n_ok[None, :])


def varlen_states(x, B, dA_cumsum, dt_out, states_in, cu_seqlens):
    """The state at the end of each packed sequence: (sequences, heads, headdim, dstate) in
    states_in's dtype. x (1, L, heads, headdim), B (1, L, groups, dstate); see the docstring."""
    _, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks, chunk_size = dt_out.shape[2], dt_out.shape[3]
    n_seqs = cu_seqlens.shape[0] - 1
    out = outputs.empty((n_seqs, heads, headdim, dstate), states_in.dtype, x.device)
    block_p = block_size(headdim, largest=16 if INTERPRETED else 64)
    block_n = block_size(dstate, largest=16 if INTERPRETED else 64)
    grid = (n_seqs * heads, cdiv(headdim, block_p) * cdiv(dstate, block_n))
    varlen_states_kernel[grid](
        x, B, dA_cumsum, dt_out, states_in, cu_seqlens, out, length, heads, groups, n_chunks, headdim, dstate,
        *x.stride()[1:], *B.stride()[1:], CHUNK=chunk_size, BLOCK_P=block_p, BLOCK_N=block_n,
        BLOCK_K=16 if INTERPRETED else 32, PRECISION=dot_precision(x.dtype), num_warps=4,
    )
    return out
