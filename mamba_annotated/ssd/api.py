"""The public SSD function: input checks, and the op registered with torch.library (:mod:`..library`)."""
import operator
from typing import Optional

import torch

from ..library import absent, contiguous, define_op, last_dim_contiguous, traced_or_captured
from ..validation import check_same, check_same_device, check_tensor, refuse_unless
from ..triton_ops import cdiv
from .backward import ssd_backward
from .chunk_state import cb_length
from .forward import Saved, ssd_forward
from .gate import gate_backward

CHUNK_SIZES = (16, 32, 64, 128, 256)
MAX_HEADDIM = 128  # the backward kernels hold a whole row of headdim in registers
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_chunk_size(chunk_size) -> int:
    """chunk_size as an int: any integer-like (operator.index: int, numpy integers, 0-d integer
    tensors), one of CHUNK_SIZES."""
    try:
        value = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size must be an integer, one of {CHUNK_SIZES}; got {chunk_size!r}") from None
    if isinstance(chunk_size, bool) or value not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}; got {chunk_size!r}")
    return value


def check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                     dt_limit, return_varlen_states, state_dtype):
    """Every argument of :func:`ssd_chunk_scan`; returns chunk_size as an int."""
    check_tensor("x", x, ndim=4)
    batch, length, heads, headdim = x.shape
    if headdim > MAX_HEADDIM:
        raise NotImplementedError(f"x: headdim {headdim} > {MAX_HEADDIM} is not supported")
    check_tensor("dt", dt, shape=(batch, length, heads))
    check_same_device("dt", dt, "x", x)
    check_tensor("A", A, shape=(heads,))
    check_same_device("A", A, "x", x)
    check_tensor("B", B, ndim=4)
    groups, dstate = B.shape[2], B.shape[3]
    if B.shape[:2] != x.shape[:2] or groups == 0 or heads % groups != 0 or dstate == 0:
        raise ValueError(f"B must have shape (batch, L, groups, dstate) = ({batch}, {length}, groups, dstate) "
                         f"with groups dividing heads = {heads} and dstate >= 1; got {tuple(B.shape)}")
    if B.dtype != x.dtype:
        raise TypeError(f"B must have the dtype of x ({x.dtype}); got {B.dtype}")
    check_same_device("B", B, "x", x)
    check_tensor("C", C)
    check_same("C", C, "B", B)
    chunk_size = check_chunk_size(chunk_size)
    if D is not None:
        check_tensor("D", D)
        if tuple(D.shape) not in ((heads,), (heads, headdim)):
            raise ValueError(f"D must have shape ({heads},) or ({heads}, {headdim}); got {tuple(D.shape)}")
        check_same_device("D", D, "x", x)
    if z is not None:
        check_tensor("z", z)
        check_same("z", z, "x", x)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, shape=(heads,))
        check_same_device("dt_bias", dt_bias, "x", x)
    if initial_states is not None:
        check_tensor("initial_states", initial_states, shape=(batch, heads, headdim, dstate))
        check_same_device("initial_states", initial_states, "x", x)
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, dtypes=INDEX_DTYPES, shape=(batch, length))
        check_same_device("seq_idx", seq_idx, "x", x)
        if length > 1 and not traced_or_captured():
            refuse_unless((seq_idx[:, 1:] >= seq_idx[:, :-1]).all(),
                          "seq_idx must be nondecreasing along L (each packed sequence one run)")
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must be given when return_varlen_states is True")
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        check_same_device("cu_seqlens", cu_seqlens, "x", x)
        if cu_seqlens.shape[0] == 0:
            raise ValueError("cu_seqlens must hold at least one offset (sequences + 1 of them); got none")
        if batch != 1:
            raise ValueError(f"return_varlen_states needs batch 1 (the packed sequences in one row, as "
                             f"mamba_ssm); got batch {batch}")
        if not traced_or_captured():
            valid = (cu_seqlens[0] >= 0) & (cu_seqlens[-1] <= length) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
            refuse_unless(valid, f"cu_seqlens must be nondecreasing offsets in [0, L = {length}]")
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not float(dt_limit[0]) < float(dt_limit[1])):
        raise ValueError(f"dt_limit must be a pair (min, max) with min < max; got {dt_limit!r}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise TypeError(f"state_dtype must be None or one of float32, float16, bfloat16; got {state_dtype!r}")
    return chunk_size


def ssd_forward_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                   dt_bias: Optional[torch.Tensor], initial_states: Optional[torch.Tensor],
                   seq_idx: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], dt_softplus: bool,
                   dt_min: float, dt_max: float, state_dtype: Optional[torch.dtype], return_final_states: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, final_states (absent unless ``return_final_states``), y before the gate (absent without
    z), the states at the ends of the packed sequences (absent without cu_seqlens), and what the
    backward pass reads: dA_cumsum, dt_out, CB, states_in (:class:`~.forward.Saved`)."""
    if x.numel() == 0:
        return empty_forward(x, B, chunk_size, z, initial_states, cu_seqlens, state_dtype, return_final_states)
    result = ssd_forward(x, dt, A.contiguous(), B, C, chunk_size, D=contiguous(D), z=z,
                         dt_bias=contiguous(dt_bias), initial_states=initial_states, seq_idx=seq_idx,
                         cu_seqlens=contiguous(cu_seqlens), dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
                         state_dtype=state_dtype, final_states=return_final_states)
    final = result.final_states if result.final_states is not None else absent(x)
    y = result.y if result.y is not None else absent(x)
    varlen = result.varlen_states if result.varlen_states is not None else absent(x)
    return (result.out, final, y, varlen, *result.saved.tensors())


def forward_outputs(x, B, chunk_size, z, cu_seqlens, state_dtype, return_final_states, make):
    """The eight outputs of :func:`ssd_forward_op`, each made by ``make(shape, dtype)``."""
    batch, length, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    n_chunks = cdiv(length, chunk_size)
    stored, final = state_dtype or x.dtype, state_dtype or torch.float32  # mamba_ssm's dtypes by default
    chunk_shape = (batch, heads, n_chunks, chunk_size)
    return (make(x.shape, x.dtype), make((batch, heads, headdim, dstate), final) if return_final_states else absent(x),
            make(x.shape, x.dtype) if z is not None else absent(x),
            make((cu_seqlens.shape[0] - 1, heads, headdim, dstate), stored) if cu_seqlens is not None else absent(x),
            make((batch, heads, n_chunks, 2, chunk_size), torch.float32),  # the sums' planes (.log_decays)
            make(chunk_shape, torch.float32),                               # the steps
            make((batch, n_chunks, groups, cb_length(chunk_size)), torch.float32),        # CB (.chunk_state)
            make((batch, n_chunks, heads, headdim, dstate), stored))


def empty_forward(x, B, chunk_size, z, initial_states, cu_seqlens, state_dtype, return_final_states):
    """No element of x: zeros everywhere, no launch; after no step the final state is the initial one."""
    outs = forward_outputs(x, B, chunk_size, z, cu_seqlens, state_dtype, return_final_states,
                           lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=x.device))
    if return_final_states and initial_states is not None and x.shape[1] == 0:
        outs[1].copy_(initial_states)
    return outs


def fake_ssd_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                     dt_min, dt_max, state_dtype, return_final_states):
    return forward_outputs(x, B, chunk_size, z, cu_seqlens, state_dtype, return_final_states,
                           lambda shape, dtype: x.new_empty(shape, dtype=dtype))


INPUT_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def ssd_backward_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    chunk_size: int, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                    dt_bias: Optional[torch.Tensor], initial_states: Optional[torch.Tensor],
                    seq_idx: Optional[torch.Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
                    y: Optional[torch.Tensor], dA_cumsum: torch.Tensor, dt_out: torch.Tensor, CB: torch.Tensor,
                    states_in: torch.Tensor, d_out: torch.Tensor, d_final: Optional[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """The gradients of x, dt, A, B, C, D, z, dt_bias, initial_states, each in its input's shape
    and dtype, contiguous (absent for an input that is None). y is the output before the gate."""
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    if x.numel() == 0:
        grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) if t is not None else absent(x)
                 for t in inputs]
        if initial_states is not None and d_final is not None and x.shape[1] == 0:
            grads[-1].copy_(d_final)  # after no step the final state is the initial one
        return grads
    dy, dz, dD = gate_backward(d_out, y, z, x, D) if z is not None else (d_out, None, None)
    grads = ssd_backward(dy, x, dt, A.contiguous(), B, C, Saved(dA_cumsum, dt_out, CB, states_in), D=contiguous(D),
                         dt_bias=contiguous(dt_bias), initial_states=initial_states, seq_idx=seq_idx,
                         d_final=d_final, dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), sum_D=z is None)
    grads["z"] = dz
    if z is not None:
        grads["D"] = dD
    return [grads[name] if t is not None else absent(x) for name, t in zip(INPUT_NAMES, inputs)]


def fake_ssd_backward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min,
                      dt_max, y, dA_cumsum, dt_out, CB, states_in, d_out, d_final):
    inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [t.new_empty(t.shape) if t is not None else absent(x) for t in inputs]


def save_ssd(ctx, inputs, output):  # "output": torch.library passes it by that name
    (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_min, dt_max,
     _, return_final_states) = inputs
    _, _, y, _, *saved = output
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, y if z is not None else None,
                          *saved)
    ctx.options = (chunk_size, dt_softplus, dt_min, dt_max)
    ctx.varlen_states = cu_seqlens is not None
    ctx.final_states = return_final_states  # else the final states' gradient is that of an absent output
    ctx.mark_non_differentiable(y, *saved)


def ssd_grads(ctx, run_backward, d_out, d_final, *_):
    if ctx.varlen_states:
        raise NotImplementedError("ssd_chunk_scan: no backward pass with return_varlen_states=True (nor has "
                                  "mamba_ssm's mamba_chunk_scan_combined); call it without return_varlen_states "
                                  "to differentiate")
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, y, *saved = ctx.saved_tensors
    chunk_size, dt_softplus, dt_min, dt_max = ctx.options
    if not ctx.final_states:
        d_final = None
    if d_out is None:
        d_out = torch.zeros_like(x)
    grads = run_backward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min,
                         dt_max, y, *saved, d_out, d_final)
    dx, d_dt, dA, dB, dC, dD, dz, d_bias, d_initial = (
        g if t is not None else None for g, t in zip(grads, (x, dt, A, B, C, D, z, dt_bias, initial_states)))
    return dx, d_dt, dA, dB, dC, None, dD, dz, d_bias, d_initial, None, None, None, None, None, None, None


ssd_chunk_scan_op = define_op("ssd_chunk_scan", ssd_forward_op, fake_ssd_forward, ssd_backward_op,
                              fake_ssd_backward, save_ssd, ssd_grads)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                   cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                   return_varlen_states=False, state_dtype=None):
    """Mamba-2's SSM by the chunked state-space-duality algorithm (chapter 5): mamba_ssm's
    ``mamba_chunk_scan_combined``, same arguments, defaults and returns, plus ``state_dtype``.

    x (batch, L, heads, headdim) float32/float16/bfloat16; dt (batch, L, heads) any float dtype;
    A (heads,); B, C (batch, L, groups, dstate) in x's dtype (heads of a group share them);
    chunk_size an integer, one of 16, 32, 64, 128, 256 (L need not be a multiple); D (heads,) or
    (heads, headdim); z like x (out = y * silu(z)); dt_bias (heads,); initial_states (batch, heads,
    headdim, dstate); seq_idx (batch, L) int32/int64, nondecreasing: packed sequences, no state
    crosses a boundary, and initial_states belong to the sequence with id 0 (as mamba_ssm: they
    reach no position with another id); dt_softplus; dt_limit (min, max): the step
    softplus(dt + dt_bias) is always clamped to it, so the default (0, inf) turns negative steps
    into 0; cu_seqlens (sequences + 1,) offsets of packed sequences, read only with
    return_varlen_states. Any tensor may be a view (split, transposed, expanded); all on x's device.
    The values inside seq_idx and cu_seqlens are checked on the device without synchronising (on a
    GPU a bad one is a device-side assert, which leaves the CUDA context unusable, as PyTorch's own
    index checks do; :func:`..validation.refuse_unless`); every other check raises at the call.

    Returns out like x; with ``return_final_states`` also the state after the last position
    (batch, heads, headdim, dstate), float32; with ``return_varlen_states`` (batch 1) also the
    state at the end of each packed sequence (sequences, heads, headdim, dstate) in x's dtype,
    computed as mamba_ssm does (:mod:`.varlen_states` says how it treats initial_states and a
    missing seq_idx): out, (out, final_states), (out, varlen_states) or
    (out, final_states, varlen_states).

    ``state_dtype`` (an extra, last; mamba_ssm 2.3.2 has none): the dtype of the returned states
    and of the states entering each chunk that the forward pass stores (mamba_ssm's vendored copy
    in vLLM has it too); None keeps mamba_ssm's dtypes above.

    Differentiable in x, dt, A, B, C, D, z, dt_bias and initial_states, through out and the final
    states; the gradients are the same bits on every run (no atomic adds); once only (a second
    derivative raises). As in mamba_ssm, there is no backward pass after return_varlen_states=True
    (it raises NotImplementedError).
    """
    chunk_size = check_ssd_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                                  dt_limit, return_varlen_states, state_dtype)
    # A B or C strided along dstate is copied, as mamba_ssm's chunk scan copies them. Mamba-2 and Hydra
    # blocks pass such views (the convolution's output transposed back, time major). On an H100 under
    # Triton 3.6 the bidirectional scores kernel read a B (or B') of that layout wrongly at lengths that
    # are not multiples of 16 (test_scores_of_a_time_major_B_rev_at_an_odd_length), the fault moving
    # from one operand to the other as the kernel's code was rearranged; a copy is read right. A
    # dstate-strided operand is also read with scalar loads where a contiguous one is read in vectors.
    out, final_states, _, varlen_states, *_ = ssd_chunk_scan_op(
        x, dt, A, last_dim_contiguous(B), last_dim_contiguous(C), chunk_size, D, z, dt_bias, initial_states, seq_idx,
        cu_seqlens if return_varlen_states else None, bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]),
        state_dtype, bool(return_final_states))
    if not return_varlen_states:
        return (out, final_states) if return_final_states else out
    return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
