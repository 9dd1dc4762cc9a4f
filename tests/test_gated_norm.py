"""The gated RMS norm kernel (mamba_annotated.gated_norm.rmsnorm_fn) against a float64 formula:
outputs and the gradients of x, weight, bias and z, every dtype, groups, both gate orders, odd
widths, views; its op under torch.library's checks; bad arguments."""
import pytest
import torch

from mamba_annotated.gated_norm import gated_rms_norm_op, rmsnorm_fn, rmsnorm_ref
from mamba_annotated.runtime import size
from mamba_annotated.testing import FLOAT_DTYPES, assert_close, assert_gradients_close, randn, tolerance


def rms_norm_f64(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """The torch-ops formula on float64 copies: the reference."""
    return rmsnorm_ref(x.double(), weight.double(), bias.double() if bias is not None else None,
                       z.double() if z is not None else None, eps, group_size, norm_before_gate)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("gated, norm_before_gate", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("group_size, with_bias", [(None, False), (24, True)])
def test_outputs_and_gradients_match_float64(dtype, gated, norm_before_gate, group_size, with_bias):
    """Rows of an odd count and width 72 (not a power of two: masked lanes), one group or three;
    the weight in float32 as a model keeps it under autocast, x and z in ``dtype``."""
    rows, width = size(gpu=1001, cpu=13), 72  # 3 x 13 rows: the backward's last band of rows is short
    inputs = dict(x=randn(3, rows, width, dtype=dtype).requires_grad_(),
                  weight=(1 + 0.5 * randn(width)).requires_grad_(),
                  bias=(0.3 * randn(width)).requires_grad_() if with_bias else None,
                  z=randn(3, rows, width, dtype=dtype).requires_grad_() if gated else None)
    options = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    ours = lambda x, weight, bias=None, z=None: rmsnorm_fn(x, weight, bias, z, **options)  # noqa: E731
    ref = lambda x, weight, bias=None, z=None: rms_norm_f64(x, weight, bias, z, **options)  # noqa: E731
    out = ours(**inputs)
    assert out.dtype == dtype and out.shape == inputs["x"].shape
    assert_close(out, ref(**inputs), tolerance(dtype))
    assert_gradients_close(ours, ref, inputs, tolerance(dtype))


@pytest.mark.parametrize("gated", [False, True])
def test_groups_of_one_element(gated):
    """Defect (GPU sweep, seeds 69 and 71): in a group of one element n = u rstd is +-1 to within
    eps / u^2, and du = rstd (dn - n mean(dn n)) cancelled to rounding noise: float32 grad x 8.9e-3
    off on an H100, twice PyTorch's error. Exactly, du = dn eps rstd^3."""
    x = (randn(5, 7) + torch.sign(randn(5, 7))).requires_grad_()  # |u| ~ 1 >> eps: the cancelling case
    inputs = dict(x=x, weight=(1 + 0.5 * randn(7)).requires_grad_(), bias=None,
                  z=randn(5, 7).requires_grad_() if gated else None)
    ours = lambda x, weight, bias=None, z=None: rmsnorm_fn(x, weight, bias, z, 1e-6, 1)  # noqa: E731
    ref = lambda x, weight, bias=None, z=None: rms_norm_f64(x, weight, bias, z, 1e-6, 1)  # noqa: E731
    assert_gradients_close(ours, ref, inputs, 1e-5)


@pytest.mark.parametrize("x_dtype, z_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_a_gate_in_another_dtype_than_x(x_dtype, z_dtype):
    """mamba_ssm takes z in its own dtype, and a Mamba-2 decoding step under bf16 autocast passes a
    float32 x with a bf16 z: the output comes in x's dtype, each gradient in its input's."""
    x = randn(2, size(gpu=301, cpu=9), 48, dtype=x_dtype).requires_grad_()
    z = randn(*x.shape, dtype=z_dtype).requires_grad_()
    weight = (1 + 0.5 * randn(48)).requires_grad_()
    ours = lambda x, weight, z: rmsnorm_fn(x, weight, None, z, 1e-5, 16)  # noqa: E731
    ref = lambda x, weight, z: rms_norm_f64(x, weight, None, z, 1e-5, 16)  # noqa: E731
    tol = tolerance(torch.bfloat16 if torch.bfloat16 in (x_dtype, z_dtype) else torch.float16)  # the coarser input
    out = ours(x, weight, z)
    assert out.dtype == x_dtype
    assert_close(out, ref(x, weight, z), tol)
    grads = torch.autograd.grad(out, [x, weight, z], randn(*x.shape, dtype=x_dtype))
    assert [g.dtype for g in grads] == [x_dtype, torch.float32, z_dtype]
    assert_gradients_close(ours, ref, dict(x=x, weight=weight, z=z), tol)


def assert_layouts_agree(names, views_results, copies_results, same_alignment=False):
    """The results from views against those from contiguous copies of them, to 1e-5 (some 80
    float32 ulps), not bit for bit. The kernels are told the largest power of two up to 16 that
    divides every row stride they read (``known_multiple``); where the copies' strides share a
    larger one than the views', the kernels read wider vectors, Triton lays a block out across the
    threads differently, and a row's sum is added in another order. (Compiled for sm_90, the
    odd-stride test's kernels hold one element of a row per thread where the view's stride is odd,
    two with the copies; on an H200 the last bits of out and dx moved.) A misread stride reads
    other numbers. Where both sides are told the same (``same_alignment``), the kernels are the same
    and so are the bits."""
    for name, got, want in zip(names, views_results, copies_results):
        if same_alignment:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("gap, group_size, same_alignment", [(3, 20, False), (24, 40, True)])
def test_views_give_what_contiguous_copies_give(gap, group_size, same_alignment):
    """x and z split from one projection (row stride wider than the width: odd, or, as in a Mamba-2
    block's in-projection, a multiple of 8 and not of 16, where the kernels are told what divides
    it), the weight and bias strided, a transposed upstream gradient: what contiguous copies give,
    forward and backward; the same bits where the rows 104 and 40 wide share the alignment 8."""
    rows, width = size(gpu=515, cpu=21), 40
    proj = randn(rows, 2 * width + gap)
    x, z = proj[:, :width], proj[:, width + gap:]
    weight, bias = (1 + 0.5 * randn(2 * width))[::2], randn(width, 3)[:, 1]
    d_out = randn(width, rows).t()
    results = []
    for views in ((x, weight, bias, z, d_out), [t.contiguous() for t in (x, weight, bias, z, d_out)]):
        leaves = [t.detach().requires_grad_() for t in views[:4]]
        out = rmsnorm_fn(*leaves, group_size=group_size, norm_before_gate=False)
        results.append((out, *torch.autograd.grad(out, leaves, views[4])))
    assert_layouts_agree(("out", "dx", "dweight", "dbias", "dz"), *results, same_alignment=same_alignment)


@pytest.mark.parametrize("odd", ["x", "z", "d_out"])
def test_one_odd_row_stride_among_aligned_ones(odd):
    """Rows of 40 channels in groups of 40 (8 divides every stride) but one input's rows a slice
    of rows 43 wide: the kernels may assume only what divides every row stride they read through (a
    claim that did not hold would round the strides, to wrong addresses). What contiguous copies
    give, forward and backward."""
    rows, width = size(gpu=515, cpu=21), 40
    views = {name: randn(rows, width + 3)[:, 3:] if name == odd else randn(rows, width)
             for name in ("x", "z", "d_out")}
    weight = 1 + 0.5 * randn(width)
    results = []
    for x, z, d_out in ((views["x"], views["z"], views["d_out"]),
                        [views[name].contiguous() for name in ("x", "z", "d_out")]):
        leaves = [t.detach().requires_grad_() for t in (x, weight, z)]
        out = rmsnorm_fn(leaves[0], leaves[1], None, leaves[2], group_size=width, norm_before_gate=False)
        results.append((out, *torch.autograd.grad(out, leaves, d_out)))
    assert_layouts_agree(("out", "dx", "dweight", "dz"), *results)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_channel_strided_views_forward_and_gradients(dtype):
    """x and z views whose channels are not adjacent in memory (the view above keeps them adjacent):
    x channel-major (a transposed (width, rows) tensor), z every other channel of a wider one, the
    weight one number expanded (stride 0), three groups; against float64, forward and the
    gradients of the leaves through the views."""
    rows, width = 11, 24
    leaves = dict(x_t=randn(width, rows, dtype=dtype), z_wide=randn(rows, 2 * width, dtype=dtype),
                  weight_one=1 + 0.5 * randn(1), bias=0.3 * randn(width))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}

    def run(norm):
        def fn(x_t, z_wide, weight_one, bias):
            return norm(x_t.t(), weight_one.expand(width), bias, z_wide[:, ::2], 1e-5, 8, False)
        return fn

    ours, ref = run(rmsnorm_fn), run(rms_norm_f64)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype))
    assert_gradients_close(ours, ref, leaves, tolerance(dtype))


