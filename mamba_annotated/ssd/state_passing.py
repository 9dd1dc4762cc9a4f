"""Chapter 5, kernel 4: pass the SSM state from chunk to chunk (chapter 4's blocked carry).

Algorithm
    Forward:  H_0 = initial_states (or 0);  H_{c+1} = gamma_c * H_c + S_c,  gamma_c = exp(a_last(c)),
              emitting H_c (the state entering chunk c) before each update; H_chunks is the final state.
    Backward: the same recurrence walked from the last chunk down, on gradients:
              G_chunks = d final_states (or 0);  emit dS_c = G_{c+1};  G_c = gamma_c * G_{c+1} + dH_c,
              where dH_c is what chunk c's outputs send to the state entering it. G_0 is
              d initial_states.
    With seq_idx, gamma_c = 0 when chunk c ends in another sequence than the one the carried state
    belongs to: the sequence of the previous chunk's last position, and for c = 0 the sequence
    with id 0 (mamba_ssm's convention: its carried sequence id starts at 0, so initial_states
    belong to sequence 0). No state crosses a sequence boundary.

Parallelism: one program per (batch, head, BLOCK elements of the headdim x dstate state); the loop
over chunks is sequential, which is cheap because there are only L / Q chunks. Its loads do not
depend on the carry, so they are prefetched a few chunks ahead (``tl.range`` stages).

Shapes: states (batch, chunks, heads, headdim*dstate) float32, emitted in float32 or a 16-bit
dtype; initial_states (batch, heads, headdim, dstate), any strides and float dtype; the final state
(batch, heads, headdim, dstate) in the dtype asked for. Bytes moved: each state read once
(4 * headdim * dstate bytes per chunk and head) and written once (2 or 4 bytes per element).
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import cdiv


@lean_launch
@triton.jit
def state_passing_kernel(states_ptr, dA_cumsum_ptr, seq_idx_ptr, init_ptr, emitted_ptr, final_ptr,
                         length, heads, n_chunks, dstate, state_size, stride_seq_b, stride_seq_l,
                         stride_init_b, stride_init_h, stride_init_p, stride_init_n,
                         REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid_bh, pid_e = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    e = pid_e * BLOCK + tl.arange(0, BLOCK)
    mask = e < state_size
    bh = pid_bh.to(tl.int64) * state_size
    if HAS_INIT:
        H = tl.load(init_ptr + b.to(tl.int64) * stride_init_b + h * stride_init_h + (e // dstate) * stride_init_p
                    + (e % dstate) * stride_init_n, mask=mask, other=0.0).to(tl.float32)
    else:
        H = tl.zeros([BLOCK], dtype=tl.float32)
    seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
    for i in tl.range(n_chunks, num_stages=3):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        chunk = ((b * n_chunks + c) * heads + h).to(tl.int64) * state_size
        tl.store(emitted_ptr + chunk + e, H.to(emitted_ptr.dtype.element_ty), mask=mask)
        gamma = tl.exp(tl.load(dA_cumsum_ptr + (pid_bh.to(tl.int64) * n_chunks + c) * CHUNK + CHUNK - 1))
        if HAS_SEQ_IDX:
            seq_end = tl.load(seq_row + (tl.minimum((c + 1) * CHUNK, length) - 1) * stride_seq_l)
            seq_carry = tl.load(seq_row + (c * CHUNK - 1) * stride_seq_l, mask=c > 0, other=0)
            # a select, not gamma = 0: the state carried out of another sequence may hold a NaN
            H = tl.where(seq_end == seq_carry, gamma * H, 0.0)
        else:
            H = gamma * H
        H += tl.load(states_ptr + chunk + e, mask=mask, other=0.0)
    tl.store(final_ptr + bh + e, H.to(final_ptr.dtype.element_ty), mask=mask)


def state_passing(states, dA_cumsum, *, length, seq_idx=None, initial=None, reverse=False,
                  out_dtype=torch.float32, final_dtype=torch.float32):
    """Run the carry over chunks. states (batch, chunks, heads, headdim, dstate) float32, contiguous.

    The emitted states are stored in ``out_dtype``: the inputs' 16-bit dtype where the kernels that
    read them round them to it anyway (the chunk scan's H_c, the backward's dS_c), or the state
    dtype asked for; the carry stays float32. The last state is stored in ``final_dtype``.

    Forward (``reverse=False``, initial = initial_states or None): returns (H_in per chunk, final state).
    Backward (``reverse=True``, states = dH per chunk, initial = d final_states or None):
    returns (dS per chunk, d initial_states).
    """
    batch, n_chunks, heads, headdim, dstate = states.shape
    state_size = headdim * dstate
    block = 256  # many programs: each walks every chunk in turn, so latency, not bandwidth, binds
    emitted = outputs.empty(states.shape, out_dtype, states.device)
    final = outputs.empty((batch, heads, headdim, dstate), final_dtype, states.device)
    state_passing_kernel[(batch * heads, cdiv(state_size, block))](
        states, dA_cumsum, seq_idx if seq_idx is not None else dA_cumsum,
        initial if initial is not None else states, emitted, final,
        length, heads, n_chunks, dstate, state_size,
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        *(initial.stride() if initial is not None else (0, 0, 0, 0)),
        REVERSE=reverse, HAS_INIT=initial is not None, HAS_SEQ_IDX=seq_idx is not None,
        CHUNK=dA_cumsum.shape[-1], BLOCK=block, num_warps=4,
    )
    return emitted, final
