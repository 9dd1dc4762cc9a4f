"""Chapter 6's ground truth, foil and fused kernel: the float64 quasiseparable reference against an
independent recurrence (both directions, packed sequences), the matrix's rank structure and
diagonal, packed batches against separate runs, the two-call composition of chapter 5's SSD against
the reference, forward and every gradient; then the fused ``bidirectional_chunk_scan`` against the
reference: both forms, shared and separate reverse parameters, every gradient, packed sequences
(seq_idx and cu_seqlens), dtypes, odd lengths and sizes, views, empty and bad inputs, reproducible
gradients, agreement with the two-call foil, and torch.library's opcheck."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.runtime.interpreter

from mamba_annotated import bidirectional_chunk_scan, ssd_chunk_scan
from mamba_annotated.bidirectional.api import bidirectional_chunk_scan_op
from mamba_annotated.bidirectional.naive import bidirectional_two_calls
from mamba_annotated.bidirectional.reference import (bidirectional_ref, packed_seq_idx, quasiseparable_matrix,
                                                     reverse_within_sequences, shift_within_sequences)
from mamba_annotated.runtime import DEVICE, INTERPRETED, size
from mamba_annotated.ssd.reference import process_dt
from mamba_annotated.testing import (SAME_COMPUTATION_FLOOR, assert_close, assert_gradients_close,
                                     assert_refused_on_the_device, assert_within_same_computation, every_other,
                                     gradients, randn, same_computation_error, tolerance,
                                     uniform)

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
    device = x.device  # the loops run on the CPU (one small step at a time)
    x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev = (
        t.cpu() if t is not None else None for t in (x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev))
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
    return (y if z is None else y * F.silu(z.double())).to(device)


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
    t = torch.arange(2 * 37, dtype=torch.float64, device=DEVICE).reshape(2, 37, 1)
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


# ---------------------------------------------------------------- the fused kernel


ALL_GRADS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias") + REVERSE


def fused_grad_tol(name, dtype):
    """tests/test_ssd.py's rule: dA, d dt_bias and dD are sums over every (batch, position) of terms
    of both signs, so they get one digit more than the per-dtype bound (5x for 16-bit tiles).
    float32 dA gets 30x: one number per head with the most cancellation, it reached 1.05e-4
    (10.5x) on one of 16 seeds (1300-1315) of test_fused_one_reverse_parameter_of_its_own[C_rev]."""
    if name == "A" and dtype == torch.float32:
        return tolerance(dtype) * 30
    if name in ("A", "dt_bias", "D"):
        return tolerance(dtype) * (10 if dtype == torch.float32 else 5)
    return tolerance(dtype)


def check_fused(inputs, dtype=torch.float32, chunk_size=16, **kw):
    """The fused op against the float64 reference, forward and the gradient of every float input."""
    inputs = {k: (v.requires_grad_() if v is not None and k in ALL_GRADS else v) for k, v in inputs.items()}
    out = bidirectional_chunk_scan(**inputs, chunk_size=chunk_size, **kw)
    assert out.dtype == dtype and out.shape == inputs["x"].shape
    assert_close(out, bidirectional_ref(**inputs, **kw), tolerance(dtype), "out")
    errors = assert_gradients_close(lambda **a: bidirectional_chunk_scan(**a, chunk_size=chunk_size, **kw),
                                    lambda **a: bidirectional_ref(**a, **kw), inputs, tol=1.0)
    assert set(errors) == {k for k, v in inputs.items() if v is not None and k in ALL_GRADS}
    for name, err in errors.items():
        assert err < fused_grad_tol(name, dtype), f"grad {name}: relative error {err:.3e}"


# (shift, separate reverse parameters, packed, chunk_size, D's shape): each pair of the values of
# shift, separate and packed appears once, and each with both chunk sizes but separate; lengths 37
# (chunk 16: groups of two heads) and 45 (chunk 32: one head per group, fewer programs for the
# interpreter) end mid-chunk
FUSED_CASES = [(False, False, False, 16, "channel"), (False, True, True, 32, "head"),
               (True, True, False, 32, "channel"), (True, False, True, 16, "head")]


@pytest.mark.parametrize("shift, separate, packed, chunk_size, D_shape", FUSED_CASES)
def test_fused_forward_and_every_gradient(shift, separate, packed, chunk_size, D_shape):
    length, heads, groups = {16: (37, 4, 2), 32: (45, 2, 2)}[chunk_size]
    inputs = make_inputs(length=length, heads=heads, groups=groups, D_shape=D_shape, separate=separate)
    if packed:  # slow decays: a state that leaked across a boundary would change the output by O(1)
        inputs["A"] = -uniform(heads, low=0.02, high=0.1)
    check_fused(inputs, chunk_size=chunk_size, dt_softplus=True, dt_limit=(0.05, 1.0) if packed else (0.0, math.inf),
                seq_idx=packed_ids(2, length) if packed else None, shift=shift)


@pytest.mark.parametrize("name", REVERSE)
def test_fused_one_reverse_parameter_of_its_own(name):
    """dt_rev, B_rev, C_rev each default to the forward one on its own: one given, two shared."""
    inputs = make_inputs(batch=1, heads=2, groups=1, separate=True)
    inputs.update({k: None for k in REVERSE if k != name})
    check_fused(inputs, dt_softplus=True, shift=name == "C_rev")


@pytest.mark.parametrize("dtype, shift", [(torch.float16, False), (torch.bfloat16, True)])
def test_fused_half_precision(dtype, shift):
    """Forward and every gradient within the 16-bit bounds; and the step gradients within 3x the
    error of chapter 5's SSD called twice, summed over three draws. Defect: the column sums of the
    decay gradients came from the dx kernel's 16-bit tiles and the row sums from float32, so the
    two signs of each term did not cancel in the reverse cumsum that formed the step gradients
    then: bfloat16 dA had 30-100x the two calls' error. Summed, not per draw: dA is one number per head,
    a sum over every position with cancellation, and the ratio of two independent roundings of it
    ranged from 0.24 to 9.7 over 16 bfloat16 draws (seeds 1380-1387, both shifts), while the sums
    over 8 draws agreed within 1.2x."""
    kw = dict(dt_softplus=True, seq_idx=packed_ids(1, 37), shift=shift)
    steps = ("dt", "A", "dt_bias") + (("dt_rev",) if shift else ())
    errors = {name: [0.0, 0.0] for name in steps}
    for _ in range(3):
        inputs = make_inputs(batch=1, heads=4, groups=2, dtype=dtype, separate=shift)
        inputs = {k: v.requires_grad_() for k, v in inputs.items() if v is not None}
        out = bidirectional_chunk_scan(**inputs, chunk_size=16, **kw)
        assert out.dtype == dtype
        assert_close(out, bidirectional_ref(**inputs, **kw), tolerance(dtype), "out")
        grad_out = randn(*inputs["x"].shape, dtype=dtype)
        ours = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, **kw), inputs, grad_out)
        foil = gradients(lambda **a: bidirectional_two_calls(**a, chunk_size=16, **kw), inputs, grad_out)
        as64 = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
        want = gradients(lambda **a: bidirectional_ref(**a, **kw), as64, grad_out.double())
        assert set(ours) == set(want) == {k for k in inputs if k in ALL_GRADS}
        for name in ours:
            assert_close(ours[name], want[name], fused_grad_tol(name, dtype), f"grad {name}")
        for name in steps:
            error, foil_error = same_computation_error(ours[name], foil[name], want[name],
                                                       SAME_COMPUTATION_FLOOR[dtype])
            errors[name][0] += error
            errors[name][1] += foil_error
    for name, (error, foil_error) in errors.items():
        assert error <= 3.0 * foil_error, f"grad {name}: error {error:.3e} above 3 x the two calls' {foil_error:.3e}"


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17])
@pytest.mark.parametrize("shift", [False, True])
def test_fused_odd_lengths_minimal_arguments(length, shift):
    """No optional argument: one group, no D, z or bias; lengths around the chunk."""
    inputs = make_inputs(batch=1, length=length, heads=2, groups=1, D_shape=None, separate=False, z=False)
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    assert_close(bidirectional_chunk_scan(x, dt, A, B, C, 16, shift=shift),
                 bidirectional_ref(x, dt, A, B, C, shift=shift), tolerance(torch.float32))


@pytest.mark.parametrize("separate", [False, True])
def test_fused_shift_with_tiles_between_row_and_column(separate):
    """With the shift, a chunk of four row blocks (64 in the interpreter's tiles of 16): the decay
    gradients of the steps between a tile's row and column blocks come from the tile's whole sum,
    which with the shift is the pair sums at its first (last, in reverse) row plus that row's own."""
    inputs = make_inputs(batch=1, length=64 + 17, heads=2, groups=1, separate=separate)
    check_fused(inputs, chunk_size=64, dt_softplus=True, shift=True)


@pytest.mark.parametrize("chunk_size, headdim, dstate", [(64, 24, 12), (32, 40, 40)])
def test_fused_sizes_that_are_not_blocks(chunk_size, headdim, dstate):
    """headdim and dstate that no block divides, several blocks of each, a chunk of several row
    blocks, a length 17 past the first chunk."""
    length = chunk_size + 17
    inputs = make_inputs(batch=1, length=length, heads=2, headdim=headdim, groups=1, dstate=dstate,
                         separate=chunk_size != 64)
    kw = dict(dt_softplus=True, shift=chunk_size == 32)
    assert_close(bidirectional_chunk_scan(**inputs, chunk_size=chunk_size, **kw), bidirectional_ref(**inputs, **kw),
                 tolerance(torch.float32))


@pytest.mark.parametrize("argument, t", [("x", 2), ("x", 10), ("x", 30), ("B", 2), ("dt", 3), ("dt", 10),
                                         ("B_rev", 20), ("dt_rev", 3), ("dt_rev", 33), ("C", 7)])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_value_reaches_exactly_the_outputs_that_read_it(argument, t, value):
    """Packed sequences (row 0: [0, 5), [5, 6), [6, 16), [16, 37); chunks of 16): a NaN or inf at
    position t makes exactly the outputs that read it non-finite (x: its whole sequence; the
    forward direction's dt and B: t and the positions after it in the sequence; the reverse
    direction's: t and those before; C: t) and leaves the other outputs the same bits. A weight
    of 0 for another sequence's position did not keep its NaN out: 0 x NaN in the diagonal
    block's product, in the chunk states and in the carried state (found on the H100 by the
    reliability step). A bad step reached the later sequences of its chunk through the cumulative
    sums, which now restart at each boundary (dt and dt_rev at t = 3). (The dense float64
    reference is no judge here: its matrix product has the same 0 x NaN.)"""
    inputs = make_inputs(batch=1, heads=2, groups=1)
    seq_idx = packed_ids(1, 37)
    kw = dict(chunk_size=16, dt_softplus=True, seq_idx=seq_idx)
    clean = bidirectional_chunk_scan(**inputs, **kw)
    inputs[argument] = inputs[argument].clone()
    inputs[argument][0, t] = value
    out = bidirectional_chunk_scan(**inputs, **kw)
    pos = torch.arange(37)
    reads = {"x": pos >= 0, "B": pos >= t, "dt": pos >= t, "B_rev": pos <= t, "dt_rev": pos <= t, "C": pos == t}
    same_sequence = (seq_idx[0] == seq_idx[0, t]).cpu()
    reached = reads[argument] & same_sequence
    assert not out[:, reached].isfinite().any(), "an output that reads the value is finite"
    may_change = reached.clone()
    if argument == "dt_rev":
        # the reverse decays are differences of chunk-local cumulative sums of dt_rev: a bad
        # step also spoils the later positions of its own chunk, which do not read it (a known
        # limit, named in the chapter's note on non-finite inputs)
        may_change |= same_sequence & (pos // 16 == t // 16)
    assert torch.equal(out[:, ~may_change], clean[:, ~may_change]), "an output that does not read the value changed"


@pytest.mark.parametrize("shift", [False, True])
def test_fused_cu_seqlens_is_seq_idx_and_separate_runs(shift):
    """cu_seqlens (an empty sequence among them) gives what the seq_idx it implies gives, and what
    each sequence gives alone; boundaries inside chunks and on a chunk's edge, slow decays (a leak
    across a boundary would be large)."""
    inputs = make_inputs(batch=1, heads=2, groups=1)
    inputs["A"] = -uniform(2, low=0.02, high=0.1)
    offsets = [0, 5, 5, 6, 16, 27, 37]
    cu_seqlens = torch.tensor(offsets, dtype=torch.int64, device=DEVICE)
    kw = dict(chunk_size=16, dt_softplus=True, shift=shift)
    by_offsets = bidirectional_chunk_scan(**inputs, cu_seqlens=cu_seqlens, **kw)
    by_ids = bidirectional_chunk_scan(**inputs, seq_idx=packed_seq_idx(None, cu_seqlens, 37).to(torch.int32), **kw)
    assert torch.equal(by_offsets, by_ids)
    alone = torch.cat([run_alone(bidirectional_chunk_scan, inputs, s, e, **kw)
                       for s, e in zip(offsets[:-1], offsets[1:]) if e > s], dim=1)
    assert_close(by_offsets, alone, tolerance(torch.float32))
    assert_close(by_offsets, bidirectional_ref(**inputs, cu_seqlens=cu_seqlens, dt_softplus=True, shift=shift),
                 tolerance(torch.float32))


@pytest.mark.parametrize("shift", [False, True])
def test_fused_cu_seqlens_as_a_view_forward_and_every_gradient(shift, monkeypatch):
    """cu_seqlens a stride-2 slice (a column of a (sequences + 1, 2) tensor whose other column holds
    the offsets reversed: read densely they are not offsets at all), an empty sequence among them,
    slow decays: forward and every gradient against float64 (check_fused). torch.searchsorted gets
    contiguous boundaries (given a view it copies them itself and warns, once per process)."""
    searchsorted, strided = torch.searchsorted, []

    def watched(boundaries, *args, **kwargs):
        strided.append(not boundaries.is_contiguous())
        return searchsorted(boundaries, *args, **kwargs)
    monkeypatch.setattr(torch, "searchsorted", watched)
    inputs = make_inputs(batch=1, heads=2, groups=1, separate=shift)
    inputs["A"] = -uniform(2, low=0.02, high=0.1)
    offsets = torch.tensor([0, 5, 5, 6, 16, 27, 37], dtype=torch.int64, device=DEVICE)
    cu_view = every_other(offsets, offsets.flip(0))
    check_fused(inputs, cu_seqlens=cu_view, dt_softplus=True, shift=shift)
    assert strided and not any(strided)


@pytest.mark.parametrize("shift, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float16)])
def test_fused_views_forward_and_gradients(shift, dtype):
    """Every tensor a view: x, z, B, C, B', C' and both steps split out of one projection (as a
    Hydra or Mamba-2 layer does), x also time-major transposed; the gradients reach the projection.
    In float16 the projection and x; A, D and dt_bias float32, as a model keeps them."""
    batch, length, heads, headdim, groups, dstate = 2, 37, 2, 8, 1, 8
    widths = [heads * headdim] * 2 + [groups * dstate] * 4 + [heads] * 2
    leaves = dict(proj=randn(batch, length, sum(widths), dtype=dtype),
                  xt=randn(length, batch, heads, headdim, dtype=dtype),
                  A=-uniform(heads, low=0.5, high=2.0), D=randn(heads), dt_bias=randn(heads, scale=0.5))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}

    def call(fn):
        def run(proj, xt, A, D, dt_bias):
            z, x, B, C, B_rev, C_rev, dt, dt_rev = torch.split(proj, widths, dim=-1)
            heads_of = lambda t: t.unflatten(-1, (-1, headdim))  # noqa: E731
            groups_of = lambda t: t.unflatten(-1, (groups, dstate))  # noqa: E731
            return fn(heads_of(x) + xt.transpose(0, 1), dt, A, groups_of(B), groups_of(C), D=D, z=heads_of(z),
                      dt_bias=dt_bias, dt_softplus=True, shift=shift, dt_rev=dt_rev, B_rev=groups_of(B_rev),
                      C_rev=groups_of(C_rev))
        return run

    ours = call(lambda *a, **k: bidirectional_chunk_scan(*a[:5], 16, **k))
    ref = call(bidirectional_ref)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype))
    errors = assert_gradients_close(ours, ref, leaves, tol=1.0)
    for name, err in errors.items():
        assert err < fused_grad_tol(name if name not in ("proj", "xt") else "x", dtype), f"grad {name}: {err:.3e}"


