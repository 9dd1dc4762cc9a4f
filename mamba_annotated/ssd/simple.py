"""Chapter 5's first versions of the SSD kernels: teaching only, checked by the tests, never called by
the production pipeline (:mod:`.forward`, :mod:`.backward`).

Each is one program per (batch, chunk, head) doing one chunk's algebra with ``tl.dot``: contiguous
float32 inputs, one group (B and C shared by all heads), the length a multiple of the chunk Q, no
``seq_idx``, ``D``, ``z`` or bounds masks. ``l`` is the cumulative log-decay inside each chunk
(ℓ in the book), laid out like ``dt`` as (batch, heads, chunks, Q), in natural-log units and float32:
the production kernels take it as two float32 planes in log2 units instead (:mod:`.log_decays`).

* :func:`chunk_state_simple`: S_c = sum_s exp(l_last - l_s) dt_s x_s B_s^T, one matmul;
* :func:`chunk_scan_simple`: y_t = exp(l_t) C_t . H_c + sum_{s<=t} (C_t . B_s) exp(l_t - l_s) dt_s x_s;
* :func:`chunk_scan_dx_simple`: the diagonal block's dx_s = dt_s sum_{t>=s} (C_t . B_s) exp(l_t - l_s) dy_t.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    """``tl.dot`` with exact float32 products ("ieee"), as PyTorch multiplies float32 by default: on a
    GPU a plain ``tl.dot`` of float32 tiles would round its inputs to TF32."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def chunk_state_simple_kernel(x_ptr, b_ptr, dt_ptr, l_ptr, s_ptr, heads, chunks,
                              Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, chunk, head)
    head, chunk, batch = pid % heads, (pid // heads) % chunks, pid // (heads * chunks)
    t = chunk * Q + tl.arange(0, Q)  # the chunk's positions
    x = tl.load(x_ptr + ((batch * chunks * Q + t) * heads + head)[:, None] * P + tl.arange(0, P)[None, :])
    B = tl.load(b_ptr + (batch * chunks * Q + t)[:, None] * N + tl.arange(0, N)[None, :])
    steps = ((batch * heads + head) * chunks + chunk) * Q + tl.arange(0, Q)
    l = tl.load(l_ptr + steps)
    l_last = tl.load(l_ptr + ((batch * heads + head) * chunks + chunk) * Q + Q - 1)
    weight = tl.exp(l_last - l) * tl.load(dt_ptr + steps)  # decay to the chunk's end, times the step
    state = dot(tl.trans(x * weight[:, None]), B)  # (P, Q) @ (Q, N)
    tl.store(s_ptr + (pid * P + tl.arange(0, P))[:, None] * N + tl.arange(0, N)[None, :], state)


@triton.jit
def chunk_scan_simple_kernel(x_ptr, b_ptr, c_ptr, h_ptr, dt_ptr, l_ptr, y_ptr, heads, chunks,
                             Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, chunk, head)
    head, chunk, batch = pid % heads, (pid // heads) % chunks, pid // (heads * chunks)
    t = chunk * Q + tl.arange(0, Q)
    rows = ((batch * chunks * Q + t) * heads + head)[:, None] * P + tl.arange(0, P)[None, :]
    B = tl.load(b_ptr + (batch * chunks * Q + t)[:, None] * N + tl.arange(0, N)[None, :])
    C = tl.load(c_ptr + (batch * chunks * Q + t)[:, None] * N + tl.arange(0, N)[None, :])
    H = tl.load(h_ptr + (pid * P + tl.arange(0, P))[:, None] * N + tl.arange(0, N)[None, :])  # (P, N)
    steps = ((batch * heads + head) * chunks + chunk) * Q + tl.arange(0, Q)
    l, dt = tl.load(l_ptr + steps), tl.load(dt_ptr + steps)
    y = tl.exp(l)[:, None] * dot(C, tl.trans(H))  # the state entering the chunk, read out
    scores = dot(C, tl.trans(B))  # (Q, Q): C_t . B_s
    causal = tl.arange(0, Q)[:, None] >= tl.arange(0, Q)[None, :]
    decay = tl.where(causal, tl.exp(l[:, None] - l[None, :]), 0.0)  # select first: exp may overflow above
    y += dot(scores * decay * dt[None, :], tl.load(x_ptr + rows))  # the diagonal block
    tl.store(y_ptr + rows, y)


@triton.jit
def chunk_scan_dx_simple_kernel(dy_ptr, b_ptr, c_ptr, dt_ptr, l_ptr, dx_ptr, heads, chunks,
                                Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, chunk, head)
    head, chunk, batch = pid % heads, (pid // heads) % chunks, pid // (heads * chunks)
    s = chunk * Q + tl.arange(0, Q)
    rows = ((batch * chunks * Q + s) * heads + head)[:, None] * P + tl.arange(0, P)[None, :]
    B = tl.load(b_ptr + (batch * chunks * Q + s)[:, None] * N + tl.arange(0, N)[None, :])
    C = tl.load(c_ptr + (batch * chunks * Q + s)[:, None] * N + tl.arange(0, N)[None, :])
    steps = ((batch * heads + head) * chunks + chunk) * Q + tl.arange(0, Q)
    l, dt = tl.load(l_ptr + steps), tl.load(dt_ptr + steps)
    scores = dot(B, tl.trans(C))  # (Q, Q), row s, column t: B_s . C_t, the transpose of the forward's
    causal = tl.arange(0, Q)[None, :] >= tl.arange(0, Q)[:, None]  # t >= s
    decay = tl.where(causal, tl.exp(l[None, :] - l[:, None]), 0.0)
    dx = dt[:, None] * dot(scores * decay, tl.load(dy_ptr + rows))  # (Q, Q) @ (Q, P)
    tl.store(dx_ptr + rows, dx)


def simple_shapes(x, l):
    batch, length, heads, P = x.shape
    chunks, Q = l.shape[2], l.shape[3]
    if length != chunks * Q:
        raise ValueError(f"the teaching kernels need the length ({length}) to be chunks x Q ({chunks} x {Q})")
    return batch, heads, chunks, Q, P


def chunk_state_simple(x, B, dt, l):
    """x (batch, L, heads, P), B (batch, L, 1, N), dt and l (batch, heads, chunks, Q): the states
    (batch, chunks, heads, P, N) float32 that each chunk adds, as :func:`.chunk_state.chunk_state`."""
    batch, heads, chunks, Q, P = simple_shapes(x, l)
    states = torch.empty(batch, chunks, heads, P, B.shape[-1], dtype=torch.float32, device=x.device)
    chunk_state_simple_kernel[(batch * chunks * heads,)](x, B, dt, l, states, heads, chunks, Q=Q, P=P, N=B.shape[-1])
    return states


def chunk_scan_simple(x, B, C, states_in, dt, l):
    """The outputs y (batch, L, heads, P) from the states entering each chunk (batch, chunks, heads, P, N)."""
    batch, heads, chunks, Q, P = simple_shapes(x, l)
    y = torch.empty_like(x)
    chunk_scan_simple_kernel[(batch * chunks * heads,)](x, B, C, states_in, dt, l, y, heads, chunks,
                                                        Q=Q, P=P, N=B.shape[-1])
    return y


def chunk_scan_dx_simple(dy, B, C, dt, l):
    """The diagonal blocks' part of dx (batch, L, heads, P), given dy like x."""
    batch, heads, chunks, Q, P = simple_shapes(dy, l)
    dx = torch.empty_like(dy)
    chunk_scan_dx_simple_kernel[(batch * chunks * heads,)](dy, B, C, dt, l, dx, heads, chunks, Q=Q, P=P, N=B.shape[-1])
    return dx
