"""Chapter 5's SSD kernels against the float64 references: forward, every gradient, seq_idx,
varlen states, odd lengths, groups, dtypes, views, bad inputs, empty inputs, reproducible
gradients, torch.library and torch.compile; on a GPU also real sizes and mamba_ssm itself."""
import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.runtime.interpreter

from mamba_annotated.runtime import DEVICE, INTERPRETED, size
from mamba_annotated.ssd import chunk_scan as scan_module, chunk_scan_bwd as backward_module
from mamba_annotated.ssd import chunk_state as state_module
from mamba_annotated.ssd import ssd_chunk_scan
from mamba_annotated.ssd.api import ssd_chunk_scan_op
from mamba_annotated.ssd.chunk_cumsum import chunk_cumsum
from mamba_annotated.ssd.chunk_scan import chunk_scan_kernel
from mamba_annotated.ssd.chunk_scan_bwd import (chunk_scan_bwd_dbc_kernel, chunk_scan_bwd_dcb_kernel,
                                                chunk_scan_bwd_dx_kernel)
from mamba_annotated.ssd.chunk_state import SCAN_ROWS, cb_length, chunk_cb, chunk_state_kernel, unpacked_cb
from mamba_annotated.ssd.log_decays import decay, decay_between, load_sums, natural_sums
from mamba_annotated.triton_ops import LN2
from mamba_annotated.ssd.reference import (process_dt, ssd_chunked_ref, ssd_quadratic_ref, ssd_recurrent_ref,
                                           ssd_varlen_states_ref)
from mamba_annotated.testing import (FLOAT_DTYPES, assert_close, assert_gradients_close,
                                     assert_refused_on_the_device, assert_within_same_computation, every_other,
                                     gradients, poisoned_outputs, randn, tolerance, uniform)

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="large sizes need compiled kernels")
ALL_GRADS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_inputs(batch=2, length=37, heads=4, headdim=16, groups=2, dstate=16, dtype=torch.float32,
                D_shape="channel", seq_idx=False):
    """Fresh random inputs for every argument; decays exp(dt A) well inside (0, 1)."""
    inputs = dict(
        x=randn(batch, length, heads, headdim, dtype=dtype),
        dt=uniform(batch, length, heads, low=0.02, high=0.6),  # positive: a decay even without softplus
        A=-uniform(heads, low=0.5, high=2.0),
        B=randn(batch, length, groups, dstate, dtype=dtype),
        C=randn(batch, length, groups, dstate, dtype=dtype),
        D=randn(heads, headdim) if D_shape == "channel" else randn(heads),
        z=randn(batch, length, heads, headdim, dtype=dtype),
        dt_bias=randn(heads, scale=0.5),
        initial_states=randn(batch, heads, headdim, dstate),
    )
    if seq_idx:
        # row 0: three sequences, boundaries inside chunks and on a chunk edge; row 1: one sequence
        cuts = torch.tensor([min(5, length - 1), min(16, length - 1)])
        pos = torch.arange(length)
        row0 = (pos[:, None] >= cuts[None, :]).sum(-1)
        inputs["seq_idx"] = torch.stack([row0] + [torch.zeros_like(row0)] * (batch - 1)).to(torch.int32).to(DEVICE)
    return inputs


def grad_tol(name, dtype):
    """dA, d dt_bias and dD are sums over every (batch, position) of terms of both signs, so the
    rounding of each term (float32: 2^-24; 16-bit tiles on the tensor cores: 2^-9) does not shrink
    with the result: one digit more than the per-dtype bound."""
    return tolerance(dtype) * (5 if dtype != torch.float32 else 10) if name in ("A", "dt_bias", "D") else tolerance(dtype)


def check_all_gradients(fn, ref_fn, inputs, dtype, skip=()):
    differentiable = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}
    errors = assert_gradients_close(fn, ref_fn, differentiable, tol=1.0)  # errors of every gradient
    for name, err in errors.items():
        if name not in skip:
            assert err < grad_tol(name, dtype), f"grad {name}: relative error {err:.3e}"
    return errors


@pytest.mark.parametrize("chunk", [32, 128])
def test_chunk_cb_stores_the_squares_on_and_below_the_diagonal(chunk):
    """CB keeps only what its readers read: the squares (of SCAN_ROWS, or one of the whole chunk)
    on the diagonal and left of it, cb_length floats per chunk and group, every float written
    (outputs start as NaN here), C_t . B_s on and below the diagonal; laid out as matrices again,
    the squares right of the diagonal are the fill (nothing there is stored)."""
    length, groups = 2 * chunk + 5, 2
    C, B = randn(1, length, groups, 32), randn(1, length, groups, 32)
    with poisoned_outputs():
        CB = chunk_cb(C, B, chunk)
    side = min(SCAN_ROWS, chunk)
    assert CB.shape == (1, 3, groups, cb_length(chunk))
    assert cb_length(chunk) == (chunk // side) * (chunk // side + 1) // 2 * side * side
    assert not CB.isnan().any()
    padded = [F.pad(t.double(), (0, 0, 0, 0, 0, 3 * chunk - length)) for t in (C, B)]
    expected = torch.einsum("bctgn,bcsgn->bcgts", *(t.view(1, 3, chunk, groups, 32) for t in padded))
    full = unpacked_cb(CB, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=CB.device).tril()
    assert_close(full[..., lower], expected[..., lower], tolerance(torch.float32), "CB")
    squares = torch.arange(chunk, device=CB.device) // side
    assert full[..., squares[None, :] > squares[:, None]].isnan().all()
    assert not full[..., squares[None, :] <= squares[:, None]].isnan().any()


def test_three_references_agree():
    inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in make_inputs(seq_idx=True).items()}
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.5), return_final_states=True)
    y_q, h_q = ssd_quadratic_ref(**inputs, **kw)
    y_r, h_r = ssd_recurrent_ref(**inputs, **kw)
    y_c, h_c = ssd_chunked_ref(**inputs, chunk_size=16, **kw)
    for out, ref in ((y_r, y_q), (y_c, y_q), (h_r, h_q), (h_c, h_q)):
        assert_close(out, ref, 1e-12)


@pytest.mark.parametrize("seq_idx, dt_limit", [(False, (0.0, math.inf)), (True, (0.05, 0.6))])
def test_every_argument_forward_and_gradients(seq_idx, dt_limit):
    inputs = make_inputs(seq_idx=seq_idx)
    kw = dict(dt_softplus=True, dt_limit=dt_limit)
    out, final = ssd_chunk_scan(**inputs, chunk_size=16, return_final_states=True, **kw)
    ref, ref_final = ssd_quadratic_ref(**inputs, return_final_states=True, **kw)
    assert_close(out, ref, tolerance(torch.float32), "y")
    assert_close(final, ref_final, tolerance(torch.float32), "final_states")
    # gradients through both outputs: the loss sees y and the final state
    check_all_gradients(lambda **a: _y_and_final(ssd_chunk_scan(**a, chunk_size=16, return_final_states=True, **kw)),
                        lambda **a: _y_and_final(ssd_quadratic_ref(**a, return_final_states=True, **kw)),
                        inputs, torch.float32)


def _y_and_final(pair):
    """Both outputs in one tensor, so one random upstream gradient reaches each."""
    y, final = pair
    return torch.cat([y.flatten(), final.flatten().to(y.dtype)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward_and_gradients(dtype):
    inputs = make_inputs(dtype=dtype)
    kw = dict(dt_softplus=True)
    assert_close(ssd_chunk_scan(**inputs, chunk_size=16, **kw), ssd_quadratic_ref(**inputs, **kw), tolerance(dtype))
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=16, **kw),
                        lambda **a: ssd_quadratic_ref(**a, **kw), inputs, dtype)


@pytest.mark.parametrize("length", [1, 15, 16, 17])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_odd_lengths_minimal_arguments(length, dtype):
    """No optional argument at all, one group, a scalar D per head, lengths around the chunk."""
    inputs = make_inputs(batch=1, length=length, heads=2, groups=1, dtype=dtype)
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    assert_close(ssd_chunk_scan(x, dt, A, B, C, 16), ssd_quadratic_ref(x, dt, A, B, C), tolerance(dtype))


def test_chunk_of_several_blocks_groups_and_scalar_D():
    """chunk 32 holds two 16-row blocks on CPU: the loops over blocks and the diagonal masks."""
    inputs = make_inputs(length=45, heads=4, groups=1, D_shape="head", seq_idx=True)
    kw = dict(dt_softplus=True)
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=32, **kw),
                        lambda **a: ssd_quadratic_ref(**a, **kw), inputs, torch.float32)


