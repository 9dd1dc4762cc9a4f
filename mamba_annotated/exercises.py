"""Checkers for the chapters' exercises: ``check("6.1", your_function)``.

Each checker draws fresh random inputs, runs the reader's function and compares it with an oracle
built from the float64 references the tests use (never from a stored answer). A wrong answer raises
AssertionError saying which case failed and by how much; a stub that still raises
NotImplementedError is reported as not attempted; a right one prints one line. The solutions live
in the chapters (collapsed) and in ``tests/test_exercises.py``.
"""
import torch

from .bidirectional.reference import quasiseparable_matrix, shift_within_sequences
from .runtime import DEVICE
from .testing import assert_close


def packed_cases(length):
    """seq_idx values every checker tries: one sequence per row (None), and two rows of packed
    sequences with a sequence of length 1 and ids that skip values."""
    position = torch.arange(length, device=DEVICE)
    row0 = (position[:, None] >= torch.tensor([1, 2, length // 2], device=DEVICE)).sum(-1)
    row1 = torch.where(position < length - 3, 3, 7)
    return [None, torch.stack([row0, row1]).to(torch.int32)]


def shift_adjoint_oracle(g, seq_idx):
    """The gradient of <shift(x), g> with respect to x, by float64 autograd through the shift."""
    x = torch.zeros_like(g, requires_grad=True)
    (grad,) = torch.autograd.grad(shift_within_sequences(x, seq_idx), x, g)
    return grad


def check_shift_adjoint(shift_adjoint):
    """6.1: shift_adjoint(g, seq_idx) is the backward of shift_within_sequences: (batch, L, ...)."""
    for length in (1, 2, 13):
        for seq_idx in packed_cases(length):
            g = torch.randn(2, length, 3, 4, dtype=torch.float64, device=DEVICE)
            got = shift_adjoint(g.clone(), seq_idx)
            if not isinstance(got, torch.Tensor) or got.shape != g.shape:
                raise AssertionError(f"exercise 6.1: expected a tensor of shape {tuple(g.shape)}, got "
                                     f"{getattr(got, 'shape', type(got).__name__)}")
            case = f"L = {length}, seq_idx = {None if seq_idx is None else seq_idx.tolist()}"
            assert_close(got, shift_adjoint_oracle(g, seq_idx), 1e-12, f"exercise 6.1 ({case})")


def diagonal_oracle(dt, B, C, D, dt_rev, B_rev, C_rev):
    """The diagonal of M (shift=False, D of shape (heads,)) from the whole float64 matrix."""
    heads = dt.shape[2]
    A = -torch.ones(heads, dtype=torch.float64, device=dt.device)  # the diagonal does not depend on A
    M = quasiseparable_matrix(dt, A, B, C, dt_rev=dt_rev, B_rev=B_rev, C_rev=C_rev, D=D)
    return M.diagonal(dim1=-2, dim2=-1)


def check_diagonal(diagonal):
    """6.2: diagonal(dt, B, C, D, dt_rev, B_rev, C_rev) -> (batch, heads, L), the diagonal of M
    for shift=False; dt, dt_rev processed steps (batch, L, heads); B, C (batch, L, groups, dstate)."""
    for heads, groups in ((2, 1), (4, 2)):
        dt, dt_rev = (torch.rand(2, 11, heads, dtype=torch.float64, device=DEVICE) + 0.1 for _ in range(2))
        B, C, B_rev, C_rev = (torch.randn(2, 11, groups, 5, dtype=torch.float64, device=DEVICE) for _ in range(4))
        D = torch.randn(heads, dtype=torch.float64, device=DEVICE)
        got = diagonal(dt, B, C, D, dt_rev, B_rev, C_rev)
        want = diagonal_oracle(dt, B, C, D, dt_rev, B_rev, C_rev)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise AssertionError(f"exercise 6.2: expected a tensor of shape {tuple(want.shape)} (batch, heads, L), "
                                 f"got {getattr(got, 'shape', type(got).__name__)}")
        assert_close(got, want, 1e-12, f"exercise 6.2 ({heads} heads, {groups} groups)")


CHECKERS = {"6.1": check_shift_adjoint, "6.2": check_diagonal}


def check(exercise: str, fn) -> bool:
    """Run the checker of ``exercise`` (e.g. "6.1") on ``fn``. Returns True and prints a line when
    it is right; returns False when ``fn`` raises NotImplementedError (the stub); raises
    AssertionError naming the failing case otherwise."""
    if exercise not in CHECKERS:
        raise ValueError(f"exercise: no checker for {exercise!r}; there are {sorted(CHECKERS)}")
    try:
        CHECKERS[exercise](fn)
    except NotImplementedError:
        print(f"exercise {exercise}: not attempted yet (the stub raises NotImplementedError)")
        return False
    print(f"exercise {exercise}: correct on every case")
    return True
