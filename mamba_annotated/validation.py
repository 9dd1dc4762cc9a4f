"""Input checks shared by every topic's ``api.py``.

Each check raises before any kernel launches and names the argument, what was expected and
what arrived, so a caller never gets a silently truncated or wrong result. The exceptions are the
checks of the values inside index tensors (:func:`refuse_unless`): they run on the device, in stream order
before the op's kernels, so that checking never makes the host wait for the GPU.
"""
import torch

from .runtime import DEVICE, INTERPRETED

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, value, *, dtypes=FLOAT_DTYPES, ndim: int | None = None,
                 min_ndim: int | None = None, shape: tuple | None = None) -> torch.Tensor:
    """``value`` must be a tensor of one of ``dtypes`` on the device the kernels run on."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}; got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s); got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(value.shape)}")
    check_device(name, value)
    return value


ON_GPU = DEVICE.type == "cuda"


def check_device(name: str, value: torch.Tensor) -> None:
    # is_cuda first: reading .device builds a torch.device, a cost at every call of every op
    if value.is_cuda != ON_GPU or (not ON_GPU and value.device.type != DEVICE.type):
        where = "CPU tensors (Triton interpreter)" if INTERPRETED else "CUDA tensors"
        raise ValueError(f"{name} is on {value.device}, but the kernels here take {where}")


def check_same_device(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``value`` must be on ``ref``'s device, index included (cuda:1 is not cuda:0)."""
    if value.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}); got {value.device}")


def check_same(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``value`` must match ``ref`` in shape, dtype and device."""
    if value.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}; got {tuple(value.shape)}")
    if value.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}); got {value.dtype}")
    check_same_device(name, value, ref_name, ref)


def refuse_unless(valid: torch.Tensor, message: str) -> None:
    """Refuse the call unless ``valid`` (a one-element bool tensor computed from the arguments'
    values, on their device) is true, without reading it back: reading it would wait for every
    kernel queued before it, so that the host could not queue the op's kernels ahead of the GPU, a
    pause per call (per layer, in a model). ``torch._assert_async`` checks it on the device
    instead: on a GPU a failed check is a device-side assert that stops the stream with
    ``message`` (the CUDA context is unusable afterwards, as after any of PyTorch's own device-side
    index checks); on the CPU it raises a RuntimeError at once."""
    torch._assert_async(valid, message)
