"""The exercise checkers (mamba_annotated.exercises) accept the chapters' solutions, reject wrong
answers with an AssertionError that names the exercise, and report an untouched stub."""
import pytest
import torch

from mamba_annotated.exercises import check
from mamba_annotated.ssd.reference import per_head


def shift_adjoint(g, seq_idx):
    """Chapter 6's solution to 6.1: shift left, zero at the end of each packed sequence."""
    out = torch.zeros_like(g)
    out[:, :-1] = g[:, 1:]
    if seq_idx is not None:
        ends = torch.zeros(seq_idx.shape, dtype=torch.bool, device=g.device)
        ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
        out[ends] = 0
    return out


def shift_adjoint_ignoring_sequences(g, seq_idx):
    """Wrong: right for one sequence per row, but lets gradients cross packed boundaries."""
    return shift_adjoint(g, None)


def shift_right(g, seq_idx):
    """Wrong: the shift itself, not its adjoint."""
    out = torch.zeros_like(g)
    out[:, 1:] = g[:, :-1]
    return out


def diagonal(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Chapter 6's solution to 6.2: D + dt_t C_t.B_t + dt'_t C'_t.B'_t, per head."""
    heads = dt.shape[2]
    both = [d * (per_head(c, heads) * per_head(b, heads)).sum(-1) for d, b, c in ((dt, B, C), (dt_rev, B_rev, C_rev))]
    return (both[0] + both[1] + D).transpose(1, 2)


def diagonal_counted_once(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Wrong: the Hydra-like mistake of counting one direction only."""
    heads = dt.shape[2]
    return (dt * (per_head(C, heads) * per_head(B, heads)).sum(-1) + D).transpose(1, 2)


def diagonal_one_group(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Wrong with groups: every head reads group 0's B and C."""
    return diagonal(dt, B[:, :, :1], C[:, :, :1], D, dt_rev, B_rev[:, :, :1], C_rev[:, :, :1])


@pytest.mark.parametrize("exercise, solution", [("6.1", shift_adjoint), ("6.2", diagonal)])
def test_solution_accepted(exercise, solution, capsys):
    assert check(exercise, solution) is True
    assert f"exercise {exercise}: correct" in capsys.readouterr().out


@pytest.mark.parametrize("exercise, wrong", [("6.1", shift_adjoint_ignoring_sequences), ("6.1", shift_right),
                                             ("6.2", diagonal_counted_once), ("6.2", diagonal_one_group)])
def test_wrong_answer_rejected(exercise, wrong):
    with pytest.raises(AssertionError, match=f"exercise {exercise}"):
        check(exercise, wrong)


def test_wrong_shape_rejected():
    with pytest.raises(AssertionError, match="expected a tensor of shape"):
        check("6.1", lambda g, seq_idx: g[:, 1:])


@pytest.mark.parametrize("exercise", ["6.1", "6.2"])
def test_stub_reported(exercise, capsys):
    def stub(*args):
        raise NotImplementedError

    assert check(exercise, stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_unknown_exercise():
    with pytest.raises(ValueError, match="no checker"):
        check("9.9", shift_adjoint)
