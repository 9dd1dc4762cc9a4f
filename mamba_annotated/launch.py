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
      values by type; the call's launch options (num_warps...) by name and value; the current device;
    * an autotuned kernel also by the exact values of its tuning key, and the tuned configuration
      (its block sizes) is remembered with the kernel;
    * the first call of each specialization, and any call while a launch hook is registered (a
      profiler such as proton), goes through Triton's own path, which compiles, tunes and calls
      the hooks.

Computing those classes costs arithmetic on every integer at every launch, so a first dictionary
takes the arguments more exactly: integers by value (the strides and sizes of a model's layers
repeat from step to step), other scalars by (type, value). A key missing there is classified and
found in the second dictionary, then remembered in the first.

Binding and keying are generated as straight-line code for each call shape (how many positional
arguments, which keywords), the first time that shape is seen: a loop over the arguments with a
type test per argument cost nearly as much host time as Triton's own launch call (measured in
benchmarks/bench_host_cost.py's profile).

Launching through ``CompiledKernel.run`` uses an internal Triton interface (the same call in Triton
3.6, run on the GPU, and 3.9, read); in the interpreter (``TRITON_INTERPRET=1``) the decorator
leaves the kernel as it is. ``tests/test_launch.py`` checks on a GPU that both paths give the same bits and that a
change of alignment or dtype gets its own kernel.
"""
import torch
import triton
from triton import knobs

from .runtime import INTERPRETED


def classify_value(v):
    """The class of one non-constexpr argument in the cache key: None and bools by value; tensors
    by (dtype, data pointer a multiple of 16); integers by (== 1, multiple of 16, in the 32-bit
    range, in the signed 64-bit range) packed in one int, with a fifth bit always set so that no
    integer's class equals False or True (0 == False in Python: an unsigned 64-bit integer would
    otherwise share a bool's class); floats by type (Triton passes them as fp32, unspecialized);
    anything else by value."""
    if v is None or type(v) is bool:
        return v
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() & 15 == 0
    if type(v) is int:
        return (16 | (v == 1) | ((v & 15) == 0) << 1 | (-2 ** 31 <= v < 2 ** 31) << 2
                | (-2 ** 63 <= v < 2 ** 63) << 3)
    return float if isinstance(v, float) else v


def classify(values, constexpr) -> tuple:
    """The class of each argument: constexpr arguments by value, the others by :func:`classify_value`."""
    return tuple(v if c else classify_value(v) for v, c in zip(values, constexpr))


# what Triton's CUDA driver asks for the current device and stream, without the driver's Python layers
# (absent from a CPU build of torch, where nothing launches)
current_device = getattr(torch._C, "_cuda_getDevice", None)
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def launch_hooks_registered() -> bool:
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


class LeanLaunch:
    """``kernel[grid](...)`` as Triton's, with the bookkeeping done once per specialization."""

    # exact keys kept per kernel before the dictionary starts afresh: a length that changes at
    # every call (decoding) makes a new exact key each time, found again through its class
    MAX_EXACT_KEYS = 4096

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
        self.compiled = {}       # (device, class key) -> (compiled kernel, ((param index, tuned value), ...))
        self.exact = {}          # (device, exact key) -> the same entry
        self.binders = {}        # (positional count, keyword names) -> binder

    def __getattr__(self, name):  # everything else is the kernel's (e.g. .src, .configs, .best_config)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def binder(self, positional: int, keywords: tuple):
        """``bind(args, kwargs) -> (values, launched, exact key)`` for calls with this many positional
        arguments and these keyword names: the parameters' values in signature order, the same with
        each tensor replaced by its data pointer (what the launcher is given), and the exact key:
        each tensor by (dtype, data pointer a multiple of 16), each int by its value, any other
        value by (type, value) (True == 1 == 1.0 in Python, not in Triton), then the launch options
        such as num_warps by name and value. Generated as straight-line code once per
        call shape, because a loop over the arguments with a test per type costs microseconds at
        every launch."""
        found = self.binders.get((positional, keywords))
        if found is not None:
            return found
        names = [f"v{i}" for i in range(len(self.param_names))]
        lines = [f"    {names[i]} = args[{i}]" for i in range(positional)]
        scope = {"Tensor": torch.Tensor}
        for i, name in enumerate(self.param_names[positional:], start=positional):
            if name in keywords:
                lines.append(f"    {names[i]} = kwargs[{name!r}]")
            else:
                scope[f"default{i}"] = self.defaults.get(name)
                lines.append(f"    {names[i]} = default{i}")
        launched, exact = [], []
        for v, constexpr in zip(names, self.constexpr):
            if constexpr:
                launched.append(v)
                exact.append(v)  # by value, as in the class key
                continue
            # a tensor is launched as its data pointer: Triton's launcher takes an int as it is, where a
            # tensor costs it a call of data_ptr() and a driver query of the pointer. An int, nearly
            # every other argument, is its own key: nothing to compute
            lines += [f"    t{v} = type({v})",
                      f"    if t{v} is int:",
                      f"        p{v} = e{v} = {v}",
                      f"    elif isinstance({v}, Tensor):  # Parameters and other subclasses too",
                      f"        p{v} = {v}.data_ptr()",
                      f"        e{v} = ({v}.dtype, p{v} & 15 == 0)",
                      f"    else:",
                      f"        p{v} = {v}",
                      f"        e{v} = (t{v}, {v})"]
            launched.append(f"p{v}")
            exact.append(f"e{v}")
        # launch options by name and value: num_warps=4 is not num_stages=4
        options = [f"{k!r}, kwargs[{k!r}]" for k in keywords if k not in self.param_names]
        key = ", ".join(exact + options)
        source = ("def bind(args, kwargs):\n" + "\n".join(lines)
                  + f"\n    return ({', '.join(names)},), ({', '.join(launched)},), ({key},)\n")
        exec(compile(source, f"<lean_launch binder of {self.param_names}>", "exec"), scope)
        found = self.binders[(positional, keywords)] = scope["bind"]
        return found

    def bind(self, args, kwargs):
        return self.binder(len(args), tuple(kwargs))(args, kwargs)

    def class_key(self, values, kwargs) -> tuple:
        """The key of the compiled kernel: the class of each value (:func:`classify`), the tuning
        key's values, the launch options."""
        options = tuple(item for name, value in kwargs.items() if name not in self.param_names for item in (name, value))
        return classify(values, self.constexpr) + tuple(values[i] for i in self.tuning_key) + options

    def launch(self, grid, args, kwargs):
        if launch_hooks_registered():
            return self.kernel[grid](*args, **kwargs)
        values, launched, exact_key = self.bind(args, kwargs)
        device = current_device()
        entry = self.exact.get((device, exact_key))
        if entry is None:
            entry = self.compiled.get((device, self.class_key(values, kwargs)))
            if entry is None:
                return self.compile(grid, args, kwargs, device, values)
            if len(self.exact) >= self.MAX_EXACT_KEYS:
                self.exact.clear()
            self.exact[(device, exact_key)] = entry
        compiled, tuned = entry
        if tuned:  # the tuned block sizes take their parameters' places (binding again cost as much as the first time)
            values, launched = list(values), list(launched)
            for index, value in tuned:
                values[index] = launched[index] = value
        if callable(grid):
            grid = grid(dict(zip(self.param_names, values)))
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, current_stream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *launched)
        return compiled

    def compile(self, grid, args, kwargs, device, values):
        """The first launch of a specialization: Triton's own path, which compiles (and tunes); the
        kernel is then kept under its class key."""
        compiled = self.kernel[grid](*args, **kwargs)
        best = getattr(self.kernel, "best_config", None)
        if best is not None and best.pre_hook is not None:
            return compiled                              # a pre-hook must run at every launch
        tuned = best.kwargs.items() if best is not None else ()
        self.compiled[(device, self.class_key(values, kwargs))] = (
            compiled, tuple((self.param_names.index(name), value) for name, value in tuned))
        return compiled


def lean_launch(kernel):
    """Decorator: ``@lean_launch`` above ``@triton.jit`` or ``@triton.autotune`` (see the module).
    In the interpreter, where host time is not the point, the kernel is left as it is."""
    return kernel if INTERPRETED else LeanLaunch(kernel)
