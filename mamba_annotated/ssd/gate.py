"""The gate of SSD and the bidirectional op, backward: out = y silu(z), one pass over the rows.

Given d_out, the output y before the gate, z and x, in float32:

    g  = d_out silu(z)                  the gradient reaching y
    dz = d_out y silu'(z)               stored in z's dtype
    dy = g                              stored in x's dtype: the chunk kernels' dots read it so
    dD = sum over batch and positions of g x     (y holds D x), per head and channel

dD is summed here, from g before it is rounded. Summed from the rounded dy, as the chunk kernels
sum it where there is no gate, a bfloat16 dD of one head at L = 2 was 2.2e-3 off on an H100 sweep
(bidirectional seed 509003), against 1e-8 for the same sum in float32; mamba_ssm also sums dD
from a float32 gradient when there is a gate. Without a gate d_out is the gradient as given, and
the chunk kernels' sums are exact products of it.

Parallelism: one program per (block of rows, head); a row is one (batch, position) of one head,
headdim wide. Each block stores its dD sums and the host adds them (no atomics: the same bits at
every call). Inputs are read through their own strides; dy and dz are contiguous.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import block_size, cdiv, rounded_product, silu_and_slope

ROW_TILE = 256 if INTERPRETED else 4096  # elements of one program's tile: rows of one head, headdim wide


@lean_launch
@triton.jit
def gate_backward_kernel(d_out_ptr, y_ptr, z_ptr, x_ptr, dy_ptr, dz_ptr, dD_ptr, rows, length, heads, headdim,
                         stride_do_b, stride_do_l, stride_do_h, stride_do_p,
                         stride_y_b, stride_y_l, stride_y_h, stride_y_p,
                         stride_z_b, stride_z_l, stride_z_h, stride_z_p,
                         stride_x_b, stride_x_l, stride_x_h, stride_x_p,
                         HAS_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # h * a head stride passes 2^31 in a heads-major view of a large tensor
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    mask = (r < rows)[:, None] & (p < headdim)[None, :]
    b = (r // length).to(tl.int64)[:, None]
    t = (r % length).to(tl.int64)[:, None]
    p = p[None, :]
    d_out = tl.load(d_out_ptr + b * stride_do_b + t * stride_do_l + h * stride_do_h + p * stride_do_p,
                    mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + b * stride_z_b + t * stride_z_l + h * stride_z_h + p * stride_z_p,
                mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * stride_y_b + t * stride_y_l + h * stride_y_h + p * stride_y_p,
                mask=mask, other=0.0).to(tl.float32)
    gate, slope = silu_and_slope(z)
    g = d_out * gate
    out = (r.to(tl.int64)[:, None] * heads + h) * headdim + p
    tl.store(dy_ptr + out, g.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + out, (d_out * y * slope).to(dz_ptr.dtype.element_ty), mask=mask)
    if HAS_D:
        x = tl.load(x_ptr + b * stride_x_b + t * stride_x_l + h * stride_x_h + p * stride_x_p,
                    mask=mask, other=0.0).to(tl.float32)
        # rounded products: every lane of the sum's last shuffles stores it, and lanes must agree
        tl.store(dD_ptr + (block.to(tl.int64) * heads + h) * headdim + p,
                 tl.sum(rounded_product(g, x), axis=0)[None, :], mask=p < headdim)


def gate_backward(d_out: torch.Tensor, y: torch.Tensor, z: torch.Tensor, x: torch.Tensor,
                  D: Optional[torch.Tensor]):
    """(dy in x's dtype, dz in z's dtype, both contiguous; dD like D, or None without D) for
    out = y silu(z), y holding D x. All four tensors are (batch, length, heads, headdim), with at
    least one position (the ops return earlier for an empty input)."""
    batch, length, heads, headdim = x.shape
    rows = batch * length
    block_p = block_size(headdim)
    block_r = max(1, min(ROW_TILE // block_p, 64))
    blocks = cdiv(rows, block_r)
    dy = outputs.empty(x.shape, x.dtype, x.device)
    dz = outputs.empty(z.shape, z.dtype, x.device)
    dD_blocks = outputs.empty((blocks, heads, headdim), torch.float32, x.device) if D is not None else dy
    gate_backward_kernel[(blocks, heads)](
        d_out, y, z, x, dy, dz, dD_blocks, rows, length, heads, headdim,
        *d_out.stride(), *y.stride(), *z.stride(), *x.stride(),
        HAS_D=D is not None, BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4)
    if D is None:
        return dy, dz, None
    dD = dD_blocks.sum(0)
    return dy, dz, (dD if D.dim() == 2 else dD.sum(-1)).to(D.dtype)
