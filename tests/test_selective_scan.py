"""Chapter 4's selective scan against the float64 loop: forward, every gradient, options, bad inputs."""
import pathlib
import sys

import pytest
import torch

from mamba_annotated.runtime import DEVICE, size
from mamba_annotated.scan.api import selective_scan
from mamba_annotated.scan.reference import selective_scan_ref
from mamba_annotated.testing import (FLOAT_DTYPES, assert_close, assert_gradients_close, randn,
                                     tolerance, uniform)

ALL_OPTIONS = dict(D=True, z=True, delta_bias=True, delta_softplus=True)


def make_inputs(batch, dim, dstate, length, dtype=torch.float32, groups=None, D=False, z=False,
                delta_bias=False, delta_softplus=False):
    """Random inputs in the ranges Mamba uses: A < 0 (decays), delta > 0 after softplus."""
    bc_shape = (batch, dstate, length) if groups is None else (batch, groups, dstate, length)
    inputs = dict(
        u=randn(batch, dim, length, dtype=dtype),
        # raw delta around 0 when softplus follows (as in Mamba), else already a step size
        delta=(randn(batch, dim, length, dtype=dtype, scale=0.5) if delta_softplus
               else uniform(batch, dim, length, low=0.02, high=0.6, dtype=dtype)),
        A=-uniform(dim, dstate, low=0.2, high=2.0),
        B=randn(*bc_shape, dtype=dtype),
        C=randn(*bc_shape, dtype=dtype),
        D=randn(dim) if D else None,
        z=randn(batch, dim, length, dtype=dtype) if z else None,
        delta_bias=randn(dim, scale=0.3) if delta_bias else None,
    )
    return inputs, dict(delta_softplus=delta_softplus)


def check_forward_and_gradients(inputs, flags, tol, return_last_state=False):
    ours = selective_scan(**inputs, **flags, return_last_state=return_last_state)
    ref = selective_scan_ref(**inputs, **flags, return_last_state=return_last_state)
    if return_last_state:
        assert ours[1].dtype == torch.float32
        assert_close(ours[1], ref[1], tol, "last state")
        ours, ref = ours[0], ref[0]
    assert ours.dtype == inputs["u"].dtype
    assert_close(ours, ref, tol, "y")
    leaves = {k: (v.requires_grad_() if v is not None else None) for k, v in inputs.items()}
    assert_gradients_close(lambda **kw: selective_scan(**kw, **flags), lambda **kw: selective_scan_ref(**kw, **flags),
                           leaves, tol)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("length", [1, 16, 41])
def test_forward_and_gradients_with_every_option(dtype, length):
    # 41 = two full chunks of 16 steps and a ragged one on CPU
    inputs, flags = make_inputs(1, 4, 4, length, dtype, **ALL_OPTIONS)
    check_forward_and_gradients(inputs, flags, tolerance(dtype), return_last_state=True)


def test_plain_scan_no_options_longer_sequence():
    inputs, flags = make_inputs(2, 4, 4, size(gpu=1000, cpu=130))
    check_forward_and_gradients(inputs, flags, tolerance(torch.float32))


@pytest.mark.parametrize("dim, groups, dstate", [(8, 2, 4), (6, 3, 5), (4, 1, 16)])
def test_groups_and_state_sizes(dim, groups, dstate):
    # (6, 3): two channels per group; dstate 5 is not a power of two; groups=1 is the 4-d form of B, C
    inputs, flags = make_inputs(2, dim, dstate, 23, groups=groups, D=True, delta_bias=True)
    check_forward_and_gradients(inputs, flags, tolerance(torch.float32), return_last_state=True)


def y_and_last_state(scan, flags):
    """``scan`` with the last state returned and flattened beside y, so one gradient check covers both."""
    def run(**kw):
        y, last = scan(**kw, **flags, return_last_state=True)
        return torch.cat([y.flatten(), last.flatten()])
    return run