def test_fused_views_of_the_per_head_arguments_and_seq_idx():
    """The arguments test_fused_views_forward_and_gradients passes contiguous, as views: A one
    number expanded over the heads (stride 0), D a transposed (headdim, heads) tensor, dt_bias a
    strided slice, seq_idx one row expanded over the batch (stride 0); against float64, forward
    and every gradient, reaching the leaves through the views."""
    heads, headdim = 2, 8
    inputs = make_inputs(batch=2, length=21, heads=heads, headdim=headdim, groups=1, D_shape=None, separate=True)
    leaves = {k: v for k, v in inputs.items() if k not in ("A", "D", "dt_bias")}
    leaves.update(A_one=-uniform(1, low=0.5, high=2.0), D_t=randn(headdim, heads),
                  bias_wide=randn(2 * heads, scale=0.5))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    seq_idx = packed_ids(1, 21).expand(2, -1)

    def call(fn, seq_idx):
        def run(A_one, D_t, bias_wide, **rest):
            return fn(A=A_one.expand(heads), D=D_t.t(), dt_bias=bias_wide[::2], **rest, seq_idx=seq_idx,
                      dt_softplus=True, shift=True)
        return run

    ours = call(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16), seq_idx)
    ref = call(bidirectional_ref, seq_idx.contiguous())  # (torch.searchsorted warns of a view)
    assert_close(ours(**leaves), ref(**leaves), tolerance(torch.float32), "out")
    errors = assert_gradients_close(ours, ref, leaves, tol=1.0)
    assert set(errors) == set(leaves)
    for name, err in errors.items():
        as_argument = dict(A_one="A", D_t="D", bias_wide="dt_bias").get(name, name)
        assert err < fused_grad_tol(as_argument, torch.float32), f"grad {name}: relative error {err:.3e}"


