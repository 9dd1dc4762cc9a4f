"""Chapter 6's ground truth and foil: the float64 quasiseparable reference against an independent
recurrence (both directions, packed sequences), the matrix's rank structure and diagonal, packed
batches against separate runs, and the two-call composition of chapter 5's SSD against the
reference, forward and every gradient."""
import math

import pytest
import torch
import torch.nn.functional as F

from mamba_annotated.bidirectional.naive import bidirectional_two_calls
from mamba_annotated.bidirectional.reference import (bidirectional_ref, packed_seq_idx, quasiseparable_matrix,
                                                     reverse_within_sequences, shift_within_sequences)
from mamba_annotated.runtime import DEVICE
from mamba_annotated.ssd.reference import process_dt
from mamba_annotated.testing import assert_close, assert_gradients_close, randn, tolerance, uniform

REVERSE = ("dt_rev", "B_rev", "C_rev")
TIME_ARGS = ("x", "dt", "B", "C", "z") + REVERSE  # the arguments indexed by position (dim 1)


def make_inputs(batch=2, length=37, heads=4, headdim=8, groups=2, dstate=8, dtype=torch.float32,
                D_shape="channel", separate=True, z=True):
    """Fresh random inputs; decays exp(dt A) well inside (0, 1). ``separate``: the backward
    direction has its own dt, B, C (Hydra); otherwise it shares them (Bi-Mamba2)."""
    inputs = dict(
        x=randn(batch, length, heads, headdim, dtype=dtype),
        dt=uniform(batch, length, heads, low=0.02, high=0.6),
        A=-uniform(heads, low=0.5, high=2.0),
        B=randn(batch, length, groups, dstate, dtype=dtype),
        C=randn(batch, length, groups, dstate, dtype=dtype),
        D={"channel": randn(heads, headdim), "head": randn(heads), None: None}[D_shape],
        z=randn(batch, length, heads, headdim, dtype=dtype) if z else None,
        dt_bias=randn(heads, scale=0.5),
    )
    if separate:
        inputs.update(dt_rev=uniform(batch, length, heads, low=0.02, high=0.6),
                      B_rev=randn(batch, length, groups, dstate, dtype=dtype),
                      C_rev=randn(batch, length, groups, dstate, dtype=dtype))
    return inputs


def packed_ids(batch, length):
    """Row 0: four sequences, one of length 1, one boundary on a chunk edge (16); row 1: two
    sequences with ids that skip values. Nondecreasing, as the SSD requires."""
    pos = torch.arange(length)
    row0 = (pos[:, None] >= torch.tensor([5, 6, 16])).sum(-1)
    row1 = torch.where(pos < 20, 1, 4)
    return torch.stack([row0, row1][:batch]).to(torch.int32).to(DEVICE)


# ---------------------------------------------------------------- an independent recurrence


def recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
               seq_idx=None, shift=False, dt_rev=None, B_rev=None, C_rev=None):
    """Two plain loops over time in float64, one per direction, the state reset where a sequence
    starts (forwards) or ends (backwards); with shift each loop emits the previous step's output."""
    batch, length, heads, headdim = x.shape
    x = x.double()
    seq = torch.zeros(batch, length, dtype=torch.long) if seq_idx is None else seq_idx.long().cpu()

    def step(d):
        d = d.double() + (0 if dt_bias is None else dt_bias.double())
        return (F.softplus(d) if dt_softplus else d).clamp(dt_limit[0], dt_limit[1])

    def per_head(M):
        return M.double().repeat_interleave(heads // M.shape[2], dim=2)

    def scan(order, dt, B, C):
        dt, B, C = step(dt), per_head(B), per_head(C)
        out = torch.zeros_like(x)
        h = torch.zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float64)
        y_before = torch.zeros(batch, heads, headdim, dtype=torch.float64)
        before = None
        for t in order:
            same = torch.zeros(batch, dtype=torch.bool) if before is None else seq[:, t] == seq[:, before]
            keep = same.double()[:, None, None]
            h = keep[..., None] * h
            h = torch.exp(dt[:, t] * A.double())[..., None, None] * h + torch.einsum(
                "bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])
            y = torch.einsum("bhpn,bhn->bhp", h, C[:, t])
            out[:, t] = keep * y_before if shift else y
            y_before, before = y, t
        return out

    y = scan(range(length), dt, B, C)
    y = y + scan(reversed(range(length)), dt if dt_rev is None else dt_rev, B if B_rev is None else B_rev,
                 C if C_rev is None else C_rev)
    if D is not None:
        y = y + x * (D.double()[:, None] if D.dim() == 1 else D.double())
    return y if z is None else y * F.silu(z.double())


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("D_shape", ["channel", "head", None])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_reference_matches_recurrence(shift, packed, D_shape, separate):
    inputs = make_inputs(D_shape=D_shape, separate=separate, z=D_shape != "head")
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.0) if packed else (0.0, math.inf),
              seq_idx=packed_ids(2, 37) if packed else None, shift=shift)
    assert_close(bidirectional_ref(**inputs, **kw), recurrence(**inputs, **kw), 1e-12)