TUNED_KERNELS = (chunk_scan_kernel, chunk_state_kernel, chunk_scan_bwd_dx_kernel, chunk_scan_bwd_dcb_kernel,
                 chunk_scan_bwd_dbc_kernel)


def tune_small_then_wide(monkeypatch, wide):
    """Every autotuned SSD kernel, in the interpreter too, tunes between all blocks 16 wide and all
    blocks ``wide``; a fake timer ranks the last configuration tried fastest. So each result comes
    from a ``wide`` run that follows trial runs of the 16-wide one on the same buffers, as on a GPU."""
    timings = iter(range(10**6, 0, -1))

    def run_once_and_rank(kernel_call, quantiles):
        kernel_call()
        return [next(timings)] * len(quantiles)

    for kernel in TUNED_KERNELS:
        meta = kernel.configs[0].kwargs
        monkeypatch.setattr(kernel, "configs", [
            triton.Config({k: (width if k.startswith("BLOCK_") else v) for k, v in meta.items()}, num_warps=4,
                          num_stages=2) for width in (16, wide)])
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.setitem(kernel.__dict__, "do_bench", run_once_and_rank)  # shadows the cached property


@pytest.mark.parametrize("D_shape", ["channel", "head"])
def test_gradients_whatever_the_tuner_tried_first(monkeypatch, D_shape):
    """Chunk 64 in one 64-row block, after trial runs with 16-row blocks: a partial result laid out
    by the tuned block size (dD's per-block sums once were) keeps stale slots from the trials."""
    tune_small_then_wide(monkeypatch, wide=64)
    inputs = make_inputs(batch=1, length=64 + 37, heads=2, groups=1, D_shape=D_shape, seq_idx=True)
    kw = dict(dt_softplus=True)
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=64, **kw),
                        lambda **a: ssd_quadratic_ref(**a, **kw), inputs, torch.float32)


# (BLOCK_M, BLOCK_K) of the chunk scan, dx and dB/dC kernels: configurations of their GPU lists
GPU_BLOCKS = [((64, 32), (64, 32), (64, 64)), ((32, 32), (32, 32), (32, 64))]


@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize("blocks", GPU_BLOCKS)
def test_gpu_block_sizes_at_chunks_of_several_squares(monkeypatch, chunk, blocks):
    """The interpreter's 16-wide blocks read CB tiles unlike the GPU's. Here the kernels run with
    GPU block sizes: chunk_cb's 64, dCB's 64 rows, the checked passes' GPU blocks, and one
    configuration of each of the chunk scan's, dx's and dB/dC's lists. At chunks of two and four of
    CB's squares, every tile's place in the stored squares (chunk_state.cb_offsets) is computed as
    on a GPU, forward and backward, with packed sequences."""
    for module in (state_module, scan_module, backward_module):
        monkeypatch.setattr(module, "INTERPRETED", False)
    monkeypatch.setattr(backward_module, "DCB_ROWS", 64)
    for kernel, (block_m, block_k) in zip((chunk_scan_kernel, chunk_scan_bwd_dx_kernel, chunk_scan_bwd_dbc_kernel),
                                          blocks):
        meta = dict(kernel.configs[0].kwargs, BLOCK_M=block_m, BLOCK_K=block_k)
        monkeypatch.setattr(kernel, "configs", [triton.Config(meta, num_warps=4, num_stages=2)])
        monkeypatch.setattr(kernel, "cache", {})
    inputs = make_inputs(batch=1, length=chunk + 37, heads=2, groups=1, seq_idx=True)
    kw = dict(dt_softplus=True)
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=chunk, **kw),
                        lambda **a: ssd_quadratic_ref(**a, **kw), inputs, torch.float32)


def test_chunked_reference_matches_kernel_state_by_state():
    inputs = make_inputs(seq_idx=True)
    out, final = ssd_chunk_scan(**inputs, chunk_size=16, return_final_states=True)
    ref, ref_final = ssd_chunked_ref(**inputs, chunk_size=16, return_final_states=True)
    assert_close(out, ref, tolerance(torch.float32))
    assert_close(final, ref_final, tolerance(torch.float32))


def test_packed_sequences_equal_separate_runs():
    """Chapter exercise 1, seq_idx: one row holding two sequences gives what two separate calls give."""
    inputs = make_inputs(batch=1, length=40, seq_idx=False)
    inputs.pop("initial_states")
    cut = 21
    seq_idx = (torch.arange(40, device=DEVICE) >= cut).to(torch.int32)[None]
    packed = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=seq_idx)
    first = ssd_chunk_scan(**{k: (v[:, :cut] if v.dim() >= 3 else v) for k, v in inputs.items()}, chunk_size=16)
    second = ssd_chunk_scan(**{k: (v[:, cut:] if v.dim() >= 3 else v) for k, v in inputs.items()}, chunk_size=16)
    assert_close(packed, torch.cat([first, second], dim=1), tolerance(torch.float32))


def test_chunk_size_does_not_change_the_result():
    """Chapter exercise 2: chunk 16 and chunk 32 agree, and both agree with the recurrence."""
    inputs = make_inputs(length=40)
    small = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    large = ssd_chunk_scan(**inputs, chunk_size=32, dt_softplus=True)
    assert_close(small, large, tolerance(torch.float32))
    assert_close(large, ssd_recurrent_ref(**inputs, dt_softplus=True), tolerance(torch.float32))


# ---------------------------------------------------------------- the drop-in contract

MAMBA_SSM_PARAMETERS = [  # mamba_ssm 2.3.2.post1's mamba_chunk_scan_combined, in order, with defaults
    ("x", inspect.Parameter.empty), ("dt", inspect.Parameter.empty), ("A", inspect.Parameter.empty),
    ("B", inspect.Parameter.empty), ("C", inspect.Parameter.empty), ("chunk_size", inspect.Parameter.empty),
    ("D", None), ("z", None), ("dt_bias", None), ("initial_states", None), ("seq_idx", None), ("cu_seqlens", None),
    ("dt_softplus", False), ("dt_limit", (0.0, float("inf"))), ("return_final_states", False),
    ("return_varlen_states", False)]


def test_mamba_ssm_signature_and_positional_order():
    """Defect: dt_softplus came before initial_states and seq_idx, so a positional call written for
    mamba_ssm passed initial_states as dt_softplus."""
    parameters = inspect.signature(ssd_chunk_scan).parameters
    assert [(name, p.default) for name, p in parameters.items()] == MAMBA_SSM_PARAMETERS + [("state_dtype", None)]
    i = make_inputs(seq_idx=True)
    out, final = ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], 16, i["D"], i["z"], i["dt_bias"],
                                i["initial_states"], i["seq_idx"], None, True, (0.05, 0.6), True)
    ref, ref_final = ssd_quadratic_ref(**i, dt_softplus=True, dt_limit=(0.05, 0.6), return_final_states=True)
    assert_close(out, ref, tolerance(torch.float32), "y")
    assert_close(final, ref_final, tolerance(torch.float32), "final_states")


@pytest.mark.parametrize("chunk", [np.int64(16), np.int32(16), torch.tensor(16)])
def test_chunk_size_takes_any_integer(chunk):
    """Defect: only a Python int passed the check; a numpy integer (a config read from an array) failed."""
    inputs = make_inputs(batch=1, length=20, heads=2, groups=1)
    assert torch.equal(ssd_chunk_scan(**inputs, chunk_size=chunk), ssd_chunk_scan(**inputs, chunk_size=16))