def test_a_time_major_B_rev_gives_what_a_contiguous_one_gives():
    """The op copies a B' (or B, C, C') whose dstate is strided, which avoids the scores kernel's
    H100 defect (test_scores_of_a_time_major_B_rev_at_an_odd_length in test_reliability_smoke.py):
    outputs and gradients the same bits as with B' contiguous (the H100 sweep case had a wrong
    output and NaN gradients; with the copy, the same bits on the H100)."""
    length = size(gpu=1021, cpu=37)  # two chunks, the second partial
    x, z = (randn(1, length, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    dt = uniform(1, length, 2, low=0.05, high=0.5)
    A = -uniform(2, low=0.5, high=1.5)
    B, C, C_rev = (randn(1, length, 1, 100, dtype=torch.bfloat16) for _ in range(3))
    time_major = randn(1, 100, 1, length, dtype=torch.bfloat16).permute(0, 3, 2, 1)  # strides (1, 1, L, L)
    results = []
    for B_rev in (time_major, time_major.contiguous()):
        leaves = [t.detach().requires_grad_() for t in (x, B_rev)]
        out = bidirectional_chunk_scan(leaves[0], dt, A, B, C, 32, z=z, B_rev=leaves[1], C_rev=C_rev)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), leaves)))
    for name, got, want in zip(("out", "dx", "dB_rev"), *results):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("shift", [False, True])