@pytest.mark.parametrize("length", [0, 1, 2])
def test_reference_smallest_lengths(length):
    inputs = make_inputs(batch=1, length=length)
    for shift in (False, True):
        ref = bidirectional_ref(**inputs, shift=shift)
        assert ref.shape == inputs["x"].shape
        if length:
            assert_close(ref, recurrence(**inputs, shift=shift), 1e-12)


def test_reversal_and_shift_within_sequences():
    seq_idx = packed_ids(2, 37)
    t = torch.arange(2 * 37, dtype=torch.float64).reshape(2, 37, 1)
    rev, shifted = reverse_within_sequences(t, seq_idx), shift_within_sequences(t, seq_idx)
    for b in range(2):
        ids = seq_idx[b].tolist()
        for s in set(ids):
            span = [i for i, v in enumerate(ids) if v == s]
            assert rev[b, span, 0].tolist() == t[b, span[::-1], 0].tolist()
            assert shifted[b, span, 0].tolist() == [0.0] + t[b, span[:-1], 0].tolist()
    assert torch.equal(reverse_within_sequences(rev, seq_idx), t)
    assert torch.equal(reverse_within_sequences(t, None), t.flip(1))
    cu_seqlens = torch.tensor([0, 5, 5, 6, 16, 37], dtype=torch.int32, device=DEVICE)
    assert packed_seq_idx(None, cu_seqlens, 37).tolist() == [[0] * 5 + [2] + [3] * 10 + [4] * 21]


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("shift", [False, True])
def test_off_diagonal_blocks_have_rank_at_most_dstate(shift):
    """Every block strictly below or above the diagonal has rank <= dstate (numerical rank:
    singular values above 1e-10 of the largest); the middle blocks reach it, the whole M exceeds it."""
    length, dstate = 40, 4
    inputs = make_inputs(batch=1, length=length, heads=2, groups=1, dstate=dstate, D_shape="head")
    step, step_rev = (process_dt(inputs[k]) for k in ("dt", "dt_rev"))
    M = quasiseparable_matrix(step, inputs["A"], inputs["B"], inputs["C"], shift=shift, dt_rev=step_rev,
                              B_rev=inputs["B_rev"], C_rev=inputs["C_rev"], D=inputs["D"])[0]

    def rank(block):
        return torch.linalg.matrix_rank(block, rtol=1e-10)

    for i in range(1, length):
        assert (rank(M[:, i:, :i]) <= dstate).all(), f"rows [{i}, {length}), cols [0, {i})"
        assert (rank(M[:, :i, i:]) <= dstate).all(), f"rows [0, {i}), cols [{i}, {length})"
    middle = length // 2
    assert (rank(M[:, middle:, :middle]) == dstate).all() and (rank(M[:, :middle, middle:]) == dstate).all()
    assert (rank(M) > dstate).all()


@pytest.mark.parametrize("D_shape", ["head", "channel"])
def test_shift_diagonal_is_D(D_shape):
    """With shift=True each direction sees strictly the past or the future: the diagonal of M is
    D exactly, whatever B and C (without shift it is D plus both directions' C_t . B_t dt_t)."""
    inputs = make_inputs(D_shape=D_shape)
    step, step_rev = (process_dt(inputs[k], inputs["dt_bias"], True) for k in ("dt", "dt_rev"))
    args = (step, inputs["A"], inputs["B"], inputs["C"], packed_ids(2, 37))
    reverse = dict(dt_rev=step_rev, B_rev=inputs["B_rev"], C_rev=inputs["C_rev"], D=inputs["D"])
    M = quasiseparable_matrix(*args, shift=True, **reverse)
    D = inputs["D"].double()
    assert torch.equal(M.diagonal(dim1=-2, dim2=-1), (D[:, None] if D.dim() == 1 else D[..., None]).expand(
        M.shape[:-1]))
    unshifted = quasiseparable_matrix(*args, shift=False, **reverse).diagonal(dim1=-2, dim2=-1)
    assert not torch.equal(unshifted, M.diagonal(dim1=-2, dim2=-1))


@pytest.mark.parametrize("shift", [False, True])
def test_zero_B_and_C_give_D_x(shift):
    """The chapter's exercise: with B = C = 0 (both directions) only the skip is left, y = D x."""
    inputs = make_inputs(D_shape="channel", separate=False, z=False)
    inputs["B"], inputs["C"] = torch.zeros_like(inputs["B"]), torch.zeros_like(inputs["C"])
    x, D = inputs["x"], inputs["D"]
    assert torch.equal(bidirectional_ref(**inputs, shift=shift), x.double() * D.double())
    assert torch.equal(bidirectional_two_calls(**inputs, chunk_size=16, shift=shift), x * D)