def test_dt_is_always_clamped_to_dt_limit():
    """Defect: the default dt_limit (0, inf) clamped nothing, in the kernel and in process_dt alike,
    so a negative step (no softplus) made the state grow; mamba_ssm clamps it to 0. The clamp
    passes the gradient inside the limits, the limits included, and none outside."""
    dt = torch.tensor([-0.5, -1e-3, 0.0, 0.25, 0.5])
    assert torch.equal(process_dt(dt), dt.double().clamp(min=0.0))
    inputs = make_inputs(batch=1, length=21, heads=2, groups=1)
    for k in ("z", "D", "dt_bias", "initial_states"):
        inputs.pop(k)
    inputs["dt"] = uniform(1, 21, 2, low=-0.4, high=0.5)
    inputs["dt"][0, :4, 0] = torch.tensor([0.125, 0.375, -0.2, 0.45])  # the limits of the second case, exactly
    clamped = dict(inputs, dt=inputs["dt"].clamp(min=0.0))
    assert_close(ssd_chunk_scan(**inputs, chunk_size=16), ssd_quadratic_ref(**clamped, dt_limit=(-math.inf, math.inf)),
                 tolerance(torch.float32))
    grad_y = randn(*inputs["x"].shape)
    for limit in ((0.0, math.inf), (0.125, 0.375)):
        grad_dt = gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=16, dt_limit=limit),
                            dict(inputs, dt=inputs["dt"].requires_grad_()), grad_y)["dt"]
        want = gradients(lambda **a: ssd_quadratic_ref(**a, dt_limit=limit),
                         {k: v.double() for k, v in inputs.items()}, grad_y.double())["dt"]
        assert_close(grad_dt, want, tolerance(torch.float32), f"grad dt, dt_limit {limit}")
        outside = (inputs["dt"] < limit[0]) | (inputs["dt"] > limit[1])
        assert (grad_dt[outside] == 0).all() and (grad_dt[~outside] != 0).all()


def test_softplus_step_is_accurate_at_tiny_steps():
    """Defect: the step was log(1 + exp(v)), which loses the low digits of 1 + e^v: 6e-3 relative
    error at a step of 1e-5. Past 20 the softplus is the identity, as in torch and mamba_ssm."""
    v = torch.cat([torch.linspace(-18.0, 5.0, 60), torch.tensor([19.5, 20.0, 20.5, 30.0])]).reshape(1, -1, 1)
    dt, bias = (v - 0.25).to(DEVICE), torch.tensor([0.25], device=DEVICE)
    _, step = chunk_cumsum(dt, -torch.ones(1, device=DEVICE), 64, dt_bias=bias, dt_softplus=True)
    want = F.softplus((dt + bias).double().flatten())  # the float32 sum the kernel forms
    got = step.flatten()[:v.numel()].double()
    assert ((got - want).abs() / want).max() < 2e-6  # a few float32 ulps (a GPU's exp and log are approximate)
    # the gradient through the softplus, at steps from 1e-8 to 1e-2
    inputs = make_inputs(batch=1, length=20, heads=2, groups=1)
    inputs["dt"] = uniform(1, 20, 2, low=-18.0, high=-5.0).requires_grad_()
    assert_gradients_close(lambda **a: ssd_chunk_scan(**a, chunk_size=16, dt_softplus=True),
                           lambda **a: ssd_quadratic_ref(**a, dt_softplus=True),
                           {k: inputs[k] for k in ("x", "dt", "A", "B", "C")}, tolerance(torch.float32))


@pytest.mark.parametrize("packed", [False, True])
def test_chunk_sums_keep_their_low_part(packed):
    """Defect (GPU sweep, SSD seed 71461: float32, L = 2039, chunk 256): the chunk sums of dt A were
    added and kept in float32, so a_last - a_t near a chunk's end, the exponent of the weights its
    state sits on, was an ulp of |a| off (3e-5 at |a| = 325): the final state 2.7e-5 off against
    mamba_ssm's 4.5e-6 on an H100. The sums are now added in float64 (the products dt' A of two
    float32 numbers are exact there) and stored as two float32 planes, hi + lo (.log_decays), which
    hold each to about 2^-48 of itself; added in order in float32, as the interpreter did, they
    were up to 2e-4 off here."""
    length, chunk, heads = 2 * 256 + 247, 256, 8
    dt = uniform(2, length, heads, low=0.5, high=2.0)  # |a| in the hundreds: an ulp of 3e-5
    A = -uniform(heads, low=0.5, high=1.0)
    seq_idx = (torch.arange(length, device=DEVICE) >= 600).to(torch.int32).expand(2, -1) if packed else None
    planes, step = chunk_cumsum(dt, A, chunk, dt_softplus=True, seq_idx=seq_idx)
    assert planes.shape == (2, heads, 3, 2, chunk) and planes.dtype == torch.float32
    terms = step.double() * A.double()[None, :, None, None]
    exact = torch.cumsum(terms, dim=-1)
    if packed:  # the sum restarts at position 600, inside chunk 2
        start = 600 - 2 * chunk
        exact[:, :, 2, start:] = torch.cumsum(terms[:, :, 2, start:], dim=-1)
    assert ((natural_sums(planes) - exact).abs() <= 2.0 ** -46 * exact.abs()).all()
    hi_only = planes[:, :, :, 0].double() * LN2.value
    assert ((hi_only - exact).abs() > 2.0 ** -30 * exact.abs()).any()  # lo matters


@triton.jit
def log_decays_kernel(sums_ptr, decay_ptr, between_ptr, CHUNK: tl.constexpr):
    k = tl.arange(0, CHUNK)
    chunk = tl.program_id(0)  # one chunk, 0
    hi, lo = load_sums(sums_ptr, chunk, k, CHUNK)
    hi_last, lo_last = load_sums(sums_ptr, chunk, CHUNK - 1, CHUNK)
    tl.store(decay_ptr + k, decay(hi, lo))
    tl.store(between_ptr + k, decay_between(hi_last, lo_last, hi, lo))


def test_exponentials_of_the_planes():
    """.log_decays on a chunk of sums down to about -80: exp(a) and exp(a_last - a) from the planes
    to a few float32 ulps of the float64 values (from hi alone, off by up to |a| 2^-24); and on a
    chunk whose sums fall to -inf, exp(a) exactly 0 there (lo is 0, not inf - inf)."""
    for infinite_step in (False, True):
        dt = uniform(1, 64, 1, low=0.5, high=2.0)
        if infinite_step:
            dt[0, 40] = math.inf  # from position 40 on the sums are -inf
        planes, _ = chunk_cumsum(dt, -torch.ones(1, device=DEVICE), 64)
        a = natural_sums(planes)[0, 0, 0]
        hi, lo = planes[0, 0, 0, 0], planes[0, 0, 0, 1]
        got_decay, got_between = (torch.empty(64, device=DEVICE) for _ in range(2))
        log_decays_kernel[(1,)](planes, got_decay, got_between, CHUNK=64)
        if infinite_step:
            assert not a[40:].isfinite().any() and (got_decay[40:] == 0).all() and (lo[40:] == 0).all()
            continue
        for got, exact in ((got_decay, torch.exp(a)), (got_between, torch.exp(a[-1] - a))):
            assert ((got.double() - exact).abs() <= 4 * 2.0 ** -23 * exact).all()  # three roundings and exp2
        from_hi = torch.exp(hi.double() * LN2.value)
        assert ((from_hi - torch.exp(a)).abs() > 4 * 2.0 ** -23 * torch.exp(a)).any()  # lo matters


def test_gradient_of_dt_split_from_a_projection():
    """Defect: the backward wrote d dt through the caller's dt strides into a contiguous buffer: a
    dt that is a torch.split view of a projection (what mamba_ssm's Mamba2 passes) wrote out of
    bounds. This is that call."""
    b, L, H, P, N, W = 1, 16, 2, 16, 8, 4
    zxbcdt = randn(b, L, W).requires_grad_()
    dt = torch.split(zxbcdt, [W - H, H], dim=-1)[1]
    x, A, B, C = randn(b, L, H, P), -uniform(H, low=0.3, high=1.3), randn(b, L, 1, N), randn(b, L, 1, N)
    ssd_chunk_scan(x, dt, A, B, C, 16, dt_softplus=True).sum().backward()
    leaf = zxbcdt.detach().double().requires_grad_()
    ssd_quadratic_ref(x, torch.split(leaf, [W - H, H], dim=-1)[1], A, B, C, dt_softplus=True).sum().backward()
    assert_close(zxbcdt.grad, leaf.grad, tolerance(torch.float32), "grad zxbcdt")