def test_gradient_through_the_last_state():
    inputs, flags = make_inputs(1, 4, 4, 37, z=True, delta_softplus=True)
    leaves = {k: (v.requires_grad_() if v is not None else None) for k, v in inputs.items()}
    assert_gradients_close(y_and_last_state(selective_scan, flags), y_and_last_state(selective_scan_ref, flags),
                           leaves, tolerance(torch.float32))


@pytest.mark.parametrize("fwd_block_l, fwd_block_d, bwd_block_d, bwd_block_l, bwd_warps",
                         [(16, 1, 1, 16, 1), (32, 4, 4, 16, 2), (64, 1, 2, 32, 4), (64, 2, 8, 64, 2)])
def test_every_block_size_the_sweeps_may_pick(monkeypatch, fwd_block_l, fwd_block_d, bwd_block_d, bwd_block_l,
                                              bwd_warps):
    """The block sizes are module constants that benchmarks/sweep_selective_scan.py changes (and the
    interpreter sets apart from the GPU's): the kernels must be right for any of them (a chunk of one
    or several backward chunks, one channel or several per program, in a group of 4 channels),
    through the last state too."""
    from mamba_annotated.scan import selective
    for name, value in dict(FWD_BLOCK_L=fwd_block_l, FWD_MAX_BLOCK_D=fwd_block_d, BWD_MAX_BLOCK_D=bwd_block_d,
                            BWD_BLOCK_L=bwd_block_l, BWD_NUM_WARPS=bwd_warps).items():
        monkeypatch.setattr(selective, name, value)
    length = 2 * fwd_block_l + 5
    inputs, flags = make_inputs(2, 8, 3, length, groups=2, **ALL_OPTIONS)
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    assert_gradients_close(y_and_last_state(selective_scan, flags), y_and_last_state(selective_scan_ref, flags),
                           leaves, tolerance(torch.float32))


def test_forward_chunks_must_hold_whole_backward_chunks(monkeypatch):
    from mamba_annotated.scan import selective
    monkeypatch.setattr(selective, "FWD_BLOCK_L", 16)
    monkeypatch.setattr(selective, "BWD_BLOCK_L", 32)
    inputs, flags = make_inputs(1, 4, 4, 40)
    with pytest.raises(AssertionError, match="whole backward chunks"):
        selective_scan(**{k: v.requires_grad_() for k, v in inputs.items() if v is not None}, **flags)


def test_large_steps_and_strong_decay():
    """delta up to 5 and A down to -8: a_t down to e^-40, where h_t - x_t must stay accurate."""
    inputs, flags = make_inputs(1, 4, 4, 29, D=True)
    inputs["delta"] = uniform(1, 4, 29, low=0.01, high=5.0)
    inputs["A"] = -uniform(4, 4, low=0.05, high=8.0)
    check_forward_and_gradients(inputs, flags, tolerance(torch.float32))


def test_softplus_far_from_zero():
    """Raw delta in (-30, 30): softplus returns its input past 20 and is nearly 0 far below."""
    inputs, flags = make_inputs(1, 4, 4, 25, delta_softplus=True)
    inputs["delta"] = uniform(1, 4, 25, low=-30.0, high=30.0)
    inputs["A"] = -uniform(4, 4, low=0.01, high=0.1)  # keep exp(delta * A) away from 0 at delta = 30
    check_forward_and_gradients(inputs, flags, tolerance(torch.float32))


def test_inputs_of_mixed_dtypes():
    """bfloat16 activations with float32 B, C (as when B, C come from a float32 projection)."""
    inputs, flags = make_inputs(2, 4, 4, 21, torch.bfloat16, **ALL_OPTIONS)
    inputs.update(B=inputs["B"].float(), C=inputs["C"].float())
    check_forward_and_gradients(inputs, flags, tolerance(torch.bfloat16), return_last_state=True)


def test_gradients_are_deterministic():
    """dB and dC are per-program partial sums added in a fixed order: no atomics, same bits every run."""
    inputs, flags = make_inputs(2, 8, 4, 33, groups=2, D=True)
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if v is not None}
    grad_y = randn(2, 8, 33)
    first, second = (torch.autograd.grad(selective_scan(**leaves, **flags), list(leaves.values()), grad_y)
                     for _ in range(2))
    for name, g1, g2 in zip(leaves, first, second):
        assert torch.equal(g1, g2), f"grad {name} differs between two runs"


