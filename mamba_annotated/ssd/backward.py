"""Chapter 5: the backward pass, kernel by kernel (no autograd, no input checks).

It starts from what the forward pass saved: the cumulative decays a and steps dt', C.B inside each
chunk and H_c, the state entering each chunk (in the inputs' dtype: half the size of x at dstate
128 and chunk 256). Recomputing them instead (as mamba_ssm does) would cost a chunk-state and a
state-passing pass; keeping them costs less memory than the float32 chunk states that recomputing
them would allocate.

1. dH_c: what chunk c's outputs send to the state entering it (chunk_state, FROM_START);
2. state passing, reversed: dS_c (in the inputs' dtype: the matmuls that read it round it to that)
   and d initial_states;
3. dx and the direct d dt (chunk_scan_bwd_dx); dB, dC and d a_t (chunk_scan_bwd_dbc);
4. d a_t -> d dt, dA, d dt_bias through a reverse cumulative sum (dt_backward).
"""

from .chunk_cumsum import dt_backward
from .chunk_scan_bwd import chunk_scan_bwd_dbc, chunk_scan_bwd_dx
from .chunk_state import chunk_state
from .state_passing import state_passing


def ssd_backward(dy, d_final, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx,
                 saved, reverse_cumsum="kernel"):
    """dy: gradient of y before the gate (like x); d_final: (batch, heads, headdim, dstate) or None;
    saved: what the forward pass kept (:class:`~.forward.Saved`).

    Returns a dict of gradients: x, dt, A, B, C, D, dt_bias, initial_states (None where absent).
    """
    dA_cumsum, dt_out = saved.dA_cumsum, saved.dt_out
    dH = chunk_state(dy, C, dA_cumsum, dt_out, seq_idx, to_end=False)
    dS, d_initial = state_passing(dH, dA_cumsum, seq_idx, x.shape[1], d_final, reverse=True, out_dtype=x.dtype)
    del dH
    dx, ddt, dD = chunk_scan_bwd_dx(saved.CB, x, dy, B, dS, dA_cumsum, dt_out, D, seq_idx)
    dB, dC, d_a = chunk_scan_bwd_dbc(x, dy, B, C, saved.CB, saved.states_in, dS, dA_cumsum, dt_out, seq_idx)
    d_dt, dA, d_bias = dt_backward(dt, A, dt_bias, dt_softplus, dt_limit, dt_out, d_a, ddt, reverse_cumsum)
    return dict(x=dx, dt=d_dt, A=dA.to(A.dtype), B=dB, C=dC, D=dD,
                dt_bias=d_bias.to(dt_bias.dtype) if dt_bias is not None else None,
                initial_states=d_initial.to(initial_states.dtype) if initial_states is not None else None)
