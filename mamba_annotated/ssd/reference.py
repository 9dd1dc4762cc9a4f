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
through them gives reference gradients. The step is always clamped to ``dt_limit`` (the default
(0, inf) turns a negative step into 0), as in mamba_ssm. ``seq_idx`` packs several sequences into
one row: M[t, s] is zero when t and s belong to different sequences, and ``initial_states``
belongs to the sequence whose id is 0, as in mamba_ssm (whose carried sequence id starts at 0): it
reaches the positions with seq_idx 0 and no other; with seq_idx [1, 1, ...] it reaches none.

Negative sequence ids (padding) are matched by :func:`ssd_chunked_ref` alone: mamba_ssm drops the
chunk state of a chunk that ends in a negative id, so what such positions see depends on the
chunk size, which the quadratic and recurrent forms do not have. They assume ids >= 0.
:func:`ssd_varlen_states_ref` gives the per-sequence states of ``return_varlen_states``.
"""
import math

import torch
import torch.nn.functional as F


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The step sizes the SSM uses: dt (+ dt_bias), softplus'ed if asked (identity past 20, as
    torch and mamba_ssm), always clamped to dt_limit. The clamp's gradient is 1 inside the
    limits, the limits included, and 0 outside, as mamba_ssm's."""
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def per_head(M, heads):
    """(batch, L, groups, dstate) -> (batch, L, heads, dstate): heads of a group share B and C."""
    return M.double().repeat_interleave(heads // M.shape[2], dim=2)


def same_sequence(seq_idx, batch, length, device):
    """(batch, L, L) boolean: positions t and s belong to one packed sequence."""
    if seq_idx is None:
        return torch.ones(batch, length, length, dtype=torch.bool, device=device)
    return seq_idx[:, :, None] == seq_idx[:, None, :]


def initial_state_reach(seq_idx, batch, length, device):
    """(batch, L) boolean: the positions that the initial state reaches (sequence id 0)."""
    if seq_idx is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return seq_idx == 0


def skip_and_gate(y, x, D, z):
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
    CB = torch.einsum("bthn,bshn->bhts", per_head(C, heads), per_head(B, heads))
    causal = torch.ones(length, length, dtype=torch.bool, device=dt.device).tril()
    keep = causal & same_sequence(seq_idx, batch, length, dt.device)[:, None]
    # exp of a masked difference: above the diagonal a_t - a_s > 0 could overflow, so zero it first
    decay = torch.exp((a[..., :, None] - a[..., None, :]).masked_fill(~keep, -math.inf))
    return CB * decay * dt.transpose(1, 2)[:, :, None, :]


def final_state_weights(dt, a, seq_idx):
    """(batch, L, heads): the weight of position s in the final state, the state after the last
    position (row L-1 of M, kept per (p, n)), from the processed dt and its cumulative sum a = cumsum(dt A)."""
    batch, length, _ = dt.shape
    last = same_sequence(seq_idx, batch, length, dt.device)[:, -1]     # (batch, L): same sequence as L-1
    return torch.exp(a[:, -1:, :] - a) * dt * last[..., None]


def final_state_term_norms(x, dt, A, B, *, dt_bias=None, seq_idx=None, dt_softplus=False,
                           dt_limit=(0.0, math.inf)):
    """(batch, heads, headdim, dstate) float64: the root of the sum over positions of the squared terms
    w_s x_s B_s of the final state (no initial state). A kernel that rounds each term's w_s x_s to a
    16-bit dtype before its dot, as the chunk-state kernel does, adds noise of about this size times
    the dtype's rounding: the reliability sweep's rule for a 16-bit final state whose terms cancel."""
    heads = x.shape[2]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    weight = final_state_weights(dt, torch.cumsum(dt * A.double(), dim=1), seq_idx)
    squares = torch.einsum("bsh,bshp,bshn->bhpn", weight ** 2, x.double() ** 2, per_head(B, heads).double() ** 2)
    return squares.sqrt()


def ssd_quadratic_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                      dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False):
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
    reach = initial_state_reach(seq_idx, batch, length, x.device)
    if initial_states is not None:
        # h0 decays by exp(a_t) until t; it reaches only the sequence with id 0
        Ch0 = torch.einsum("bthn,bhpn->bthp", per_head(C, heads), initial_states.double())
        y = y + Ch0 * (torch.exp(a) * reach[..., None])[..., None]
    out = skip_and_gate(y, x, D, z)
    if not return_final_states:
        return out
    final = torch.einsum("bsh,bshp,bshn->bhpn", final_state_weights(dt, a, seq_idx), x.double(), per_head(B, heads))
    if initial_states is not None:
        carries = (torch.exp(a[:, -1]) * reach[:, -1:])                 # (batch, heads)
        final = final + carries[..., None, None] * initial_states.double()
    return out, final


