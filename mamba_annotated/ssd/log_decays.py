"""The chunk sums a_t in two float32 planes, and their exponentials (every SSD weight is one).

Every SSD weight is exp of a difference of two sums, a_t - a_s (or a_t, or a_last - a_t), and a
decaying chunk's sums grow large: |a| = 325 at the end of a chunk of 256 is ordinary. A float32
sum is only good to half an ulp of |a| (1.5e-5 there), so a difference of two of them is off by up
to an ulp of |a|, however small the difference: relative error 3e-5 in a weight near the chunk's
end, where a decaying chunk's state sits. So :mod:`.chunk_cumsum` adds the steps in float64 and
stores each sum, in log2 units (times log2(e), for ``exp2``), as two float32 numbers: hi, the
nearest float32, and lo, the rest. The pair holds the float64 sum to about 2^-48 of itself (the
tests allow 2^-46: the scaling to log2 units and back rounds too), and the kernels never do
float64 arithmetic:

* a tile of weights exp(a_t - a_s) (the diagonal blocks) takes exp2(hi_t - hi_s) per weight. That
  difference is exact where the two are within a factor 2 of each other (Sterbenz's lemma), which
  is where it is small next to |a|, and otherwise is rounded once relative to itself. The rest,
  exp2(lo_t - lo_s), is a row factor exp2(lo_t) and a column factor exp2(-lo_s). The chunk scan
  folds both into vectors it scales by anyway (the column's step dt_s, the finished row); the
  backward's dx and dCB tiles fold one and pay one multiply per weight for the other.
  Far from the diagonal that rounding of hi_t - hi_s is relative to the exponent itself, |x| 2^-24
  for a weight of e^-|x|: an error relative to the largest weights of the tile, not to each.
* a vector of weights takes exp2(hi_t - hi_s) times exp2 of the rest, the lo parts and the
  subtraction's own rounding error (:func:`decay_between`), or for exp(a_t) itself exp2(hi_t)
  exp2(lo_t) (:func:`decay`): each weight to float32 rounding.

Layout: (batch, heads, chunks, 2, Q) float32, a chunk's hi plane then its lo plane, so that one
chunk's Q his and Q los are two contiguous rows.
"""
import torch
import triton
import triton.language as tl

from ..triton_ops import LN2


@triton.jit
def load_sums(sums_ptr, chunk, k, CHUNK: tl.constexpr):
    """(hi, lo) at chunk positions ``k`` of chunk number ``chunk`` (an int64 index over (batch,
    heads, chunks))."""
    base = sums_ptr + chunk.to(tl.int64) * (2 * CHUNK)
    return tl.load(base + k), tl.load(base + CHUNK + k)


@triton.jit
def decay(hi, lo):
    """exp(a) from a's planes."""
    return tl.exp2(hi) * tl.exp2(lo)


@triton.jit
def decay_between(hi_to, lo_to, hi_from, lo_from):
    """exp(a_to - a_from) from the two sums' planes, to float32 rounding. hi_to - hi_from is exact
    only where the two are close; its rounding error is recovered exactly (Knuth's two-sum) and
    joins the lo parts, so a weight far from its end (a small one) is as exact as a near one."""
    d = hi_to - hi_from
    v = d - hi_to
    rounding = tl.where(tl.abs(d) < float("inf"), (hi_to - (d - v)) + (-hi_from - v), 0.0)
    return tl.exp2(d) * tl.exp2(rounding + (lo_to - lo_from))


def natural_sums(sums: torch.Tensor) -> torch.Tensor:
    """The planes (batch, heads, chunks, 2, Q) as the float64 sums a (batch, heads, chunks, Q), for
    checks against a reference."""
    return (sums[..., 0, :].double() + sums[..., 1, :].double()) * LN2.value