def test_gradients_of_views_equal_those_of_contiguous_copies():
    """Every input a view: x, z, B, C and dt split from one projection (Mamba2's layout), A expanded
    from one number (stride 0), D transposed, dt_bias strided, initial_states expanded over the
    batch and transposed, seq_idx expanded, and both upstream gradients transposed. No kernel may
    address one tensor with another's strides: the gradients must be those of contiguous copies."""
    b, L, H, P, G, N = 2, 21, 2, 16, 1, 16
    proj = randn(b, L, 2 * H * P + 2 * G * N + H)
    z, x, B, C, dt = torch.split(proj, [H * P, H * P, G * N, G * N, H], dim=-1)
    views = dict(x=x.view(b, L, H, P), dt=dt, A=(-uniform(1, low=0.5, high=1.5)).expand(H),
                 B=B.view(b, L, G, N), C=C.view(b, L, G, N), D=randn(P, H).t(), z=z.view(b, L, H, P),
                 dt_bias=randn(2 * H)[::2], initial_states=randn(1, H, N, P).expand(b, -1, -1, -1).transpose(2, 3),
                 seq_idx=(torch.arange(L, device=DEVICE) >= 8).to(torch.int32).expand(b, -1))
    assert not any(v.is_contiguous() for v in views.values())
    weight_y = randn(b, P, H, L).permute(0, 3, 2, 1)
    weight_final = randn(b, H, N, P).transpose(2, 3)

    def grads_of(inputs):
        leaves = {k: (v.detach().requires_grad_() if v.is_floating_point() else v) for k, v in inputs.items()}
        y, final = ssd_chunk_scan(**leaves, chunk_size=16, dt_softplus=True, return_final_states=True)
        loss = (y * weight_y).sum() + (final * weight_final).sum()
        names = [k for k, v in leaves.items() if v.is_floating_point()]
        return dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names])))

    got = grads_of(views)
    want = grads_of({k: v.contiguous() for k, v in views.items()})
    for name in want:
        assert_close(got[name], want[name], 1e-6, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_views_forward_and_gradients_against_float64(dtype):
    """The views of the test above (x, z, B, C and dt split from one projection, here in ``dtype``;
    A expanded from one number, D transposed, dt_bias strided, initial_states expanded over the
    batch and transposed, seq_idx expanded) judged against float64 itself, not a contiguous copy:
    y, the final states and the gradient of every leaf through the views."""
    b, L, H, P, G, N = 2, 21, 2, 16, 1, 16
    widths = [H * P, H * P, G * N, G * N, H]
    leaves = dict(proj=randn(b, L, sum(widths), dtype=dtype), A_one=-uniform(1, low=0.5, high=1.5),
                  D_t=randn(P, H), bias_wide=randn(2 * H, scale=0.5), state_one=randn(1, H, N, P))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    seq_idx = (torch.arange(L, device=DEVICE) >= 8).to(torch.int32).expand(b, -1)

    def call(fn):
        def run(proj, A_one, D_t, bias_wide, state_one):
            z, x, B, C, dt = torch.split(proj, widths, dim=-1)
            return _y_and_final(fn(x.unflatten(-1, (H, P)), dt, A_one.expand(H), B.unflatten(-1, (G, N)),
                                   C.unflatten(-1, (G, N)), D=D_t.t(), z=z.unflatten(-1, (H, P)),
                                   dt_bias=bias_wide[::2], seq_idx=seq_idx, dt_softplus=True, return_final_states=True,
                                   initial_states=state_one.expand(b, -1, -1, -1).transpose(2, 3)))
        return run

    ours = call(lambda *a, **k: ssd_chunk_scan(*a, chunk_size=16, **k))
    ref = call(ssd_quadratic_ref)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype), "y and final states")
    errors = assert_gradients_close(ours, ref, leaves, tol=1.0)
    assert set(errors) == set(leaves)
    for name, err in errors.items():
        as_argument = dict(proj="x", A_one="A", D_t="D", bias_wide="dt_bias", state_one="initial_states")[name]
        assert err < grad_tol(as_argument, dtype), f"grad {name}: relative error {err:.3e}"


def test_time_major_B_and_C_give_what_contiguous_ones_give():
    """Mamba-2's block passes B and C time major (its convolution's output transposed back: dstate
    strided). The op reads copies of such a B and C (the bidirectional scores kernel read that layout
    wrongly on an H100 at lengths that are not multiples of 16, tests/test_bidirectional.py): outputs
    and gradients the same bits as with contiguous B and C, at an odd length, a dstate that leaves a
    masked tail, chunk 32 and bfloat16, where the bidirectional fault showed."""
    length = size(gpu=1021, cpu=37)  # two chunks, the second partial
    x = randn(1, length, 2, 32, dtype=torch.bfloat16)
    dt = uniform(1, length, 2, low=0.05, high=0.5)
    A = -uniform(2, low=0.5, high=1.5)
    time_major = [randn(1, 100, 1, length, dtype=torch.bfloat16).permute(0, 3, 2, 1) for _ in range(2)]
    results = []
    for B, C in (time_major, [t.contiguous() for t in time_major]):
        leaves = [t.detach().requires_grad_() for t in (x, B, C)]
        out = ssd_chunk_scan(leaves[0], dt, A, leaves[1], leaves[2], 32)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), leaves)))
    for name, got, want in zip(("out", "dx", "dB", "dC"), *results):
        assert torch.equal(got, want), name


def varlen_case(length, cuts, heads=2, dtype=torch.float32):
    """Batch-1 inputs packing sequences that end at ``cuts``; cu_seqlens and the matching seq_idx."""
    inputs = make_inputs(batch=1, length=length, heads=heads, groups=1, dtype=dtype)
    cu_seqlens = torch.tensor([0, *cuts], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.bucketize(torch.arange(length, device=DEVICE), cu_seqlens[1:], right=True).to(torch.int32)[None]
    return inputs, cu_seqlens, seq_idx


@pytest.mark.parametrize("first_end, with_seq_idx", [(11, True), (23, True), (23, False), (11, "other")])
def test_varlen_states_as_mamba_ssm_computes_them(first_end, with_seq_idx):
    """return_varlen_states: the state at the end of each packed sequence (one empty), as mamba_ssm
    computes it: initial_states reach the first sequence's state only when that sequence runs past
    the first chunk, and without seq_idx an earlier sequence leaks into a later one's state. With a
    seq_idx that cuts elsewhere ("other": at 5 too) the decays still run across its boundaries,
    as mamba_ssm's do (restarted sums there once gave the first state a relative error of 3e-2)."""
    inputs, cu_seqlens, seq_idx = varlen_case(40, [first_end, 30, 30, 40])
    if with_seq_idx == "other":
        seq_idx = seq_idx + (torch.arange(40, device=DEVICE) >= 5).to(torch.int32)[None]
    # slow decays, so that what initial_states add after 23 steps is not lost to float32 rounding
    inputs["A"] = -uniform(2, low=0.01, high=0.05)
    kw = dict(dt_softplus=True, seq_idx=seq_idx if with_seq_idx else None)
    out, final, varlen = ssd_chunk_scan(**inputs, chunk_size=16, cu_seqlens=cu_seqlens, return_final_states=True,
                                        return_varlen_states=True, **kw)
    assert varlen.shape == (4, 2, 16, 16) and varlen.dtype == inputs["x"].dtype
    ref = ssd_varlen_states_ref(**{k: inputs[k] for k in ("x", "dt", "A", "B", "C")}, chunk_size=16,
                                cu_seqlens=cu_seqlens, initial_states=inputs["initial_states"],
                                dt_bias=inputs["dt_bias"], **kw)
    assert_close(varlen, ref, tolerance(torch.float32), "varlen_states")
    # the return conventions: (out, varlen_states) without the final states
    out_2, varlen_2 = ssd_chunk_scan(**inputs, chunk_size=16, cu_seqlens=cu_seqlens, return_varlen_states=True, **kw)
    assert torch.equal(out_2, out) and torch.equal(varlen_2, varlen)
    # cu_seqlens is read only with return_varlen_states, as in mamba_ssm
    assert torch.equal(ssd_chunk_scan(**inputs, chunk_size=16, cu_seqlens=cu_seqlens, **kw), out)
    without_h0 = ssd_chunk_scan(**dict(inputs, initial_states=None), chunk_size=16, cu_seqlens=cu_seqlens,
                                return_varlen_states=True, **kw)[1]
    assert torch.equal(without_h0[0], varlen[0]) == (first_end <= 16)


def test_varlen_states_are_the_final_states_of_separate_runs():
    inputs, cu_seqlens, seq_idx = varlen_case(45, [7, 20, 38, 45])
    inputs.pop("initial_states")
    _, varlen = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                               return_varlen_states=True)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        alone = {k: (v[:, start:end] if v.dim() >= 3 else v) for k, v in inputs.items()}
        assert_close(varlen[i], ssd_quadratic_ref(**alone, return_final_states=True)[1][0], tolerance(torch.float32))


