"""The depthwise conv kernels (mamba_annotated/conv1d.py) against the float64 formula: causal and
centred windows, widths 2 to 4, odd lengths, packed sequences, with and without bias and SiLU, the
blocks' transposed views (of whole rows and of slices of wider ones), plain contiguous and strided
inputs, every float dtype, forward and every gradient; what the kernels assume of the strides; and
the input checks. (tests/test_modules.py runs the blocks that call it.)"""
import pytest
import torch

from mamba_annotated.conv1d import depthwise_conv1d, depthwise_conv_ref
from mamba_annotated.runtime import DEVICE

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def on_device(*shape, dtype=torch.float32):
    """Fresh draws (tests/conftest.py seeds each test) made on the device: a view taken after
    ``.to(DEVICE)`` keeps its strides, where moving a view with gaps would copy it dense."""
    return torch.randn(*shape, device=DEVICE).to(dtype)


def rows(batch, length, channels, row, batch_gap=0, dtype=torch.float32):
    """(batch, channels, L) seen in (batch, L, row) memory, row >= channels wide, its batch stride
    L * row + batch_gap: the layouts the blocks hand the kernels, and odd strides beside them."""
    memory = on_device(batch, length * row + batch_gap, dtype=dtype)[:, :length * row].view(batch, length, row)
    return memory[..., row - channels:].transpose(1, 2)


def inputs(batch, channels, length, width, dtype, layout):
    """x in one of four layouts, a weight and a bias."""
    if layout == "channels_last":  # (batch, L, channels) activations, seen as (batch, channels, L)
        x = rows(batch, length, channels, channels, dtype=dtype)
    elif layout == "projection_slice":  # the blocks' case: a slice of a wider in-projection output
        # rows 3 channels + 24 wide: with 16 channels a multiple of 8 and not of 16, as in a Mamba-2
        # block, where the kernels are told what divides the strides
        x = rows(batch, length, channels, 3 * channels + 24, dtype=dtype)
    elif layout == "contiguous":
        x = on_device(batch, channels, length, dtype=dtype)
    else:  # every other position of a wider tensor: no stride is the natural one
        x = on_device(batch, channels, 2 * length, dtype=dtype)[..., ::2]
    # a transposed weight and a strided bias: the kernels read the weight through its strides, and the
    # op makes the bias contiguous
    weight = on_device(width, channels).t() / width
    bias = on_device(2 * channels)[::2]
    return x, weight, bias


def packed_ids(batch, length):
    """(batch, L) int32: each row cut into 1 to 4 sequences at random positions."""
    ids = []
    for _ in range(batch):
        cuts = torch.randint(1, max(length, 2), (int(torch.randint(0, 4, (1,))),))
        ids.append(torch.bucketize(torch.arange(length), cuts.sort().values, right=True))
    return torch.stack(ids).to(DEVICE, torch.int32)