def test_sequence_labels_do_not_matter(shift):
    """Ids are compared for equality only: packed_ids and packed_ids - 1 give the same bits, with
    a NaN step in the first sequence too, which stays in it (the sums once ran on from a negative
    run into id 0 of the first chunk, the sequence SSD's initial state belongs to)."""
    inputs = make_inputs(batch=1, heads=2, groups=1, separate=shift)
    inputs["dt"][0, 2] = math.nan
    ids = packed_ids(1, 37)
    out = bidirectional_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, seq_idx=ids, shift=shift)
    relabelled = bidirectional_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, seq_idx=ids - 1, shift=shift)
    assert torch.equal(out.isnan(), relabelled.isnan()) and torch.equal(out.nan_to_num(), relabelled.nan_to_num())
    assert out[:, 5:].isfinite().all()


@pytest.mark.parametrize("shift, separate", [(False, False), (True, True)])
def test_fused_packed_after_a_strongly_decaying_sequence(shift, separate):
    """The cumulative sums restart at each boundary, so a weight factored through a reference
    position across one can overflow (exp of a large positive exponent): the dx kernel's
    transposed tiles multiplied such a weight by a zeroed score, 0 x inf = NaN in dx and d dt.
    Sequence [5, 6) holds one step of 200 (a decay of e^-100 or less, both directions), so the
    exponents from it to its neighbours pass float32's exp range; forward and every gradient
    against float64. (Sequences of many large steps lose digits however the sums run: a is then
    large, and a_t - a_s near the diagonal keeps only its absolute rounding, 2^-24 |a|.)"""
    inputs = make_inputs(batch=2, heads=2, groups=1, separate=separate)
    for name in ("dt", "dt_rev"):
        if inputs.get(name) is not None:
            inputs[name][0, 5] = 200.0
    check_fused(inputs, chunk_size=16, dt_softplus=True, seq_idx=packed_ids(2, 37), shift=shift)


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
@pytest.mark.parametrize("shift", [False, True])
def test_fused_leading_negative_ids_into_a_short_last_chunk(shift, separate):
    """Ids -1 up to t = 36 of 45, then 0, chunk 16: the last chunk is cut short by L, and the state
    carried into it belongs to id -1. Positions past L must never count as that sequence's (a
    chunk-state kernel that read their ids as -1 would take sequence 0's rows into it). Forward and
    every gradient against float64."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=separate)
    seq_idx = (torch.arange(45, device=DEVICE) >= 36).to(torch.int32)[None] - 1
    check_fused(inputs, chunk_size=16, dt_softplus=True, seq_idx=seq_idx, shift=shift)


@pytest.mark.parametrize("length, chunk, boundary, nan_at", [(45, 16, 36, 38), (300, 128, 150, 170)])
@pytest.mark.parametrize("nan_in", ["dy", "x"])
@pytest.mark.parametrize("op", [ssd_chunk_scan, bidirectional_chunk_scan,
                                functools.partial(bidirectional_chunk_scan, shift=True)],
                         ids=["ssd", "bidirectional", "bidirectional-shift"])
def test_a_non_finite_value_stays_in_its_packed_sequence(op, nan_in, length, chunk, boundary, nan_at):
    """A NaN in dy (or in x) in the second of two packed sequences, a few steps after the boundary
    inside a chunk, spoils the gradients of its own sequence only, in both chunked ops. The first
    sequence's last positions share its chunk: the backward's products there take a zeroed weight
    times the NaN's row, 0 x NaN, unless selects after the products (dCB, dG, the state terms)
    and the dx kernels' checked launch keep it out. And the NaN does reach the rows that see it:
    x's gradient at the boundary, which sees dy there only through the diagonal block."""
    inputs = make_inputs(batch=1, length=length, heads=2, groups=1, separate=False)
    inputs["seq_idx"] = (torch.arange(length, device=DEVICE) >= boundary).to(torch.int32)[None]
    dy = randn(*inputs["x"].shape)
    (dy if nan_in == "dy" else inputs["x"])[0, nan_at] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: op(**a, chunk_size=chunk, dt_softplus=True), inputs, dy)
    assert all(grads[name][0, :boundary].isfinite().all() for name in ("x", "dt", "B", "C")), grads
    if nan_in == "dy":
        assert not grads["x"][0, boundary].isfinite().any()


@pytest.mark.parametrize("nan_in", ["dy", "x"])
@pytest.mark.parametrize("op", [ssd_chunk_scan, bidirectional_chunk_scan,
                                functools.partial(bidirectional_chunk_scan, shift=True)],
                         ids=["ssd", "bidirectional", "bidirectional-shift"])
def test_a_non_finite_value_in_a_leading_negative_sequence_stays_there(op, nan_in):
    """Ids -1 up to t = 36 of 45, then 0, chunk 16; a NaN at t = 16, in the sequence of id -1. The
    last chunk is cut short by L, and the rows past L must not count as id -1's (as the one before
    them does): a padding row kept by the state terms' selects took 0 x NaN from a state of id -1
    into the step-gradient slots, and from there into d dt of sequence 0."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=False)
    inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 36).to(torch.int32)[None] - 1
    dy = randn(*inputs["x"].shape)
    (dy if nan_in == "dy" else inputs["x"])[0, 16] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: op(**a, chunk_size=16, dt_softplus=True), inputs, dy)
    assert all(grads[name][0, 36:].isfinite().all() for name in ("x", "dt", "B", "C")), grads


@pytest.mark.parametrize("shift", [False, True])
def test_each_direction_keeps_a_non_finite_dy_to_its_own_steps(shift):
    """Hydra's separate parameters per direction, one sequence, a NaN in dy at t = 20 (chunk 16):
    y_t reads the forward direction's steps and B up to t and the reverse direction's from t on, so
    the gradients of dt and B after t and of dt_rev and B_rev before t stay finite. The checked dx
    launch counted a row that sees dy_t through one direction as seeing it in both accumulators,
    and d dt of the rows after t in its chunk came out NaN."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=True, D_shape=None, z=False)
    dy = randn(*inputs["x"].shape)
    dy[0, 20] = math.nan
    for name in ("dt", "B", "dt_rev", "B_rev"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, dt_softplus=True, shift=shift),
                      inputs, dy)
    assert grads["dt"][0, 21:].isfinite().all() and grads["B"][0, 21:].isfinite().all()
    assert grads["dt_rev"][0, :20].isfinite().all() and grads["B_rev"][0, :20].isfinite().all()