def test_varlen_states_of_offsets_given_as_a_view():
    """cu_seqlens a column of a (sequences + 1, 2) tensor (stride 2; the varlen-states kernel reads
    offsets densely, so the op must copy them): the states are still each sequence's final state,
    against float64."""
    inputs, cu_seqlens, seq_idx = varlen_case(29, [7, 20, 29])
    inputs.pop("initial_states")
    cu_view = every_other(cu_seqlens, cu_seqlens.flip(0))
    _, varlen = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=seq_idx, cu_seqlens=cu_view, return_varlen_states=True)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        alone = {k: (v[:, start:end] if v.dim() >= 3 else v) for k, v in inputs.items()}
        assert_close(varlen[i], ssd_quadratic_ref(**alone, return_final_states=True)[1][0], tolerance(torch.float32))


def test_no_backward_after_return_varlen_states():
    """As mamba_ssm: no backward pass after return_varlen_states=True, and a clear error, not a
    gradient that silently leaves the varlen states out."""
    inputs, cu_seqlens, _ = varlen_case(20, [9, 20])
    x = inputs.pop("x").requires_grad_()
    out, varlen = ssd_chunk_scan(x, **inputs, chunk_size=16, cu_seqlens=cu_seqlens, return_varlen_states=True)
    with pytest.raises(NotImplementedError, match="return_varlen_states"):
        (out.sum() + varlen.sum()).backward()


def test_state_dtype_sets_the_dtype_of_the_returned_and_stored_states():
    inputs, cu_seqlens, seq_idx = varlen_case(24, [13, 24], dtype=torch.bfloat16)
    kw = dict(chunk_size=16, seq_idx=seq_idx, cu_seqlens=cu_seqlens, return_final_states=True,
              return_varlen_states=True)
    _, final, varlen = ssd_chunk_scan(**inputs, **kw)
    assert (final.dtype, varlen.dtype) == (torch.float32, torch.bfloat16)  # mamba_ssm's
    ref_final = ssd_quadratic_ref(**inputs, seq_idx=seq_idx, return_final_states=True)[1]
    ref_varlen = ssd_varlen_states_ref(**{k: inputs[k] for k in ("x", "dt", "A", "B", "C")}, chunk_size=16,
                                       cu_seqlens=cu_seqlens, initial_states=inputs["initial_states"],
                                       seq_idx=seq_idx, dt_bias=inputs["dt_bias"])
    for state_dtype in (torch.float32, torch.float16):
        _, final, varlen = ssd_chunk_scan(**inputs, **kw, state_dtype=state_dtype)
        assert (final.dtype, varlen.dtype) == (state_dtype, state_dtype)
        assert_close(final, ref_final, tolerance(torch.bfloat16), "final_states")
        assert_close(varlen, ref_varlen, tolerance(torch.bfloat16), "varlen_states")
    # States stored in float32: the gradients are still right. In a problem this small a fixed
    # bound fails for some draws (dA and d dt_bias sum 24 bfloat16 terms of both signs, which can
    # cancel to near 0: 7 of 300 seeds failed, up to a relative error of 1.07; one seed in 80 put
    # d dt at 1.06e-2), so each gradient may also be up to twice the default path's error on the
    # same draw.
    differentiable = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}

    def errors(**kw):
        return assert_gradients_close(lambda **a: ssd_chunk_scan(**a, chunk_size=16, seq_idx=seq_idx, **kw),
                                      lambda **a: ssd_quadratic_ref(**a, seq_idx=seq_idx), differentiable, tol=math.inf)
    default, stored32 = errors(), errors(state_dtype=torch.float32)
    for name, err in stored32.items():
        bound = max(grad_tol(name, torch.bfloat16), 2 * default[name])
        assert err < bound, f"grad {name}: relative error {err:.3e} (default state dtype: {default[name]:.3e})"


def test_initial_states_belong_to_sequence_zero():
    """Defect: initial_states fed the sequence of position 0 whatever its id. mamba_ssm's carried
    sequence id starts at 0, so they reach the positions with id 0 and no other: none at all in a
    row whose ids start at 1."""
    inputs = make_inputs(batch=2, length=37, heads=2, groups=1)
    pos = torch.arange(37, device=DEVICE)
    seq_idx = torch.stack([1 + (pos >= 10), (pos >= 20).long()]).to(torch.int32)
    out, final = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=seq_idx, return_final_states=True)
    bare, bare_final = ssd_chunk_scan(**dict(inputs, initial_states=None), chunk_size=16, seq_idx=seq_idx,
                                      return_final_states=True)
    assert torch.equal(out[0], bare[0]) and torch.equal(final, bare_final)  # row 1 ends in sequence 1
    assert not torch.equal(out[1, :20], bare[1, :20]) and torch.equal(out[1, 20:], bare[1, 20:])
    for ref in (ssd_quadratic_ref, ssd_recurrent_ref, lambda **a: ssd_chunked_ref(**a, chunk_size=16)):
        assert_close(out, ref(**inputs, seq_idx=seq_idx), tolerance(torch.float32))
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=16),
                        lambda **a: ssd_quadratic_ref(**a), dict(inputs, seq_idx=seq_idx), torch.float32)


def test_negative_sequence_ids_as_mamba_ssm():
    """Ids before 0 (padding): mamba_ssm adds no chunk state for a chunk that ends in a negative id,
    so those positions see their own chunk only; the chunked reference does the same."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1)
    seq_idx = (torch.bucketize(torch.arange(45, device=DEVICE), torch.tensor([20, 40], device=DEVICE), right=True)
               - 1).to(torch.int32)[None]
    kw = dict(dt_softplus=True, seq_idx=seq_idx, return_final_states=True)
    check_all_gradients(lambda **a: _y_and_final(ssd_chunk_scan(**a, chunk_size=16, **kw)),
                        lambda **a: _y_and_final(ssd_chunked_ref(**a, chunk_size=16, **kw)), inputs, torch.float32)


def test_double_backward_raises_a_clear_error():
    inputs = make_inputs(batch=1, length=20, heads=2, groups=1)
    x = inputs.pop("x").requires_grad_()
    (grad_x,) = torch.autograd.grad(ssd_chunk_scan(x, **inputs, chunk_size=16).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_x.sum().backward()


@pytest.mark.skipif(not INTERPRETED, reason="counts launches in the interpreter")
@pytest.mark.parametrize("batch, length, heads", [(1, 0, 2), (0, 5, 2), (2, 5, 0)])
def test_empty_inputs_give_empty_outputs_and_gradients_without_a_launch(no_launch, batch, length, heads):
    """After no step the final state is the initial state, and its gradient flows straight back."""
    inputs = make_inputs(batch=batch, length=length, heads=heads, groups=1, D_shape="head")
    inputs = {k: v.requires_grad_() for k, v in inputs.items()}
    out, final = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True, return_final_states=True)
    assert out.shape == inputs["x"].shape and final.shape == inputs["initial_states"].shape
    weight = randn(*final.shape)
    (out.sum() + (final * weight).sum()).backward()
    h0 = inputs["initial_states"]
    assert torch.equal(final, h0.detach() if length == 0 else torch.zeros_like(final))
    assert torch.equal(h0.grad, weight if length == 0 else torch.zeros_like(weight))
    for name in inputs.keys() - {"initial_states"}:
        assert inputs[name].grad.shape == inputs[name].shape and not inputs[name].grad.any(), name


def run_programs_in_reverse_order(monkeypatch):
    """The interpreter runs a grid's programs one after another in order: from here on, last to first."""
    builder = triton.runtime.interpreter.interpreter_builder
    in_order = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx",
                        lambda x, y, z: in_order(*(n - 1 - i for n, i in zip(builder.grid_dim, (x, y, z)))))


@pytest.mark.skipif(not INTERPRETED, reason="reorders the programs of the interpreter")
def test_gradients_are_the_same_bits_whatever_order_the_programs_run_in(monkeypatch):
    """Defect: d a_t gathered float32 atomic adds, whose order (the order programs finish in on a
    GPU) changed the last bits of dA, d dt and d dt_bias from run to run. Here the programs run in
    order and in reverse, after trial runs of the tuner's configurations (as on a GPU)."""
    tune_small_then_wide(monkeypatch, wide=32)
    inputs = make_inputs(batch=1, length=32 + 9, heads=2, groups=1, dstate=32, seq_idx=True)
    inputs = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}
    def fn(**args):
        return _y_and_final(ssd_chunk_scan(**args, chunk_size=32, dt_softplus=True, return_final_states=True))

    grad_out = randn(inputs["x"].numel() + inputs["initial_states"].numel())
    first = gradients(fn, inputs, grad_out)          # the tuner's trial runs, then the tuned one
    again = gradients(fn, inputs, grad_out)
    with pytest.MonkeyPatch.context() as reverse:
        run_programs_in_reverse_order(reverse)
        backwards = gradients(fn, inputs, grad_out)
    for name in first:
        assert torch.equal(first[name], again[name]) and torch.equal(first[name], backwards[name]), name


