"""Kernel launches with less host time: ``@lean_launch`` over ``@triton.jit`` (or ``@triton.autotune``).

``kernel[grid](*args, **kwargs)`` costs the host tens of microseconds in Triton 3.6, most of it
before the launch proper: binding the arguments to the kernel's signature, classifying each one
(dtype, 16-byte alignment, divisibility by 16, == 1) into the key of the compiled kernel, and
looking that key up. An op of a few launches then costs more host time than a small problem costs
the GPU, and a model pays it in every layer at every step.

The wrapper keeps the compiled kernel of each specialization in a dictionary of its own, keyed by
a classification that is at least as fine as Triton's (so a cached kernel is exactly the one
Triton would pick), and launches it through the compiled kernel's launcher directly:

    * tensors by (dtype, data pointer a multiple of 16); constexpr arguments by their value;
      other integers by (== 1, multiple of 16, fits in 32 bits, fits in 64 signed bits); other
      values by type; the call's launch options (num_warps...) by value; the current device;
    * an autotuned kernel also by the exact values of its tuning key, and the tuned configuration
      (its block sizes) is remembered with the kernel;
    * the first call of each specialization, and any call while a launch hook is registered (a
      profiler such as proton), goes through Triton's own path, which compiles, tunes and calls
      the hooks.

Launching through ``CompiledKernel.run`` uses an internal Triton interface (the same call in Triton
3.6, run on the GPU, and 3.9, read); in the interpreter (``TRITON_INTERPRET=1``) the decorator
leaves the kernel as it is. ``tests/test_launch.py`` checks on a GPU that both paths give the same bits and that a
change of alignment or dtype gets its own kernel.
"""
import torch
import triton
from triton import knobs
from triton.runtime import driver

from .runtime import INTERPRETED


def classify(values, constexpr) -> tuple:
    """The class of each argument in the cache key: constexpr arguments, None and bools by value;
    tensors by (dtype, data pointer a multiple of 16); integers by (== 1, multiple of 16, in the
    32-bit range, in the signed 64-bit range) packed in one int; floats by type (Triton passes
    them as fp32, unspecialized); anything else by value. One comprehension, no call per
    argument: a function call each would cost more than the rest of the launch."""
    Tensor = torch.Tensor
    return tuple([
        v if c or v is None or type(v) is bool
        else (v.dtype, v.data_ptr() & 15 == 0) if isinstance(v, Tensor)
        else ((v == 1) | ((v & 15) == 0) << 1 | (-2 ** 31 <= v < 2 ** 31) << 2 | (-2 ** 63 <= v < 2 ** 63) << 3)
        if type(v) is int
        else float if isinstance(v, float) else v
        for v, c in zip(values, constexpr)])


def launch_hooks_registered() -> bool:
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


class LeanLaunch:
    """``kernel[grid](...)`` as Triton's, with the bookkeeping done once per specialization."""

    def __init__(self, kernel):
        self.kernel = kernel                       # a JITFunction, or an Autotuner around one
        self.fn = kernel                           # what figures.show_source unwraps
        jit = kernel
        while not isinstance(jit, triton.runtime.JITFunction):
            jit = jit.fn
        self.param_names = [p.name for p in jit.params]
        self.constexpr = [p.is_constexpr for p in jit.params]
        self.defaults = {name: p.default for name, p in jit.signature.parameters.items()
                         if p.default is not p.empty}
        self.tuning_key = [self.param_names.index(name) for name in getattr(kernel, "keys", ())]
        self.compiled = {}                         # cache key -> (compiled kernel, tuned block sizes)
        self.layouts = {}                          # (positional count, keyword names) -> how to bind

    def __getattr__(self, name):  # everything else is the kernel's (e.g. .src, .configs, .best_config)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def layout(self, positional: int, keywords: tuple):
        """Where each parameter's value comes from for calls of this shape, and which keywords
        are launch options (num_warps...) rather than parameters."""
        found = self.layouts.get((positional, keywords))
        if found is None:
            sources = [("arg", i) for i in range(positional)]
            for name in self.param_names[positional:]:
                sources.append(("kw", name) if name in keywords else ("default", self.defaults.get(name)))
            options = tuple(k for k in keywords if k not in self.param_names)
            found = self.layouts[(positional, keywords)] = (sources, options)
        return found

    def bind(self, args, kwargs):
        sources, options = self.layout(len(args), tuple(kwargs))
        values = [args[i] if kind == "arg" else kwargs[i] if kind == "kw" else i for kind, i in sources]
        return values, options

    def key(self, values, options, kwargs, device):
        classes = classify(values, self.constexpr)
        tuned = tuple(values[i] for i in self.tuning_key)
        return device, classes, tuned, tuple(kwargs[o] for o in options)

    def launch(self, grid, args, kwargs):
        if launch_hooks_registered():
            return self.kernel[grid](*args, **kwargs)
        values, options = self.bind(args, kwargs)
        device = driver.active.get_current_device()
        key = self.key(values, options, kwargs, device)
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)   # compiles (and tunes) as usual
            best = getattr(self.kernel, "best_config", None)
            if best is not None and best.pre_hook is not None:
                return compiled                              # a pre-hook must run at every launch
            self.compiled[key] = (compiled, dict(best.kwargs) if best is not None else {})
            return compiled
        compiled, tuned = entry
        if tuned:
            values, _ = self.bind(args, {**kwargs, **tuned})
        if callable(grid):
            grid = grid(dict(zip(self.param_names, values)))
        stream = driver.active.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *values)
        return compiled


def lean_launch(kernel):
    """Decorator: ``@lean_launch`` above ``@triton.jit`` or ``@triton.autotune`` (see the module).
    In the interpreter, where host time is not the point, the kernel is left as it is."""
    return kernel if INTERPRETED else LeanLaunch(kernel)
