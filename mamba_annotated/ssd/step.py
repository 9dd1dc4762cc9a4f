"""Decoding with Mamba-2: the SSD recurrence for one new token, the state updated in place.

Algorithm (per batch b and head h; float32 inside the kernel)
    The chunked pipeline (chapter 5) pays for tiles of Q positions; a decoding step has one. What
    carries the past is the state after the last position, so one step is the recurrent form of
    the SSM (``ssd_recurrent_ref``) at a single t:
        dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max)   (bias and softplus optional; the clamp
                                                               always applies, as in the chunked
                                                               pipeline, by the same helper)
        state <- exp(dt' A_h) state + dt' x B^T        (headdim, dstate): a decay and a rank-one update
        y = state C + D x,  then y * silu(z)           (D and z optional)
    A and dt are one number per head (Mamba-2's scalar decay), so the decay is one exponential per
    (batch, head), and B, C are shared by the heads of a group.

Parallelism: one program per (BLOCK_P rows of headdim, batch row, head); it loads its
[BLOCK_P, dstate] slice of the state once, updates it in registers and stores it back. Rows are
independent: no program waits for another, nothing is reduced across programs.

Shapes: state (batch, heads, headdim, dstate) any float dtype and any strides, updated in place;
x, z (batch, heads, headdim); dt (batch, heads); A, dt_bias (heads,); B, C (batch, groups, dstate);
D (heads,) or (heads, headdim). Returns y (batch, heads, headdim) in x's dtype.

Bytes moved: the state, read and written once: 2 * batch*heads*headdim*dstate elements; x, z, y
are dstate times smaller, B and C headdim * heads / groups times smaller. A decoding step of a
layer is bound by this traffic.
"""
import math

import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..library import contiguous
from ..triton_ops import cdiv, next_power_of_2, sigmoid, state_rows
from ..validation import check_same_device, check_tensor
from .chunk_cumsum import step_and_slope


@lean_launch
@triton.jit
def ssd_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr,
    heads, headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_state_b, stride_state_h, stride_state_p, stride_state_n,
    stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
    stride_z_b, stride_z_h, stride_z_p,
    HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < dstate
    mask = p_mask[:, None] & n_mask[None, :]
    g = h // heads_per_group
    b64 = b.to(tl.int64)

    # the head's step and decay: scalars, processed exactly as chunk_cumsum processes a position
    dt = tl.load(dt_ptr + b64 * stride_dt_b + h * stride_dt_h).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    dt, _ = step_and_slope(dt, bias, dt_min, dt_max, DT_SOFTPLUS)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))

    state_ptrs = (state_ptr + b64 * stride_state_b + h * stride_state_h
                  + p[:, None] * stride_state_p + n[None, :] * stride_state_n)
    state = tl.load(state_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b64 * stride_x_b + h * stride_x_h + p * stride_x_p, mask=p_mask, other=0.0).to(tl.float32)
    # padded states get B = C = 0: they stay 0 and add nothing to y
    B = tl.load(B_ptr + b64 * stride_B_b + g * stride_B_g + n * stride_B_n, mask=n_mask, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + b64 * stride_C_b + g * stride_C_g + n * stride_C_n, mask=n_mask, other=0.0).to(tl.float32)

    state = decay * state + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * C[None, :], axis=1)     # the float32 state, before its rounding into memory
    if HAS_D:
        if D_PER_CHANNEL:
            y += tl.load(D_ptr + h * headdim + p, mask=p_mask, other=0.0).to(tl.float32) * x
        else:
            y += tl.load(D_ptr + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b64 * stride_z_b + h * stride_z_h + p * stride_z_p, mask=p_mask, other=0.0).to(tl.float32)
        y *= z * sigmoid(z)
    tl.store(y_ptr + (b * heads + h).to(tl.int64) * headdim + p, y.to(y_ptr.dtype.element_ty),
             mask=p_mask)


