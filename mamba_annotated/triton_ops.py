"""The ``@triton.jit`` helpers every topic shares: one copy, one behaviour.

* The dot precision policy. Every op multiplies float32 tiles the way PyTorch multiplies float32
  matrices: exactly ("ieee") while ``torch.get_float32_matmul_precision()`` is "highest" (PyTorch's
  default), on TF32 tensor cores once the caller allows it ("high" or "medium",
  ``torch.backends.cuda.matmul.allow_tf32 = True``). 16-bit tiles always use the tensor cores with
  float32 accumulation. Triton 3.9's interpreter gets bfloat16 dots wrong, so there bfloat16
  tiles are widened to float32 first ("widen"): the products of 16-bit numbers are exact in
  float32, so the result is the one a GPU computes. (Its float32 -> bfloat16 casts round as a GPU's
  do once :mod:`.interpreter_rounding` is installed, which ``runtime`` does.)
* exp2/log2 constants: kernels take exponentials base 2 (``exp2`` is one instruction; ``tl.exp``
  multiplies its argument by log2(e) first), with the factor folded into a scale computed once.
  They are constexpr: in a kernel ``x * LOG2E``, on the host ``x * LOG2E.value``.
* ``softplus``, accurate to float32 rounding over the whole range (the step sizes of Mamba-1 and
  Mamba-2 go through it).
* ``drop_hidden_nonfinite``: masked products that keep a NaN or inf out of the rows the mask
  hides it from; ``is_nonfinite`` and ``any_nonfinite``, the tests that decide whether a tile needs
  that checked pass.
* ``rounded_product``: ``a * b`` rounded before a ``tl.sum`` adds it, so every lane of a warp
  agrees on the sum (below).
* ``known_multiple`` and ``alignment``: telling the compiler what divides a stride, so that loads
  through it can be vector-wide.
* ``block_size``: the power-of-two tile that covers a dimension, within bounds; ``state_rows``: the
  rows of a recurrent state one decoding-step program updates.
"""
import math

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETED

# Kernels may read only constexpr globals (a plain float imported into another module fails to
# compile on a GPU, though the interpreter accepts it); host code takes ``.value``.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)    # ln(2): log(x) = log2(x) * LN2


def dot_precision(dtype: torch.dtype) -> str:
    """How :func:`mm` multiplies tiles of ``dtype`` under the policy above (read at each launch)."""
    if dtype == torch.float32:
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return "widen" if INTERPRETED and dtype == torch.bfloat16 else "tf32"  # "tf32": ignored for 16-bit


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """``tl.dot(a, b)`` with float32 accumulation, as :func:`dot_precision` chose."""
    if PRECISION == "widen":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def rounded_product(a, b):
    """``a * b``, each product rounded to float32 on its own: the operand of a ``tl.sum`` whose lanes
    must agree. ``tl.sum`` ends in butterfly shuffles, each lane adding its partner's partial sum to
    its own. Where a lane holds one product per summed row, LLVM contracts the first step into
    ``fma(a, b, partner's product)``: the lane's own product enters unrounded, its partner's
    rounded, and the two lanes end one ulp apart. Both then write "the" sum to one shared-memory
    slot on the way to the global store: every racecheck hazard the SSD and bidirectional backward
    kernels showed on an H100 (Triton issue 7264). An FMA with a +0.0 addend cannot be rewritten as
    a multiplication (it turns a -0.0 product into +0.0), so nothing is left to contract, and the
    reduction adds rounded products in a fixed order, as on the CPU."""
    return tl.fma(a, b, 0.0)


@triton.jit
def log1p(u):
    """log(1 + u) for u >= 0, to float32 rounding: log(w) * u / (w - 1) with w = 1 + u rounded
    cancels the rounding of w (Goldberg's method); where w rounds to 1, log(1 + u) = u.
    ``libdevice.log1p`` would do, but the interpreter has no libdevice."""
    w = 1.0 + u
    rounded_away = w != 1.0
    return tl.where(rounded_away, tl.log(w) * (u / tl.where(rounded_away, w - 1.0, 1.0)), u)


@triton.jit
def softplus(x):
    """log(1 + e^x) = max(x, 0) + log1p(e^-|x|), accurate to float32 rounding for every x.

    The naive ``log(1 + exp(x))`` loses the low digits of 1 + e^x: at x = -9 it is 6e-3 off,
    relative. Past x = 20 the correction is below float32 rounding of x, as torch assumes."""
    return tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x)))