def test_noncontiguous_inputs_are_copied_not_misread():
    inputs, flags = make_inputs(2, 4, 4, 19, D=True)
    strided = dict(inputs, u=inputs["u"].transpose(0, 1).contiguous().transpose(0, 1),
                   B=inputs["B"].transpose(1, 2).contiguous().transpose(1, 2))
    assert not strided["u"].is_contiguous() and not strided["B"].is_contiguous()
    assert_close(selective_scan(**strided, **flags), selective_scan_ref(**inputs, **flags), tolerance(torch.float32))


def test_exercise_time_invariant_scan_is_a_convolution():
    """Chapter 4's exercise: with delta, B, C constant in time (S4D), y = K * u with K_k = sum_n C_n exp(k delta A_n) delta B_n."""
    dim, dstate, length = 4, 4, 33
    inputs, flags = make_inputs(1, dim, dstate, length)
    step = uniform(dim, low=0.05, high=0.5)
    B_const, C_const = randn(dstate), randn(dstate)
    inputs.update(delta=step[None, :, None].expand(1, dim, length),
                  B=B_const[None, :, None].expand(1, dstate, length),
                  C=C_const[None, :, None].expand(1, dstate, length))
    y = selective_scan(**inputs, **flags)

    # the solution: the convolution kernel, then a causal convolution
    k = torch.arange(length, dtype=torch.float64, device=DEVICE)
    decay = torch.exp(k[None, None, :] * (step.double()[:, None] * inputs["A"].double())[:, :, None])
    K = (C_const.double()[None, :, None] * decay * (step.double()[:, None] * B_const.double()[None, :])[:, :, None]).sum(1)
    u = inputs["u"].double()[0]
    y_conv = torch.stack([(K[:, : t + 1].flip(-1) * u[:, : t + 1]).sum(-1) for t in range(length)], dim=-1)
    assert_close(y[0], y_conv, tolerance(torch.float32), "y as a convolution")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="large sizes need compiled kernels")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_large_gpu_problem(dtype):
    inputs, flags = make_inputs(2, 96, 16, 2049, dtype, groups=3, **ALL_OPTIONS)
    check_forward_and_gradients(inputs, flags, tolerance(dtype), return_last_state=True)


