"""Where the kernels run: a CUDA GPU, or Triton's interpreter on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so the switch must be
thrown before any kernel module is imported. ``mamba_annotated/__init__.py`` imports this module
first; on a machine without CUDA it turns the interpreter on and says so once.

The chapters size their problems through :func:`size`, so one notebook runs at full size on a GPU
and at a few hundred elements on a laptop, where the interpreter runs programs one after another.
"""
import functools
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    print(
        "mamba_annotated: no CUDA device, so Triton's interpreter runs the kernels on CPU tensors "
        "(small problem sizes; timings are not representative).",
        file=sys.stderr,
    )

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:  # the interpreter's associative_scan, one combine call per step instead of per element,
    # its float32 -> bfloat16 conversions rounded to nearest even, as a GPU rounds them, and its
    # calls between jitted functions without patching triton.language again
    from . import interpreter_calls, interpreter_rounding, interpreter_scan

    interpreter_scan.install()
    interpreter_rounding.install()
    interpreter_calls.install()
DEVICE = torch.device("cuda" if HAS_CUDA and not INTERPRETED else "cpu")


def size(gpu, cpu):
    """The problem size for this machine: ``gpu`` when kernels compile for a GPU, else ``cpu``."""
    return cpu if INTERPRETED else gpu


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Streaming multiprocessors of the GPU (1 in the interpreter). Cached: asking the driver costs
    tens of microseconds, paid on every call of an op that plans its launch by it."""
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE.type == "cuda" else 1


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return "CPU (Triton interpreter)"


def describe() -> None:
    """Print the environment a notebook ran in: device, library versions, interpreter or not."""
    import triton

    print(f"device:      {device_name()}")
    print(f"torch:       {torch.__version__}")
    print(f"triton:      {triton.__version__}")
    print(f"interpreter: {'on' if INTERPRETED else 'off'}")
