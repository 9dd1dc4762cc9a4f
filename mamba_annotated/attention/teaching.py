"""Chapter 7's foils: two other schedules of the backward loops, kept off the production path.

fused
    One kernel, two loops: program i does the dK/dV of key block i, then the dQ of query block i
    for every head of its group (the production :func:`.backward.dkdv_program` and
    :func:`.backward.dq_program`, one after the other). It saves a launch, but the program is
    bigger (more registers, fewer programs in flight) and, causal, the dQ halves are unevenly
    loaded. Deterministic, and the same arithmetic as the production pair.
atomic
    dQ inside the dK/dV loop, as in the original FlashAttention: the loop already holds the tile
    dS, so dQ_tile += scale * dS K_j costs one more product and no recomputation of S and dP (5
    matrix products per tile instead of 7). But many key blocks add into the same rows of dQ, so
    they add with float32 atomics, into a buffer the size of Q in float32, in whatever order the
    programs finish: the last bits of dQ can change from run to run.

:func:`attention_variant` runs the production forward pass with a chosen backward schedule, for
the chapter and the benchmark.
"""
import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .. import outputs
from ..library import last_dim_contiguous
from ..triton_ops import LOG2E, block_size, cdiv, dot_precision, mm
from .api import attention, attention_gradients, attention_outputs, check_attention_inputs, check_real
from .backward import backward_config, backward_preprocess, batch_row_head_strides, dkdv_program, dq_program


