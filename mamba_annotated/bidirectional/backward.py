"""Chapter 6: the fused backward pass, both directions on one chunk grid (no autograd, no checks).

It starts from what the forward pass saved (:class:`~.forward.Saved`): the cumulative decays and
steps of both directions, the scores G (and Gd) of the diagonal blocks, and the states H, H'
entering each chunk from the left and from the right (the inputs' dtype).

1. dH, dH': what each chunk's outputs send to the two states that reach it, one kernel
   (:func:`.chunk_states.chunk_states` with ``grad``);
2. the state passing, each direction walked the other way, both in one launch: dS, dS';
3. dx, the direct step gradients and dD (one kernel); dG and the pair sums of the decay gradients
   (one kernel); dB, dC (and dB', dC') with the state terms of the decay gradients (one
   kernel) (:mod:`.chunk_scan_bwd`); with the shift, dC and dC' one row over (:func:`queries_to_rows`);
4. the gradients of dt, dt_rev, A, dt_bias (:mod:`.step_backward`).

No step adds with atomics: the gradients are the same bits on every run.
"""
import math

import torch

from .chunk_scan_bwd import DecaySlots, chunk_scan_bwd_dbc, chunk_scan_bwd_dx
from .chunk_states import chunk_states
from .state_passing import state_passing_backward
from .step_backward import step_backward


def queries_to_rows(d_query, d_query_rev, C, C_rev):
    """With the shift, row t reads C_{t-1} forwards and C'_{t+1} backwards: the query gradients
    (float32, per row t) move one row over, and add up where C' is C. Returns (dC, dC' or None)."""
    dC = torch.zeros(C.shape, dtype=torch.float32, device=C.device)
    dC[:, :-1] = d_query[:, 1:]
    dC_rev = dC if C_rev is None else torch.zeros_like(dC)
    dC_rev[:, 1:] += d_query_rev[:, :-1]
    return dC.to(C.dtype), (dC_rev.to(C_rev.dtype) if C_rev is not None else None)


def bidirectional_backward(dy, x, dt, A, B, C, saved, *, D=None, dt_bias=None, seq_idx=None, dt_softplus=False,
                           dt_limit=(0.0, math.inf), shift=False, dt_rev=None, B_rev=None, C_rev=None, sum_D=True):
    """dy: gradient of y before the gate (like x, any strides); saved: the forward pass's record;
    ``sum_D`` False where the gate's backward sums dD (:mod:`..ssd.gate`; D's gradient is None then).

    Returns a dict of gradients: x, dt, A, B, C, D, dt_bias, dt_rev, B_rev, C_rev (None where the
    input is None), each in its input's shape and dtype, contiguous."""
    B_r = B if B_rev is None else B_rev
    C_r = C if C_rev is None else C_rev
    steps = (saved.a, saved.dt_out, saved.b, saved.dt_rev_out)
    dH = chunk_states(dy, C, C_r, *steps, A, seq_idx=seq_idx, shift=shift, grad=True)
    dS, carry = state_passing_backward(dH, saved.a, saved.b, saved.states_in, length=x.shape[1], seq_idx=seq_idx,
                                       out_dtype=x.dtype)
    del dH
    dx, rows, dD = chunk_scan_bwd_dx(saved.G, saved.Gd, x, dy, B, B_r, dS[0], dS[1], *steps, A, D=D,
                                     seq_idx=seq_idx, shift=shift, shared_step=dt_rev is None, sum_D=sum_D)
    dB, dC, dB_rev, dC_rev, (diag, state) = chunk_scan_bwd_dbc(
        x, dy, B, C, B_r, C_r, saved.G, saved.states_in[0], saved.states_in[1], dS[0], dS[1], *steps, A,
        seq_idx=seq_idx, shift=shift)
    if shift:
        dC, dC_rev = queries_to_rows(dC, dC_rev, C, C_rev)
    grad_dt, grad_dt_rev, dA, d_bias = step_backward(dt, dt_rev, A, saved, DecaySlots(rows, diag, state, carry),
                                                     dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                                     shift=shift)
    return dict(x=dx, dt=grad_dt, A=dA.to(A.dtype), B=dB, C=dC, D=dD,
                dt_bias=d_bias.to(dt_bias.dtype) if d_bias is not None else None,
                dt_rev=grad_dt_rev, B_rev=dB_rev, C_rev=dC_rev)
