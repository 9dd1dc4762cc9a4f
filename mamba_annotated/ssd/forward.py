"""Chapter 5: the forward pass, the five kernels in order (no autograd, no input checks).

    chunk_cumsum -> chunk_cb -> chunk_state -> state_passing -> chunk_scan  (-> varlen_states)

Returns every intermediate the backward pass needs, so :mod:`.api` can save or drop them.
"""
import math
from dataclasses import dataclass

import torch

from .chunk_cumsum import chunk_cumsum
from .chunk_scan import chunk_scan
from .chunk_state import chunk_cb, chunk_state
from .state_passing import state_passing
from .varlen_states import varlen_states


@dataclass
class Saved:
    """What the backward pass reads from the forward pass (:mod:`.backward`)."""
    dA_cumsum: torch.Tensor        # (batch, heads, chunks, 2, Q) float32: the sums' planes (.log_decays)
    dt_out: torch.Tensor           # (batch, heads, chunks, Q) float32
    CB: torch.Tensor               # (batch, chunks, groups, cb_length(Q)) float32: the squares of .chunk_state
    states_in: torch.Tensor        # (batch, chunks, heads, headdim, dstate) the state dtype: H_c

    def tensors(self):
        return self.dA_cumsum, self.dt_out, self.CB, self.states_in


@dataclass
class ForwardResult:
    out: torch.Tensor                   # (batch, L, heads, headdim), x's dtype
    y: torch.Tensor | None              # before the z gate (only when z is given)
    final_states: torch.Tensor | None   # (batch, heads, headdim, dstate) float32 or the state dtype
    varlen_states: torch.Tensor | None  # (sequences, heads, headdim, dstate) (only with cu_seqlens)
    saved: Saved


def ssd_forward(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), state_dtype=None, final_states=True):
    """The forward pass on checked inputs (A, D and dt_bias contiguous; the others any strides).

    ``state_dtype`` (None: mamba_ssm's choice) stores the states entering each chunk in that dtype
    (else x's) and returns the final states in it (else float32); the states of ``cu_seqlens``
    come in the dtype of the stored states, as in mamba_ssm. ``final_states`` False: the final
    states are neither allocated nor stored (None in the result); mamba_ssm computes them always."""
    steps = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    dA_cumsum, dt_out = chunk_cumsum(dt, A, chunk_size, **steps, seq_idx=seq_idx,
                                     initial_states=initial_states is not None)
    CB = chunk_cb(C, B, chunk_size)
    states = chunk_state(x, B, dA_cumsum, dt_out, seq_idx=seq_idx, to_end=True)
    states_in, final_states = state_passing(states, dA_cumsum, length=x.shape[1], seq_idx=seq_idx,
                                            initial=initial_states, out_dtype=state_dtype or x.dtype,
                                            final_dtype=(state_dtype or torch.float32) if final_states else None)
    del states  # freed before the outputs are allocated: lower peak memory
    out, y = chunk_scan(CB, x, C, states_in, dA_cumsum, dt_out, z=z, D=D, seq_idx=seq_idx)
    varlen = None
    if cu_seqlens is not None:
        # mamba_ssm's varlen states read sums that run across seq_idx's boundaries (cu_seqlens alone
        # marks the sequences there, and may disagree with seq_idx): with seq_idx, sums of their own
        decays = dA_cumsum if seq_idx is None else chunk_cumsum(dt, A, chunk_size, **steps)[0]
        varlen = varlen_states(x, B, decays, dt_out, states_in, cu_seqlens)
    return ForwardResult(out, y, final_states, varlen, Saved(dA_cumsum, dt_out, CB, states_in))
