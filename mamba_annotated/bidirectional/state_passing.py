"""Chapter 6, kernel 4: pass both directions' states from chunk to chunk, in one launch.

Algorithm (chapter 5's blocked carry, :mod:`mamba_annotated.ssd.state_passing`, twice):
    forward states, left to right:   H_0 = 0;      H_{c+1}  = exp(a_last(c)) H_c     + S_c
    reverse states, right to left:   H'_last = 0;  H'_{c-1} = exp(b_last(c)) H'_c    + S'_c
emitting the state entering each chunk before each update. The backward pass (``grad``) walks each
direction the other way on the gradients dH, dH' and emits dS_c (the gradient of S_c, that is of
H_{c+1}) and dS'_c (that of H'_{c-1}), and on the way the carries' terms of the step gradients,
<dS_c, gamma_c H_c> and <dS'_c, gamma'_c H'_c>, from the float32 gradients before they are
rounded to the emitted dtype (chapter 5's state passing does the same). With seq_idx, the carry through chunk c is dropped when c
ends in another sequence than the one of the position before it (each state belongs to the
sequence of the last position of the chunk it enters; :mod:`.chunk_states`): no state crosses a
boundary, in either direction.

Parallelism: one program per (direction, batch, head, BLOCK elements of the state); its loop over
chunks is sequential. The two directions share one grid, so their walks run side by side: the
loop is bound by latency, not bandwidth, and two launches would run one after the other.

Shapes: states (2, batch, chunks, heads, headdim, dstate) float32, forward then reverse; emitted
the same, in the dtype asked for (x's: the kernels that read them round them to it anyway); the
carries' terms (2, batch, heads, chunks, blocks) float32, one partial sum per program. Bytes moved:
each state read once and written once; backward, the stored states read once more.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import cdiv, rounded_product


@lean_launch
@triton.jit
def state_passing_kernel(states_ptr, a_ptr, b_ptr, seq_idx_ptr, emitted_ptr, entering_ptr, carry_ptr, length,
                         batch_heads, heads, n_chunks, state_size, direction_size, stride_seq_b, stride_seq_l,
                         GRAD: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    direction = tl.program_id(0) // batch_heads  # 0: the forward states, 1: the reverse ones
    pid_bh = tl.program_id(0) % batch_heads
    b, h = pid_bh // heads, pid_bh % heads
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < state_size
    right_to_left = direction != GRAD
    base = direction.to(tl.int64) * direction_size
    seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
    H = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(n_chunks, num_stages=3):
        c = tl.where(right_to_left, n_chunks - 1 - i, i)
        chunk = base + ((b * n_chunks + c) * heads + h).to(tl.int64) * state_size
        tl.store(emitted_ptr + chunk + e, H.to(emitted_ptr.dtype.element_ty), mask=mask)
        last = (pid_bh.to(tl.int64) * n_chunks + c) * CHUNK + CHUNK - 1
        gamma = tl.exp(tl.where(direction == 0, tl.load(a_ptr + last), tl.load(b_ptr + last)))
        if HAS_SEQ_IDX:
            seq_end = tl.load(seq_row + (tl.minimum((c + 1) * CHUNK, length) - 1) * stride_seq_l)
            seq_before = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
            # a select, not gamma = 0: the state carried out of another sequence may hold a NaN
            gamma = tl.where(seq_end == seq_before, gamma, 0.0)
        if GRAD:  # the carry's term: <the state gradient, still float32, gamma H entering chunk c>
            entering = tl.load(entering_ptr + chunk + e, mask=mask, other=0.0).to(tl.float32)
            carry = tl.sum(rounded_product(H, entering), axis=0)
            if HAS_SEQ_IDX:
                carry = tl.where(seq_end == seq_before, gamma * carry, 0.0)
            else:
                carry = gamma * carry
            blocks = tl.num_programs(1)
            tl.store(carry_ptr + direction.to(tl.int64) * batch_heads * n_chunks * blocks
                     + (pid_bh.to(tl.int64) * n_chunks + c) * blocks + tl.program_id(1), carry)
        if HAS_SEQ_IDX:
            H = tl.where(seq_end == seq_before, gamma * H, 0.0)
        else:
            H = gamma * H
        H += tl.load(states_ptr + chunk + e, mask=mask, other=0.0)


BLOCK = 256  # many programs: each walks every chunk in turn, so latency, not bandwidth, binds


def launch(states, a, b, *, length, seq_idx, out_dtype, entering=None):
    _, batch, n_chunks, heads, headdim, dstate = states.shape
    state_size = headdim * dstate
    blocks = cdiv(state_size, BLOCK)
    emitted = outputs.empty(states.shape, out_dtype, states.device)
    carry = outputs.empty((2, batch, heads, n_chunks, blocks), torch.float32, states.device) \
        if entering is not None else None
    state_passing_kernel[(2 * batch * heads, blocks)](
        states, a, b, seq_idx if seq_idx is not None else a, emitted, entering if entering is not None else states,
        carry if carry is not None else a, length, batch * heads, heads, n_chunks, state_size, states[0].numel(),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        GRAD=int(entering is not None), HAS_SEQ_IDX=seq_idx is not None, CHUNK=a.shape[-1], BLOCK=BLOCK, num_warps=4,
    )
    return emitted, carry


def state_passing(states, a, b, *, length, seq_idx=None, out_dtype=torch.float32):
    """Both directions' carries: states (2, batch, chunks, heads, headdim, dstate) float32,
    contiguous; a, b the two directions' cumulative decays. Returns H and H' (the states entering
    each chunk from the left and the right), the same shape, in ``out_dtype``."""
    return launch(states, a, b, length=length, seq_idx=seq_idx, out_dtype=out_dtype)[0]


def state_passing_backward(dH, a, b, states_in, *, length, seq_idx=None, out_dtype=torch.float32):
    """Both carries walked back on dH, dH' (as ``states`` above); states_in: the forward's H, H'.
    Returns (dS and dS', the same shape, in ``out_dtype``; the carries' terms of the step gradients
    (2, batch, heads, chunks, blocks) float32, partial sums of :data:`BLOCK` elements)."""
    return launch(dH, a, b, length=length, seq_idx=seq_idx, out_dtype=out_dtype, entering=states_in)
