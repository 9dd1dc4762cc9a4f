"""The depthwise convolution along time of the Mamba, Mamba-2, Hydra and attention blocks, with its
optional SiLU, one Triton kernel forward and two backward.

For x (batch, channels, L), weight (channels, width) and position t, in float32, rounded once to
x's dtype at the store:

    pre_t = bias + sum_k weight_k x_{t - left + k}    (k = 0 .. width - 1)
    out_t = silu(pre_t) if activation else pre_t

x reads as zero before the start and past the end and, with ``seq_idx`` (batch, L), wherever its
position belongs to another packed sequence than t's. left = width - 1 is Mamba's causal conv (the
causal_conv1d package's); left = (width - 1) // 2 is Hydra's centred one.

Why a kernel: the blocks hold these activations as (batch, L, channels), the in-projection's layout,
and torch's ``F.conv1d`` wants channels first: the path it replaces transposed, padded, convolved
with a generic depthwise kernel, sliced, transposed back and applied SiLU as a separate kernel, and
its backward did the same. This kernel reads x through its strides (a transposed view costs
nothing), and writes ``out`` channels-last, the layout the Mamba-2 and Hydra blocks go on in, so
their transpose back is a view too (Mamba-1's selective scan takes channels first and copies).

Backward, with g = d out: d pre = g * silu'(pre) (pre recomputed from x), d bias = sum of d pre,
d weight_k = sum_t d pre_t x_{t - left + k}, and d x_s = sum_k weight_k d pre_{s + left - k} over
the outputs whose window holds s (the same masks). The first kernel forms d pre in float32, stores
it, and each program sums its tile's share of d weight and d bias into a slot of its own; the host
adds the slots (no atomics: the same bits at every call). The second kernel gathers d x from
d pre. Both walk tiles of (positions, channels), channels along the fast axis.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import outputs
from .library import absent, contiguous, define_op
from .runtime import size
from .triton_ops import alignment, cdiv, known_multiple, silu_and_slope
from .validation import check_same_device, check_tensor

# (positions, channels) per program: 64 channels of 16-bit data are one 128-byte line per position
BLOCK_T, BLOCK_C = size(gpu=(64, 64), cpu=(16, 16))
WARPS = 4


@triton.jit
def _window_tap(x_ptr, seq_ptr, batch, t, c, seq_t, length, channels, stride_xb, stride_xc, stride_xt,
                SHIFT: tl.constexpr, HAS_SEQ: tl.constexpr, ALIGN: tl.constexpr):
    """x at positions t + SHIFT for channels c, as float32; zero where it does not count: outside
    [0, L) and, with seq_idx, outside t's sequence. Offsets are 64-bit: one row may pass 2^31
    elements. ALIGN divides stride_xb and stride_xt (see ``launch_alignment``)."""
    stride_xb, stride_xt = known_multiple(stride_xb, ALIGN), known_multiple(stride_xt, ALIGN)
    s = t + SHIFT
    ok = (s >= 0) & (s < length)
    if HAS_SEQ:
        ok = ok & (tl.load(seq_ptr + batch * length + s, mask=ok, other=0) == seq_t)
    mask = ok[:, None] & (c < channels)[None, :]
    offsets = batch * stride_xb + s.to(tl.int64)[:, None] * stride_xt + c.to(tl.int64)[None, :] * stride_xc
    return tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pre_activation(x_ptr, w_ptr, b_ptr, seq_ptr, batch, t, c, seq_t, length, channels,
                    stride_xb, stride_xc, stride_xt, stride_wc, stride_wk,
                    WIDTH: tl.constexpr, LEFT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
                    ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    c_ok = c < channels
    pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        xs = _window_tap(x_ptr, seq_ptr, batch, t, c, seq_t, length, channels, stride_xb, stride_xc, stride_xt,
                         k - LEFT, HAS_SEQ, ALIGN)
        w = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        pre += xs * w[None, :]
    if HAS_BIAS:
        pre += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    return pre


@triton.jit
def _tile(length, channels, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    batch = tl.program_id(2).to(tl.int64)
    return batch, t, c, (t < length)[:, None] & (c < channels)[None, :]


@triton.jit
def _channels_last(batch, t, c, length, channels):
    """Offsets of positions t, channels c in a contiguous (batch, L, channels) tensor (out, d pre, dx)."""
    return (batch * length + t.to(tl.int64))[:, None] * channels + c[None, :]


@triton.jit
def _sequence_of(seq_ptr, batch, t, length, HAS_SEQ: tl.constexpr):
    """The packed-sequence id of each position t (without seq_idx, t itself, which nothing reads)."""
    if HAS_SEQ:
        return tl.load(seq_ptr + batch * length + t, mask=t < length, other=0)
    return t


@triton.jit
def depthwise_conv_fwd_kernel(x_ptr, w_ptr, b_ptr, seq_ptr, out_ptr, length, channels,
                              stride_xb, stride_xc, stride_xt, stride_wc, stride_wk,
                              WIDTH: tl.constexpr, LEFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_SEQ: tl.constexpr, SILU: tl.constexpr, ALIGN: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    channels = known_multiple(channels, ALIGN)  # before the masks: lanes of one vector share theirs
    batch, t, c, inside = _tile(length, channels, BLOCK_T, BLOCK_C)
    seq_t = _sequence_of(seq_ptr, batch, t, length, HAS_SEQ)
    out = _pre_activation(x_ptr, w_ptr, b_ptr, seq_ptr, batch, t, c, seq_t, length, channels,
                          stride_xb, stride_xc, stride_xt, stride_wc, stride_wk,
                          WIDTH, LEFT, HAS_BIAS, HAS_SEQ, ALIGN, BLOCK_T, BLOCK_C)
    if SILU:
        out, _ = silu_and_slope(out)
    tl.store(out_ptr + _channels_last(batch, t, c, length, channels), out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def depthwise_conv_bwd_pre_kernel(x_ptr, w_ptr, b_ptr, seq_ptr, dout_ptr, dpre_ptr, dw_ptr, db_ptr, length, channels,
                                  stride_xb, stride_xc, stride_xt, stride_wc, stride_wk,
                                  stride_gb, stride_gc, stride_gt,
                                  WIDTH: tl.constexpr, LEFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  HAS_SEQ: tl.constexpr, SILU: tl.constexpr, ALIGN: tl.constexpr,
                                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """d pre (float32, (batch, L, channels)) and this tile's partial sums of d weight (slot (batch,
    tile of positions), (WIDTH, channels)) and d bias (slot, (channels,))."""
    channels = known_multiple(channels, ALIGN)
    batch, t, c, inside = _tile(length, channels, BLOCK_T, BLOCK_C)
    seq_t = _sequence_of(seq_ptr, batch, t, length, HAS_SEQ)
    stride_gb, stride_gt = known_multiple(stride_gb, ALIGN), known_multiple(stride_gt, ALIGN)
    g_offsets = batch * stride_gb + t.to(tl.int64)[:, None] * stride_gt + c.to(tl.int64)[None, :] * stride_gc
    g = tl.load(dout_ptr + g_offsets, mask=inside, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_ptr, w_ptr, b_ptr, seq_ptr, batch, t, c, seq_t, length, channels,
                              stride_xb, stride_xc, stride_xt, stride_wc, stride_wk,
                              WIDTH, LEFT, HAS_BIAS, HAS_SEQ, ALIGN, BLOCK_T, BLOCK_C)
        _, slope = silu_and_slope(pre)
        g = g * slope  # zero outside the tile: g was loaded as zero there, and pre there is finite
    tl.store(dpre_ptr + _channels_last(batch, t, c, length, channels), g, mask=inside)
    slot = batch * tl.num_programs(0) + tl.program_id(0)
    c_ok = c < channels
    for k in tl.static_range(WIDTH):
        xs = _window_tap(x_ptr, seq_ptr, batch, t, c, seq_t, length, channels, stride_xb, stride_xc, stride_xt,
                         k - LEFT, HAS_SEQ, ALIGN)
        tl.store(dw_ptr + (slot * WIDTH + k) * channels + c, tl.sum(g * xs, axis=0), mask=c_ok)
    if HAS_BIAS:
        tl.store(db_ptr + slot * channels + c, tl.sum(g, axis=0), mask=c_ok)


@triton.jit
def depthwise_conv_bwd_x_kernel(dpre_ptr, w_ptr, seq_ptr, dx_ptr, length, channels, stride_wc, stride_wk,
                                stride_pb, stride_pt, WIDTH: tl.constexpr, LEFT: tl.constexpr, HAS_SEQ: tl.constexpr,
                                ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """d x_s = sum_k weight_k d pre_{s + LEFT - k} over the outputs whose window holds s; dx is
    (batch, L, channels), contiguous. The masks are those of the forward pass seen from s: output
    t = s + LEFT - k counts where it is inside [0, L) and, with seq_idx, in s's sequence."""
    channels = known_multiple(channels, ALIGN)
    batch, s, c, inside = _tile(length, channels, BLOCK_T, BLOCK_C)
    seq_s = _sequence_of(seq_ptr, batch, s, length, HAS_SEQ)
    c_ok = c < channels
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        dpre = _window_tap(dpre_ptr, seq_ptr, batch, s, c, seq_s, length, channels, stride_pb, 1, stride_pt,
                           LEFT - k, HAS_SEQ, ALIGN)
        w = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        dx += dpre * w[None, :]
    tl.store(dx_ptr + _channels_last(batch, s, c, length, channels), dx.to(dx_ptr.dtype.element_ty), mask=inside)


