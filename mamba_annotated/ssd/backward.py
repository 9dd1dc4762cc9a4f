"""Chapter 5: the backward pass, kernel by kernel (no autograd, no input checks).

It starts from what the forward pass saved: the cumulative decays a and steps dt', C.B inside each
chunk and H_c, the state entering each chunk (in the inputs' dtype: half the size of x at dstate
128 and chunk 256). Recomputing them instead (as mamba_ssm does) would cost a chunk-state and a
state-passing pass; keeping them costs less memory than the float32 chunk states that recomputing
them would allocate.

1. dH_c: what chunk c's outputs send to the state entering it (chunk_state, FROM_START);
2. state passing, reversed: dS_c (in the inputs' dtype: the matmuls that read it round it to that),
   d initial_states, and the carry's term of the step gradients (from the float32 state gradients
   and the initial states as given);
3. dx and the direct d dt (chunk_scan_bwd_dx); dB, dC and the step gradients' terms in slots
   (chunk_scan_bwd_dbc);
4. the slots -> d(dt' A) through in-register cumulative sums -> d dt, dA, d dt_bias (dt_backward).

No step adds with atomics, so the gradients are the same bits on every run
(:mod:`.chunk_scan_bwd` says how).
"""
import math

from .chunk_cumsum import dt_backward
from .chunk_scan_bwd import DecayGradients, chunk_scan_bwd_dbc, chunk_scan_bwd_dx
from .chunk_state import chunk_state
from .state_passing import state_passing_backward


def chunk_gradients(dy, x, B, C, saved, *, D=None, initial_states=None, seq_idx=None, d_final=None, sum_D=True):
    """Steps 1-3: a dict of the gradients of x, B, C, D and initial_states (None where absent; D's
    too with ``sum_D`` False, the gate's backward having summed it), and the
    :class:`~.chunk_scan_bwd.DecayGradients` that step 4 turns into those of dt, A, dt_bias."""
    dA_cumsum, dt_out = saved.dA_cumsum, saved.dt_out
    dH = chunk_state(dy, C, dA_cumsum, dt_out, seq_idx=seq_idx, to_end=False)
    dS, d_initial, carry = state_passing_backward(dH, dA_cumsum, saved.states_in, length=x.shape[1],
                                                  seq_idx=seq_idx, d_final=d_final, initial_states=initial_states,
                                                  out_dtype=x.dtype)
    del dH
    dx, d_step, dD = chunk_scan_bwd_dx(saved.CB, x, dy, B, dS, dA_cumsum, dt_out, D=D, seq_idx=seq_idx, sum_D=sum_D)
    dB, dC, (pairs, from_start, to_end) = chunk_scan_bwd_dbc(x, dy, B, C, saved.CB, saved.states_in, dS, dA_cumsum,
                                                             dt_out, seq_idx=seq_idx,
                                                             has_initial_states=initial_states is not None)
    grads = dict(x=dx, B=dB, C=dC, D=dD,
                 initial_states=d_initial.to(initial_states.dtype) if initial_states is not None else None)
    return grads, DecayGradients(d_step, pairs, from_start, to_end, carry)


def step_gradients_by_name(d_dt, dA, d_bias, A, dt_bias):
    return dict(dt=d_dt, A=dA.to(A.dtype), dt_bias=d_bias.to(dt_bias.dtype) if dt_bias is not None else None)


def ssd_backward(dy, x, dt, A, B, C, saved, *, D=None, dt_bias=None, initial_states=None, seq_idx=None,
                 d_final=None, dt_softplus=False, dt_limit=(0.0, math.inf), sum_D=True):
    """dy: gradient of y before the gate (like x, any strides); d_final: gradient of the final
    states or None; saved: what the forward pass kept (:class:`~.forward.Saved`); ``sum_D`` False
    where the gate's backward sums dD (:mod:`.gate`).

    Returns a dict of gradients: x, dt, A, B, C, D, dt_bias, initial_states (None where absent),
    each in its input's shape and dtype, contiguous.
    """
    grads, decay = chunk_gradients(dy, x, B, C, saved, D=D, initial_states=initial_states, seq_idx=seq_idx,
                                   d_final=d_final, sum_D=sum_D)
    step = dt_backward(dt, A, saved.dt_out, decay, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    return {**grads, **step_gradients_by_name(*step, A, dt_bias)}
