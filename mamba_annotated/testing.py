"""Shared checking helpers: the tests and the chapters judge every kernel the same way.

The rule (DESIGN.md, "Verification rules"): compare against a float64 reference by the relative
error ||out - ref|| / ||ref||, with an explicit bound per dtype; draw fresh random inputs for
every check; poison outputs before a launch so unwritten elements fail.
"""
import contextlib
import os
import random
import re
import subprocess
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import outputs
from .runtime import DEVICE

# Bounds on ||out - ref|| / ||ref|| for kernels that accumulate in float32. 16-bit *outputs*
# are rounded once at the end (half an ulp: 2^-9 for bfloat16), hence 1e-2 with headroom.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-12}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64. NaN anywhere in ``out`` gives NaN (which fails every bound)."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    if torch.isnan(out64).any():
        return float("nan")
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "output") -> float:
    """Raise AssertionError unless rel_error(out, ref) < tol; return the error."""
    err = rel_error(out, ref)
    if not err < tol:  # also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3e} is not below {tol:.0e}")
    return err


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Notebook form of :func:`assert_close`: prints the measured error beside its bound, raises
    on failure. The error changes from run to run; ``book/nbval_sanitize.cfg`` masks it (the
    ``rel err 3.1e-08 < 1e-05`` form) so that nbval compares the rest of the line."""
    err = assert_close(out, ref, tol, name)
    print(f"{name}: rel err {err:.1e} < {tol:.0e}")


# The floor added to "k x the same computation's error": where the same computation in the
# kernel's dtype happens to be exact, a kernel may still differ by float32 accumulation order.
SAME_COMPUTATION_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def same_computation_error(out, same, ref, floor, rounding=None):
    """The rule "at most k x the error of the same computation": returns (error, its reference).

    error = rel_error(out, ref) and reference = rel_error(same, ref) + floor, where ``same`` is
    the same result computed in plain PyTorch (or by the peer) in the kernel's dtype. Infinities
    (e.g. the log-sum-exp of a row that sees nothing) must sit where ``ref`` has them and are left
    out of both errors. Where ``ref`` is exactly zero no relative error exists: the error is then
    the RMS of ``out`` and the reference is the floor alone.

    ``rounding`` (a tensor like ``ref``, optional) bounds, element by element, what rounding alone
    may leave in a result whose exact value comes from terms that cancel: its norm is added to the
    reference, relative to ``ref`` (or, where ``ref`` is zero, as an RMS). Only a caller that can
    bound the cancelled terms passes it (the attention gradients' dP - D, for one).
    """
    infinite = torch.isinf(ref).cpu()
    if not torch.equal(torch.isinf(out).cpu(), infinite) or not torch.equal(out.cpu()[infinite], ref.cpu()[infinite]):
        return float("inf"), 0.0
    out, same, ref = (torch.where(infinite, 0.0, t.detach().cpu().double()) for t in (out, same, ref))
    allowed = 0.0 if rounding is None else rounding.detach().cpu().double().norm().item()
    if not ref.any():
        return out.square().mean().sqrt().item(), floor + allowed / max(out.numel(), 1) ** 0.5
    return rel_error(out, ref), rel_error(same, ref) + floor + allowed / ref.norm().item()


def assert_within_same_computation(name, out, same, ref, dtype, factor: float = 2.0,
                                   rounding=None) -> tuple[float, float]:
    """Raise AssertionError unless ``out`` is within ``factor`` x the error of ``same`` (plus the
    floor of ``dtype``, plus ``rounding``: see :func:`same_computation_error`) against the float64
    ``ref``; return (the error, the same computation's)."""
    error, reference = same_computation_error(out, same, ref, SAME_COMPUTATION_FLOOR[dtype], rounding)
    if not error <= factor * reference:
        raise AssertionError(f"{name}: error {error:.3e} above {factor:g} x the same computation's in "
                             f"{dtype} ({reference:.3e})")
    return error, reference


def check_within_same_computation(name, out, same, ref, dtype, factor: float = 2.0) -> None:
    """Notebook form of :func:`assert_within_same_computation`: prints the measured error beside its
    bound, ``rel err 2.0e-03 <= 2 x PyTorch's 4.8e-03 in bfloat16`` (PyTorch's error includes the
    floor of ``dtype``), and raises on failure. Both numbers change from run to run;
    ``book/nbval_sanitize.cfg`` masks them so that nbval compares the rest of the line."""
    error, reference = assert_within_same_computation(name, out, same, ref, dtype, factor)
    print(f"{name}: rel err {error:.1e} <= {factor:g} x PyTorch's {reference:.1e} "
          f"in {str(dtype).removeprefix('torch.')}")


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block every kernel output starts as NaN (see :mod:`mamba_annotated.outputs`)."""
    previous = outputs.set_poison(True)
    try:
        yield
    finally:
        outputs.set_poison(previous)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def randn(*shape, dtype=torch.float32, device=DEVICE, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(dtype)  # a tuple: () gives a 0-d tensor


def uniform(*shape, low: float, high: float, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    return (torch.rand(shape, device=device) * (high - low) + low).to(dtype)


def every_other(t: torch.Tensor, between: torch.Tensor) -> torch.Tensor:
    """A stride-2 view of a vector ``t``'s values: column 0 of a two-column record whose column 1
    holds ``between`` (e.g. values a dense read would misread quietly, or NaN, or -1). Tests give
    it where an op takes a (batch,) or offsets tensor, to see that the op reads it by its stride or
    copies it."""
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"every_other takes a vector of two elements or more (fewer count as contiguous in "
                         f"any view); got shape {tuple(t.shape)}")
    return torch.stack([t, between], dim=1)[:, 0]


def random_scan_inputs(shape, dtype=torch.float32, with_h0=True):
    """Fresh (a, b, h0) for a first-order scan along the last dim of ``shape``.

    Decays in (0.6, 1), so the state neither explodes nor vanishes over thousands of steps;
    normal inputs; a float32 initial state of shape[:-1] (or None).
    """
    a = uniform(*shape, low=0.6, high=1.0, dtype=dtype)
    b = randn(*shape, dtype=dtype)
    h0 = randn(*shape[:-1]) if with_h0 else None
    return a, b, h0


def gradients(fn, inputs: dict, grad_out: torch.Tensor) -> dict:
    """d<fn(**inputs), grad_out>/d input for every input that requires grad."""
    leaves = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inputs.items() if v is not None}
    out = fn(**leaves)
    out = out[0] if isinstance(out, tuple) else out
    wrt = [k for k, v in leaves.items() if v.requires_grad]
    grads = torch.autograd.grad(out, [leaves[k] for k in wrt], grad_out.to(out.dtype))
    return dict(zip(wrt, grads))


def assert_gradients_close(fn, ref_fn, inputs: dict, tol: float, seed: int = 0) -> dict:
    """Compare every gradient of ``fn`` with ``ref_fn`` run on float64 copies of the inputs.

    ``inputs`` maps argument names to tensors; those with ``requires_grad`` are differentiated.
    A random upstream gradient (never ones, which hides sign and index errors) is drawn once,
    rounded to the output's dtype (what ``fn`` receives) and fed to both: the reference then
    differentiates at the same upstream values, so a 16-bit check measures the kernel's rounding,
    not that of the upstream gradient (which a sum of terms of both signs can amplify tenfold).
    Returns the relative error of each gradient.
    """
    with torch.no_grad():
        out = fn(**{k: v for k, v in inputs.items() if v is not None})
        out = out[0] if isinstance(out, tuple) else out
    generator = torch.Generator(device="cpu").manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype).double()
    got = gradients(fn, inputs, grad_out.to(out.device))
    ref_inputs = {
        k: (v.detach().to(dtype=torch.float64).requires_grad_(v.requires_grad) if v is not None else None)
        for k, v in inputs.items()
    }
    want = gradients(ref_fn, ref_inputs, grad_out.to(out.device))
    return {k: assert_close(got[k], want[k], tol, f"grad {k}") for k in want}


def assert_associative(combine, sample, trials: int = 100, tol: float = 1e-5) -> None:
    """Check combine(combine(x, y), z) == combine(x, combine(y, z)) on random triples.

    ``sample()`` returns a random element (a tuple of tensors); ``combine`` takes two and returns
    one. Triton's interpreter folds scans strictly left to right, so a non-associative combine
    passes there and fails on a GPU, which reassociates: this test is the only guard on CPU.
    """
    for _ in range(trials):
        x, y, z = sample(), sample(), sample()
        left = combine(combine(x, y), z)
        right = combine(x, combine(y, z))
        for i, (l, r) in enumerate(zip(left, right)):
            assert_close(l, r, tol, f"combine component {i}")


def assert_refused_in_a_child_process(function: str, message: str, *args, **kwargs) -> None:
    """``mamba_annotated.<function>(*args, **kwargs)`` must fail in a child process with ``message``
    (a regular expression) in its error output. On a GPU a failed ``torch._assert_async`` is a
    device-side assert, which leaves the CUDA context unusable (as any of PyTorch's own device-side
    index checks does), so a test cannot make the call in its own process."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "call.pt")
        torch.save((args, kwargs), path)
        script = ("import sys, torch, mamba_annotated; args, kwargs = torch.load(sys.argv[1]); "
                  f"mamba_annotated.{function}(*args, **kwargs); "
                  "torch.cuda.is_available() and torch.cuda.synchronize()")
        child = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=300)
    assert child.returncode != 0, f"{function}: the call must be refused"
    assert re.search(message, child.stderr), child.stderr[-2000:]


def assert_refused_on_the_device(function: str, message: str, *args, **kwargs) -> None:
    """``mamba_annotated.<function>(*args, **kwargs)`` must be refused, with ``message`` (a regular
    expression), by a check made on the device (``validation.refuse_unless``): on a GPU in a child
    process (:func:`assert_refused_in_a_child_process`); on the CPU, where ``torch._assert_async``
    raises a RuntimeError at once, here."""
    if DEVICE.type == "cuda":
        assert_refused_in_a_child_process(function, message, *args, **kwargs)
        return
    import mamba_annotated

    try:
        getattr(mamba_annotated, function)(*args, **kwargs)
    except RuntimeError as error:
        assert re.search(message, str(error)), str(error)
    else:
        raise AssertionError(f"{function}: the call must be refused")


# the Python ways of reading a tensor's value back to the host
READS_BACK = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy")
# the operators whose result needs values on the host: a scalar read (what item() and bool() call),
# and those whose output size depends on the values
READ_BACK_OPS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
                 "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive")