@pytest.mark.parametrize("op", [ssd_chunk_scan, bidirectional_chunk_scan,
                                functools.partial(bidirectional_chunk_scan, shift=True)],
                         ids=["ssd", "bidirectional", "bidirectional-shift"])
def test_a_non_finite_dy_in_chunk_0_stays_in_its_sequence_whatever_the_ids(op):
    """Sequences [0, 5), [5, 6), [6, 16), [16, 37) with ids -2, -1, 0, 1 (chunk 16) and a NaN in dy
    at t = 10, in the sequence of id 0: the gradients of the two sequences before it stay finite, as
    they do with ids 0, 1, 2, 3. Chunk 0 has no state carried in, but its rows of id 0 matched the
    carried id's default of 0, and a zero state times the NaN's row went into the step gradients."""
    inputs = make_inputs(batch=1, length=37, heads=2, groups=1, separate=False)
    del inputs["dt_bias"]
    inputs["seq_idx"] = (torch.arange(37, device=DEVICE)[:, None] >= torch.tensor([5, 6, 16], device=DEVICE)
                         ).sum(-1).to(torch.int32)[None] - 2
    dy = randn(*inputs["x"].shape)
    dy[0, 10] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: op(**a, chunk_size=16, dt_softplus=True), inputs, dy)
    assert all(grads[name][0, :6].isfinite().all() for name in ("x", "dt", "B", "C")), grads


@pytest.mark.parametrize("shift", [False, True])
def test_a_non_finite_dy_at_a_chunk_edge_stays_in_its_sequence(shift):
    """Two sequences that meet on a chunk edge (16, chunk 16) and a NaN in dy at t = 15, the first
    sequence's last position: no state crosses the edge, so the second sequence's gradients stay
    finite. The reverse state entering chunk 0 from the right is zero, and the chunk's last
    sequence took a state term of it (0 x NaN), which with the shift moved one row on, into dC of
    the second sequence's first row."""
    inputs = make_inputs(batch=1, length=37, heads=2, groups=1, separate=shift)
    inputs["seq_idx"] = (torch.arange(37, device=DEVICE) >= 16).to(torch.int32)[None]
    dy = randn(*inputs["x"].shape)
    dy[0, 15] = math.nan
    names = ("x", "dt", "B", "C") + (("dt_rev", "B_rev", "C_rev") if shift else ())
    for name in names:
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, dt_softplus=True, shift=shift),
                      inputs, dy)
    assert all(grads[name][0, 16:].isfinite().all() for name in names), grads


@pytest.mark.parametrize("op", [ssd_chunk_scan, bidirectional_chunk_scan], ids=["ssd", "bidirectional"])
def test_a_non_finite_B_keeps_out_of_the_next_sequences_steps_and_x(op):
    """A NaN in B at t = 33, in the first of two packed sequences (0 up to t = 36 of 45, then 1, chunk
    16): the second sequence's d dt and dx stay finite (its dC does not yet: the strict xfail below).
    Chapter 6's dG kernel multiplied its scores, G = C B, unselected into the step gradients."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=False)
    inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 36).to(torch.int32)[None]
    inputs["B"][0, 33] = math.nan
    for name in ("x", "dt"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: op(**a, chunk_size=16, dt_softplus=True), inputs, randn(*inputs["x"].shape))
    assert grads["x"][0, 36:].isfinite().all() and grads["dt"][0, 36:].isfinite().all(), grads


def test_with_the_shift_a_non_finite_dy_skips_its_own_x():
    """With the shift (Hydra's form) and no D, y_t reads every x_s of its sequence but x_t, so a NaN
    in dy_t must leave dx_t finite; the checked dx launch counted row t as seeing dy_t."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=True, D_shape=None)
    dy = randn(*inputs["x"].shape)
    dy[0, 20] = math.nan
    inputs["x"].requires_grad_()
    grads = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, dt_softplus=True, shift=True),
                      inputs, dy)
    assert grads["x"][0, 20].isfinite().all() and not grads["x"][0, 19].isfinite().any()


def test_with_the_shift_a_non_finite_dy_skips_its_own_step():
    """With the shift y_t reads neither step t of the forward direction nor of the reverse one, so a
    NaN in dy_t leaves d dt_t and d dt_rev_t finite. The row's own step was taken back from the pair
    sums as a difference, NaN - NaN; the pair sums now leave it out."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=True, D_shape=None, z=False)
    dy = randn(*inputs["x"].shape)
    dy[0, 20] = math.nan
    for name in ("dt", "dt_rev"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, dt_softplus=True, shift=True),
                      inputs, dy)
    assert grads["dt"][0, 20].isfinite().all() and grads["dt_rev"][0, 20].isfinite().all()


@pytest.mark.parametrize("op", [ssd_chunk_scan, bidirectional_chunk_scan], ids=["ssd", "bidirectional"])
def test_a_non_finite_B_stays_in_its_packed_sequence(op):
    """A NaN in B at t = 33, in the first of two packed sequences (0 up to t = 36 of 45, then 1,
    chunk 16), leaves the second sequence's gradients finite. It reached dC of the second
    sequence's rows in the same chunk: dC_r sums dCB[r, s] B_s over the chunk's columns, and a
    select on dCB cannot keep out a NaN of B that enters through the product; the dB/dC kernels'
    checked launches do. (A NaN in C reached dB of the rows that do not read it in the same way.)"""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=False)
    inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 36).to(torch.int32)[None]
    inputs["B"][0, 33] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: op(**a, chunk_size=16, dt_softplus=True), inputs, randn(*inputs["x"].shape))
    assert all(grads[name][0, 36:].isfinite().all() for name in ("x", "dt", "B", "C")), grads


@pytest.mark.parametrize("shift", [False, True])
def test_fused_agrees_with_two_calls(shift):
    """The fused pipeline and the naive composition of two causal SSD calls compute the same function."""
    inputs = make_inputs(length=45, heads=2, groups=1, separate=shift)
    kw = dict(dt_softplus=True, seq_idx=packed_ids(2, 45), shift=shift)
    assert_close(bidirectional_chunk_scan(**inputs, chunk_size=32, **kw),
                 bidirectional_two_calls(**inputs, chunk_size=32, **kw), 2 * tolerance(torch.float32))


@pytest.mark.parametrize("shift", [False, True])
def test_fused_zero_B_and_C_give_D_x(shift):
    """The chapter's exercise on the kernel: with B = C = 0 only the skip is left, y = D x exactly."""
    inputs = make_inputs(D_shape="channel", separate=False, z=False)
    inputs["B"], inputs["C"] = torch.zeros_like(inputs["B"]), torch.zeros_like(inputs["C"])
    out = bidirectional_chunk_scan(**inputs, chunk_size=16, shift=shift)
    assert torch.equal(out, inputs["x"] * inputs["D"])