def small_op_args(optional):
    """Arguments of the registered op (mamba_annotated::ssd_chunk_scan), small; the final states asked
    for with every optional argument, not without."""
    inputs = make_inputs(batch=1, length=17, heads=2, groups=1, seq_idx=True)
    if not optional:
        inputs = {k: inputs[k] if k in ("x", "dt", "A", "B", "C") else None for k in inputs}
    inputs = {k: (v.requires_grad_() if v is not None and v.is_floating_point() else v) for k, v in inputs.items()}
    i = inputs
    return (i["x"], i["dt"], i["A"], i["B"], i["C"], 16, i["D"], i["z"], i["dt_bias"], i["initial_states"],
            i["seq_idx"], None, True, 0.0, math.inf, None, optional)


@pytest.mark.parametrize("optional", [False, True], ids=["bare", "every_argument"])
def test_opcheck(optional):
    torch.library.opcheck(ssd_chunk_scan_op.op, small_op_args(optional))


def test_torch_compile_fullgraph_matches_eager():
    inputs = make_inputs(batch=1, length=21, heads=2, groups=1, seq_idx=True)
    inputs = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}

    def fn(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        y, final = ssd_chunk_scan(x, dt, A, B, C, 16, D, z, dt_bias, initial_states, seq_idx, dt_softplus=True,
                                  return_final_states=True)
        return (2 * y).sum() + final.square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    names = [k for k in inputs if k in ALL_GRADS]
    eager_loss, compiled_loss = fn(**inputs), compiled(**inputs)
    want = torch.autograd.grad(eager_loss, [inputs[k] for k in names])
    got = torch.autograd.grad(compiled_loss, [inputs[k] for k in names])
    assert_close(compiled_loss, eager_loss, 1e-6, "loss")
    for name, g, w in zip(names, got, want):
        assert_close(g, w, 1e-6, f"grad {name}")


def batch_one(inputs):
    """The first row of every batched argument."""
    return {k: (v[:1] if isinstance(v, torch.Tensor) and k not in ("A", "D", "dt_bias") else v) for k, v in inputs.items()}


BAD_INPUTS = [
    (lambda i: dict(i, x=i["x"].double()), TypeError, "x must have dtype"),
    (lambda i: dict(i, x=i["x"][0]), ValueError, "x must have 4 dimensions"),
    (lambda i: dict(i, dt=i["dt"][:, :-1]), ValueError, "dt must have shape"),
    (lambda i: dict(i, A=i["A"][:-1]), ValueError, "A must have shape"),
    (lambda i: dict(i, A=i["A"].to("meta")), ValueError, "A is on meta"),
    (lambda i: dict(i, B=i["B"][:, :, :1].expand(-1, -1, 3, -1)), ValueError, "B must have shape"),
    (lambda i: dict(i, B=i["B"][..., :0], C=i["C"][..., :0]), ValueError, "dstate >= 1"),
    (lambda i: dict(i, B=i["B"].half()), TypeError, "B must have the dtype of x"),
    (lambda i: dict(i, C=i["C"][..., :-1]), ValueError, "C must have the shape of B"),
    (lambda i: dict(i, chunk_size=24), ValueError, "chunk_size must be one of"),
    (lambda i: dict(i, chunk_size=512), ValueError, "chunk_size must be one of"),
    (lambda i: dict(i, chunk_size=True), ValueError, "chunk_size must be one of"),
    (lambda i: dict(i, chunk_size=16.0), TypeError, "chunk_size must be an integer"),
    (lambda i: dict(i, chunk_size="16"), TypeError, "chunk_size must be an integer"),
    (lambda i: dict(i, D=i["D"][:, :-1]), ValueError, "D must have shape"),
    (lambda i: dict(i, z=i["z"][:, :-1]), ValueError, "z must have the shape of x"),
    (lambda i: dict(i, dt_bias=i["dt_bias"][None]), ValueError, "dt_bias must have shape"),
    (lambda i: dict(i, initial_states=i["initial_states"][..., :-1]), ValueError, "initial_states must have shape"),
    (lambda i: dict(i, seq_idx=torch.zeros(2, 37, device=i["x"].device)), TypeError, "seq_idx must have dtype"),
    (lambda i: dict(i, seq_idx=torch.zeros(2, 36, dtype=torch.int32, device=i["x"].device)), ValueError, "seq_idx must have shape"),
    (lambda i: dict(i, return_varlen_states=True), ValueError, "cu_seqlens must be given"),
    (lambda i: dict(i, return_varlen_states=True, cu_seqlens=torch.tensor([0, 37], device=i["x"].device)),
     ValueError, "return_varlen_states needs batch 1"),
    (lambda i: dict(batch_one(i), return_varlen_states=True, cu_seqlens=torch.tensor([0.0, 37.0], device=DEVICE)),
     TypeError, "cu_seqlens must have dtype"),
    (lambda i: dict(i, dt_limit=(1.0, 0.5)), ValueError, "dt_limit must be a pair"),
    (lambda i: dict(i, state_dtype=torch.float64), TypeError, "state_dtype must be None or one of"),
    (lambda i: dict(i, x=torch.zeros(2, 37, 4, 256, device=i["x"].device)), NotImplementedError, "headdim 256"),
    (lambda i: dict(i, x=i["x"].cpu().numpy()), TypeError, "x must be a torch.Tensor"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(build, error, message):
    inputs = dict(make_inputs(), chunk_size=16)
    with pytest.raises(error, match=message):
        ssd_chunk_scan(**build(inputs))


def varlen_call(i, cu_seqlens):
    return dict(batch_one(i), return_varlen_states=True, cu_seqlens=torch.tensor(cu_seqlens, device=DEVICE))


# the values inside seq_idx and cu_seqlens, checked on the device (validation.refuse_unless)
BAD_INDEX_VALUES = [
    (lambda i: dict(i, seq_idx=torch.arange(37, 0, -1, dtype=torch.int32, device=DEVICE).expand(2, -1)),
     "seq_idx must be nondecreasing"),
    (lambda i: varlen_call(i, [0, 20, 38]), "cu_seqlens must be nondecreasing offsets"),
    (lambda i: varlen_call(i, [0, 30, 20, 37]), "cu_seqlens must be nondecreasing offsets"),
    (lambda i: varlen_call(i, [-1, 37]), "cu_seqlens must be nondecreasing offsets"),
]


@pytest.mark.parametrize("build, message", BAD_INDEX_VALUES)
def test_bad_index_values_are_refused_on_the_device(build, message):
    assert_refused_on_the_device("ssd_chunk_scan", message, **build(dict(make_inputs(), chunk_size=16)))


@pytest.mark.parametrize("argument, value", [("dt", math.nan), ("B", math.nan), ("C", math.nan), ("x", math.nan),
                                             ("x", math.inf)])
def test_a_non_finite_value_never_reaches_earlier_outputs(argument, value):
    """A NaN in dt, B, C or x at position t (mid-chunk) leaves every output before t finite (dt went
    through the clamp as a number: Triton's min and max drop NaN by default; a later B or dt
    reached earlier rows through 0 * NaN in the within-chunk weights: the causal select now comes
    after the products; a later x did through the product itself, seen on the H100 by the
    reliability step: drop_hidden_nonfinite). The output at t is NaN, and so are all later ones
    for dt, B and x (C_t is read by row t alone)."""
    t = 25
    inputs = make_inputs(batch=1, length=40, heads=2, groups=1)
    clean = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    inputs[argument] = inputs[argument].clone()
    inputs[argument][0, t] = value
    y = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    assert torch.equal(y[:, :t], clean[:, :t]), "a non-finite value reached an output before its position"
    later = y[:, t:] if argument != "C" else y[:, t:t + 1]
    assert (~torch.isfinite(later)).flatten(2).any(-1).all(), "the outputs that read the value should not be finite"
    if argument == "C":
        assert torch.isfinite(y[:, t + 1:]).all()


@pytest.mark.parametrize("length, chunk", [(40, 16), (300, 128)])
@pytest.mark.parametrize("argument", ["dy", "x"])
def test_a_non_finite_value_keeps_to_the_gradients_that_see_it(argument, length, chunk):
    """The backward's causality, one sequence: a NaN at position t (mid-chunk) in dy leaves the
    gradients of x, dt, B and C finite at every later position (they never reach y_t), and one in x
    at every earlier one (they never read x_t). For dy, zeroed weights times the NaN's row, 0 x NaN,
    spread it to the later rows of its chunk, until the dx kernel's checked launch; the x cases held
    before and guard the selects after the dCB products."""
    t = chunk + 9
    inputs = make_inputs(batch=1, length=length, heads=2, groups=1)
    dy = randn(*inputs["x"].shape)
    (dy if argument == "dy" else inputs["x"])[0, t] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=chunk, dt_softplus=True), inputs, dy)
    clear = slice(t + 1, None) if argument == "dy" else slice(0, t)
    assert all(grads[name][0, clear].isfinite().all() for name in ("x", "dt", "B", "C")), grads


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("argument", ["B", "C"])
def test_a_non_finite_B_or_C_reaches_only_the_gradients_that_read_it(argument, packed):
    """A NaN in B_s (or C_s) at s = 25, mid-chunk (chunk 16): y_t reads B_s for t >= s and C_s for
    t = s only, so dC of the rows before s (dB of the rows after s) must stay finite, and with
    packed sequences ([0, 28), [28, 45)) so must every gradient of the second sequence. B and C
    enter the dB/dC kernel's diagonal products, where a zeroed dCB entry times the NaN gave 0 x NaN
    to the rows that do not read it, until its checked launch; the NaN does reach the rows that do."""
    s = 25
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, seq_idx=packed)
    del inputs["initial_states"]
    if packed:
        inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 28).to(torch.int32)[None]
    inputs[argument] = inputs[argument].clone()
    inputs[argument][0, s] = math.nan
    for name in ("x", "dt", "B", "C"):
        inputs[name].requires_grad_()
    grads = gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=16, dt_softplus=True), inputs,
                      randn(*inputs["x"].shape))
    if argument == "B":
        assert grads["C"][0, :s].isfinite().all() and not grads["C"][0, s + 1].isfinite().any()
    else:
        assert grads["B"][0, s + 1:28].isfinite().all() and not grads["B"][0, s - 1].isfinite().any()
    if packed:
        assert all(grads[name][0, 28:].isfinite().all() for name in ("x", "dt", "B", "C")), grads