class ReadBackDetector(TorchDispatchMode):
    """Fails on the operators that read values back, and on those that do in some overloads:
    repeat_interleave with repeats given as a tensor and no output_size, and indexing by a bool mask."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        reads = name in READ_BACK_OPS or (
            name == "aten::repeat_interleave" and func._overloadname.startswith("Tensor")
            and kwargs.get("output_size") is None) or (
            name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
                                          if i is not None))
        if reads:
            raise AssertionError(f"{name} reads a tensor's value back to the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def reading_back_fails():
    """Inside, a read of a tensor's value back to the host raises: one waits for every kernel queued
    before it, a pause at every call of an op (at every layer of a model) in which the host cannot
    queue kernels ahead of the GPU. Caught: the Python reads (:data:`READS_BACK`) and the operators
    that read (:class:`ReadBackDetector`), on any device; on a GPU also every synchronisation
    PyTorch's own sync detector sees, copies from the host included. Run the code once before,
    outside: compiling and tuning Triton kernels synchronise."""
    def read_back(*_, **__):
        raise AssertionError("read a tensor's value back to the host")

    saved = {name: getattr(torch.Tensor, name) for name in READS_BACK}
    for name in READS_BACK:
        setattr(torch.Tensor, name, read_back)
    if DEVICE.type == "cuda":
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with ReadBackDetector():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode(mode)