def empty_channels_last(batch, channels, length, dtype, device):
    """A (batch, channels, L) tensor whose memory is (batch, L, channels): the blocks' layout."""
    return outputs.empty((batch, length, channels), dtype, device).transpose(1, 2)


def launch_alignment(channels, *tensors):
    """What divides the channel count (the row stride of what a kernel writes) and every stride it
    multiplies a batch or a position by, for ``known_multiple``: each tensor is (batch, channels,
    L), its channel axis the fast one."""
    return alignment(channels, *(stride for t in tensors for stride in (t.stride(0), t.stride(2))))


def conv_grid(batch, channels, length):
    return cdiv(length, BLOCK_T), cdiv(channels, BLOCK_C), batch


def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor],
                 left: int, silu: bool) -> torch.Tensor:
    batch, channels, length = x.shape
    out = empty_channels_last(batch, channels, length, x.dtype, x.device)
    if x.numel():
        depthwise_conv_fwd_kernel[conv_grid(batch, channels, length)](
            x, weight, bias if bias is not None else weight, seq_idx if seq_idx is not None else x, out,
            length, channels, *x.stride(), *weight.stride(),
            WIDTH=weight.shape[1], LEFT=left, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu,
            ALIGN=launch_alignment(channels, x), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=WARPS)
    return out


