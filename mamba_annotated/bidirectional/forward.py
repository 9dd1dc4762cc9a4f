"""Chapter 6: the fused forward pass, both directions on one chunk grid (no autograd, no checks).

    chunk_cumsum (x2 with dt_rev) -> chunk_scores -> chunk_states -> state_passing -> chunk_outputs

No input is flipped, shifted or concatenated: the reverse direction's decays are exclusive
cumulative sums on the forward chunks (:mod:`.decays`), the scores of both triangles come from one
kernel, the two chunk states from one read of x and B, the two carries from one launch (left to
right and right to left side by side), and one output kernel sums everything. chunk_cumsum is
chapter 5's, run on dt_rev too when the reverse direction has a step of its own. Returns every
intermediate the backward pass needs.
"""
import math
from dataclasses import dataclass

import torch

from ..ssd.chunk_cumsum import chunk_cumsum
from .chunk_outputs import chunk_outputs
from .chunk_scores import chunk_scores
from .chunk_states import chunk_states
from .state_passing import state_passing


@dataclass
class Saved:
    """What the backward pass reads from the forward pass (:mod:`.backward`)."""
    a: torch.Tensor            # (batch, heads, chunks, Q) float32: forward cumulative log-decays
    dt_out: torch.Tensor       # (batch, heads, chunks, Q) float32: processed steps
    b: torch.Tensor            # the reverse direction's (the same tensors when dt_rev is not given)
    dt_rev_out: torch.Tensor
    G: torch.Tensor            # (batch, chunks, groups, Q, Q) float32: the diagonal blocks' scores
    Gd: torch.Tensor | None    # (batch, chunks, groups, Q) float32: the reverse diagonal (no shift)
    states_in: torch.Tensor    # (2, batch, chunks, heads, headdim, dstate), x's dtype: the states
                               # entering each chunk from the left, then those from the right


def steps(dt, dt_rev, A, chunk_size, dt_bias, dt_softplus, dt_limit, seq_idx):
    """(a, dt_out, b, dt_rev_out); one chunk_cumsum when the reverse direction shares dt.

    The sums are float32, each rounded once from a float64 sum: this op's kernels still subtract
    them in float32 (chapter 5's keep their low part, :mod:`..ssd.log_decays`)."""
    options = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx, planes=False)
    a, dt_out = chunk_cumsum(dt, A, chunk_size, **options)
    b, dt_rev_out = (a, dt_out) if dt_rev is None else chunk_cumsum(dt_rev, A, chunk_size, **options)
    return a, dt_out, b, dt_rev_out


def bidirectional_forward(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None, seq_idx=None,
                          dt_softplus=False, dt_limit=(0.0, math.inf), shift=False, dt_rev=None, B_rev=None,
                          C_rev=None):
    """The forward pass on checked inputs (A, D and dt_bias contiguous; the others any strides).
    B_rev, C_rev, dt_rev None: shared with B, C, dt. Returns (out, y before the gate or None, Saved)."""
    B_rev = B if B_rev is None else B_rev
    C_rev = C if C_rev is None else C_rev
    a, dt_out, b, dt_rev_out = steps(dt, dt_rev, A, chunk_size, dt_bias, dt_softplus, dt_limit, seq_idx)
    G, Gd = chunk_scores(C, B, C_rev, B_rev, chunk_size, shift=shift)
    states = chunk_states(x, B, B_rev, a, dt_out, b, dt_rev_out, A, seq_idx=seq_idx, shift=shift)
    states_in = state_passing(states, a, b, length=x.shape[1], seq_idx=seq_idx, out_dtype=x.dtype)
    del states  # freed before the outputs are allocated: lower peak memory
    out, y = chunk_outputs(G, Gd, x, C, C_rev, states_in[0], states_in[1], a, dt_out, b, dt_rev_out, A, z=z, D=D,
                           seq_idx=seq_idx, shift=shift)
    return out, y, Saved(a, dt_out, b, dt_rev_out, G, Gd, states_in)
