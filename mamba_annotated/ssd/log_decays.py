"""Exponentials of the chunk sums a_t (float64, from :mod:`.chunk_cumsum`) in float32 arithmetic.

Every SSD weight is exp of a difference of two sums, a_t - a_s (or a_t, or a_last - a_t), and a
decaying chunk's sums grow large: |a| = 325 at the end of a chunk of 256 is ordinary. A float32
sum is only good to half an ulp of |a| (1.5e-5 there), so a difference of two of them is off by up
to an ulp of |a|, however small the difference: relative error 3e-5 in a weight near the chunk's
end, where a decaying chunk's state sits. The sums are therefore kept in float64, and the kernels
take their exponentials in one of two ways, neither of which does float64 arithmetic per weight:

* a vector of exponents (a state's weights exp(a_last - a_t), a chunk's decay exp(a_last)): the
  difference is formed in float64, split as hi + lo (hi the nearest float32, lo the rest) and
  exp(hi) exp(lo) taken in float32 (:func:`exp_of`).
* a tile of exponents a_t - a_s (the diagonal blocks): each sum is split once per row and per
  column, hi_t + lo_t, and the tile takes exp(hi_t - hi_s) only. hi_t - hi_s is exact where the
  two are within a factor 2 of each other (Sterbenz's lemma), which is where the difference is
  small next to |a|, and otherwise is rounded once relative to itself. The rest, exp(lo_t -
  lo_s), is a row factor exp(lo_t) and a column factor exp(-lo_s): the chunk scan folds both into
  vectors it scales by anyway (the column's step dt_s, the finished row); the backward's dx and
  dCB tiles fold one and pay one multiply per weight for the other (:func:`split`). The split
  itself, float64 loads and conversions per column block, is not free: on an H100 the chunk scan
  kernel took 18 % longer than with float32 sums (README).
"""
import triton
import triton.language as tl


@triton.jit
def split(a, SCALE: tl.constexpr):
    """float64 ``a * SCALE`` as float32 (hi, lo): hi the nearest float32, lo the remainder (0
    where hi is infinite, so that a sum of -inf still decays to exactly 0, not NaN)."""
    scaled = a * SCALE
    hi = scaled.to(tl.float32)
    lo = tl.where(tl.abs(hi) < float("inf"), (scaled - hi.to(tl.float64)).to(tl.float32), 0.0)
    return hi, lo


@triton.jit
def exp_of(x):
    """exp of the float64 ``x`` in float32 arithmetic: exp(hi) exp(lo), to float32 rounding."""
    hi, lo = split(x, 1.0)
    return tl.exp(hi) * tl.exp(lo)