@pytest.mark.parametrize("argument, t", [("x", 2), ("B", 2), ("x", 20), ("C", 20), ("dt", 2), ("dt", 7)])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_value_stays_in_its_packed_sequence(argument, t, value):
    """Packed sequences (row 0: [0, 5), [5, 16), [16, 37); chunks of 16): a NaN or inf in x, B, C
    or dt of one sequence leaves the other sequences' outputs the same bits. Weights of 0 did not
    keep it out: 0 x NaN in the diagonal block's product with x, in the chunk state (w = 0 times x
    and B) and in the carry (the state times gamma = 0). A bad step dt crossed a boundary inside
    its chunk through the cumulative sums of dt A, which ran across it: they now restart there."""
    inputs = make_inputs(batch=1, length=37, heads=2, groups=1, seq_idx=True)
    del inputs["initial_states"]
    clean = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    inputs[argument] = inputs[argument].clone()
    inputs[argument][0, t] = value
    y = ssd_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    ids = inputs["seq_idx"][0]
    other = (ids != ids[t]).cpu()
    assert torch.equal(y[:, other], clean[:, other]), "a non-finite value reached another sequence"
    reads = torch.arange(37) == t if argument == "C" else (torch.arange(37) >= t) & ~other
    assert not y[:, reads].isfinite().all(-1).all(-1).any(), "an output that reads the value is finite"


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_packed_sequences_after_a_strongly_decaying_one(chunk_size):
    """The cumulative sums restart at each boundary, so across one the exponent of a weight that
    the mask drops can be large and positive (exp overflows): every such weight must be dropped
    by a select, not multiplied by 0 (0 x inf = NaN). Position 5 starts a sequence with one step
    of 200 (a decay of e^-100 or less): the exponents from it to the positions after it in its
    chunk pass float32's exp range. Forward and every gradient against float64."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1, seq_idx=True)
    inputs["dt"][0, 5] = 200.0
    kw = dict(dt_softplus=True)
    out = ssd_chunk_scan(**inputs, chunk_size=chunk_size, **kw)
    assert_close(out, ssd_quadratic_ref(**inputs, **kw), tolerance(torch.float32))
    check_all_gradients(lambda **a: ssd_chunk_scan(**a, chunk_size=chunk_size, **kw),
                        lambda **a: ssd_quadratic_ref(**a, **kw), inputs, torch.float32)


@pytest.mark.parametrize("cuts, first_id", [([10, 30], -1), ([4, 8, 30], -2)])
def test_negative_ids_before_the_sequence_of_the_initial_state(cuts, first_id):
    """mamba_ssm's convention: the initial state belongs to id 0 and decays from position 0, so
    with leading negative ids (one run, or two: -2, -1) it reaches the id-0 rows decayed through
    the steps of the negative runs. The cumulative sums restart at boundaries, but the id-0 run of
    the first chunk is summed from the chunk's start (restarting into it once gave y a relative
    error of 0.12 against mamba_ssm on the H100; continuing it from a restarted -1 run, 3e-3)."""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1)
    inputs["seq_idx"] = ((torch.arange(45, device=DEVICE)[:, None] >= torch.tensor(cuts, device=DEVICE))
                         .sum(-1).to(torch.int32) + first_id)[None]
    kw = dict(dt_softplus=True)
    check_all_gradients(lambda **a: _y_and_final(ssd_chunk_scan(**a, chunk_size=16, return_final_states=True, **kw)),
                        lambda **a: _y_and_final(ssd_quadratic_ref(**a, return_final_states=True, **kw)),
                        inputs, torch.float32)


def test_leading_negative_ids_into_a_short_last_chunk():
    """Ids -1 up to t = 36 of 45, then 0, chunk 16: the last chunk is cut short by L, and the state
    carried into it belongs to id -1. Positions past L must never count as that sequence's (a
    chunk-state kernel that read their ids as -1 would send the gradient of sequence 0's rows into
    sequence -1's state, and from there into dx of every earlier chunk). So a NaN in dy at t = 38
    leaves dx finite at every position of id -1, the earlier chunks' and those of its own chunk.
    (A float64 reference does not apply: a negative id ending a chunk is mamba_ssm's padding,
    whose state is dropped.)"""
    inputs = make_inputs(batch=1, length=45, heads=2, groups=1)
    del inputs["initial_states"]
    inputs["seq_idx"] = (torch.arange(45, device=DEVICE) >= 36).to(torch.int32)[None] - 1
    x = inputs.pop("x").clone().requires_grad_()
    y = ssd_chunk_scan(x, **inputs, chunk_size=16, dt_softplus=True)
    dy = torch.randn_like(y)
    dy[0, 38] = math.nan
    dx, = torch.autograd.grad(y, x, dy)
    assert dx[0, :36].isfinite().all()


def test_without_initial_states_sequence_labels_do_not_matter():
    """Without initial states no sequence is special, so ids -1, 0, 1 and 0, 1, 2 for the same
    packing give the same bits, with a NaN step in the first sequence too: it stays there."""
    inputs = make_inputs(batch=1, length=37, heads=2, groups=1, seq_idx=True)
    del inputs["initial_states"]
    inputs["dt"][0, 2] = math.nan
    ids = inputs.pop("seq_idx")
    y = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=ids, dt_softplus=True)
    relabelled = ssd_chunk_scan(**inputs, chunk_size=16, seq_idx=ids - 1, dt_softplus=True)
    assert torch.equal(relabelled.isnan(), y.isnan()) and torch.equal(relabelled.nan_to_num(), y.nan_to_num())
    assert y[:, 5:].isfinite().all()


# ---------------------------------------------------------------- GPU: real sizes and the peer

@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("chunk, headdim, dstate, groups, dtype", [
    (32, 32, 16, 1, torch.float32),
    (64, 64, 64, 2, torch.bfloat16),
    (128, 128, 128, 4, torch.float16),
    (256, 64, 256, 1, torch.bfloat16),
    (256, 128, 128, 2, torch.float32),
])
def test_real_sizes_against_reference(chunk, headdim, dstate, groups, dtype):
    """Every gradient at real sizes; bfloat16's dA and d dt_bias have their own test below."""
    inputs = make_inputs(batch=2, length=3 * chunk + 37, heads=8, headdim=headdim, groups=groups,
                         dstate=dstate, dtype=dtype, seq_idx=True)
    kw = dict(dt_softplus=True, dt_limit=(0.01, 2.0))
    check_all_gradients(lambda **a: _y_and_final(ssd_chunk_scan(**a, chunk_size=chunk, return_final_states=True, **kw)),
                        lambda **a: _y_and_final(ssd_quadratic_ref(**a, return_final_states=True, **kw)),
                        inputs, dtype, skip=("A", "dt_bias") if dtype == torch.bfloat16 else ())


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("chunk, headdim, dstate, groups", [(64, 64, 64, 2), (256, 64, 256, 1)])
def test_bfloat16_decay_gradients_within_twice_the_peer_error(chunk, headdim, dstate, groups):
    """DESIGN.md's rule for 16-bit: at most twice the error of the same computation by the peer."""
    peer = mamba_ssm_combined_or_skip()
    inputs = make_inputs(batch=2, length=3 * chunk + 37, heads=8, headdim=headdim, groups=groups,
                         dstate=dstate, dtype=torch.bfloat16, seq_idx=True)
    kw = dict(dt_softplus=True, dt_limit=(0.01, 2.0), return_final_states=True)
    differentiable = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}
    n_out = inputs["x"].numel() + inputs["initial_states"].numel()
    grad_out = torch.randn(n_out, dtype=torch.float64, device=DEVICE).to(torch.bfloat16)
    ours = gradients(lambda **a: _y_and_final(ssd_chunk_scan(**a, chunk_size=chunk, **kw)), differentiable, grad_out)
    theirs = gradients(lambda **a: _y_and_final(peer.mamba_chunk_scan_combined(**a, chunk_size=chunk, **kw)),
                       differentiable, grad_out)
    as64 = {k: (v.detach().double().requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}
    want = gradients(lambda **a: _y_and_final(ssd_quadratic_ref(**a, **kw)), as64, grad_out.double())
    for name in ("A", "dt_bias"):
        assert_within_same_computation(f"grad {name}", ours[name], theirs[name], want[name], torch.bfloat16)


def mamba_ssm_combined():
    """mamba_ssm's Triton SSD module where the peer imports (the GPU box's wheels), else None
    (scripts/reliability/cases.py then leaves the peer's rule unjudged)."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from peers import mamba_ssm_module
    return mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")


def mamba_ssm_combined_or_skip():
    """:func:`mamba_ssm_combined` for a test that compares with the peer: skipped where the peer
    does not import. The loader prints why, which pytest shows with -s and without -n."""
    module = mamba_ssm_combined()
    if module is None:
        pytest.skip("mamba_ssm's Triton SSD does not import")
    return module


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_mamba_ssm(dtype):
    module = mamba_ssm_combined_or_skip()
    inputs = make_inputs(batch=2, length=1000, heads=8, headdim=64, groups=2, dstate=64, dtype=dtype)
    kw = dict(dt_softplus=True, return_final_states=True)
    out, final = ssd_chunk_scan(**inputs, chunk_size=128, **kw)
    peer_out, peer_final = module.mamba_chunk_scan_combined(**inputs, chunk_size=128, **kw)
    ref, ref_final = ssd_quadratic_ref(**inputs, **kw)
    # ours is at least as close to float64 as the peer (within a factor for rounding noise)
    for name, mine, peer, want in (("y", out, peer_out, ref), ("final_states", final, peer_final, ref_final)):
        assert_close(mine, want, tolerance(dtype), name)
        assert_within_same_computation(name, mine, peer, want, dtype)


@pytest.mark.gpu
@gpu_only
def test_drop_in_semantics_against_mamba_ssm():
    """Where the semantics are mamba_ssm's own: negative steps clamped, initial_states with seq_idx
    that does not start at 0, negative sequence ids, varlen states with initial states, return
    conventions and dtypes. Same inputs, same call, positional."""
    module = mamba_ssm_combined_or_skip()
    length, chunk = 300, 64
    inputs = make_inputs(batch=1, length=length, heads=8, headdim=32, groups=2, dstate=32)
    inputs["dt"] = uniform(1, length, 8, low=-0.3, high=0.5)
    cuts = torch.tensor([0, 40, 150, 150, 300], dtype=torch.int32, device=DEVICE)
    ids = torch.bucketize(torch.arange(length, device=DEVICE), cuts[1:], right=True).to(torch.int32)[None]
    for seq_idx in (None, ids, ids + 1, ids - 1):
        args = (inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk, inputs["D"], inputs["z"],
                inputs["dt_bias"], inputs["initial_states"], seq_idx, cuts, False, (0.0, float("inf")), True, True)
        ours, peers = ssd_chunk_scan(*args), module.mamba_chunk_scan_combined(*args)
        for name, mine, peer in zip(("y", "final_states", "varlen_states"), ours, peers):
            assert mine.dtype == peer.dtype and mine.shape == peer.shape, name
            # 3e-3: mamba_ssm multiplies float32 tiles in TF32; a semantic difference is far larger
            assert_close(mine, peer, 3e-3, f"{name}, seq_idx {None if seq_idx is None else seq_idx[0, 0].item()}")


@pytest.mark.gpu
@gpu_only
def test_backward_is_the_same_bits_on_every_run_at_real_sizes():
    inputs = make_inputs(batch=2, length=3 * 256 + 37, heads=8, headdim=64, groups=2, dstate=128,
                         dtype=torch.bfloat16, seq_idx=True)
    inputs = {k: (v.requires_grad_() if k in ALL_GRADS else v) for k, v in inputs.items()}
    def fn(**args):
        return _y_and_final(ssd_chunk_scan(**args, chunk_size=256, dt_softplus=True, return_final_states=True))

    grad_out = randn(inputs["x"].numel() + inputs["initial_states"].numel(), dtype=torch.bfloat16)
    first = gradients(fn, inputs, grad_out)
    for _ in range(3):
        again = gradients(fn, inputs, grad_out)
        for name in first:
            assert torch.equal(first[name], again[name]), name


@pytest.mark.gpu
@pytest.mark.large_memory
@gpu_only
def test_64_bit_indexing():
    """x with more than 2^31 elements; the last 300 positions form their own sequence, so their
    outputs can be checked against the reference run on that slice alone."""
    batch, length, heads, headdim, dstate = 1, 2**19, 72, 64, 16
    tail = 300
    inputs = make_inputs(batch=batch, length=length, heads=heads, headdim=headdim, groups=1, dstate=dstate,
                         dtype=torch.bfloat16)
    for k in ("z", "initial_states", "D"):
        inputs.pop(k)
    assert inputs["x"].numel() > 2**31
    seq_idx = (torch.arange(length, device=DEVICE) >= length - tail).to(torch.int32)[None]
    out = ssd_chunk_scan(**inputs, chunk_size=256, seq_idx=seq_idx, dt_softplus=True)
    sliced = {k: (v[:, -tail:] if v.dim() >= 3 else v) for k, v in inputs.items()}
    assert_close(out[:, -tail:], ssd_quadratic_ref(**sliced, dt_softplus=True), tolerance(torch.bfloat16))


@pytest.mark.parametrize("D_shape", ["head", "channel"])
def test_dD_with_the_gate_is_summed_before_its_rounding(D_shape):
    """Defect (H100 sweep, bidirectional seed 509003; SSD formed dD alike): with the gate z, the
    gradient reaching y, d_out silu(z), was rounded to bfloat16 and dD summed from that copy: 2e-3
    off at L = 2, where a float32 sum is 1e-6 off. The gate's backward now sums dD (.gate)."""
    inputs = make_inputs(batch=2, length=2, heads=1, headdim=64, groups=1, dstate=16, dtype=torch.bfloat16,
                         D_shape=D_shape)
    inputs.pop("initial_states")
    differentiable = {k: (v.requires_grad_() if k in ("x", "D", "z") else v) for k, v in inputs.items()}
    errors = [assert_gradients_close(lambda **a: ssd_chunk_scan(**a, chunk_size=16, dt_softplus=True),
                                     lambda **a: ssd_quadratic_ref(**a, dt_softplus=True), differentiable, tol=1.0,
                                     seed=seed)["D"] for seed in range(4)]
    assert max(errors) < 1e-4, errors