def fake_conv_forward(x, weight, bias, seq_idx, left, silu):
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1])).transpose(1, 2)


def conv_backward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor],
                  left: int, silu: bool, d_out: torch.Tensor) -> list[torch.Tensor]:
    """(dx like x's shape, channels-last; d weight like weight; d bias like bias, or absent)."""
    batch, channels, length = x.shape
    width = weight.shape[1]
    dx = empty_channels_last(batch, channels, length, x.dtype, x.device)
    if not x.numel():
        return [dx, weight.new_zeros(weight.shape), bias.new_zeros(bias.shape) if bias is not None else absent(x)]
    tiles = conv_grid(batch, channels, length)
    slots = batch * tiles[0]
    dpre = outputs.empty((batch, length, channels), torch.float32, x.device)
    dw = outputs.empty((slots, width, channels), torch.float32, x.device)
    db = outputs.empty((slots, channels), torch.float32, x.device) if bias is not None else None
    seq = seq_idx if seq_idx is not None else x
    depthwise_conv_bwd_pre_kernel[tiles](
        x, weight, bias if bias is not None else weight, seq, d_out, dpre, dw, db if db is not None else dw,
        length, channels, *x.stride(), *weight.stride(), *d_out.stride(),
        WIDTH=width, LEFT=left, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu,
        ALIGN=launch_alignment(channels, x, d_out), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=WARPS)
    depthwise_conv_bwd_x_kernel[tiles](
        dpre, weight, seq, dx, length, channels, *weight.stride(), dpre.stride(0), dpre.stride(1),
        WIDTH=width, LEFT=left, HAS_SEQ=seq_idx is not None,
        ALIGN=alignment(channels),  # d pre is contiguous: its strides are multiples of the channel count
        BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=WARPS)
    d_weight = dw.sum(0).t().contiguous().to(weight.dtype)
    return [dx, d_weight, db.sum(0).to(bias.dtype) if bias is not None else absent(x)]