@triton.jit
def attention_bwd_fused_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                               stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                               stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                               stride_dqb, stride_dqm, stride_dqh, stride_dkb, stride_dkn, stride_dkh,
                               stride_dvb, stride_dvn, stride_dvh,
                               seqlen_q, seqlen_k, heads, kv_heads, head_dim, qk_scale, softmax_scale,
                               CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                               EVEN_M2: tl.constexpr, EVEN_N2: tl.constexpr, EVEN_D: tl.constexpr,
                               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (max(key blocks, query blocks), batch * kv_heads): program i does the dk, dv of key
    block i, then the dq of query block i for every head of its group: two loops, one launch."""
    block = tl.program_id(0)
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    group = heads // kv_heads
    if block * BLOCK_N < seqlen_k:
        # unpacked (VARLEN False); causal is the window (unbounded, 0); no softcap, ALiBi or dropout
        # (lse2_ptr: pointers never read)
        dkdv_program(block, batch, kv_head, q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr,
                     lse2_ptr, lse2_ptr, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                     stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                     stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, 0, 0,
                     seqlen_q, seqlen_k, seqlen_q, seqlen_k, 0, heads, group, head_dim, qk_scale, 0.0, softmax_scale,
                     -1, 0, 0.0, False, False, CAUSAL, False, False, False, EVEN_M, EVEN_N, EVEN_D, PRECISION, BLOCK_M,
                     BLOCK_N, BLOCK_D)
    if block * BLOCK_M2 < seqlen_q:
        for g in range(group):
            dq_program(block, batch, kv_head * group + g, q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr,
                       dq_ptr, lse2_ptr, lse2_ptr,
                       stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                       stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                       stride_dqb, stride_dqm, stride_dqh, 0, 0,
                       seqlen_q, seqlen_k, seqlen_q, seqlen_k, 0, heads, group, head_dim, qk_scale, 0.0,
                       softmax_scale, -1, 0, 0.0, False, False, CAUSAL, False, False, False, EVEN_M2, EVEN_N2, EVEN_D,
                       PRECISION, BLOCK_M2, BLOCK_N2, BLOCK_D)


@triton.jit
def dkdv_query_blocks_atomic_dq(dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptrs, delta_ptrs, dq_ptrs, lo, hi,
                                mask_until, offs_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim,
                                causal_offset, qk_scale, softmax_scale, stride_qm, stride_dom, stride_dqm,
                                CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                                EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """:func:`.backward.dkdv_query_blocks` that also adds each tile's share of dq, scale * dS K,
    into a float32 buffer with atomics."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
        if EVEN_M and EVEN_D:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        else:
            q = tl.load(q_ptrs, mask=row_mask, other=0.0)
            do = tl.load(do_ptrs, mask=row_mask, other=0.0)
        lse2 = tl.load(lse2_ptrs, mask=rows < seqlen_q, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=rows < seqlen_q, other=0.0)
        p_t = tl.exp2(mm(k, tl.trans(q), PRECISION) * qk_scale - lse2[None, :])
        if CAUSAL:
            if start_m < mask_until:
                p_t = tl.where(offs_n[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
        if not EVEN_N:  # keys past the end: their dS feeds dq here, so their P must be 0, not exp2(-lse2)
            p_t = tl.where(offs_n[:, None] < seqlen_k, p_t, 0.0)
        dv += mm(p_t.to(do.dtype), do, PRECISION)
        dp_t = mm(v, tl.trans(do), PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += mm(ds_t, q, PRECISION)
        tl.atomic_add(dq_ptrs, mm(tl.trans(ds_t), k, PRECISION) * softmax_scale, mask=row_mask)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        dq_ptrs += BLOCK_M * stride_dqm
        lse2_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def attention_bwd_atomic_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse2_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                                stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                                stride_dqb, stride_dqm, stride_dqh, stride_dkb, stride_dkn, stride_dkh,
                                stride_dvb, stride_dvn, stride_dvh,
                                seqlen_q, seqlen_k, heads, kv_heads, head_dim, qk_scale, softmax_scale,
                                CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                                EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (key blocks, batch * kv_heads): the dK/dV program of :func:`.backward.dkdv_program`,
    its loop adding into dq (float32, zeroed) as it goes."""
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    group = heads // kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    causal_offset = seqlen_k - seqlen_q
    key_rows = start_n.to(tl.int64) + tl.arange(0, BLOCK_N)[:, None]
    key_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh + key_rows * stride_kn + offs_d[None, :],
                mask=key_mask, other=0.0)
    v = tl.load(v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh + key_rows * stride_vn + offs_d[None, :],
                mask=key_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        lo = tl.maximum(0, start_n - causal_offset) // BLOCK_M * BLOCK_M
        mask_until = start_n + BLOCK_N - 1 - causal_offset
    else:
        lo = 0
        mask_until = 0
    for g in range(group):
        head = kv_head * group + g
        row_tile = lo.to(tl.int64) + tl.arange(0, BLOCK_M)[:, None]
        q_ptrs = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh + row_tile * stride_qm + offs_d[None, :]
        do_ptrs = (dout_ptr + batch.to(tl.int64) * stride_dob + head * stride_doh + row_tile * stride_dom
                   + offs_d[None, :])
        dq_ptrs = dq_ptr + batch.to(tl.int64) * stride_dqb + head * stride_dqh + row_tile * stride_dqm + offs_d[None, :]
        lse2_ptrs = lse2_ptr + (batch * heads + head).to(tl.int64) * seqlen_q + lo + offs_m
        delta_ptrs = delta_ptr + (batch * heads + head).to(tl.int64) * seqlen_q + lo + offs_m
        dk, dv = dkdv_query_blocks_atomic_dq(
            dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptrs, delta_ptrs, dq_ptrs, lo, seqlen_q, mask_until,
            offs_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim, causal_offset, qk_scale, softmax_scale,
            stride_qm, stride_dom, stride_dqm,
            CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N, EVEN_D=EVEN_D, PRECISION=PRECISION, BLOCK_M=BLOCK_M)
    tl.store(dk_ptr + batch.to(tl.int64) * stride_dkb + kv_head * stride_dkh + key_rows * stride_dkn + offs_d[None, :],
             (dk * softmax_scale).to(dk_ptr.dtype.element_ty), mask=key_mask)
    tl.store(dv_ptr + batch.to(tl.int64) * stride_dvb + kv_head * stride_dvh + key_rows * stride_dvn + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=key_mask)


def attention_backward_fused(q, k, v, out, lse, dout, *, causal, softmax_scale, config=None):
    """The production backward's arguments and results, in one launch (:func:`attention_bwd_fused_kernel`).
    It uses both tilings of :func:`.backward.backward_config` with the warps and stages of "dkdv"."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    cfg = config or backward_config(head_dim, q.dtype)
    launch = dict(cfg["dkdv"])
    bn, bm = launch.pop("BLOCK_N"), launch.pop("BLOCK_M")
    bm2, bn2 = cfg["dq"]["BLOCK_M"], cfg["dq"]["BLOCK_N"]
    block_d = block_size(head_dim)
    delta, lse2 = backward_preprocess(out, dout, lse)
    dq = outputs.empty(q.shape, q.dtype, q.device)
    dk = outputs.empty(k.shape, k.dtype, k.device)
    dv = outputs.empty(v.shape, v.dtype, v.device)
    grid = (max(cdiv(seqlen_k, bn), cdiv(seqlen_q, bm2)), batch * kv_heads)
    attention_bwd_fused_kernel[grid](
        q, k, v, dout, lse2, delta, dq, dk, dv, *batch_row_head_strides(q, k, v, dout, dq, dk, dv),
        seqlen_q, seqlen_k, heads, kv_heads, head_dim, softmax_scale * LOG2E.value, softmax_scale,
        CAUSAL=causal, EVEN_M=seqlen_q % bm == 0, EVEN_N=seqlen_k % bn == 0, EVEN_M2=seqlen_q % bm2 == 0,
        EVEN_N2=seqlen_k % bn2 == 0, EVEN_D=head_dim == block_d, PRECISION=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_M2=bm2, BLOCK_N2=bn2, BLOCK_D=block_d, **launch)
    return dq, dk, dv


def attention_backward_atomic(q, k, v, out, lse, dout, *, causal, softmax_scale, config=None):
    """The production backward's arguments and results, dq by float32 atomics inside the dK/dV
    loop (:func:`attention_bwd_atomic_kernel`, the tiles of "dkdv"); not bitwise reproducible."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    launch = dict((config or backward_config(head_dim, q.dtype))["dkdv"])
    bn, bm = launch.pop("BLOCK_N"), launch.pop("BLOCK_M")
    block_d = block_size(head_dim)
    delta, lse2 = backward_preprocess(out, dout, lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # an accumulator: must start at 0
    dk = outputs.empty(k.shape, k.dtype, k.device)
    dv = outputs.empty(v.shape, v.dtype, v.device)
    attention_bwd_atomic_kernel[(cdiv(seqlen_k, bn), batch * kv_heads)](
        q, k, v, dout, lse2, delta, dq, dk, dv, *batch_row_head_strides(q, k, v, dout, dq, dk, dv),
        seqlen_q, seqlen_k, heads, kv_heads, head_dim, softmax_scale * LOG2E.value, softmax_scale,
        CAUSAL=causal, EVEN_M=seqlen_q % bm == 0, EVEN_N=seqlen_k % bn == 0, EVEN_D=head_dim == block_d,
        PRECISION=dot_precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **launch)
    return dq.to(q.dtype), dk, dv


FOILS = {"fused": attention_backward_fused, "atomic": attention_backward_atomic}
BACKWARDS = ("split", *FOILS)  # "split": the production op


class AttentionVariant(torch.autograd.Function):
    """The production forward pass; the backward pass of the chosen schedule."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, backward):
        out, lse = attention_outputs(q, k, v, softmax_scale, -1, 0 if causal else -1, 0.0, None, 0.0, None)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.backward = softmax_scale, causal, backward
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if q.numel() == 0 or k.numel() == 0:
            grads = attention_gradients(q, k, v, out, lse, grad_out, ctx.softmax_scale, -1, 0 if ctx.causal else -1,
                                        0.0, None, 0.0, None)
        else:
            q, k, v, grad_out = (last_dim_contiguous(t) for t in (q, k, v, grad_out))
            grads = FOILS[ctx.backward](q, k, v, out, lse, grad_out, causal=ctx.causal,
                                        softmax_scale=ctx.softmax_scale)
        return (*grads, None, None, None)


def attention_variant(q, k, v, causal=False, softmax_scale=None, *, backward="split"):
    """:func:`.api.attention` (full or causal) with a choice of backward schedule, for the chapter and
    the benchmark: "split" (the production op itself: dK/dV kernel + dQ kernel), "fused" (one
    kernel, two loops) or "atomic" (dQ by float32 atomics; not bitwise reproducible). Returns out."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}; got {backward!r}")
    if backward == "split":
        return attention(q, k, v, softmax_scale=softmax_scale, causal=causal)
    check_attention_inputs(q, k, v)
    if softmax_scale is not None:
        check_real("softmax_scale", softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return AttentionVariant.apply(q, k, v, scale, bool(causal), backward)
