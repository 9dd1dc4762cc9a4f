"""Float64 references for Mamba-2's state-space duality (SSD): the ground truth of chapter 5.

The SSM of one head is a matrix M acting along time, y = M x, with

    M[t, s] = (C_t . B_s) * exp(a_t - a_s) * dt_s   for s <= t   (0 above the diagonal),
    a_t = sum_{k <= t} dt_k * A                      (the cumulative log-decay),

plus the skip D x and the gate y * silu(z). Three references multiply by the same M:

* :func:`ssd_quadratic_ref` builds M explicitly (the "attention" form, O(L^2));
* :func:`ssd_recurrent_ref` walks time with a state h_t of shape (headdim, dstate) (the "RNN"
  form, O(L));
* :func:`ssd_chunked_ref` is the algorithm the kernels implement: quadratic inside chunks,
  low-rank chunk states passed from chunk to chunk.

All three take mamba_ssm's ``mamba_chunk_scan_combined`` layout and run in float64, so autograd
through them gives reference gradients. ``seq_idx`` packs several sequences into one row: M[t, s]
is zero when t and s belong to different sequences, and ``initial_states`` feeds the sequence of
position 0 only.
"""
import math

import torch
import torch.nn.functional as F


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The step sizes the SSM uses: dt (+ dt_bias), softplus'ed if asked, clamped to dt_limit."""
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _per_head(M, heads):
    """(batch, L, groups, dstate) -> (batch, L, heads, dstate): heads of a group share B and C."""
    return M.double().repeat_interleave(heads // M.shape[2], dim=2)


def _same_sequence(seq_idx, batch, length, device):
    """(batch, L, L) boolean: positions t and s belong to one packed sequence."""
    if seq_idx is None:
        return torch.ones(batch, length, length, dtype=torch.bool, device=device)
    return seq_idx[:, :, None] == seq_idx[:, None, :]


def _skip_and_gate(y, x, D, z):
    if D is not None:
        D = D.double()
        y = y + x.double() * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z.double())
    return y


def ssd_matrix(dt, A, B, C, seq_idx=None):
    """M of every head: (batch, heads, L, L), M[t, s] = (C_t . B_s) exp(a_t - a_s) dt_s for s <= t.

    ``dt`` is the processed step (see :func:`process_dt`); A (heads,); B, C (batch, L, groups, dstate).
    """
    batch, length, heads = dt.shape
    a = torch.cumsum(dt * A.double(), dim=1).transpose(1, 2)          # (batch, heads, L)
    CB = torch.einsum("bthn,bshn->bhts", _per_head(C, heads), _per_head(B, heads))
    causal = torch.ones(length, length, dtype=torch.bool, device=dt.device).tril()
    keep = causal & _same_sequence(seq_idx, batch, length, dt.device)[:, None]
    # exp of a masked difference: above the diagonal a_t - a_s > 0 could overflow, so zero it first
    decay = torch.exp((a[..., :, None] - a[..., None, :]).masked_fill(~keep, -math.inf))
    return CB * decay * dt.transpose(1, 2)[:, :, None, :]


def ssd_quadratic_ref(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf),
                      return_final_states=False):
    """y = M x (+ the initial state's contribution), skip and gate; the quadratic form, float64.

    Shapes as ``mamba_chunk_scan_combined``: x (batch, L, heads, headdim), dt (batch, L, heads),
    A (heads,), B, C (batch, L, groups, dstate), D (heads,) or (heads, headdim), z like x,
    dt_bias (heads,), initial_states (batch, heads, headdim, dstate), seq_idx (batch, L).
    Returns y (batch, L, heads, headdim) float64 [and the final state (batch, heads, headdim, dstate)].
    """
    batch, length, heads, headdim = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    M = ssd_matrix(dt, A, B, C, seq_idx)
    y = torch.einsum("bhts,bshp->bthp", M, x.double())
    a = torch.cumsum(dt * A.double(), dim=1)                             # (batch, L, heads)
    first_sequence = (torch.ones(batch, length, dtype=torch.bool, device=x.device) if seq_idx is None
                      else seq_idx == seq_idx[:, :1])
    if initial_states is not None:
        # h0 decays by exp(a_t) until t; it reaches only the sequence that position 0 starts
        Ch0 = torch.einsum("bthn,bhpn->bthp", _per_head(C, heads), initial_states.double())
        y = y + Ch0 * (torch.exp(a) * first_sequence[..., None])[..., None]
    out = _skip_and_gate(y, x, D, z)
    if not return_final_states:
        return out
    # the final state is the state after the last position: row L-1 of M, kept per (p, n)
    last = _same_sequence(seq_idx, batch, length, x.device)[:, -1]      # (batch, L): same seq as L-1
    weight = torch.exp(a[:, -1:, :] - a) * dt * last[..., None]         # (batch, L, heads)
    final = torch.einsum("bsh,bshp,bshn->bhpn", weight, x.double(), _per_head(B, heads))
    if initial_states is not None:
        carries = (torch.exp(a[:, -1]) * first_sequence[:, -1:])        # (batch, heads)
        final = final + carries[..., None, None] * initial_states.double()
    return out, final


