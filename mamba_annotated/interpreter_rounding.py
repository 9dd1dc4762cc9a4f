"""float32 -> bfloat16 in Triton's interpreter, rounded to nearest even as a GPU rounds (CPU only;
compiled kernels are untouched).

The interpreter (Triton 3.9, ``triton/runtime/interpreter.py``) keeps bfloat16 as its 16 high bits
in a ``uint16`` and converts float32 to it by dropping the low 16 bits: it truncates toward zero,
where a GPU's ``cvt.rn.bf16.f32`` rounds to nearest even. Every bfloat16 value a kernel stores
under the interpreter is then biased toward zero by half an ulp on average, and every sum of such
values inherits the bias. The SSD backward showed it: at one position, with float32 initial states
stored as bfloat16 states, the state term of dA came out 0.2-1 % too small in magnitude on every
upstream gradient (sweep seed 71315), where the same term rounded as on the GPU was off by noise
of either sign. Its explicit-rounding path (``fp_downcast_rounding="rtne"``) rounds half up and
lets a mantissa that rounds up spill into the exponent field unchecked.

:func:`install` replaces both conversions, float32 -> bfloat16 only, by rounding on the bits:
add ``0x7FFF`` plus the lowest kept bit, then drop the low half (ties go to the even neighbour;
a carry out of the mantissa steps the exponent, up to infinity), NaN kept a quiet NaN. Every
other conversion is the interpreter's own. ``runtime`` calls it when it turns the interpreter on.
"""
import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> the uint16 bits of bfloat16, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(values), quiet_nan, rounded).reshape(np.shape(values))


def is_float32_to_bfloat16(src, dst_type):
    return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16


def rounding(convert):
    """``convert`` (a conversion method of the interpreter's builder) with float32 -> bfloat16
    rounded to nearest even."""
    def method(self, src, dst_type, *rest):
        if is_float32_to_bfloat16(src, dst_type):
            return interpreter.TensorHandle(bfloat16_bits(src.data), dst_type.scalar)
        return convert(self, src, dst_type, *rest)
    method.rounds_to_nearest_even = True
    return method


def install():
    builder = interpreter.InterpreterBuilder
    for name in ("cast_impl", "create_fp_to_fp"):
        if not getattr(getattr(builder, name), "rounds_to_nearest_even", False):
            setattr(builder, name, rounding(getattr(builder, name)))
