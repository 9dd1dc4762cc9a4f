"""Chapter 1's sequential scan against the float64 loop: forward, gradients, dtypes, bad inputs."""
import pytest
import torch

from mamba_annotated import linear_scan, sequential_scan
from mamba_annotated import runtime
from mamba_annotated.runtime import DEVICE, size
from mamba_annotated.scan.reference import linear_scan_ref
from mamba_annotated.testing import (FLOAT_DTYPES, assert_close, assert_gradients_close, random_scan_inputs, randn,
                                     tolerance, uniform)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("length", [1, 7, 1000, 4096])
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_gradients(dtype, length, reverse):
    if runtime.INTERPRETED and length > 1000:
        pytest.skip("4096 steps run on the GPU only: the interpreter takes 25-30 s each (1000 steps "
                    "run the same time loop there)")
    if runtime.INTERPRETED and length == 1000 and dtype == torch.float16:
        pytest.skip("1000 steps in float16 run on the GPU only (10-15 s each in the interpreter); bfloat16 keeps "
                    "the long 16-bit case there")
    channels = size(gpu=333, cpu=19)  # not a multiple of the channel block
    a, b, h0 = random_scan_inputs((channels, length), dtype, with_h0=True)
    tol = tolerance(dtype)
    assert_close(sequential_scan(a, b, h0=h0, reverse=reverse), linear_scan_ref(a, b, h0, reverse), tol)
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_(), h0=h0.requires_grad_())
    assert_gradients_close(lambda a, b, h0: sequential_scan(a, b, h0=h0, reverse=reverse),
                           lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, tol)


# Shared by both first-order scans (chapter 1's and chapter 4's): leading dimensions, strides.
@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 17), (70, 5)])
def test_leading_dims_without_initial_state(scan, shape):
    a, b, _ = random_scan_inputs(shape, torch.float32, with_h0=False)
    assert_close(scan(a, b), linear_scan_ref(a, b), tolerance(torch.float32))
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_())
    assert_gradients_close(scan, linear_scan_ref, inputs, tolerance(torch.float32))


@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
def test_noncontiguous_input_is_copied_not_misread(scan):
    a, b, _ = random_scan_inputs((9, 40), torch.float32, with_h0=False)
    a_t = a.t().contiguous().t()  # same values, transposed strides
    assert not a_t.is_contiguous()
    assert_close(scan(a_t, b), linear_scan_ref(a, b), tolerance(torch.float32))


@pytest.mark.parametrize("dtype, reverse", [(torch.float32, True), (torch.bfloat16, False)])
def test_non_contiguous_views_forward_and_gradients(dtype, reverse):
    """tests/test_linear_scan.py's test of this name for chapter 1's scan: a and b halves of one
    time-major projection (last stride != 1), h0 a strided slice; against float64, forward and the
    gradients of the leaves through the views."""
    channels, length = 19, 23  # channels: not a multiple of the channel block
    projection = torch.cat([uniform(length, channels, low=0.6, high=1.0), randn(length, channels)], dim=1)
    projection = projection.to(dtype).requires_grad_()
    h0_wide = randn(2 * channels).requires_grad_()

    def run(scan):
        def fn(projection, h0_wide):
            a, b = projection.T.chunk(2, dim=0)            # (channels, length) views, stride(-1) != 1
            return scan(a, b, h0=h0_wide[::2], reverse=reverse)
        return fn

    ours = run(lambda a, b, **kw: sequential_scan(a, b, **kw))
    ref = run(linear_scan_ref)
    leaves = dict(projection=projection, h0_wide=h0_wide)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype), "h")
    assert_gradients_close(ours, ref, leaves, tolerance(dtype))


def test_initial_state_of_another_dtype():
    a, b, _ = random_scan_inputs((6, 25), torch.bfloat16, with_h0=False)
    h0 = randn(6, dtype=torch.float32)
    assert_close(sequential_scan(a, b, h0=h0), linear_scan_ref(a, b, h0), tolerance(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="large sizes need compiled kernels")
def test_large_gpu_problem():
    a, b, h0 = random_scan_inputs((8, 1536, 8192), torch.float32, with_h0=True)
    assert_close(sequential_scan(a, b, h0=h0), linear_scan_ref(a, b, h0), tolerance(torch.float32))


BAD_INPUTS = [
    (lambda a, b: dict(a=a.cpu().numpy(), b=b), TypeError, "a must be a torch.Tensor"),
    (lambda a, b: dict(a=a, b=b.double()), TypeError, "b must have dtype"),
    (lambda a, b: dict(a=a.int(), b=b), TypeError, "a must have dtype"),
    (lambda a, b: dict(a=a, b=b[:, :-1]), ValueError, "b must have the shape of a"),
    (lambda a, b: dict(a=a, b=b.half()), TypeError, "b must have the dtype of a"),
    (lambda a, b: dict(a=a, b=b, h0=torch.zeros(4, device=a.device)), ValueError, "h0 must have shape"),
    (lambda a, b: dict(a=a, b=b, h0=torch.zeros(3, dtype=torch.int64, device=a.device)), TypeError, "h0 must have dtype"),
    (lambda a, b: dict(a=torch.tensor(1.0, device=a.device), b=torch.tensor(1.0, device=a.device)), ValueError, "a must have at least 1"),
]


@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(scan, build, error, message):
    a, b, _ = random_scan_inputs((3, 10), torch.float32, with_h0=False)
    with pytest.raises(error, match=message):
        scan(**build(a, b))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a second device type")
def test_wrong_device_is_refused():
    a, b, _ = random_scan_inputs((3, 10), torch.float32, with_h0=False)
    with pytest.raises(ValueError, match="a is on cpu"):
        sequential_scan(a.cpu(), b.cpu())


def test_exercise_initial_state_folds_into_first_input():
    a, b, h0 = random_scan_inputs((11, 30), torch.float32, with_h0=True)
    b_folded = b.clone()
    b_folded[:, 0] += a[:, 0] * h0
    assert_close(sequential_scan(a, b, h0=h0), sequential_scan(a, b_folded), tolerance(torch.float32))


def test_exercise_reverse_is_flipped_forward():
    a, b, _ = random_scan_inputs((11, 30), torch.float32, with_h0=False)
    flipped = sequential_scan(a.flip(-1), b.flip(-1)).flip(-1)
    assert_close(sequential_scan(a, b, reverse=True), flipped, tolerance(torch.float32))
