"""A faster ``tl.associative_scan`` for Triton's interpreter (CPU only; compiled kernels are untouched).

The interpreter (Triton 3.x, ``triton/runtime/interpreter.py``) evaluates a scan with a custom
combine function one element at a time: for every element of the tile it wraps the operands as
interpreter tensors and calls the combine function in Python. A selective-scan program scans a
(channels, steps) tile once per state, so on CPU the scans were most of the time of every
Mamba-1 test and of the model chapter.

The combine functions of a scan are elementwise (that is what lets a GPU apply them to whole
vectors), so calling one on every slice across the scan axis, each step of the scan combining
the running slice with the next, computes the same numbers with one call per step instead of
one per element: the same float operations on the same values, in the same order along the
axis. :func:`install` replaces the interpreter's method by that loop; ``runtime`` calls it when
it turns the interpreter on.
"""
import numpy as np
from triton.language import core
from triton.runtime import interpreter


per_element_scan = interpreter.ScanOps.generic_scan  # Triton's own, kept for the test that compares the two


def scan_by_slices(self, inputs):
    """ScanOps.generic_scan, one combine call per position along ``self.axis``."""
    data = [arg.handle.data for arg in inputs]
    dtypes = [arg.dtype for arg in inputs]
    results = [np.empty_like(d) for d in data]
    axis = self.axis % data[0].ndim  # a kernel may scan along axis -1 (Triton's own method mishandles it)
    for k in range(data[0].shape[axis]):
        here = (slice(None),) * axis + (k,)
        if k == 0:
            for result, d in zip(results, data):
                result[here] = d[here]
            continue
        before = (slice(None),) * axis + (k - 1,)
        running = [self.to_tensor(r[before], t) for r, t in zip(results, dtypes)]
        new = [self.to_tensor(d[here], t) for d, t in zip(data, dtypes)]
        combined = self.combine_fn.fn(*running, *new)
        combined = combined if isinstance(combined, tuple) else (combined,)
        for result, value in zip(results, combined):
            result[here] = value.handle.data.reshape(result[here].shape) if isinstance(value, core.tensor) else value
    return [self.to_tensor(r, t) for r, t in zip(results, dtypes)]


def install():
    interpreter.ScanOps.generic_scan = scan_by_slices