def ssd_recurrent_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                      dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False):
    """The same SSM as a recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.

    The state h is (batch, heads, headdim, dstate); it restarts at zero where seq_idx changes, and
    starts from initial_states only where the first position's sequence id is 0.
    """
    batch, length, heads, headdim = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    B, C, x = per_head(B, heads), per_head(C, heads), x.double()
    h = (torch.zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float64, device=x.device)
         if initial_states is None else initial_states.double())
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.double())                          # (batch, heads)
        if seq_idx is not None:
            before = seq_idx[:, t - 1] if t > 0 else torch.zeros_like(seq_idx[:, 0])
            decay = decay * (seq_idx[:, t] == before)[:, None]
        h = decay[..., None, None] * h + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    out = skip_and_gate(torch.stack(ys, dim=1) if length else x.double() * 0, x, D, z)
    return (out, h) if return_final_states else out


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None, initial_states=None,
                    seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
                    return_intermediates=False):
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

    With seq_idx, as mamba_ssm: S_c counts the positions of the chunk's last sequence only, and
    none if that sequence's id is negative; the carried state belongs to the sequence of the
    previous chunk's last position (id 0 before the first chunk), and it is dropped at the end of
    a chunk that ends in another sequence and ignored by the positions of another sequence.
    """
    batch, length, heads, headdim = x.shape
    Q = chunk_size
    n_chunks = -(-length // Q)
    pad = n_chunks * Q - length
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    # padding with dt = 0 and x = B = C = 0 leaves every real output and the final state unchanged
    x_, dt_ = F.pad(x.double(), (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
    B_, C_ = (F.pad(per_head(M, heads), (0, 0, 0, 0, 0, pad)) for M in (B, C))
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
    seq_last = seqc[..., -1:]                                            # (batch, chunks, 1)
    in_last = (seqc == seq_last) & (seq_last >= 0)                       # (batch, chunks, Q)
    to_end = torch.exp(a[:, :, -1:, :] - a) * dtc * in_last[..., None]   # (batch, chunks, Q, heads)
    S = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, xc, Bc)

    # state passing, chunk by chunk (a sequential loop over chunks: chapter 4's blocked carry)
    H = (torch.zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float64, device=x.device)
         if initial_states is None else initial_states.double())
    carried = torch.zeros(batch, dtype=torch.long, device=x.device)     # the sequence H belongs to
    carried_by_chunk = []
    H_in = []
    for c in range(n_chunks):
        H_in.append(H)
        carried_by_chunk.append(carried)
        continues = (seqc[:, c, -1] == carried).double()[:, None]       # the carried sequence goes on
        H = (torch.exp(a[:, c, -1]) * continues)[..., None, None] * H + S[:, c]
        carried = seqc[:, c, -1]
    H_in = (torch.stack(H_in, dim=1) if n_chunks else
            torch.zeros(batch, 0, heads, headdim, B.shape[-1], dtype=torch.float64, device=x.device))

    if n_chunks:
        reach = seqc == torch.stack(carried_by_chunk, dim=1)[..., None]  # (batch, chunks, Q): t sees H_c
        y_off = torch.einsum("bcthn,bchpn->bcthp", Cc, H_in) * (torch.exp(a) * reach[..., None])[..., None]
        y = (y_diag + y_off).reshape(batch, n_chunks * Q, heads, headdim)[:, :length]
    else:
        y = x.double() * 0
    out = skip_and_gate(y, x, D, z)
    result = (out, H) if return_final_states else out
    if not return_intermediates:
        return result
    heads_per_group = heads // B.shape[2]
    steps = dict(dA_cumsum=a.permute(0, 3, 1, 2), dt=dtc.permute(0, 3, 1, 2),
                 CB=CB[:, :, ::heads_per_group], states=S, states_in=H_in, final_states=H)
    return result, steps


def ssd_varlen_states_ref(x, dt, A, B, C, chunk_size, cu_seqlens, *, initial_states=None, seq_idx=None,
                          dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The per-sequence states of ``return_varlen_states``, as mamba_ssm computes them, float64.

    batch must be 1; cu_seqlens (num_seqs + 1,) holds where each packed sequence starts and ends.
    For the sequence [start, end), let c be the chunk of its last position end - 1 and a the
    cumulative log-decay inside that chunk. Its state is

        sum_{k in [max(start, c Q), end)} exp(min(a_{end-1} - a_k, 0)) dt_k x_k B_k^T
        + exp(a_{end-1}) H_c                    only if the sequence started before chunk c,

    where H_c is the state entering chunk c from the state passing (which knows the sequences
    only through seq_idx). So, as in mamba_ssm: without a matching seq_idx, earlier sequences leak
    into H_c; and initial_states reach the first sequence's state only when that sequence runs
    past the first chunk. An empty sequence gets a zero state.
    Returns (num_seqs, heads, headdim, dstate) float64.
    """
    _, steps = ssd_chunked_ref(x, dt, A, B, C, chunk_size, dt_bias=dt_bias, initial_states=initial_states,
                               seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                               return_intermediates=True)
    heads = x.shape[2]
    a = steps["dA_cumsum"][0]                                            # (heads, chunks, Q)
    step = steps["dt"][0]
    xs, Bs = x[0].double(), per_head(B, heads)[0]
    states = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        state = torch.zeros(heads, x.shape[3], B.shape[3], dtype=torch.float64, device=x.device)
        if end > start:
            c = (end - 1) // chunk_size
            first = max(start, c * chunk_size)
            k = torch.arange(first, end, device=x.device)
            a_end = a[:, c, end - 1 - c * chunk_size]                   # (heads,)
            weight = torch.exp(torch.clamp(a_end[:, None] - a[:, c, k - c * chunk_size], max=0.0))
            weight = weight * step[:, c, k - c * chunk_size]            # (heads, positions)
            state = torch.einsum("hk,khp,khn->hpn", weight, xs[k], Bs[k])
            if start < c * chunk_size:
                state = state + torch.exp(a_end)[:, None, None] * steps["states_in"][0, c]
        states.append(state)
    if not states:
        return torch.zeros(0, heads, x.shape[3], B.shape[3], dtype=torch.float64, device=x.device)
    return torch.stack(states)
