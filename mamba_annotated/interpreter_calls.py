"""Calls between ``@triton.jit`` functions in Triton's interpreter without re-patching (CPU only).

When the interpreter launches a kernel (``GridExecutor.__call__`` in ``triton/runtime/interpreter.py``,
Triton 3.8 and 3.9) it replaces the builtins of ``triton.language`` (``tl.load``, ``tl.dot``, the
tensor methods, ``tl.range``...) by interpreted versions, runs every program, and puts the
originals back. A call from one jitted function to another (``InterpretedFunction.__call__``)
patches the same modules again, in every program and at every call: each time a walk over the
modules' members with ``inspect.getmembers``, about 2 ms. The package's kernels call several such
helpers per program, and under cProfile that walk took 9.9 of the 53 s of an SSD test.

What the patching does depends only on which of ``triton.language`` and ``triton.language.core``
the function's globals hold (``interpreter._patch_lang`` reads nothing else of it), and a patch made
during a launch stays in place until the launch ends. So a call made during a launch whose modules
are already patched changes nothing: :func:`install` makes it skip the walk. The launch's own
patching, and any call outside a launch or with a module not yet patched, run Triton's code.
"""
import inspect
import threading

from triton import language as tl
from triton.runtime import interpreter


def triton_original(name, owner):
    """Triton's own ``owner.name``, also when this module is reloaded after :func:`install`
    (where the attribute is already the patch, which keeps the original beside it)."""
    current = getattr(owner, name, None)
    return getattr(current, "triton_original", current)


triton_patch_lang = triton_original("_patch_lang", interpreter)
triton_launch = triton_original("__call__", getattr(interpreter, "GridExecutor", None))

# per thread, as each launch runs on its caller's thread: the language modules patched by the launch
# running there (``.modules``); None outside a launch
launch_state = threading.local()


class NothingPatched:
    """The scope of a call that patched nothing: nothing to restore."""

    def restore(self):
        pass


def language_modules(fn) -> frozenset:
    """The modules ``interpreter._patch_lang`` patches for ``fn``: those of ``triton.language`` and
    ``triton.language.core`` that its globals hold (by identity, as the interpreter compares them)."""
    return frozenset(m for m in (tl, tl.core) if any(v is m for v in fn.__globals__.values()))


def patched_in_launch():
    """The modules the launch running on this thread has patched so far; None outside a launch."""
    return getattr(launch_state, "modules", None)


def patch_lang_once(fn):
    """``interpreter._patch_lang``, skipped where the running launch has patched ``fn``'s modules."""
    modules, patched = language_modules(fn), patched_in_launch()
    if patched is not None and modules and modules <= patched:
        return NothingPatched()
    scope = triton_patch_lang(fn)  # an fn with no language module fails Triton's own assert here
    if patched is not None:
        patched.update(modules)
    return scope


def launch(self, *args, **kwargs):
    """``GridExecutor.__call__``, recording which modules its patching and its calls patched."""
    outer, launch_state.modules = patched_in_launch(), set()
    try:
        return triton_launch(self, *args, **kwargs)
    finally:
        launch_state.modules = outer


patch_lang_once.triton_original, launch.triton_original = triton_patch_lang, triton_launch


def install():
    """Replace the interpreter's patching and launch by the above, where this Triton has both (an
    interpreter built otherwise is left as it is: slower, not wrong)."""
    if triton_patch_lang is not None and triton_launch is not None:
        interpreter._patch_lang = patch_lang_once
        interpreter.GridExecutor.__call__ = launch
