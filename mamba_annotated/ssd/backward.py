"""Chapter 5: the backward pass, kernel by kernel (no autograd, no input checks).

1. the cumsum again, then dH_c: what chunk c's outputs send to the state entering it
   (chunk_state, FROM_START);
2. state passing, reversed: dS_c and d initial_states;
3. recompute the other forward intermediates (CB, chunk states, states entering each chunk):
   cheaper in memory than saving (batch, chunks, heads, headdim, dstate) float32 states. This
   forward walk also gives the carry's part of d a_last(c), <dS_c, gamma_c H_c>, from its float32
   carry, which is why the reversed walk comes first;
4. dx and the direct d dt (chunk_scan_bwd_dx); dB, dC and d a_t (chunk_scan_bwd_dbc);
5. d a_t -> d dt, dA, d dt_bias through a reverse cumulative sum (dt_backward).
"""

from .chunk_cumsum import chunk_cumsum, dt_backward
from .chunk_scan_bwd import chunk_scan_bwd_dbc, chunk_scan_bwd_dx
from .chunk_state import chunk_cb, chunk_state
from .state_passing import state_passing


def ssd_backward(dy, d_final, x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit,
                 initial_states, seq_idx, reverse_cumsum="kernel"):
    """dy: gradient of y before the gate (like x); d_final: (batch, heads, headdim, dstate) or None.

    Returns a dict of gradients: x, dt, A, B, C, D, dt_bias, initial_states (None where absent).
    """
    length = x.shape[1]
    dA_cumsum, dt_out = chunk_cumsum(dt, A, dt_bias, dt_softplus, dt_limit, chunk_size)
    dH = chunk_state(dy, C, dA_cumsum, dt_out, seq_idx, to_end=False)
    dS, d_initial = state_passing(dH, dA_cumsum, seq_idx, length, d_final, reverse=True)
    del dH
    CB = chunk_cb(C, B, chunk_size)
    states = chunk_state(x, B, dA_cumsum, dt_out, seq_idx, to_end=True)
    states_in, _, d_a_last = state_passing(states, dA_cumsum, seq_idx, length, initial_states,
                                           grad_states=dS, out_dtype=x.dtype)
    del states
    dx, ddt, dD = chunk_scan_bwd_dx(CB, x, dy, B, dS, dA_cumsum, dt_out, D, seq_idx)
    dB, dC, d_a = chunk_scan_bwd_dbc(x, dy, B, C, CB, states_in, dS, dA_cumsum, dt_out, seq_idx)
    d_a[..., -1] += d_a_last
    d_dt, dA, d_bias = dt_backward(dt, A, dt_bias, dt_softplus, dt_limit, dt_out, d_a, ddt, reverse_cumsum)
    return dict(x=dx, dt=d_dt, A=dA.to(A.dtype), B=dB, C=dC, D=dD,
                dt_bias=d_bias.to(dt_bias.dtype) if dt_bias is not None else None,
                initial_states=d_initial.to(initial_states.dtype) if initial_states is not None else None)