def mamba_ssm_selective_scan_ref():
    """mamba_ssm's own PyTorch reference, or None (see peers.mamba_ssm_selective_scan)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from peers import mamba_ssm_selective_scan

    module, _ = mamba_ssm_selective_scan()
    return getattr(module, "selective_scan_ref", None)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="mamba_ssm runs on the GPU box only")
def test_agrees_with_mamba_ssm_reference():
    ref = mamba_ssm_selective_scan_ref()
    if ref is None:
        pytest.skip("mamba_ssm is not installed")
    inputs, flags = make_inputs(2, 64, 16, 1000, groups=2, **ALL_OPTIONS)
    ours, ours_last = selective_scan(**inputs, **flags, return_last_state=True)
    theirs, theirs_last = ref(**inputs, **flags, return_last_state=True)
    assert_close(ours, theirs, 1e-5, "y vs mamba_ssm")
    assert_close(ours_last, theirs_last, 1e-5, "last state vs mamba_ssm")


BAD_INPUTS = [
    (lambda i: dict(i, u=i["u"].cpu().numpy()), TypeError, "u must be a torch.Tensor"),
    (lambda i: dict(i, u=i["u"].double(), delta=i["delta"].double()), TypeError, "u must have dtype"),
    (lambda i: dict(i, u=i["u"][0]), ValueError, "u must have 3 dimensions"),
    (lambda i: dict(i, delta=i["delta"][..., :-1]), ValueError, "delta must have the shape of u"),
    (lambda i: dict(i, delta=i["delta"].half()), TypeError, "delta must have the dtype of u"),
    (lambda i: dict(i, A=i["A"][:-1]), ValueError, r"A must have shape \(dim, N\)"),
    (lambda i: dict(i, A=i["A"].to(torch.complex64)), NotImplementedError, "A: complex A"),
    (lambda i: dict(i, B=i["B"][0, :, :1].T.expand(4, 4).contiguous()), NotImplementedError, "B: a time-invariant B"),
    (lambda i: dict(i, A=i["A"].int()), TypeError, "A must have dtype"),
    (lambda i: dict(i, B=i["B"][..., :-1]), ValueError, "B must have shape"),
    (lambda i: dict(i, B=i["B"][:, :-1]), ValueError, "B must have shape"),
    (lambda i: dict(i, B=i["B"][None]), ValueError, "B must have shape"),
    (lambda i: dict(i, B=i["B"][:, None].expand(2, 3, 4, 10)), ValueError, "groups .* must divide dim"),
    (lambda i: dict(i, C=i["C"][:, None]), ValueError, "C must have the shape of B"),
    (lambda i: dict(i, C=i["C"].int()), TypeError, "C must have dtype"),
    (lambda i: dict(i, D=torch.ones(3, device=DEVICE)), ValueError, "D must have shape"),
    (lambda i: dict(i, z=i["z"][..., 1:]), ValueError, "z must have the shape of u"),
    (lambda i: dict(i, delta_bias=torch.ones(4, 1, device=DEVICE)), ValueError, "delta_bias must have shape"),
    (lambda i: dict(i, delta_bias=torch.ones(4, dtype=torch.int64, device=DEVICE)), TypeError, "delta_bias must have dtype"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(build, error, message):
    inputs, flags = make_inputs(2, 4, 4, 10, D=True, z=True, delta_bias=True)
    with pytest.raises(error, match=message):
        selective_scan(**build(inputs), **flags)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a second device type")
def test_wrong_device_is_refused():
    inputs, flags = make_inputs(2, 4, 4, 10)
    with pytest.raises(ValueError, match="B is on cpu"):
        selective_scan(**dict(inputs, B=inputs["B"].cpu()), **flags)


@pytest.mark.parametrize("shape", [(2, 4, 0), (0, 4, 7), (2, 0, 7)])
def test_empty_inputs_give_empty_outputs_and_gradients(shape):
    batch, dim, length = shape
    inputs, flags = make_inputs(batch, dim, 3, length, D=True, z=True, delta_bias=True)
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    y, last = selective_scan(**leaves, **flags, return_last_state=True)
    assert y.shape == shape and last.shape == (batch, dim, 3)
    assert not last.any()  # no step taken: the state stays at zero
    (y.sum() + last.sum()).backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and not leaf.grad.any(), name


@pytest.mark.parametrize("log_decay", [-9.0, -12.0])
def test_small_decays_keep_dA_accurate(log_decay):
    """a_t = exp(delta A) near e^-9 and e^-12: forming a_t h_{t-1} as h_t - x_t cancelled (dA off by
    2.7e-4 and 4.8e-3); float32 arithmetic allows about 1e-6."""
    inputs, flags = make_inputs(1, 4, 4, 37)
    inputs["delta"] = uniform(1, 4, 37, low=0.9, high=1.1)
    inputs["A"] = torch.full((4, 4), log_decay, device=DEVICE) + uniform(4, 4, low=-0.5, high=0.5)
    leaves = {k: (v.requires_grad_() if v is not None else None) for k, v in inputs.items()}
    errors = assert_gradients_close(lambda **kw: selective_scan(**kw, **flags),
                                    lambda **kw: selective_scan_ref(**kw, **flags), leaves, 1e-5)
    assert errors["A"] < 1e-5


def test_softplus_of_tiny_steps_is_accurate():
    """softplus(x) for x near -9 and -11.5 (steps of 1e-4 and 1e-5): log(1 + e^x) lost 4e-4 and 6e-3."""
    inputs, flags = make_inputs(1, 4, 4, 20, delta_softplus=True)
    inputs["delta"] = uniform(1, 4, 20, low=-12.0, high=-9.0)
    inputs["D"] = None
    ours = selective_scan(**inputs, **flags)
    ref = selective_scan_ref(**inputs, **flags)
    assert_close(ours, ref, 2e-6, "y with tiny softplus'ed steps")


def test_non_contiguous_inputs_forward_and_gradients():
    """Views as a model makes them: u and z halves of one projection, delta transposed, B and C
    slices of a wider tensor, A expanded from a row (stride 0)."""
    batch, dim, dstate, length = 2, 4, 4, 21
    xz = randn(batch, length, 2 * dim).transpose(1, 2)                # (batch, 2*dim, L), stride(-1) != 1
    delta = uniform(batch, length, dim, low=0.02, high=0.6).transpose(1, 2)
    BC = randn(batch, 2 * dstate, length + 3)[..., 3:]
    A = -uniform(1, dstate, low=0.2, high=2.0).expand(dim, dstate)
    leaves = dict(xz=xz.requires_grad_(), delta=delta.requires_grad_(), BC=BC.requires_grad_(),
                  A=A.requires_grad_())

    def run(scan):
        def fn(xz, delta, BC, A):
            u, z = xz.chunk(2, dim=1)
            B, C = BC.chunk(2, dim=1)
            return scan(u, delta, A, B, C, z=z, delta_softplus=False)
        return fn

    assert_close(run(selective_scan)(**leaves), run(selective_scan_ref)(**leaves), 1e-5, "y")
    assert_gradients_close(run(selective_scan), run(selective_scan_ref), leaves, 1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_D_delta_bias_and_grouped_B_C_forward_and_gradients(dtype):
    """The arguments the test above passes contiguous, as views: D a strided slice (stride 2),
    delta_bias one number expanded over the channels (stride 0), B and C in the grouped 4-d form,
    time-major (batch, L, 2, groups, N) storage permuted to (batch, groups, N, L); u and delta
    transposed. Against float64, forward (y and the last state) and the gradients of the leaves."""
    batch, dim, groups, dstate, length = 2, 4, 2, 3, 21
    leaves = dict(ut=randn(batch, length, dim, dtype=dtype), delta_t=randn(batch, length, dim, dtype=dtype, scale=0.5),
                  A=-uniform(dim, dstate, low=0.2, high=2.0), BC=randn(batch, length, 2, groups, dstate, dtype=dtype),
                  D_wide=randn(2 * dim), bias_one=randn(1, scale=0.3))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}

    def run(scan):
        def fn(ut, delta_t, A, BC, D_wide, bias_one):
            B, C = BC.permute(2, 0, 3, 4, 1).unbind(0)    # (batch, groups, N, L), stride(-1) != 1
            y, last = scan(ut.transpose(1, 2), delta_t.transpose(1, 2), A, B, C, D=D_wide[::2], z=None,
                           delta_bias=bias_one.expand(dim), delta_softplus=True, return_last_state=True)
            return torch.cat([y.flatten(), last.flatten().to(y.dtype)])  # one upstream rounding for both
        return fn

    ours, ref = run(selective_scan), run(selective_scan_ref)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype), "y and last state")
    assert_gradients_close(ours, ref, leaves, tolerance(dtype))


def test_positional_call_as_mamba_ssm_makes_it():
    """mamba_ssm's Mamba.forward (no fast path): selective_scan_fn(x, dt, A, B, C, self.D.float(),
    z=z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True, return_last_state=...)."""
    inputs, _ = make_inputs(2, 4, 4, 19, D=True, z=True, delta_bias=True, delta_softplus=True)
    i = inputs
    y, last = selective_scan(i["u"], i["delta"], i["A"], i["B"], i["C"], i["D"].float(), z=i["z"],
                             delta_bias=i["delta_bias"].float(), delta_softplus=True, return_last_state=True)
    ref, ref_last = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
    assert_close(y, ref, 1e-5, "y")
    assert_close(last, ref_last, 1e-5, "last state")
    assert isinstance(selective_scan(i["u"], i["delta"], i["A"], i["B"], i["C"]), torch.Tensor)