def ssd_state_update_launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    """Checked inputs; A, D and dt_bias contiguous. Returns y (batch, heads, headdim), contiguous."""
    batch, heads, headdim, dstate = state.shape
    groups = B.shape[1]
    y = outputs.empty((batch, heads, headdim), x.dtype, x.device)
    if y.numel() == 0:
        return y
    BLOCK_P = state_rows(dstate, headdim)
    z_strides = z.stride() if z is not None else (0, 0, 0)
    ssd_state_update_kernel[(cdiv(headdim, BLOCK_P), batch, heads)](
        state, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, y,
        heads, headdim, dstate, heads // groups, float(dt_limit[0]), float(dt_limit[1]),
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *z_strides,
        HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        BLOCK_P=BLOCK_P, BLOCK_N=next_power_of_2(dstate), num_warps=4,
    )
    return y


def check_ssd_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_limit):
    check_tensor("state", state, ndim=4)
    batch, heads, headdim, dstate = state.shape
    check_tensor("x", x, shape=(batch, heads, headdim))
    check_same_device("x", x, "state", state)
    check_tensor("dt", dt, shape=(batch, heads))
    check_same_device("dt", dt, "state", state)
    check_tensor("A", A, shape=(heads,))
    check_same_device("A", A, "state", state)
    check_tensor("B", B, ndim=3)
    groups = B.shape[1]
    if B.shape[0] != batch or B.shape[2] != dstate or groups == 0 or heads % groups:
        raise ValueError(f"B must have shape (batch, groups, dstate) = ({batch}, groups, {dstate}) with groups "
                         f"dividing heads = {heads}; got {tuple(B.shape)}")
    check_same_device("B", B, "state", state)
    check_tensor("C", C, shape=tuple(B.shape))
    check_same_device("C", C, "state", state)
    if D is not None:
        check_tensor("D", D)
        if tuple(D.shape) not in ((heads,), (heads, headdim)):
            raise ValueError(f"D must have shape ({heads},) or ({heads}, {headdim}); got {tuple(D.shape)}")
        check_same_device("D", D, "state", state)
    if z is not None:
        check_tensor("z", z, shape=(batch, heads, headdim))
        check_same_device("z", z, "state", state)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, shape=(heads,))
        check_same_device("dt_bias", dt_bias, "state", state)
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not float(dt_limit[0]) < float(dt_limit[1])):
        raise ValueError(f"dt_limit must be a pair (min, max) with min < max; got {dt_limit!r}")


def ssd_state_update_impl(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                          dt_bias: torch.Tensor | None, dt_softplus: bool, dt_min: float,
                          dt_max: float) -> torch.Tensor:
    """The launch on checked inputs (the body of the registered op)."""
    return ssd_state_update_launch(state, x, dt, A.contiguous(), B, C, contiguous(D), z, contiguous(dt_bias),
                                   dt_softplus, (dt_min, dt_max))


ssd_state_update_op = torch.library.custom_op("mamba_annotated::ssd_state_update", ssd_state_update_impl,
                                              mutates_args=("state",))
ssd_state_update_op.register_fake(lambda state, x, *_: x.new_empty(x.shape))


def ssd_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *,
                     dt_limit=(0.0, math.inf)):
    """One decoding step of Mamba-2's SSM, ``state`` updated in place (see the module for the math):
    the position after the ones that ``ssd_chunk_scan(..., return_final_states=True)`` summed into
    its final state, so a prefill by the chunked scan followed by steps gives the chunked scan of
    the whole sequence.

    state (batch, heads, headdim, dstate), any float dtype (the update runs in float32 and is
    rounded once into the state); x (batch, heads, headdim); dt (batch, heads); A (heads,);
    B, C (batch, groups, dstate), groups dividing heads; D (heads,) or (heads, headdim); z like x;
    dt_bias (heads,); dt_softplus; dt_limit (min, max): the step is always clamped to it, as in
    ``ssd_chunk_scan``. Any tensor may be a view. Returns y like x, from the float32 state before
    its rounding into ``state``. Not differentiable (decoding).
    """
    check_ssd_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    args = (state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]))
    return ssd_state_update_op(*args) if torch.compiler.is_compiling() else ssd_state_update_impl(*args)
