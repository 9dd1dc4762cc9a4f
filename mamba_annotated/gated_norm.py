"""The (gated) RMS norm of Mamba blocks, one Triton kernel each way: mamba_ssm's ``rmsnorm_fn``.

For each row of x (..., N) and each group of ``group_size`` channels (None: one group of N), in
float32, rounded once to x's dtype at the store:

    u    = x * silu(z)            if z is given and not norm_before_gate, else x
    rstd = 1 / sqrt(mean(u^2) + eps)            (over the group)
    out  = (u * rstd * weight + bias) * silu(z) if z is given and norm_before_gate
           (u * rstd * weight + bias)           otherwise

Why a kernel: written with torch ops, the norm runs a handful of elementwise kernels each way and
autograd keeps their float32 intermediates (several copies of a d_inner-wide activation per layer,
where a bfloat16 model keeps one). This kernel reads x and z once, writes out and one float32
``rstd`` per row and group, and its backward recomputes u from x and z.

Backward, with n = u * rstd, the gradient reaching n * weight + bias being g (dy, times silu(z)
after a post-norm gate): d weight = sum over rows of g * n, d bias = sum of g, and within a group
du = rstd * (g * weight - n * mean(g * weight * n)), except in a group of one element, where it is
g * weight * eps * rstd^3 (below); the gates' derivative is
silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))). Each backward program walks a band of rows and
keeps its weight and bias sums in registers; the host adds the bands' partial sums (no atomics: the
same bits at every call).

Parallelism: forward, one program per (row, group); backward, one per (band of rows, group).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import outputs
from .library import absent, contiguous, define_op, last_dim_contiguous
from .runtime import DEVICE, sm_count
from .triton_ops import alignment, block_size, cdiv, known_multiple, silu_and_slope
from .validation import check_same_device, check_tensor


@triton.jit
def gated_rms_norm_fwd_kernel(x_ptr, z_ptr, w_ptr, b_ptr, out_ptr, rstd_ptr, n_groups, group_size, eps,
                              stride_x, stride_z, stride_out,
                              HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                              ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    group_size = known_multiple(group_size, ALIGN)
    stride_x, stride_z, stride_out = (known_multiple(stride_x, ALIGN), known_multiple(stride_z, ALIGN),
                                      known_multiple(stride_out, ALIGN))
    k = tl.arange(0, BLOCK)
    ok = k < group_size
    cols = g * group_size + k
    u = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_Z:
        gate, _ = silu_and_slope(tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0).to(tl.float32))
        if not NORM_BEFORE_GATE:
            u = u * gate
    rstd = 1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) / group_size + eps)
    tl.store(rstd_ptr + row * n_groups + g, rstd)
    out = u * rstd * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            out = out * gate
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gated_rms_norm_bwd_kernel(x_ptr, z_ptr, w_ptr, b_ptr, rstd_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, db_ptr,
                              rows, rows_per_band, n_groups, group_size, width, eps,
                              stride_x, stride_z, stride_dy,
                              HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                              ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    band = tl.program_id(0)
    g = tl.program_id(1)
    group_size, width = known_multiple(group_size, ALIGN), known_multiple(width, ALIGN)
    stride_x, stride_z, stride_dy = (known_multiple(stride_x, ALIGN), known_multiple(stride_z, ALIGN),
                                     known_multiple(stride_dy, ALIGN))
    k = tl.arange(0, BLOCK)
    ok = k < group_size
    cols = g * group_size + k
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = (band * rows_per_band).to(tl.int64)
    x_row, z_row, dy_row = x_ptr + start * stride_x, z_ptr + start * stride_z, dy_ptr + start * stride_dy
    dx_row, dz_row, rstd_row = dx_ptr + start * width, dz_ptr + start * width, rstd_ptr + start * n_groups + g
    for _ in range(0, tl.minimum(rows_per_band, rows - start)):  # row pointers step along the band
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        u = x
        if HAS_Z:
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            gate, slope = silu_and_slope(z)
            if not NORM_BEFORE_GATE:
                u = x * gate
        rstd = tl.load(rstd_row)
        n = u * rstd
        grad = tl.load(dy_row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_Z:
            if NORM_BEFORE_GATE:  # out = y * silu(z), y = n * w + b
                y = n * w
                if HAS_BIAS:
                    y += b
                tl.store(dz_row + cols, (grad * y * slope).to(dz_ptr.dtype.element_ty), mask=ok)
                grad = grad * gate
        dw += grad * n
        db += grad
        dn = grad * w
        du = (dn - n * (tl.sum(dn * n, axis=0) / group_size)) * rstd
        # A lone element's n is +-1 to within eps / u^2, so dn - n^2 dn cancels to rounding noise (a
        # float32 grad x 8.9e-3 off on an H100, groups of one element); exactly, du = dn eps rstd^3
        du = tl.where(group_size == 1, dn * eps * (rstd * rstd * rstd), du)
        dx = du
        if HAS_Z:
            if not NORM_BEFORE_GATE:  # u = x * silu(z)
                dx = du * gate
                tl.store(dz_row + cols, (du * x * slope).to(dz_ptr.dtype.element_ty), mask=ok)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        x_row += stride_x
        z_row += stride_z
        dy_row += stride_dy
        dx_row += width
        dz_row += width
        rstd_row += n_groups
    tl.store(dw_ptr + band.to(tl.int64) * width + cols, dw, mask=ok)
    if HAS_BIAS:
        tl.store(db_ptr + band.to(tl.int64) * width + cols, db, mask=ok)


MAX_GROUP_BYTES = 65536  # mamba_ssm's bound too: one group of x held by one program


def rows_of(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (..., width) as (rows, width) with unit channel stride (a copy only where needed)."""
    return last_dim_contiguous(t.reshape(-1, width))