def test_packed_matrix_is_block_diagonal():
    seq_idx = packed_ids(2, 37)
    inputs = make_inputs()
    step = process_dt(inputs["dt"])
    M = quasiseparable_matrix(step, inputs["A"], inputs["B"], inputs["C"], seq_idx, D=inputs["D"][:, 0])
    across = seq_idx[:, :, None] != seq_idx[:, None, :]
    assert not M.masked_select(across[:, None]).any()


# ---------------------------------------------------------------- packed sequences


def run_alone(fn, inputs, start, end, row=0, **kw):
    """fn on the positions [start, end) of one row, as a batch of its own."""
    return fn(**{k: (v[row:row + 1, start:end] if k in TIME_ARGS else v) for k, v in inputs.items()}, **kw)


def spans(seq_idx_row):
    ids = seq_idx_row.tolist()
    return [(ids.index(s), len(ids) - ids[::-1].index(s)) for s in sorted(set(ids))]


@pytest.mark.parametrize("shift", [False, True])
def test_packed_equals_separate_runs_reference(shift):
    """No state crosses a boundary and each sequence is reversed within itself: a packed batch
    gives what each sequence alone gives, via seq_idx (two rows) and via cu_seqlens (one row, an
    empty sequence among them)."""
    inputs = make_inputs()
    seq_idx = packed_ids(2, 37)
    packed = bidirectional_ref(**inputs, seq_idx=seq_idx, shift=shift)
    for row in range(2):
        for start, end in spans(seq_idx[row]):
            alone = run_alone(bidirectional_ref, inputs, start, end, row, shift=shift)
            assert_close(packed[row:row + 1, start:end], alone, 1e-12, f"row {row}, [{start}, {end})")
    one_row = {k: (v[:1] if k in TIME_ARGS else v) for k, v in inputs.items()}
    cu_seqlens = torch.tensor([0, 5, 5, 6, 16, 37], dtype=torch.int32, device=DEVICE)
    by_offsets = bidirectional_ref(**one_row, cu_seqlens=cu_seqlens, shift=shift)
    assert_close(by_offsets, packed[:1], 1e-12)


@pytest.mark.parametrize("how", ["seq_idx", "cu_seqlens"])
def test_packed_equals_separate_runs_two_calls(how):
    inputs = make_inputs(batch=1, heads=2, groups=1)
    offsets = [0, 5, 6, 16, 37]
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    packing = dict(seq_idx=packed_ids(1, 37)) if how == "seq_idx" else dict(cu_seqlens=cu_seqlens)
    for shift in (False, True):
        kw = dict(chunk_size=16, dt_softplus=True, shift=shift)
        packed = bidirectional_two_calls(**inputs, **packing, **kw)
        alone = torch.cat([run_alone(bidirectional_two_calls, inputs, s, e, **kw)
                           for s, e in zip(offsets[:-1], offsets[1:])], dim=1)
        assert_close(packed, alone, tolerance(torch.float32), f"shift={shift}")


# ---------------------------------------------------------------- the two-call foil against the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [False, True])
def test_two_calls_forward(shift, dtype):
    inputs = make_inputs(length=45, dtype=dtype, D_shape="head")
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.0), seq_idx=packed_ids(2, 45), shift=shift)
    out = bidirectional_two_calls(**inputs, chunk_size=32, **kw)
    assert out.dtype == dtype and out.shape == inputs["x"].shape
    assert_close(out, bidirectional_ref(**inputs, **kw), tolerance(dtype))


def test_two_calls_smallest_lengths():
    for length in (1, 2):
        inputs = make_inputs(batch=1, length=length, heads=2, groups=1)
        for shift in (False, True):
            assert_close(bidirectional_two_calls(**inputs, chunk_size=16, shift=shift),
                         bidirectional_ref(**inputs, shift=shift), tolerance(torch.float32), f"L={length}")


def grad_tol(name):
    """dA and d dt_bias come from the SSD's backward kernels, which sum terms of both signs over
    every (batch, position): chapter 5's rule gives them one digit more than the per-dtype bound."""
    return tolerance(torch.float32) * (10 if name in ("A", "dt_bias") else 1)


# (shift, packed, chunk_size): every pair of the three factors' values appears once
GRADIENT_CASES = [(False, False, 16), (False, True, 32), (True, True, 16), (True, False, 32)]


@pytest.mark.parametrize("shift, packed, chunk_size", GRADIENT_CASES)
def test_two_calls_gradients(shift, packed, chunk_size):
    length = {16: 37, 32: 45}[chunk_size]
    inputs = make_inputs(length=length, heads=2, groups=1, D_shape="channel" if packed else "head")
    for v in inputs.values():
        v.requires_grad_()
    kw = dict(dt_softplus=True, seq_idx=packed_ids(2, length) if packed else None, shift=shift)
    errors = assert_gradients_close(lambda **a: bidirectional_two_calls(**a, chunk_size=chunk_size, **kw),
                                    lambda **a: bidirectional_ref(**a, **kw), inputs, tol=1.0)
    assert set(errors) == set(inputs)
    for name, err in errors.items():
        assert err < grad_tol(name), f"grad {name}: relative error {err:.3e}"
