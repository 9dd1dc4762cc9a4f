"""Chapter 4's linear_scan against the float64 loop: every path (chained walk, three phases), any
length, forward and gradients, every dtype, reverse, initial state, bad inputs."""
import pytest
import torch

from mamba_annotated.scan import linear_scan, sequential_scan
from mamba_annotated.runtime import DEVICE, INTERPRETED, size
from mamba_annotated.scan.blocked import adjoint_combine, linear_scan_backward, linear_scan_forward, plan
from mamba_annotated.scan.reference import linear_scan_ref
from mamba_annotated.testing import (FLOAT_DTYPES, assert_associative, assert_close, assert_gradients_close,
                                     gradients, random_scan_inputs, randn, tolerance, uniform)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("length", [1, 7, 100, 1000])
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_gradients(dtype, length, reverse):
    if INTERPRETED and length == 1000 and (dtype != torch.float32 or reverse):
        pytest.skip("1000 steps in 16-bit or reversed run on the GPU only: 10-40 s each in the interpreter, "
                    "where float32 forward keeps the 1000-step case, 100 steps cover the 16-bit loads and "
                    "stores, and test_every_path_forward_and_backward every blocking of the reversed scan")
    rows = size(gpu=333, cpu=3)
    a, b, h0 = random_scan_inputs((rows, length), dtype, with_h0=True)
    tol = tolerance(dtype)
    assert_close(linear_scan(a, b, h0=h0, reverse=reverse), linear_scan_ref(a, b, h0, reverse), tol)
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_(), h0=h0.requires_grad_())
    assert_gradients_close(lambda a, b, h0: linear_scan(a, b, h0=h0, reverse=reverse),
                           lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, tol)


# (block, blocks_per_segment): one block; a chained walk of many blocks; three phases with one,
# two and three blocks per segment (the last segment short); phase 2 itself chaining blocks.
PATHS = [(256, None), (16, 1000), (16, 1), (16, 2), (16, 3), (4, 1)]


@pytest.mark.parametrize("block, blocks_per_segment", PATHS)
@pytest.mark.parametrize("length", [1, 16, 97, 130])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_path_forward_and_backward(block, blocks_per_segment, length, reverse):
    if INTERPRETED and block == 4 and length == 130:
        pytest.skip("4-wide blocks over 130 steps run on the GPU only (25 s each in the interpreter); 97 steps "
                    "walk the same path there")
    a, b, h0 = random_scan_inputs((2, length), torch.float32, with_h0=True)
    tol = tolerance(torch.float32)
    h = linear_scan_forward(a, b, h0, reverse=reverse, block=block, blocks_per_segment=blocks_per_segment)
    assert_close(h, linear_scan_ref(a, b, h0, reverse), tol, "h")
    grad_h = randn(2, length, dtype=torch.float64)
    got = linear_scan_backward(a, h, h0, grad_h.float(), reverse=reverse, block=block, blocks_per_segment=blocks_per_segment)
    inputs = dict(a=a.double().requires_grad_(), b=b.double().requires_grad_(), h0=h0.double().requires_grad_())
    want = gradients(lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, grad_h)
    for name, value in zip(("a", "b", "h0"), got):
        assert_close(value, want[name], tol, f"grad {name}")


def test_adjoint_combine_is_associative():
    # the interpreter folds scans left to right, so only this catches a wrong regrouping on CPU
    def sample():
        return (uniform(5, low=0.5, high=1.5, dtype=torch.float64), uniform(5, low=0.5, high=1.5, dtype=torch.float64),
                randn(5, dtype=torch.float64))
    assert_associative(lambda x, y: adjoint_combine.fn(*x, *y), sample, tol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_with_zero_decays(reverse):
    # a decay of exactly 0 cuts the row: the backward must not divide by a (as lam = mu / a would)
    a, b, h0 = random_scan_inputs((3, 50), torch.float32, with_h0=True)
    a[:, ::7] = 0.0
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_(), h0=h0.requires_grad_())
    assert_gradients_close(lambda a, b, h0: linear_scan(a, b, h0=h0, reverse=reverse),
                           lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, tolerance(torch.float32))


def test_plan_uses_one_segment_when_rows_fill_the_machine_and_several_when_not():
    assert plan(rows=100_000, length=1 << 20, block=1024)[1:] == (1024, 1)
    assert plan(rows=4, length=7)[0] == 8  # a short row gets a short block, not idle lanes
    if DEVICE.type == "cuda":
        block, per_segment, segments = plan(rows=1, length=1 << 20, block=1024)
        assert segments > 1 and segments * per_segment >= 1024


@pytest.mark.parametrize("reverse", [False, True])
def test_initial_state_of_another_dtype(reverse):
    a, b, _ = random_scan_inputs((6, 25), torch.bfloat16, with_h0=False)
    h0 = randn(6, dtype=torch.float32, scale=3.0)
    assert_close(linear_scan(a, b, h0=h0, reverse=reverse), linear_scan_ref(a, b, h0, reverse), tolerance(torch.bfloat16))
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_(), h0=h0.requires_grad_())
    assert_gradients_close(lambda a, b, h0: linear_scan(a, b, h0=h0, reverse=reverse),
                           lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, tolerance(torch.bfloat16))


def test_reverse_is_the_flipped_forward_scan():
    # chapter 4, exercise 2
    a, b, h0 = random_scan_inputs((4, 90), torch.float32, with_h0=True)
    assert_close(linear_scan(a, b, h0=h0, reverse=True), linear_scan(a.flip(-1), b.flip(-1), h0=h0).flip(-1),
                 tolerance(torch.float32))


