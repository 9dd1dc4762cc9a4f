"""Chapter 5: the forward pass, the five kernels in order (no autograd, no input checks).

    chunk_cumsum -> chunk_cb -> chunk_state -> state_passing -> chunk_scan

Returns every intermediate the backward pass needs, so :mod:`.api` can save or drop them.
"""
from dataclasses import dataclass

import torch

from .chunk_cumsum import chunk_cumsum
from .chunk_scan import chunk_scan
from .chunk_state import chunk_cb, chunk_state
from .state_passing import state_passing


@dataclass
class Saved:
    """What the backward pass reads from the forward pass (:mod:`.backward`)."""
    dA_cumsum: torch.Tensor        # (batch, heads, chunks, Q) float32
    dt_out: torch.Tensor           # (batch, heads, chunks, Q) float32
    CB: torch.Tensor               # (batch, chunks, groups, Q, Q) float32
    states_in: torch.Tensor        # (batch, chunks, heads, headdim, dstate) x's dtype: H_c

    def tensors(self):
        return self.dA_cumsum, self.dt_out, self.CB, self.states_in


@dataclass
class ForwardResult:
    out: torch.Tensor              # (batch, L, heads, headdim), x's dtype
    y: torch.Tensor | None         # before the z gate (only when z is given)
    final_states: torch.Tensor     # (batch, heads, headdim, dstate) float32
    saved: Saved


def ssd_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx):
    dA_cumsum, dt_out = chunk_cumsum(dt, A, dt_bias, dt_softplus, dt_limit, chunk_size)
    CB = chunk_cb(C, B, chunk_size)
    states = chunk_state(x, B, dA_cumsum, dt_out, seq_idx, to_end=True)
    states_in, final_states = state_passing(states, dA_cumsum, seq_idx, x.shape[1], initial_states,
                                            out_dtype=x.dtype)
    del states  # freed before the outputs are allocated: lower peak memory
    out, y = chunk_scan(CB, x, z, C, states_in, dA_cumsum, dt_out, D, seq_idx)
    return ForwardResult(out, y, final_states, Saved(dA_cumsum, dt_out, CB, states_in))
