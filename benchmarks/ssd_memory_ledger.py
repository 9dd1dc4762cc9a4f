"""Where the SSD forward pass's peak memory goes: ours beside mamba_ssm's, tensor by tensor, on a CPU.

bench_ssd.py measures each forward pass's peak on a GPU (``torch.cuda.max_memory_allocated`` above
the inputs, under ``torch.no_grad``). This script explains that number without a GPU. It runs both
forward passes on CPU tensors of the benchmark's shapes with every Triton launch replaced by
nothing, records each storage the pass allocates and the moment it is freed, and prints the
tensors alive at the peak, by the function that allocated them.

What it counts is what the GPU's caching allocator sees, less its rounding: the lifetimes of the
tensors in Python. No kernel runs, so no launch holds a tensor (our launches pass data pointers;
the interpreter, which would copy every argument, is not entered), and the outputs hold garbage,
which neither forward pass reads on the host.

It needs Triton's interpreter, which lets the kernels be "launched" on CPU tensors; on a machine
without a GPU the package turns it on by itself (mamba_annotated/runtime.py):

    python benchmarks/ssd_memory_ledger.py

mamba_ssm's Triton kernels come from its installed wheel (peers.py); without it, ours alone.
"""
import argparse
import contextlib
import pathlib
import sys
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_ssd import CHUNK, SHAPES, make_inputs  # noqa: E402  the benchmark's shapes, chunk and inputs
from mamba_annotated import runtime, ssd_chunk_scan  # noqa: E402
from peers import mamba_ssm_module  # noqa: E402

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


def forward_ledger(fn, inp) -> Ledger:
    """The ledger of one forward pass of ``fn`` (ours or the peer's, one signature) on bench_ssd.py's
    inputs ``inp``, called as it calls them."""
    ledger = Ledger()
    with torch.no_grad(), launches_stubbed(), ledger:
        fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=CHUNK, D=inp["D"],
           dt_bias=inp["dt_bias"], dt_softplus=True)
    return ledger


def print_ledger(name, ledger):
    print(f"{name}: peak {ledger.peak_bytes / MiB:.2f} MiB above the inputs; alive at the peak:")
    for nbytes, shape, dtype, owner in sorted(ledger.at_peak.values(), key=lambda v: -v[0]):
        print(f"  {nbytes / MiB:9.2f} MiB  {str(shape):28} {str(dtype).removeprefix('torch.'):9} {owner}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                        help="batch,L,heads,headdim,dstate ...")
    args = parser.parse_args()
    if not runtime.INTERPRETED:
        sys.exit("ssd_memory_ledger: needs Triton's interpreter (TRITON_INTERPRET=1, or a machine without a GPU)")
    combined = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    impls = {"ours": ssd_chunk_scan}
    if combined is not None:
        impls["mamba_ssm"] = combined.mamba_chunk_scan_combined
    for text in args.shapes:
        shape = tuple(int(v) for v in text.split(","))
        inp = make_inputs(*shape)
        print(f"== {shape}, chunk {CHUNK}, bfloat16, D, dt_bias, softplus, forward under no_grad")
        peaks = {}
        for name, fn in impls.items():
            ledger = forward_ledger(fn, inp)
            print_ledger(name, ledger)
            peaks[name] = ledger.peak_bytes
        if len(peaks) == 2:
            print(f"ours - mamba_ssm: {(peaks['ours'] - peaks['mamba_ssm']) / MiB:+.2f} MiB "
                  f"({peaks['ours'] / peaks['mamba_ssm']:.3f}x)")


if __name__ == "__main__":
    main()