def blocked_reference(a, b, h0, reverse, block=1024):
    """float64 scan of long rows in O(L / block + block) Python steps: scan inside blocks, then
    carry the block end states across blocks (the loop reference would take L steps)."""
    if reverse:
        return blocked_reference(a.flip(-1), b.flip(-1), h0, False, block).flip(-1)
    rows, length = a.shape
    pad = -length % block
    a = torch.nn.functional.pad(a.double(), (0, pad), value=1.0).view(rows, -1, block)
    b = torch.nn.functional.pad(b.double(), (0, pad), value=0.0).view(rows, -1, block)
    local = linear_scan_ref(a, b)
    decay = torch.cumprod(a, dim=-1)
    ends = linear_scan_ref(decay[..., -1], local[..., -1], h0)
    carry_in = torch.cat([h0.double()[:, None], ends[:, :-1]], dim=1)
    return (local + decay * carry_in[..., None]).view(rows, -1)[:, :length]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="a million steps needs compiled kernels")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("rows, length", [(3, 1 << 20), (200, 100_000)])
def test_long_rows_forward_and_backward(dtype, reverse, rows, length):
    a, b, h0 = random_scan_inputs((rows, length), dtype, with_h0=True)
    tol = tolerance(dtype)
    h = linear_scan_forward(a, b, h0, reverse=reverse)
    assert_close(h, blocked_reference(a, b, h0, reverse), tol, "h")
    # the adjoint is the reverse scan of (a one step later, g): check db and da = db * h_{t-1}
    grad_h = randn(rows, length, dtype=dtype)
    grad_a, grad_b, grad_h0 = linear_scan_backward(a, h, h0, grad_h, reverse=reverse)
    shift = 1 if reverse else -1  # where "one forward step later" sits, as a roll of the time axis
    a_later = torch.roll(a.double(), shift, dims=-1)
    a_later[:, -1 if not reverse else 0] = 0.0
    lam = blocked_reference(a_later, grad_h, torch.zeros(rows, device=a.device), not reverse)
    h_ref = blocked_reference(a, b, h0, reverse)
    h_earlier = torch.roll(h_ref, -shift, dims=-1)
    h_earlier[:, 0 if not reverse else -1] = h0.double()
    first = -1 if reverse else 0
    assert_close(grad_b, lam, tol, "grad b")
    assert_close(grad_a, lam * h_earlier, tol, "grad a")
    assert_close(grad_h0, a.double()[:, first] * lam[:, first], tol, "grad h0")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a second device type")
def test_wrong_device_is_refused():
    a, b, _ = random_scan_inputs((3, 10), torch.float32, with_h0=False)
    with pytest.raises(ValueError, match="a is on cpu"):
        linear_scan(a.cpu(), b.cpu())


@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
@pytest.mark.parametrize("shape", [(0, 10), (3, 0), (2, 0, 5)])
def test_empty_inputs_give_empty_outputs_and_gradients(scan, shape):
    """Zero rows used to divide by zero while planning the launch; every op returns empty for empty."""
    a, b, h0 = (t.requires_grad_() for t in random_scan_inputs(shape, torch.float32, with_h0=True))
    h = scan(a, b, h0=h0)
    assert h.shape == a.shape
    h.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape and h0.grad.shape == h0.shape
    assert not h0.grad.any()


@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
@pytest.mark.parametrize("shape", [(37,), (2, 3, 37)])
@pytest.mark.parametrize("reverse", [False, True])
def test_leading_dimensions_forward_and_gradients(scan, shape, reverse):
    """One row without a leading dimension (h0 a 0-d tensor) and rows over two leading dimensions
    reach the launchers as they are, with outputs and gradients in the inputs' shapes."""
    a, b, h0 = random_scan_inputs(shape, torch.float32, with_h0=True)
    inputs = dict(a=a.requires_grad_(), b=b.requires_grad_(), h0=h0.requires_grad_())
    h = scan(a, b, h0=h0, reverse=reverse)
    assert h.shape == a.shape and h.is_contiguous()
    assert_close(h, linear_scan_ref(a, b, h0, reverse), tolerance(torch.float32))
    assert_gradients_close(lambda a, b, h0: scan(a, b, h0=h0, reverse=reverse),
                           lambda a, b, h0: linear_scan_ref(a, b, h0, reverse), inputs, tolerance(torch.float32))


@pytest.mark.parametrize("scan", [sequential_scan, linear_scan])
def test_extras_are_keyword_only(scan):
    a, b, h0 = random_scan_inputs((3, 10), torch.float32, with_h0=True)
    with pytest.raises(TypeError):
        scan(a, b, h0)


@pytest.mark.parametrize("dtype, reverse", [(torch.float32, False), (torch.float32, True), (torch.float16, False),
                                            (torch.bfloat16, True)])
def test_non_contiguous_views_forward_and_gradients(dtype, reverse):
    """a and b as halves of one projection along time-major memory, h0 an expanded (stride-0) row;
    in 16 bits the projection (a, b) too, h0 float32."""
    rows, length = 6, 37
    projection = randn(length, 2 * rows, dtype=dtype).requires_grad_()
    h0 = randn(1).expand(rows).requires_grad_()

    def run(scan):
        def fn(projection, h0):
            a_raw, b = projection.T.chunk(2, dim=0)        # (rows, length) views, stride(-1) != 1
            return scan(torch.sigmoid(a_raw), b, h0=h0, reverse=reverse)
        return fn

    ours = lambda projection, h0: run(lambda a, b, **kw: linear_scan(a, b, **kw))(projection, h0)  # noqa: E731
    ref = lambda projection, h0: run(linear_scan_ref)(projection, h0)  # noqa: E731
    leaves = dict(projection=projection, h0=h0)
    assert_close(ours(**leaves), ref(**leaves), tolerance(dtype), "h")
    assert_gradients_close(ours, ref, leaves, tolerance(dtype))