def launch_options(group_size: int, rows: list[Optional[torch.Tensor]]) -> dict:
    """The block and warps for a group, and for ``known_multiple`` what divides the group size and
    the row strides of every input ``rows`` (2-d; None for an absent z). The outputs are contiguous,
    their rows a whole number of groups wide."""
    block = block_size(group_size)
    align = alignment(group_size, *(t.stride(0) for t in rows if t is not None))
    return dict(BLOCK=block, num_warps=min(16, max(1, block // 256)), ALIGN=align)


def gated_rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           z: Optional[torch.Tensor], eps: float, group_size: int, norm_before_gate: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out like x, rstd (rows, groups) float32)."""
    width = x.shape[-1]
    weight, bias = contiguous(weight), contiguous(bias)  # the kernels read them at the channel index
    x2, z2 = rows_of(x, width), rows_of(z, width) if z is not None else None
    rows, n_groups = x2.shape[0], width // group_size
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((rows, n_groups), dtype=torch.float32, device=x.device)
    if rows:
        gated_rms_norm_fwd_kernel[(rows, n_groups)](
            x2, z2 if z2 is not None else x2, weight, bias if bias is not None else weight, out, rstd, n_groups,
            group_size, eps, x2.stride(0), z2.stride(0) if z2 is not None else 0, width,
            HAS_Z=z is not None, HAS_BIAS=bias is not None, NORM_BEFORE_GATE=norm_before_gate,
            **launch_options(group_size, [x2, z2]))
    return out, rstd


def fake_gated_rms_norm_forward(x, weight, bias, z, eps, group_size, norm_before_gate):
    return x.new_empty(x.shape), x.new_empty((math.prod(x.shape[:-1]), x.shape[-1] // group_size),
                                             dtype=torch.float32)


def gated_rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            z: Optional[torch.Tensor], rstd: torch.Tensor, eps: float, group_size: int,
                            norm_before_gate: bool, d_out: torch.Tensor) -> list[torch.Tensor]:
    """(dx, d weight, d bias, dz): like x, weight, bias, z (absent for a bias or z that is None)."""
    width = x.shape[-1]
    weight, bias = contiguous(weight), contiguous(bias)
    x2, dy2 = rows_of(x, width), rows_of(d_out, width)
    z2 = rows_of(z, width) if z is not None else None
    rows, n_groups = x2.shape[0], width // group_size
    bands = max(1, min(rows, 4 * sm_count() if DEVICE.type == "cuda" else 4))
    rows_per_band = cdiv(max(rows, 1), bands)
    bands = cdiv(max(rows, 1), rows_per_band)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=x.device) if z is not None else None
    # each band's partial sums: every element written by the kernel, or zeros when there is no row
    partials = outputs.empty if rows else (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    dw = partials((bands, width), torch.float32, x.device)
    db = partials((bands, width), torch.float32, x.device) if bias is not None else None
    if rows:
        gated_rms_norm_bwd_kernel[(bands, n_groups)](
            x2, z2 if z2 is not None else x2, weight, bias if bias is not None else weight, rstd, dy2, dx,
            dz if dz is not None else dx, dw, db if db is not None else dw, rows, rows_per_band, n_groups,
            group_size, width, eps, x2.stride(0), z2.stride(0) if z2 is not None else 0, dy2.stride(0),
            HAS_Z=z is not None, HAS_BIAS=bias is not None, NORM_BEFORE_GATE=norm_before_gate,
            **launch_options(group_size, [x2, z2, dy2]))
    return [dx, dw.sum(0).to(weight.dtype), db.sum(0).to(bias.dtype) if bias is not None else absent(x),
            dz if dz is not None else absent(x)]


def fake_gated_rms_norm_backward(x, weight, bias, z, rstd, eps, group_size, norm_before_gate, d_out):
    return [x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else absent(x),
            z.new_empty(z.shape) if z is not None else absent(x)]


def save_gated_rms_norm(ctx, inputs, output):  # "output": torch.library passes it by that name
    x, weight, bias, z, eps, group_size, norm_before_gate = inputs
    ctx.save_for_backward(x, weight, bias, z, output[1])
    ctx.options = (eps, group_size, norm_before_gate)
    ctx.mark_non_differentiable(output[1])


def gated_rms_norm_grads(ctx, run_backward, d_out, _):
    x, weight, bias, z, rstd = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None, None, None
    dx, dw, db, dz = run_backward(x, weight, bias, z, rstd, *ctx.options, d_out)
    return (dx, dw, db if bias is not None else None, dz if z is not None else None, None, None, None)


gated_rms_norm_op = define_op("gated_rms_norm", gated_rms_norm_forward, fake_gated_rms_norm_forward,
                              gated_rms_norm_backward, fake_gated_rms_norm_backward, save_gated_rms_norm,
                              gated_rms_norm_grads)


def rmsnorm_ref(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """The formula of the module docstring in torch ops: float32 arithmetic (float64 for float64
    inputs, the tests' reference), returned in x's dtype. The benchmarks' torch baseline."""
    dtype = x.dtype
    compute = torch.promote_types(dtype, torch.float32)
    u = x.to(compute)
    gate = F.silu(z.to(compute)) if z is not None else None
    if gate is not None and not norm_before_gate:
        u = u * gate
    groups = u.unflatten(-1, (-1, group_size if group_size is not None else u.shape[-1]))
    out = (groups * torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(dtype)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm's ``rmsnorm_fn`` (ops/triton/layernorm_gated.py): same arguments, defaults and
    return (see the module docstring). x and z (..., N) in float dtypes, z's may differ from x's (a
    decoding step under autocast gates a float32 x by a bfloat16 z), any strides; weight and bias
    (N,) (bias may be None); group_size divides N. Returns a tensor like x. Differentiable in x,
    weight, bias and z (each gradient in its input's dtype)."""
    check_tensor("x", x, min_ndim=1)
    width = x.shape[-1] if x.dim() else 0
    check_tensor("weight", weight, shape=(width,))
    check_same_device("weight", weight, "x", x)
    if bias is not None:
        check_tensor("bias", bias, shape=(width,))
        check_same_device("bias", bias, "x", x)
    if z is not None:
        check_tensor("z", z, shape=tuple(x.shape))
        check_same_device("z", z, "x", x)
    group_size = width if group_size is None else int(group_size)
    if group_size <= 0 or width % group_size:
        raise ValueError(f"group_size must divide the last dimension of x ({width}); got {group_size}")
    if group_size * x.element_size() > MAX_GROUP_BYTES:
        raise ValueError(f"a group of x must fit in {MAX_GROUP_BYTES} bytes (one program holds it in registers, as "
                         f"mamba_ssm's kernel does); got {group_size} channels of {x.dtype}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0; got {eps}")
    out, _ = gated_rms_norm_op(x, weight, bias, z, float(eps), group_size, bool(norm_before_gate))
    return out