@pytest.mark.skipif(not INTERPRETED, reason="counts launches in the interpreter")
@pytest.mark.parametrize("batch, length, heads", [(1, 0, 2), (0, 5, 2), (2, 5, 0)])
def test_fused_empty_inputs_give_empty_outputs_and_zero_gradients(no_launch, batch, length, heads):
    inputs = make_inputs(batch=batch, length=length, heads=heads, groups=1, D_shape="head")
    inputs = {k: v.requires_grad_() for k, v in inputs.items()}
    out = bidirectional_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, shift=True)
    assert out.shape == inputs["x"].shape
    out.sum().backward()
    for name, v in inputs.items():
        assert v.grad.shape == v.shape and not v.grad.any(), name


def run_programs_in_reverse_order(monkeypatch):
    """The interpreter runs a grid's programs one after another in order: from here on, last to first."""
    builder = triton.runtime.interpreter.interpreter_builder
    in_order = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx",
                        lambda x, y, z: in_order(*(n - 1 - i for n, i in zip(builder.grid_dim, (x, y, z)))))


@pytest.mark.skipif(not INTERPRETED, reason="reorders the programs of the interpreter")
def test_fused_gradients_are_the_same_bits_whatever_order_the_programs_run_in():
    inputs = make_inputs(batch=1, length=41, heads=2, groups=1, dstate=24)
    inputs = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}

    def fn(**args):
        return bidirectional_chunk_scan(**args, chunk_size=32, dt_softplus=True, seq_idx=packed_ids(1, 41),
                                        shift=True)

    grad_out = randn(*inputs["x"].shape)
    first, again = gradients(fn, inputs, grad_out), gradients(fn, inputs, grad_out)
    with pytest.MonkeyPatch.context() as reverse:
        run_programs_in_reverse_order(reverse)
        backwards = gradients(fn, inputs, grad_out)
    for name in first:
        assert torch.equal(first[name], again[name]) and torch.equal(first[name], backwards[name]), name


def op_args(optional, shift):
    """Arguments of the registered op (mamba_annotated::bidirectional_chunk_scan), small."""
    i = make_inputs(batch=1, length=17, heads=2, groups=1, separate=optional)
    i = {k: (v.requires_grad_() if v is not None else v) for k, v in i.items()}
    seq_idx = packed_ids(1, 17) if optional else None
    if optional:
        return (i["x"], i["dt"], i["A"], i["B"], i["C"], 16, i["D"], i["z"], i["dt_bias"], seq_idx, True, 0.0,
                math.inf, shift, i["dt_rev"], i["B_rev"], i["C_rev"])
    return (i["x"], i["dt"], i["A"], i["B"], i["C"], 16, None, None, None, None, False, 0.0, math.inf, shift,
            None, None, None)


@pytest.mark.parametrize("optional, shift", [(False, False), (True, True)], ids=["bare", "every_argument"])
def test_fused_opcheck(optional, shift):
    torch.library.opcheck(bidirectional_chunk_scan_op.op, op_args(optional, shift))


def test_fused_torch_compile_fullgraph_matches_eager():
    inputs = make_inputs(batch=1, length=21, heads=2, groups=1)
    inputs = {k: v.requires_grad_() for k, v in inputs.items()}
    seq_idx = packed_ids(1, 21)

    def fn(x, dt, A, B, C, D, z, dt_bias, dt_rev, B_rev, C_rev):
        y = bidirectional_chunk_scan(x, dt, A, B, C, 16, D, z, dt_bias, True, seq_idx=seq_idx, shift=True,
                                     dt_rev=dt_rev, B_rev=B_rev, C_rev=C_rev)
        return (2 * y).square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_loss, compiled_loss = fn(**inputs), compiled(**inputs)
    want = torch.autograd.grad(eager_loss, list(inputs.values()))
    got = torch.autograd.grad(compiled_loss, list(inputs.values()))
    assert_close(compiled_loss, eager_loss, 1e-6, "loss")
    for name, g, w in zip(inputs, got, want):
        assert_close(g, w, 1e-6, f"grad {name}")


def first_row(inputs):
    return {k: (v[:1] if k in TIME_ARGS else v) for k, v in inputs.items()}