def fake_conv_backward(x, weight, bias, seq_idx, left, silu, d_out):
    return [fake_conv_forward(x, weight, bias, seq_idx, left, silu), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else absent(x)]


def save_conv(ctx, inputs, output):  # "output": torch.library passes it by that name
    x, weight, bias, seq_idx, left, silu = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.options = (left, silu)


def conv_grads(ctx, run_backward, d_out):
    x, weight, bias, seq_idx = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None, None
    dx, dw, db = run_backward(x, weight, bias, seq_idx, *ctx.options, d_out)
    return dx, dw, db if bias is not None else None, None, None, None


depthwise_conv_op = define_op("depthwise_conv1d", conv_forward, fake_conv_forward, conv_backward, fake_conv_backward,
                              save_conv, conv_grads)


def depthwise_conv_ref(x, weight, bias, left, seq_idx=None, activation=None):
    """The module docstring's formula in torch ops, in x's dtype's arithmetic (the tests' float64
    reference): x (batch, channels, L), weight (channels, width)."""
    width, length = weight.shape[1], x.shape[-1]
    pads = (left, width - 1 - left)
    windows = torch.nn.functional.pad(x, pads).unfold(-1, width, 1)  # (batch, channels, L, width)
    if seq_idx is not None:
        inside = torch.nn.functional.pad(torch.ones_like(seq_idx, dtype=torch.bool), pads).unfold(-1, width, 1)
        ids = torch.nn.functional.pad(seq_idx, pads).unfold(-1, width, 1)
        windows = windows * (inside & (ids == seq_idx[..., :length, None]))[:, None].to(x.dtype)
    out = (windows * weight[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[:, None]
    return torch.nn.functional.silu(out) if activation is not None else out


def depthwise_conv1d(x, weight, bias=None, left=None, seq_idx=None, activation=None):
    """x (batch, channels, L) of a float dtype, any strides (the blocks pass a transposed view of
    their (batch, L, channels) activations); weight (channels, width) or nn.Conv1d's (channels, 1,
    width), any float dtype and strides; bias (channels,) or None; ``left`` the past positions each
    window sees (default width - 1, causal); ``seq_idx`` (batch, L) integer ids of packed sequences,
    or None; ``activation`` None or "silu"/"swish". Returns (batch, channels, L) in x's dtype (under
    autocast too, with or without seq_idx), its memory channels-last. Differentiable in x, weight
    and bias (float32 sums, gradients in their dtypes)."""
    check_tensor("x", x, ndim=3)
    batch, channels, length = x.shape
    check_tensor("weight", weight)
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape (channels, width) or (channels, 1, width) with channels = "
                         f"{channels}; got {tuple(weight.shape)}")
    check_same_device("weight", weight, "x", x)
    if bias is not None:
        check_tensor("bias", bias, shape=(channels,))
        check_same_device("bias", bias, "x", x)
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, dtypes=(torch.int32, torch.int64), shape=(batch, length))
        check_same_device("seq_idx", seq_idx, "x", x)
        seq_idx = seq_idx.to(torch.int32).contiguous()
    width = weight.shape[1]
    left = width - 1 if left is None else int(left)
    if not 0 <= left < width:
        raise ValueError(f"left must be in [0, width) = [0, {width}); got {left}")
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"activation: {activation!r} is not implemented (None, 'silu' or 'swish')")
    # the kernels read the bias at the channel index
    return depthwise_conv_op(x, weight, contiguous(bias), seq_idx, left, activation is not None)
