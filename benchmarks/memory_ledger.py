"""A ledger of the storages a pass allocates, on a CPU, with Triton's launches stubbed: what is alive
at the pass's peak, tensor by tensor, and which function of ours (or of mamba_ssm) allocated it.

The benchmarks measure peak memory on a GPU (``torch.cuda.max_memory_allocated`` above what was
allocated before the call, benchmarks/peak_memory.py). These pieces explain that number without a GPU:
every Triton launch is replaced by nothing, each storage an op creates is counted until it is freed,
and the peak keeps the list of what was alive then. What it counts is what the GPU's caching
allocator sees, less its rounding: the lifetimes of the tensors in Python. No kernel runs, so no
launch holds a tensor (our launches pass data pointers; the interpreter, which would copy every
argument, is not entered), and the outputs hold garbage, which no pass counted here reads on the host.

It needs Triton's interpreter, which lets the kernels be "launched" on CPU tensors; on a machine
without a GPU the package turns it on by itself (mamba_annotated/runtime.py). Used by
ssd_memory_ledger.py and attention_memory_ledger.py.
"""
import contextlib
import pathlib
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MiB = 2 ** 20
# frames of these packages name the function that allocated a tensor
OWNERS = ("mamba_annotated", "mamba_ssm")


class Ledger(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while the mode is on, until that storage is
    freed; keeps the peak and what was alive then, as {number: (bytes, shape, dtype, owner)} with
    the storages numbered in the order they were made."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.live = {}
        self.at_peak = {}
        self.by_pointer = {}  # data pointer -> number of the live storage there
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.record(t)
        return out

    def record(self, t: torch.Tensor):
        storage = t.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or pointer in self.by_pointer:  # a view, or an op that wrote into its input
            return
        self.made += 1
        self.by_pointer[pointer] = self.made
        self.live[self.made] = (nbytes, tuple(t.shape), t.dtype, allocating_function())
        self.live_bytes += nbytes
        # PyTorch keeps a storage's Python object for as long as the storage lives
        weakref.finalize(storage, self.free, self.made, pointer)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.at_peak = self.live_bytes, dict(self.live)

    def free(self, number, pointer):
        self.live_bytes -= self.live.pop(number)[0]
        if self.by_pointer.get(pointer) == number:  # not yet taken by a newer storage
            del self.by_pointer[pointer]


def allocating_function() -> str:
    """The innermost frame in mamba_annotated or mamba_ssm, as module.function:line."""
    for frame in reversed(traceback.extract_stack()):
        path = pathlib.Path(frame.filename)
        # outputs.empty allocates for every launcher of ours: name the launcher instead
        if any(owner in path.parts for owner in OWNERS) and path.stem != "outputs":
            return f"{path.stem}.{frame.name}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def launches_stubbed():
    """Triton launches do nothing (the interpreter's grid executor is replaced), autotuners take their
    first configuration (they would time each on the device), and ``torch.cuda.device``, which
    mamba_ssm enters around its launches, is a no-op on CPU tensors."""
    from triton.runtime import autotuner, interpreter
    saved = interpreter.GridExecutor.__call__, autotuner.Autotuner.run, torch.cuda.device
    tuner_run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return tuner_run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = lambda self, *args, **kwargs: None
    autotuner.Autotuner.run = first_config
    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, autotuner.Autotuner.run, torch.cuda.device = saved


def print_ledger(name, ledger):
    print(f"{name}: peak {ledger.peak_bytes / MiB:.2f} MiB above the inputs; alive at the peak:")
    for nbytes, shape, dtype, owner in sorted(ledger.at_peak.values(), key=lambda v: -v[0]):
        print(f"  {nbytes / MiB:9.2f} MiB  {str(shape):28} {str(dtype).removeprefix('torch.'):9} {owner}")