BAD_INPUTS = [
    (lambda i: dict(i, x=i["x"].double()), TypeError, "x must have dtype"),
    (lambda i: dict(i, x=i["x"][0]), ValueError, "x must have 4 dimensions"),
    (lambda i: dict(i, x=torch.zeros(2, 37, 4, 256, device=DEVICE)), NotImplementedError, "headdim 256"),
    (lambda i: dict(i, dt=i["dt"][:, :-1]), ValueError, "dt must have shape"),
    (lambda i: dict(i, A=i["A"][:-1]), ValueError, "A must have shape"),
    (lambda i: dict(i, B=i["B"].half()), TypeError, "B must have the dtype of x"),
    (lambda i: dict(i, C=i["C"][..., :-1]), ValueError, "C must have the shape of B"),
    (lambda i: dict(i, chunk_size=24), ValueError, "chunk_size must be one of"),
    (lambda i: dict(i, chunk_size=512), ValueError, "chunk_size must be one of"),
    (lambda i: dict(i, chunk_size=16.0), TypeError, "chunk_size must be an integer"),
    (lambda i: dict(i, D=i["D"][:, :-1]), ValueError, "D must have shape"),
    (lambda i: dict(i, z=i["z"][:, :-1]), ValueError, "z must have the shape of x"),
    (lambda i: dict(i, dt_bias=i["dt_bias"][None]), ValueError, "dt_bias must have shape"),
    (lambda i: dict(i, dt_limit=(1.0, 0.5)), ValueError, "dt_limit must be a pair"),
    (lambda i: dict(i, dt_rev=i["dt_rev"][:, :-1]), ValueError, "dt_rev must have shape"),
    (lambda i: dict(i, dt_rev=i["dt_rev"].long()), TypeError, "dt_rev must have dtype"),
    (lambda i: dict(i, B_rev=i["B_rev"][..., :-1]), ValueError, "B_rev must have the shape of B"),
    (lambda i: dict(i, C_rev=i["C_rev"].half()), TypeError, "C_rev must have the dtype of B"),
    (lambda i: dict(i, C_rev=i["C_rev"].cpu().numpy()), TypeError, "C_rev must be a torch.Tensor"),
    (lambda i: dict(i, seq_idx=torch.zeros(2, 37, device=DEVICE)), TypeError, "seq_idx must have dtype"),
    (lambda i: dict(i, seq_idx=torch.zeros(2, 36, dtype=torch.int32, device=DEVICE)), ValueError,
     "seq_idx must have shape"),
    (lambda i: dict(i, cu_seqlens=torch.tensor([0, 37], device=DEVICE)), ValueError, "cu_seqlens needs batch 1"),
    (lambda i: dict(first_row(i), cu_seqlens=torch.tensor([0.0, 37.0], device=DEVICE)), TypeError,
     "cu_seqlens must have dtype"),
    (lambda i: dict(first_row(i), cu_seqlens=torch.tensor([0, 37], device=DEVICE),
                    seq_idx=torch.zeros(1, 37, dtype=torch.int32, device=DEVICE)), ValueError,
     "seq_idx or cu_seqlens, not both"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_fused_bad_inputs_raise_clear_errors(build, error, message):
    inputs = dict(make_inputs(), chunk_size=16)
    with pytest.raises(error, match=message):
        bidirectional_chunk_scan(**build(inputs))


def packed_call(i, cu_seqlens):
    return dict(first_row(i), cu_seqlens=torch.tensor(cu_seqlens, device=DEVICE))


# the values inside seq_idx and cu_seqlens, checked on the device (validation.refuse_unless)
BAD_INDEX_VALUES = [
    (lambda i: dict(i, seq_idx=torch.arange(37, 0, -1, dtype=torch.int32, device=DEVICE).expand(2, -1)),
     "seq_idx must be nondecreasing"),
    (lambda i: packed_call(i, [0, 20, 38]), "cu_seqlens must be nondecreasing offsets"),
    (lambda i: packed_call(i, [3, 20, 37]), "cu_seqlens must be nondecreasing offsets"),
    (lambda i: packed_call(i, [0, 30, 20, 37]), "cu_seqlens must be nondecreasing offsets"),
]


@pytest.mark.parametrize("build, message", BAD_INDEX_VALUES)
def test_bad_index_values_are_refused_on_the_device(build, message):
    assert_refused_on_the_device("bidirectional_chunk_scan", message, **build(dict(make_inputs(), chunk_size=16)))


# ---------------------------------------------------------------- GPU: real sizes, the tuned configurations

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real sizes need compiled kernels")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("chunk, headdim, dstate, groups, dtype, shift", [
    (32, 32, 16, 1, torch.float32, False),
    (64, 64, 64, 2, torch.bfloat16, True),
    (128, 128, 128, 4, torch.float16, False),
    (256, 64, 256, 1, torch.bfloat16, False),
    (256, 128, 128, 2, torch.float32, True),
])
def test_fused_real_sizes_against_reference(chunk, headdim, dstate, groups, dtype, shift):
    """Every gradient at real sizes, with the tuned configurations; the 16-bit step gradients
    (sums over every position of terms of both signs) within 3x the two-call composition's error."""
    length = 3 * chunk + 37
    inputs = make_inputs(batch=2, length=length, heads=8, headdim=headdim, groups=groups, dstate=dstate, dtype=dtype,
                         separate=shift)
    inputs = {k: v.requires_grad_() for k, v in inputs.items() if v is not None}
    kw = dict(dt_softplus=True, dt_limit=(0.01, 2.0), seq_idx=packed_ids(2, length), shift=shift)
    assert_close(bidirectional_chunk_scan(**inputs, chunk_size=chunk, **kw), bidirectional_ref(**inputs, **kw),
                 tolerance(dtype), "out")
    grad_out = randn(*inputs["x"].shape, dtype=dtype)
    ours = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=chunk, **kw), inputs, grad_out)
    as64 = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    want = gradients(lambda **a: bidirectional_ref(**a, **kw), as64, grad_out.double())
    steps = ("dt", "A", "dt_bias", "dt_rev")
    for name in ours:
        if dtype == torch.float32 or name not in steps:
            assert_close(ours[name], want[name], fused_grad_tol(name, dtype), f"grad {name}")
    if dtype != torch.float32:
        foil = gradients(lambda **a: bidirectional_two_calls(**a, chunk_size=chunk, **kw), inputs, grad_out)
        for name in set(steps) & set(ours):
            assert_within_same_computation(f"grad {name}", ours[name], foil[name], want[name], dtype, factor=3.0)


@pytest.mark.gpu
@gpu_only
def test_fused_backward_is_the_same_bits_on_every_run_at_real_sizes():
    inputs = make_inputs(batch=2, length=3 * 256 + 37, heads=8, headdim=64, groups=2, dstate=128,
                         dtype=torch.bfloat16)
    inputs = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}

    def fn(**args):
        return bidirectional_chunk_scan(**args, chunk_size=256, dt_softplus=True, seq_idx=packed_ids(2, 805),
                                        shift=True)

    grad_out = randn(*inputs["x"].shape, dtype=torch.bfloat16)
    first = gradients(fn, inputs, grad_out)
    for _ in range(3):
        again = gradients(fn, inputs, grad_out)
        for name in first:
            assert torch.equal(first[name], again[name]), name


