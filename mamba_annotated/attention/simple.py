"""Chapter 7's first versions of the attention kernels: teaching only, checked by the tests, never
called by :func:`.api.attention`.

Contiguous (batch * heads, L, d) tensors, as many key/value heads as query heads, L_q = L_k = L a
multiple of the block, d a power of two, natural exponentials, no strides, bounds masks or autotuning.

* :func:`attention_forward_simple`: one program per (batch * head, query block) sweeps the key
  blocks with the online softmax and returns O and the log-sum-exp of every row;
* :func:`attention_dkdv_simple`: one program per (batch * head, key block) walks every query block
  and sums dK and dV, rebuilding P = exp(S - lse) from the saved lse;
* :func:`attention_dq_simple`: one program per (batch * head, query block) walks the key blocks.
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """``tl.dot`` with exact float32 products ("ieee"), as PyTorch multiplies float32 by default: on a
    GPU a plain ``tl.dot`` of float32 tiles would round its inputs to TF32."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def attention_forward_simple_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, L, scale,
                                    CAUSAL: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    bh, start = tl.program_id(0), tl.program_id(1) * BLOCK  # (batch * head, query block)
    rows = start + tl.arange(0, BLOCK)
    tile = (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :]
    q = tl.load(q_ptr + tile) * scale  # the scale folded into q once
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # running maximum of each row
    l = tl.zeros([BLOCK], tl.float32)  # running sum of exp(s - m)
    acc = tl.zeros([BLOCK, D], tl.float32)  # running sum of exp(s - m) v
    for key_start in range(0, start + BLOCK if CAUSAL else L, BLOCK):  # causal: no block right of ours
        keys = key_start + tl.arange(0, BLOCK)
        kv = (bh * L + keys)[:, None] * D + tl.arange(0, D)[None, :]
        s = dot(q, tl.trans(tl.load(k_ptr + kv)))  # (BLOCK queries, BLOCK keys)
        if CAUSAL:
            s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new[:, None])  # rescale the old sums, weigh the new keys
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + dot(p, tl.load(v_ptr + kv))
        m = m_new
    tl.store(o_ptr + tile, acc / l[:, None])
    tl.store(lse_ptr + bh * L + rows, m + tl.log(l))


@triton.jit
def attention_dkdv_simple_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, L, scale,
                                 CAUSAL: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    bh, start = tl.program_id(0), tl.program_id(1) * BLOCK  # (batch * head, key block)
    keys = start + tl.arange(0, BLOCK)
    tile = (bh * L + keys)[:, None] * D + tl.arange(0, D)[None, :]
    k, v = tl.load(k_ptr + tile), tl.load(v_ptr + tile)  # kept in registers for the whole walk
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    for query_start in range(start if CAUSAL else 0, L, BLOCK):  # causal: no query block above ours
        rows = query_start + tl.arange(0, BLOCK)
        qo = (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :]
        q, do = tl.load(q_ptr + qo), tl.load(do_ptr + qo)
        lse, delta = tl.load(lse_ptr + bh * L + rows), tl.load(delta_ptr + bh * L + rows)
        p = tl.exp(scale * dot(q, tl.trans(k)) - lse[:, None])  # P rebuilt from the saved lse
        if CAUSAL:
            p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
        dv += dot(tl.trans(p), do)  # dV = P^T dO
        ds = p * (dot(do, tl.trans(v)) - delta[:, None])  # dS = P (dP - rowsum(dO o O))
        dk += scale * dot(tl.trans(ds), q)  # dK = scale dS^T Q
    tl.store(dk_ptr + tile, dk)
    tl.store(dv_ptr + tile, dv)


@triton.jit
def attention_dq_simple_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, L, scale,
                               CAUSAL: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    bh, start = tl.program_id(0), tl.program_id(1) * BLOCK  # (batch * head, query block)
    rows = start + tl.arange(0, BLOCK)
    tile = (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :]
    q, do = tl.load(q_ptr + tile), tl.load(do_ptr + tile)
    lse, delta = tl.load(lse_ptr + bh * L + rows), tl.load(delta_ptr + bh * L + rows)
    dq = tl.zeros([BLOCK, D], tl.float32)
    for key_start in range(0, start + BLOCK if CAUSAL else L, BLOCK):
        keys = key_start + tl.arange(0, BLOCK)
        kv = (bh * L + keys)[:, None] * D + tl.arange(0, D)[None, :]
        k = tl.load(k_ptr + kv)
        p = tl.exp(scale * dot(q, tl.trans(k)) - lse[:, None])
        if CAUSAL:
            p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
        ds = p * (dot(do, tl.trans(tl.load(v_ptr + kv))) - delta[:, None])
        dq += scale * dot(ds, k)  # dQ = scale dS K
    tl.store(dq_ptr + tile, dq)


def heads_first(t):
    """(batch, L, heads, d) -> contiguous (batch * heads, L, d), the teaching kernels' layout."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()


def check_simple(q, block):
    L, d = q.shape[1], q.shape[-1]
    if L % block or d & (d - 1) or d < 16:
        raise ValueError(f"the teaching kernels need L ({L}) a multiple of {block} and d ({d}) a power of two >= 16")


def attention_forward_simple(q, k, v, causal=False, block=16):
    """q, k, v (batch, L, heads, d) float32: O like q and lse (batch, heads, L), as attention_ref."""
    check_simple(q, block)
    batch, L, heads, d = q.shape
    o = torch.empty(batch * heads, L, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch * heads, L, dtype=torch.float32, device=q.device)
    attention_forward_simple_kernel[(batch * heads, L // block)](
        heads_first(q), heads_first(k), heads_first(v), o, lse, L, 1.0 / math.sqrt(d), CAUSAL=causal, BLOCK=block, D=d)
    return o.reshape(batch, heads, L, d).transpose(1, 2), lse.reshape(batch, heads, L)


def attention_backward_simple(q, k, v, o, lse, do, causal=False, block=16):
    """dq, dk, dv (like q) from the forward's o and lse and the upstream gradient do."""
    check_simple(q, block)
    batch, L, heads, d = q.shape
    delta = (do.double() * o.double()).sum(-1).transpose(1, 2).float().contiguous()  # rowsum(dO o O), (b, h, L)
    q_, k_, v_, do_, lse_ = heads_first(q), heads_first(k), heads_first(v), heads_first(do), lse.contiguous()
    dq, dk, dv = (torch.empty_like(q_) for _ in range(3))
    grid, scale = (batch * heads, L // block), 1.0 / math.sqrt(d)
    attention_dkdv_simple_kernel[grid](q_, k_, v_, do_, lse_, delta, dk, dv, L, scale, CAUSAL=causal, BLOCK=block, D=d)
    attention_dq_simple_kernel[grid](q_, k_, v_, do_, lse_, delta, dq, L, scale, CAUSAL=causal, BLOCK=block, D=d)
    return tuple(t.reshape(batch, heads, L, d).transpose(1, 2) for t in (dq, dk, dv))
