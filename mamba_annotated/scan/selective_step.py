"""Decoding with Mamba-1: the selective scan for one new token, the state updated in place.

Algorithm (per batch b, channel d, state n; float32 inside the kernel)
    Generation feeds one token per call, and the state after the prompt is all it needs to carry:
    the scan of chapter 4.9 for a single step, reading the state instead of starting from zero.
        delta = softplus(delta + delta_bias_d)           (bias and softplus optional; the same
                                                          softplus as the scan, so a step equals
                                                          the scan's position)
        h_dn  = exp(delta * A_dn) * h_dn + delta * B_n * x_d
        y_d   = sum_n C_n h_dn + D_d x_d,  then y_d * silu(z_d)   (D and z optional)
    The 4-d layout (mamba_ssm's "heads" form) is the same update over heads * dim channels: the
    head and the row within it only say where each channel's numbers live.

Parallelism: one program per (BLOCK_M channels of one head, batch row, head); it loads its
[BLOCK_M, dstate] slice of the state once, updates it in registers and stores it back. Channels
never talk to each other, so no program waits for another and nothing is reduced across programs.

Shapes (mamba_ssm's ``selective_state_update``): state (batch, dim, dstate) or (batch, heads, dim,
dstate), any float dtype and any strides, updated in place; x, dt, z (batch, [heads,] dim);
A (dim, dstate) or (heads, dim, dstate); B, C (batch, dstate) or (batch, groups, dstate), channel
c of the heads * dim using group c // (heads * dim / groups); D, dt_bias (dim,) or (heads, dim).
Returns y like x.

Bytes moved: the state, read and written once: 2 * batch*channels*dstate elements; A once more
(channels*dstate, shared by the batch, from cache after the first row); x, dt, z, y and B, C are
dstate times smaller. A decoding step of a layer is bound by this traffic.
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..triton_ops import cdiv, next_power_of_2, rounded_product, sigmoid, softplus, state_rows
from ..validation import check_same_device, check_tensor


@lean_launch
@triton.jit
def selective_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr,
    heads, dim, dstate, channels_per_group,
    stride_state_b, stride_state_h, stride_state_d, stride_state_n,
    stride_x_b, stride_x_h, stride_x_d, stride_dt_b, stride_dt_h, stride_dt_d,
    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
    stride_z_b, stride_z_h, stride_z_d,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    row_mask = rows < dim
    mask = row_mask[:, None] & (n[None, :] < dstate)
    channel = h * dim + rows                       # index into the flattened (heads * dim) A, D, dt_bias
    group = channel // channels_per_group          # a gather: a block may straddle two groups

    state_ptrs = (state_ptr + b.to(tl.int64) * stride_state_b + h * stride_state_h
                  + rows[:, None] * stride_state_d + n[None, :] * stride_state_n)
    state = tl.load(state_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + h * stride_x_h + rows * stride_x_d,
                mask=row_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b.to(tl.int64) * stride_dt_b + h * stride_dt_h + rows * stride_dt_d,
                 mask=row_mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + channel, mask=row_mask, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus(dt)
    # padded states get A = 0 and B = C = 0: their decay is 1, they stay 0 and add nothing to y
    A = tl.load(A_ptr + channel[:, None] * dstate + n[None, :], mask=mask, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + b.to(tl.int64) * stride_B_b + group[:, None] * stride_B_g + n[None, :] * stride_B_n,
                mask=mask, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + b.to(tl.int64) * stride_C_b + group[:, None] * stride_C_g + n[None, :] * stride_C_n,
                mask=mask, other=0.0).to(tl.float32)

    state = tl.exp(dt[:, None] * A) * state + (dt * x)[:, None] * B
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    # the float32 state, before its rounding into memory; each product rounded before the sum, so
    # that every lane holds the same y (racecheck found lanes racing with sums a bit apart: rounded_product)
    y = tl.sum(rounded_product(state, C), axis=1)
    if HAS_D:
        y += tl.load(D_ptr + channel, mask=row_mask, other=0.0).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b.to(tl.int64) * stride_z_b + h * stride_z_h + rows * stride_z_d,
                    mask=row_mask, other=0.0).to(tl.float32)
        y *= z * sigmoid(z)
    tl.store(y_ptr + (b * heads + h).to(tl.int64) * dim + rows, y.to(y_ptr.dtype.element_ty),
             mask=row_mask)


def selective_state_update_launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """The 4-d layout: state (batch, heads, dim, dstate); x, dt, z (batch, heads, dim); A (heads *
    dim, dstate), D and dt_bias (heads * dim,) contiguous; B, C (batch, groups, dstate). Returns y
    (batch, heads, dim), contiguous."""
    batch, heads, dim, dstate = state.shape
    groups = B.shape[1]
    y = outputs.empty((batch, heads, dim), x.dtype, x.device)
    if y.numel() == 0:
        return y
    BLOCK_M = state_rows(dstate, dim)
    z_strides = z.stride() if z is not None else (0, 0, 0)
    selective_state_update_kernel[(cdiv(dim, BLOCK_M), batch, heads)](
        state, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, y,
        heads, dim, dstate, heads * dim // groups,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *z_strides,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        BLOCK_M=BLOCK_M, BLOCK_N=next_power_of_2(dstate), num_warps=4,
    )
    return y


def check_selective_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices):
    """Every argument in the 4-d layout (the 3-d one given a head axis of 1)."""
    if state_batch_indices is not None:
        raise NotImplementedError("state_batch_indices: indirect state rows (continuous batching) are not "
                                  "implemented; pass None and a state with one row per batch element")
    check_tensor("state", state, ndim=4)
    batch, heads, dim, dstate = state.shape
    check_tensor("x", x, shape=(batch, heads, dim))
    check_same_device("x", x, "state", state)
    check_tensor("dt", dt, shape=(batch, heads, dim))
    check_same_device("dt", dt, "state", state)
    check_tensor("A", A, shape=(heads, dim, dstate))
    check_same_device("A", A, "state", state)
    check_tensor("B", B, ndim=3)
    groups = B.shape[1]
    if B.shape[0] != batch or B.shape[2] != dstate or groups == 0 or (heads * dim) % groups:
        raise ValueError(f"B must have shape (batch, groups, dstate) = ({batch}, groups, {dstate}) with groups "
                         f"dividing the {heads * dim} channels; got {tuple(B.shape)}")
    check_same_device("B", B, "state", state)
    check_tensor("C", C, shape=tuple(B.shape))
    check_same_device("C", C, "state", state)
    for name, vector in (("D", D), ("dt_bias", dt_bias)):
        if vector is not None:
            check_tensor(name, vector, shape=(heads, dim))
            check_same_device(name, vector, "state", state)
    if z is not None:
        check_tensor("z", z, shape=(batch, heads, dim))
        check_same_device("z", z, "state", state)


def selective_state_update_impl(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                                B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                                dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """The launch on checked 4-d inputs (the body of the registered op). The kernel indexes A, D and
    dt_bias by channel, densely: a view of them (strided, or expanded with stride 0) is copied."""
    flat = (lambda t: t.reshape(-1).contiguous() if t is not None else None)
    return selective_state_update_launch(state, x, dt, A.reshape(-1, A.shape[-1]).contiguous(), B, C,
                                         flat(D), z, flat(dt_bias), dt_softplus)


selective_state_update_op = torch.library.custom_op("mamba_annotated::selective_state_update",
                                                    selective_state_update_impl, mutates_args=("state",))
selective_state_update_op.register_fake(lambda state, x, *_: x.new_empty(x.shape))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """One decoding step of the selective SSM, ``state`` updated in place: mamba_ssm's
    ``selective_state_update``, same arguments, layouts and return (see the module for the math).

    state (batch, dim, dstate) or (batch, heads, dim, dstate), any float dtype (the update runs in
    float32 and is rounded once into the state); x, dt, z (batch, [heads,] dim); A (dim, dstate) or
    (heads, dim, dstate); B, C (batch, dstate) or (batch, groups, dstate), groups dividing the
    heads * dim channels; D, dt_bias (dim,) or (heads, dim); dt_softplus. Any tensor may be a view.
    Returns y like x (from the float32 state, before it is rounded into ``state``). ``state_batch_indices`` (continuous batching)
    is not implemented: anything but None raises NotImplementedError. Not differentiable (decoding).
    """
    heads_layout = isinstance(state, torch.Tensor) and state.dim() == 4
    if not heads_layout:
        def head(t, ndim):  # the 3-d layout is the 4-d one with a head axis of 1
            return t.unsqueeze(1) if isinstance(t, torch.Tensor) and t.dim() == ndim else t
        state, x, dt, z = head(state, 3), head(x, 2), head(dt, 2), head(z, 2)
        A = A.unsqueeze(0) if isinstance(A, torch.Tensor) and A.dim() == 2 else A
        D, dt_bias = (t.unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 1 else t for t in (D, dt_bias))
    B, C = (t.unsqueeze(1) if isinstance(t, torch.Tensor) and t.dim() == 2 else t for t in (B, C))
    check_selective_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    if torch.compiler.is_compiling():
        y = selective_state_update_op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus))
    else:
        y = selective_state_update_impl(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus))
    return y if heads_layout else y.squeeze(1)