def ssd_recurrent_ref(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf),
                      return_final_states=False):
    """The same SSM as a recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.

    The state h is (batch, heads, headdim, dstate); it restarts at zero where seq_idx changes.
    """
    batch, length, heads, headdim = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    B, C, x = _per_head(B, heads), _per_head(C, heads), x.double()
    h = (torch.zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float64, device=x.device)
         if initial_states is None else initial_states.double())
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.double())                          # (batch, heads)
        if seq_idx is not None and t > 0:
            decay = decay * (seq_idx[:, t] == seq_idx[:, t - 1])[:, None]
        h = decay[..., None, None] * h + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    out = _skip_and_gate(torch.stack(ys, dim=1), x, D, z)
    return (out, h) if return_final_states else out


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                    initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf),
                    return_final_states=False, return_intermediates=False):
    """The chunked algorithm of the kernels, in float64 PyTorch, step by step.

    ``return_intermediates`` also returns a dict of every step's result in the kernels' layouts
    (dA_cumsum, dt (batch, heads, chunks, Q); CB (batch, chunks, groups, Q, Q); states,
    states_in (batch, chunks, heads, headdim, dstate); final_states), so each kernel can be
    checked on its own.

    1. a = cumsum(dt A) inside each chunk;
    2. diagonal blocks: y_diag = M_chunk x_chunk (quadratic, within the chunk);
    3. chunk states: S_c = sum_s exp(a_last - a_s) dt_s x_s B_s^T (what chunk c adds to the state);
    4. state passing: H_{c+1} = exp(a_last(c)) H_c + S_c, H_0 = initial_states;
    5. off-diagonal blocks: y_off,t = exp(a_t) H_c C_t for t in chunk c.
    """
    batch, length, heads, headdim = x.shape
    Q = chunk_size
    n_chunks = -(-length // Q)
    pad = n_chunks * Q - length
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    # padding with dt = 0 and x = B = C = 0 leaves every real output and the final state unchanged
    x_, dt_ = F.pad(x.double(), (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
    B_, C_ = (F.pad(_per_head(M, heads), (0, 0, 0, 0, 0, pad)) for M in (B, C))
    seq = (torch.zeros(batch, length, dtype=torch.long, device=x.device) if seq_idx is None
           else seq_idx.long())
    seq_ = torch.cat([seq, seq[:, -1:].expand(batch, pad)], dim=1)       # pads join the last sequence

    def chunks(t):  # (batch, n_chunks * Q, ...) -> (batch, n_chunks, Q, ...)
        return t.reshape(batch, n_chunks, Q, *t.shape[2:])

    xc, dtc, Bc, Cc, seqc = chunks(x_), chunks(dt_), chunks(B_), chunks(C_), chunks(seq_)
    a = torch.cumsum(dtc * A.double(), dim=2)                            # (batch, chunks, Q, heads)
    same = seqc[..., :, None] == seqc[..., None, :]                      # (batch, chunks, Q, Q)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    keep = (causal & same)[:, :, None]                                   # (batch, chunks, 1, Q, Q)
    a_h = a.transpose(2, 3)                                              # (batch, chunks, heads, Q)
    decay = torch.exp((a_h[..., :, None] - a_h[..., None, :]).masked_fill(~keep, -math.inf))
    CB = torch.einsum("bcthn,bcshn->bchts", Cc, Bc)
    y_diag = torch.einsum("bchts,bcsh,bcshp->bcthp", CB * decay, dtc, xc)

    # chunk states: positions of the chunk's last sequence only (an earlier sequence has ended)
    in_last = (seqc == seqc[..., -1:])                                   # (batch, chunks, Q)
    to_end = torch.exp(a[:, :, -1:, :] - a) * dtc * in_last[..., None]   # (batch, chunks, Q, heads)
    S = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, xc, Bc)

    # state passing, chunk by chunk (a sequential loop over chunks: chapter 4's blocked carry)
    H = (torch.zeros_like(S[:, 0]) if initial_states is None else initial_states.double())
    carry_seq = seq[:, 0]
    H_in = []
    for c in range(n_chunks):
        H_in.append(H)
        continues = (seqc[:, c, -1] == carry_seq).double()[:, None]     # the carried sequence goes on
        H = (torch.exp(a[:, c, -1]) * continues)[..., None, None] * H + S[:, c]
        carry_seq = seqc[:, c, -1]
    H_in = torch.stack(H_in, dim=1)                                      # (batch, chunks, heads, p, n)

    reach = (seqc == torch.cat([seq[:, :1], seqc[:, :-1, -1]], dim=1)[..., None])  # t sees H_c
    y_off = torch.einsum("bcthn,bchpn->bcthp", Cc, H_in) * (torch.exp(a) * reach[..., None])[..., None]
    y = (y_diag + y_off).reshape(batch, n_chunks * Q, heads, headdim)[:, :length]
    out = _skip_and_gate(y, x, D, z)
    result = (out, H) if return_final_states else out
    if not return_intermediates:
        return result
    heads_per_group = heads // B.shape[2]
    steps = dict(dA_cumsum=a.permute(0, 3, 1, 2), dt=dtc.permute(0, 3, 1, 2),
                 CB=CB[:, :, ::heads_per_group], states=S, states_in=H_in, final_states=H)
    return result, steps