def test_gradients_are_the_same_bits_at_every_call():
    """The weight's gradient adds per-band partial sums on the host, not by atomics."""
    x = randn(size(gpu=4099, cpu=45), 64, dtype=torch.bfloat16).requires_grad_()
    weight = randn(64).requires_grad_()
    z = randn(*x.shape, dtype=torch.bfloat16)
    grads = [torch.autograd.grad(rmsnorm_fn(x, weight, None, z).float().square().sum(), [x, weight])
             for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_no_rows():
    x = randn(0, 16).requires_grad_()
    weight = randn(16).requires_grad_()
    out = rmsnorm_fn(x, weight, None)
    assert out.shape == (0, 16)
    dx, dw = torch.autograd.grad(out.sum(), [x, weight], allow_unused=False)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))


def test_no_rows_with_bias_gate_and_groups(no_launch):
    """Every argument present, no row: an empty out and dz, zero d weight and d bias, no launch."""
    x, z = randn(2, 0, 16, dtype=torch.bfloat16).requires_grad_(), randn(2, 0, 16).requires_grad_()
    weight, bias = randn(16).requires_grad_(), randn(16).requires_grad_()
    out = rmsnorm_fn(x, weight, bias, z, group_size=8, norm_before_gate=False)
    assert out.shape == x.shape and out.dtype == x.dtype
    dx, dw, db, dz = torch.autograd.grad(out.float().sum(), [x, weight, bias, z])
    assert dx.shape == x.shape and dz.shape == z.shape and dz.dtype == z.dtype
    assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))


def test_the_op_passes_torch_library_checks():
    x, z = randn(2, 5, 24).requires_grad_(), randn(2, 5, 24).requires_grad_()
    weight, bias = randn(24).requires_grad_(), randn(24).requires_grad_()
    torch.library.opcheck(gated_rms_norm_op.op, (x, weight, bias, z, 1e-5, 12, False))
    torch.library.opcheck(gated_rms_norm_op.op, (x, weight, None, None, 1e-6, 24, True))


@pytest.mark.parametrize("bad, error", [
    (dict(group_size=7), ValueError),                          # does not divide 24
    (dict(z=randn(2, 5, 12)), ValueError),                    # z's shape is not x's
    (dict(z=torch.ones(2, 5, 24, dtype=torch.int32)), TypeError),
    (dict(weight=randn(23)), ValueError),
    (dict(eps=-1.0), ValueError),
    (dict(x=randn(1, 40000), weight=randn(40000)), ValueError),  # a group past 64 KiB of float32
])
def test_bad_arguments_raise_before_any_launch(bad, error):
    args = dict(x=randn(2, 5, 24), weight=randn(24), bias=None, z=None, eps=1e-6, group_size=None)
    args.update(bad)
    with pytest.raises(error):
        rmsnorm_fn(**args)