def relative_error(ours, ref):
    return ((ours.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [  # (batch, channels, length, width, left)
    (2, 24, 37, 4, 3),     # Mamba's causal conv, an odd length
    (1, 40, 1, 4, 3),      # one position
    (3, 17, 70, 3, 1),     # Hydra's centred conv (width 3: one past, one future)
    (2, 33, 50, 4, 1),     # width 4 centred as Hydra's ((width - 1) // 2 past, two future)
    (2, 130, 150, 4, 2),   # channels and positions over several of the GPU's 64 x 64 tiles
    (1, 8, 5, 2, 0),       # a window that sees only the present and the future
    (2, 16, 45, 4, 3),     # rows of 16 channels: 8 divides a projection slice's row stride (72), 16 does not
]


@pytest.mark.parametrize("batch,channels,length,width,left", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["channels_last", "projection_slice", "contiguous", "strided"])
@pytest.mark.parametrize("packed", [False, True])
def test_forward_and_gradients_match_float64(batch, channels, length, width, left, dtype, layout, packed):
    x, weight, bias = inputs(batch, channels, length, width, dtype, layout)
    seq_idx = packed_ids(batch, length) if packed else None
    for silu, with_bias in ((True, True), (False, False)):
        b = bias if with_bias else None
        xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
        bs = b.detach().requires_grad_() if b is not None else None
        out = depthwise_conv1d(xs, ws, bs, left, seq_idx, activation="silu" if silu else None)
        assert out.shape == x.shape and out.dtype == dtype
        x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        b64 = b.detach().double().requires_grad_() if b is not None else None
        ref = depthwise_conv_ref(x64, w64, b64, left, seq_idx, activation="silu" if silu else None)
        assert relative_error(out, ref) < TOLERANCE[dtype]
        # the gradient in the output's layout where the blocks have it (channels-last), else channels-first
        d_out = (rows(batch, length, channels, channels) if layout in ("channels_last", "projection_slice")
                 else on_device(*ref.shape))
        out.backward(d_out.to(dtype))
        ref.backward(d_out.double())
        assert relative_error(xs.grad, x64.grad) < TOLERANCE[dtype]
        assert xs.grad.dtype == dtype and ws.grad.dtype == weight.dtype
        # the weight's and bias's gradients sum over every position: float32 sums of 16-bit products
        assert relative_error(ws.grad, w64.grad) < TOLERANCE[dtype]
        if b is not None:
            assert relative_error(bs.grad, b64.grad) < TOLERANCE[dtype]


@pytest.mark.parametrize("odd", ["x batch stride", "d_out batch stride", "d_out row stride"])
def test_every_stride_counts_in_the_alignment(odd):
    """Rows of 16 channels 72 wide (8 divides the strides, 16 does not) with one stride odd among
    them: the kernels may assume only what divides every stride they read through (a claim that
    did not hold would round the strides, to wrong addresses), forward and gradients against float64."""
    batch, channels, length, width = 2, 16, 33, 4
    x = rows(batch, length, channels, 72, batch_gap=1 if odd == "x batch stride" else 0)
    d_out = rows(batch, length, channels, 73 if odd == "d_out row stride" else 72,
                 batch_gap=1 if odd == "d_out batch stride" else 0)
    weight, bias = on_device(channels, width) / width, on_device(channels)
    xs, x64 = x.detach().requires_grad_(), x.detach().double().requires_grad_()
    out = depthwise_conv1d(xs, weight, bias, width - 1, activation="silu")
    ref = depthwise_conv_ref(x64, weight.double(), bias.double(), width - 1, activation="silu")
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    out.backward(d_out)
    ref.backward(d_out.double())
    assert relative_error(xs.grad, x64.grad) < TOLERANCE[torch.float32]


def test_no_window_reaches_into_another_sequence():
    """Changing one packed sequence leaves every output and input gradient of the others as they were."""
    x, weight, bias = inputs(1, 16, 30, 4, torch.float32, "channels_last")
    seq_idx = torch.tensor([[0] * 10 + [1] * 12 + [2] * 8], dtype=torch.int32, device=DEVICE)
    changed = x.clone()
    changed[..., 10:22] = 100.0
    d_out = torch.randn(x.shape, device=DEVICE)
    others = torch.cat([torch.arange(10), torch.arange(22, 30)])
    for left in (3, 1):
        outs, grads = [], []
        for t in (x, changed):
            t = t.detach().requires_grad_()
            out = depthwise_conv1d(t, weight, bias, left, seq_idx, activation="silu")
            outs.append(out)
            grads.append(torch.autograd.grad(out, t, d_out)[0])
        assert torch.equal(outs[0][..., others], outs[1][..., others])
        assert torch.equal(grads[0][..., others], grads[1][..., others])


def test_nn_conv1d_weight_and_default_causal_window():
    """nn.Conv1d's (channels, 1, width) weight is taken as it is, and left defaults to width - 1,
    torch's conv padded by width - 1 and cut to the first L outputs (mamba_ssm's path without
    causal_conv1d)."""
    conv = torch.nn.Conv1d(12, 12, 4, groups=12, padding=3).to(DEVICE)
    x = torch.randn(2, 12, 19, device=DEVICE)
    expected = conv(x)[..., :19]
    assert torch.allclose(depthwise_conv1d(x, conv.weight, conv.bias), expected, atol=1e-5, rtol=1e-5)


def test_empty_inputs_and_refusals():
    x = torch.zeros(2, 5, 0, device=DEVICE, requires_grad=True)
    weight = torch.randn(5, 4, device=DEVICE, requires_grad=True)
    out = depthwise_conv1d(x, weight, None, activation="silu")
    assert out.shape == (2, 5, 0)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    with pytest.raises(ValueError, match="left"):
        depthwise_conv1d(x, weight, None, 4)
    with pytest.raises(NotImplementedError, match="activation"):
        depthwise_conv1d(x, weight, None, activation="relu")
    x = torch.randn(2, 5, 7, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        depthwise_conv1d(x, torch.randn(4, 4, device=DEVICE))  # 4 filters for 5 channels
    with pytest.raises(ValueError, match="bias"):
        depthwise_conv1d(x, weight, torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="seq_idx"):
        depthwise_conv1d(x, weight, seq_idx=torch.zeros(1, 7, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="x"):
        depthwise_conv1d(x.double(), weight)