@pytest.mark.gpu
@pytest.mark.large_memory
@gpu_only
def test_fused_64_bit_indexing():
    """x with more than 2^31 elements; the last 300 positions form their own sequence, so their
    outputs can be checked against the reference run on that slice alone."""
    batch, length, heads, headdim, dstate, tail = 1, 2**19, 72, 64, 16, 300
    inputs = make_inputs(batch=batch, length=length, heads=heads, headdim=headdim, groups=1, dstate=dstate,
                         dtype=torch.bfloat16, D_shape="head", separate=False, z=False)
    assert inputs["x"].numel() > 2**31
    seq_idx = (torch.arange(length, device=DEVICE) >= length - tail).to(torch.int32)[None]
    out = bidirectional_chunk_scan(**inputs, chunk_size=256, seq_idx=seq_idx, dt_softplus=True)
    sliced = {k: (v[:, -tail:] if k in TIME_ARGS and v is not None else v) for k, v in inputs.items()}
    assert_close(out[:, -tail:], bidirectional_ref(**sliced, dt_softplus=True), tolerance(torch.bfloat16))


@pytest.mark.parametrize("D_shape", ["head", "channel"])
@pytest.mark.parametrize("shift", [False, True])
def test_dD_with_the_gate_is_summed_before_its_rounding(D_shape, shift):
    """Defect (H100 sweep, seed 509003: bfloat16 dD of one head with the gate at L = 2, 2.2e-3 off
    against the two-call foil's 1e-8): the gradient reaching y, d_out silu(z), was rounded to
    bfloat16 and dD summed from that copy. The gate's backward now sums dD (ssd/gate.py)."""
    inputs = make_inputs(batch=2, length=2, heads=1, headdim=64, groups=1, dtype=torch.bfloat16, D_shape=D_shape)
    differentiable = {k: (v.requires_grad_() if k in ("x", "D", "z") else v) for k, v in inputs.items()}
    errors = [assert_gradients_close(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, shift=shift),
                                     lambda **a: bidirectional_ref(**a, shift=shift), differentiable, tol=1.0,
                                     seed=seed)["D"] for seed in range(size(gpu=4, cpu=2))]
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("nan_in", ["B", "B_rev", "x", "C_last"])
@pytest.mark.parametrize("separate", [False, True])
def test_with_the_shift_a_non_finite_input_stays_out_of_the_outputs_that_skip_it(nan_in, separate, packed):
    """With the shift (Hydra's form) and no D, y_t reads neither x_t nor B_t (nor B'_t): the
    diagonal's weight is 0. Its score and x_t still entered the band's product, 0 x NaN, so a NaN
    in B_t, B'_t or x_t made y_t NaN; and a NaN in a sequence's last C, which the next sequence's
    first row takes as its forward query, reached that row through the same diagonal entry.
    Sequences [0, 21) and [21, 45) (or one, unpacked), chunk 16; the NaN at t = 10, or in C at t = 20."""
    if (nan_in == "B_rev" and not separate) or (nan_in == "C_last" and not packed):
        pytest.skip("B' is B" if nan_in == "B_rev" else "one sequence: row 21 reads C_20")
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=separate, D_shape=None, z=False)
    if packed:
        inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 21).to(torch.int32)[None]
    name, at = ("C", 20) if nan_in == "C_last" else (nan_in, 10)
    inputs[name][0, at] = math.nan
    y = bidirectional_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, shift=True)
    if nan_in == "C_last":
        assert y[0, 21:].isfinite().all()
    else:  # the NaN's own row stays finite, and the next row that reads it does not
        reader = at - 1 if nan_in == "B_rev" else at + 1
        assert y[0, at].isfinite().all() and not y[0, reader].isfinite().all()


@pytest.mark.parametrize("nan_in", ["B", "B_rev", "C"])
@pytest.mark.parametrize("shift", [False, True])
def test_each_direction_keeps_a_non_finite_B_or_C_to_the_rows_that_read_it(shift, nan_in):
    """Separate parameters per direction, sequences [0, 28) and [28, 45), chunk 16, a NaN at s = 25:
    B_s reaches the query gradients of the rows after s only (those before s do not read it), B'_s
    those before it, and C_s the gradients of B before it; the second sequence keeps every gradient
    finite. The dB/dC kernel's diagonal products multiplied a zeroed dG entry by the NaN, 0 x NaN,
    until its checked launch."""
    s = 25
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=True, D_shape=None, z=False)
    inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 28).to(torch.int32)[None]
    inputs[nan_in] = inputs[nan_in].clone()
    inputs[nan_in][0, s] = math.nan
    names = ("x", "dt", "B", "C", "dt_rev", "B_rev", "C_rev")
    for name in names:
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: bidirectional_chunk_scan(**a, chunk_size=16, dt_softplus=True, shift=shift),
                      inputs, randn(*inputs["x"].shape))
    assert all(grads[name][0, 28:].isfinite().all() for name in names), grads
    if nan_in == "B":
        assert grads["C"][0, :s].isfinite().all() and not grads["C"][0, s + 1].isfinite().any()
    elif nan_in == "B_rev":
        assert grads["C_rev"][0, s + 1:28].isfinite().all() and not grads["C_rev"][0, s - 1].isfinite().any()
    else:
        assert grads["B"][0, s + 1:28].isfinite().all() and not grads["B"][0, s - 1].isfinite().any()


@pytest.mark.parametrize("D_shape", ["head", "channel"])
def test_with_the_shift_and_D_a_non_finite_x_reaches_its_channel_only(D_shape):
    """With the shift and D, every output of a sequence reads x_t: the other rows through the two
    triangles, row t through D x_t. So a NaN in one channel of x_t reaches that channel of every
    output of its head, and nothing else, as the float64 reference has it. The band of the output
    kernel then needs no check of its x tiles (which marks a whole row NaN, every channel)."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, separate=True, D_shape=D_shape, z=False)
    inputs["x"][0, 10, 1, 3] = math.nan
    y = bidirectional_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, shift=True)
    reference = bidirectional_ref(**inputs, dt_softplus=True, shift=True)
    expected = torch.ones_like(reference, dtype=torch.bool)
    expected[0, :, 1, 3] = False
    assert torch.equal(reference.isfinite().cpu(), expected.cpu())
    assert torch.equal(y.isfinite().cpu(), expected.cpu())
