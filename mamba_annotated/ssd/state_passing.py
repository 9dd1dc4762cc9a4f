"""Chapter 5, kernel 4: pass the SSM state from chunk to chunk (chapter 4's blocked carry).

Algorithm
    Forward:  H_0 = initial_states (or 0);  H_{c+1} = gamma_c * H_c + S_c,  gamma_c = exp(a_last(c)),
              emitting H_c (the state entering chunk c) before each update; H_chunks is the final state.
    Backward: the same recurrence walked from the last chunk down, on gradients:
              G_chunks = d final_states (or 0);  emit dS_c = G_{c+1};  G_c = gamma_c * G_{c+1} + dH_c,
              where dH_c is what chunk c's outputs send to the state entering it. G_0 is
              d initial_states. On the way it forms the carry's term of the step gradients,
              <G_{c+1}, gamma_c H_c> (see :mod:`.chunk_scan_bwd`), from the float32 G before it is
              rounded to the emitted dS_c, and from H_0 = initial_states as given (float32 initial
              states are rounded to the inputs' dtype when stored among the H_c): as mamba_ssm
              forms it from float32 states and state gradients. From the rounded pair, at one
              position with float32 initial states, dA's error was 2.8 x mamba_ssm's on an H100
              (sweep seed 72315).
    With seq_idx, gamma_c = 0 when chunk c ends in another sequence than the one the carried state
    belongs to: the sequence of the previous chunk's last position, and for c = 0 the sequence
    with id 0 (mamba_ssm's convention: its carried sequence id starts at 0, so initial_states
    belong to sequence 0). No state crosses a sequence boundary.

Parallelism: one program per (batch, head, BLOCK elements of the headdim x dstate state); the loop
over chunks is sequential, which is cheap because there are only L / Q chunks. Its loads do not
depend on the carry, so they are prefetched a few chunks ahead (``tl.range`` stages).

Shapes: states (batch, chunks, heads, headdim*dstate) float32, emitted in float32 or a 16-bit
dtype; initial_states (batch, heads, headdim, dstate), any strides and float dtype; the final state
(batch, heads, headdim, dstate) in the dtype asked for; the carry's terms (batch, heads, chunks,
blocks) float32, one partial sum per program. Bytes moved: each state read once (4 * headdim *
dstate bytes per chunk and head) and written once (2 or 4 bytes per element); backward, the
stored H_c read once more.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import cdiv, rounded_product
from .log_decays import decay, load_sums


@triton.jit
def load_state(ptr, b, h, e, dstate, stride_b, stride_h, stride_p, stride_n, mask):
    """Elements e of one (batch, head) state given by its strides, in float32."""
    return tl.load(ptr + b.to(tl.int64) * stride_b + h * stride_h + (e // dstate) * stride_p + (e % dstate) * stride_n,
                   mask=mask, other=0.0).to(tl.float32)


@triton.jit
def chunk_end_id(seq_row, c, length, stride_seq_l, CHUNK: tl.constexpr):
    """The sequence id at chunk c's last position; 0 for c < 0 (c = -1: mamba_ssm's convention,
    the carried sequence starts as id 0, so initial_states belong to sequence 0; c = -2: the
    reverse walk's last prefetch, never used) and for c past the last chunk (the forward walk's
    last prefetch, never used)."""
    n_chunks = tl.cdiv(length, CHUNK)
    return tl.load(seq_row + (tl.minimum((c + 1) * CHUNK, length) - 1) * stride_seq_l,
                   mask=(c >= 0) & (c < n_chunks), other=0)


@lean_launch
@triton.jit
def state_passing_kernel(states_ptr, dA_cumsum_ptr, seq_idx_ptr, init_ptr, emitted_ptr, final_ptr,
                         entering_ptr, h0_ptr, carry_ptr,
                         length, heads, n_chunks, dstate, state_size, stride_seq_b, stride_seq_l,
                         stride_init_b, stride_init_h, stride_init_p, stride_init_n,
                         stride_h0_b, stride_h0_h, stride_h0_p, stride_h0_n,
                         REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                         CARRY: tl.constexpr, HAS_H0: tl.constexpr, HAS_FINAL: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr):
    pid_bh, pid_e = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    e = pid_e * BLOCK + tl.arange(0, BLOCK)
    mask = e < state_size
    bh = pid_bh.to(tl.int64) * state_size
    if HAS_INIT:
        H = load_state(init_ptr, b, h, e, dstate, stride_init_b, stride_init_h, stride_init_p, stride_init_n, mask)
    else:
        H = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_H0:  # backward: the initial states as given, for the carry's term of chunk 0
        h0 = load_state(h0_ptr, b, h, e, dstate, stride_h0_b, stride_h0_h, stride_h0_p, stride_h0_n, mask)
    seq_row = seq_idx_ptr + b.to(tl.int64) * stride_seq_b
    if HAS_SEQ_IDX:
        # the ids at the chunks' last positions, end(c), with end(-1) = 0: the state entering chunk
        # c + 1 continues only if end(c) == end(c - 1). Each step holds the pair it needs and loads
        # the one id the next step adds, so the step never waits on a load of its own
        first = n_chunks - 1 if REVERSE else 0
        end_prev = chunk_end_id(seq_row, first - 1, length, stride_seq_l, CHUNK)
        end_this = chunk_end_id(seq_row, first, length, stride_seq_l, CHUNK)
    for i in tl.range(n_chunks, num_stages=3):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        if HAS_SEQ_IDX:
            if REVERSE:
                end_next = chunk_end_id(seq_row, c - 2, length, stride_seq_l, CHUNK)
            else:
                end_next = chunk_end_id(seq_row, c + 1, length, stride_seq_l, CHUNK)
        chunk = ((b * n_chunks + c) * heads + h).to(tl.int64) * state_size
        tl.store(emitted_ptr + chunk + e, H.to(emitted_ptr.dtype.element_ty), mask=mask)
        gamma = decay(*load_sums(dA_cumsum_ptr, pid_bh.to(tl.int64) * n_chunks + c, CHUNK - 1, CHUNK))
        if CARRY:  # <G_{c+1}, gamma_c H_c> over this program's elements, G still float32
            entering = tl.load(entering_ptr + chunk + e, mask=mask, other=0.0).to(tl.float32)
            if HAS_H0:
                entering = tl.where(c == 0, h0, entering)
            carry = gamma * tl.sum(rounded_product(H, entering), axis=0)
        if HAS_SEQ_IDX:
            # a select, not gamma = 0: the state carried out of another sequence may hold a NaN
            continues = end_this == end_prev
            H = tl.where(continues, gamma * H, 0.0)
            if CARRY:
                carry = tl.where(continues, carry, 0.0)
            if REVERSE:
                end_this, end_prev = end_prev, end_next
            else:
                end_prev, end_this = end_this, end_next
        else:
            H = gamma * H
        if CARRY:
            tl.store(carry_ptr + (pid_bh.to(tl.int64) * n_chunks + c) * tl.num_programs(1) + pid_e, carry)
        H += tl.load(states_ptr + chunk + e, mask=mask, other=0.0)
    if HAS_FINAL:
        tl.store(final_ptr + bh + e, H.to(final_ptr.dtype.element_ty), mask=mask)


BLOCK = 256  # many programs: each walks every chunk in turn, so latency, not bandwidth, binds


def launch(states, dA_cumsum, *, length, seq_idx, initial, reverse, out_dtype, final_dtype, entering=None,
           h0=None):
    """One pass of the carry (see the module docstring); returns (emitted, final, carry or None).
    ``final_dtype`` None: no final state is allocated or stored (final is None)."""
    batch, n_chunks, heads, headdim, dstate = states.shape
    state_size = headdim * dstate
    blocks = cdiv(state_size, BLOCK)
    emitted = outputs.empty(states.shape, out_dtype, states.device)
    final = outputs.empty((batch, heads, headdim, dstate), final_dtype, states.device) if final_dtype else None
    carry = outputs.empty((batch, heads, n_chunks, blocks), torch.float32, states.device) if entering is not None \
        else None
    state_passing_kernel[(batch * heads, blocks)](
        states, dA_cumsum, seq_idx if seq_idx is not None else dA_cumsum,
        initial if initial is not None else states, emitted, final if final is not None else emitted,
        entering if entering is not None else states, h0 if h0 is not None else states,
        carry if carry is not None else emitted,
        length, heads, n_chunks, dstate, state_size,
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        *(initial.stride() if initial is not None else (0, 0, 0, 0)),
        *(h0.stride() if h0 is not None else (0, 0, 0, 0)),
        REVERSE=reverse, HAS_INIT=initial is not None, HAS_SEQ_IDX=seq_idx is not None,
        CARRY=entering is not None, HAS_H0=h0 is not None, HAS_FINAL=final is not None, CHUNK=dA_cumsum.shape[-1],
        BLOCK=BLOCK, num_warps=4,
    )
    return emitted, final, carry


def state_passing(states, dA_cumsum, *, length, seq_idx=None, initial=None, out_dtype=torch.float32,
                  final_dtype=torch.float32):
    """The forward carry. states (batch, chunks, heads, headdim, dstate) float32, contiguous;
    initial: initial_states or None.

    Returns (H_c, the states entering each chunk, in ``out_dtype``: the inputs' 16-bit dtype where
    the kernels that read them round them to it anyway, or the state dtype asked for; the final
    state, in ``final_dtype``, or None where ``final_dtype`` is None: a forward pass whose caller
    does not ask for it neither allocates nor stores it). The carry itself stays float32.
    """
    emitted, final, _ = launch(states, dA_cumsum, length=length, seq_idx=seq_idx, initial=initial, reverse=False,
                               out_dtype=out_dtype, final_dtype=final_dtype)
    return emitted, final


def state_passing_backward(dH, dA_cumsum, states_in, *, length, seq_idx=None, d_final=None, initial_states=None,
                           out_dtype=torch.float32):
    """The carry walked back. dH (batch, chunks, heads, headdim, dstate) float32, contiguous: what
    each chunk's outputs send to the state entering it; states_in: the forward's H_c (contiguous);
    d_final: the gradient of the final states or None; initial_states as the forward got them.

    Returns (dS_c per chunk in ``out_dtype``, d initial_states in float32 (None without initial
    states), the carry's term of the step gradients per (batch, head, chunk) in partial sums of
    :data:`BLOCK` elements, float32).
    """
    return launch(dH, dA_cumsum, length=length, seq_idx=seq_idx, initial=d_final, reverse=True,
                  out_dtype=out_dtype, final_dtype=torch.float32 if initial_states is not None else None,
                  entering=states_in, h0=initial_states)