@triton.jit
def sigmoid(x):
    """d softplus / dx = 1 / (1 + e^-x), to float32 rounding for every x; e^-|x| never overflows."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def silu_and_slope(z):
    """(silu(z), silu'(z)) in float32: the gate of Mamba blocks, out = y silu(z), and its derivative."""
    sig = sigmoid(z)
    return z * sig, sig * (1.0 + z * (1.0 - sig))


@triton.jit
def is_nonfinite(x):
    """NaN or +-inf, elementwise (bfloat16 is widened first: the interpreter holds it as integers,
    where NaN == NaN)."""
    wide = x.to(tl.float32)
    return (wide != wide) | (tl.abs(wide) == float("inf"))


@triton.jit
def any_nonfinite(tile):
    """Whether a 2-D tile holds a NaN or inf (one reduction: the cheap test that decides whether a
    kernel's checked pass, :func:`drop_hidden_nonfinite`, must run)."""
    return tl.max(tl.max(is_nonfinite(tile).to(tl.int32), 1), 0) > 0


@triton.jit
def drop_hidden_nonfinite(values, seen, hits):
    """For a masked product ``weights @ values`` whose weights are 0 where ``seen`` (rows, keys) is
    False: a select on the weights cannot keep a NaN or inf of the ``values`` tile (keys, cols)
    out of the rows that do not see its key, since the product computes 0 x NaN = NaN (tensor
    cores too). So the non-finite entries are zeroed here, and ``hits`` (rows,) counts the keys
    with a non-finite value each row sees; the caller makes those rows NaN at the end, as the
    unmasked product would have (in every column, and an inf as NaN: a per-column count would
    hold a second accumulator tile in registers). A tile with no non-finite value, the usual
    case, costs one test of each element and a reduction."""
    bad = is_nonfinite(values)
    bad_key = tl.max(bad.to(tl.int32), 1)
    if tl.max(bad_key, 0) > 0:
        hits += tl.sum((seen & (bad_key[None, :] > 0)).to(tl.int32), 1)
        values = tl.where(bad, 0.0, values)
    return values, hits


@triton.jit
def drop_hidden_nonfinite_split(values, seen, first, hits_first, hits_rest):
    """:func:`drop_hidden_nonfinite` for a tile of values that two accumulators of the same rows take,
    each through its own weights: of the keys a row sees, those where ``first`` (rows, keys) holds
    count in ``hits_first``, the others in ``hits_rest``, so that each accumulator is made NaN only
    where its own product would have been."""
    bad = is_nonfinite(values)
    bad_key = tl.max(bad.to(tl.int32), 1)
    if tl.max(bad_key, 0) > 0:
        hit = seen & (bad_key[None, :] > 0)
        hits_first += tl.sum((hit & first).to(tl.int32), 1)
        hits_rest += tl.sum((hit & ~first).to(tl.int32), 1)
        values = tl.where(bad, 0.0, values)
    return values, hits_first, hits_rest


@triton.jit
def sequence_run(seq_row, stride_seq_l, chunk_start, chunk_end, owner, CHUNK: tl.constexpr):
    """[first, stop) of a chunk's positions (numbered from 0) whose id in ``seq_row`` is ``owner``:
    one run, since seq_idx never decreases (a packed sequence's positions in the chunk); an empty
    range (first = CHUNK, stop = 0) where there is none. Positions at or past ``chunk_end`` (the end
    of L) are never in it, whatever the owner. A chunk-state kernel finds its run once, before its
    loop, so that the loop's masks are arithmetic on the step, with no load of ids to wait for.

    Where the chunk's first and last ids are both ``owner``, every id between them is too, and the
    run is the whole chunk: that takes two loads. Only a chunk where a sequence starts or ends
    loads all its ids and reduces them across the block, a wait before the loop's first loads."""
    first = tl.zeros([], dtype=tl.int32)
    stop = chunk_end - chunk_start
    id_first = tl.load(seq_row + chunk_start.to(tl.int64) * stride_seq_l)
    id_last = tl.load(seq_row + (chunk_end - 1).to(tl.int64) * stride_seq_l)
    if (id_first != owner) | (id_last != owner):
        k = tl.arange(0, CHUNK)
        inside = chunk_start + k < chunk_end
        ids = tl.load(seq_row + (chunk_start + k).to(tl.int64) * stride_seq_l, mask=inside, other=0)
        owned = inside & (ids == owner)
        first = tl.min(tl.where(owned, k, CHUNK), 0)
        stop = tl.max(tl.where(owned, k, -1), 0) + 1
    return first, stop


@triton.jit
def known_multiple(value, ALIGN: tl.constexpr):
    """``value``, an integer argument of the kernel that ``ALIGN`` divides (:func:`alignment`), in a
    form from which Triton can tell. Triton knows of an integer argument only whether 16 divides it,
    and when it does not, every load through it is one element wide. A row stride that 8 divides
    and 16 does not (a slice of mamba_ssm's in-projection output, which is 2 d_inner + 2 groups
    d_state + heads wide) would then read bfloat16 rows 2 bytes at a time where 16 would do.
    ``value // ALIGN * ALIGN`` is ``value`` again, and a product with a constant is a multiple of it;
    an ALIGN that does not divide ``value`` would round it down, to wrong addresses. At 16 Triton
    knows it already, and the division is left out."""
    if ALIGN > 1 and ALIGN < 16:
        value = value // ALIGN * ALIGN
    return value


def alignment(*values: int) -> int:
    """The largest power of two up to 16 that divides every one of ``values`` (:func:`known_multiple`)."""
    return math.gcd(16, *values)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's launch arithmetic. (``triton.cdiv`` and ``triton.next_power_of_2``
    are constexpr functions in Triton 3.6, whose wrapper costs the host about a microsecond per call;
    an op plans its launches with a dozen of them.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_size(dim: int, smallest: int = 16, largest: int | None = None) -> int:
    """The power of two that covers ``dim`` (``tl.arange`` and ``tl.dot`` need one), clamped to
    [smallest, largest]."""
    block = max(smallest, next_power_of_2(dim))
    return min(block, largest) if largest is not None else block


def state_rows(dstate: int, rows: int) -> int:
    """Rows of a recurrent state (channels, or headdim) that one decoding-step program updates:
    fewer as dstate grows, so its [rows, dstate] tile stays near 512 numbers in registers."""
    block = 32 if dstate <= 16 else 16 if dstate <= 32 else 8 if dstate <= 64 else 4
    return min(block, next_power_of_2(rows))
