"""Chapter 6: the decays of both directions on one chunk grid (``@triton.jit`` helpers).

Chapter 5's ``chunk_cumsum`` gives, inside each chunk, the inclusive cumulative log-decay of the
forward direction, a_t = A sum_{k <= t} dt_k, and (run on dt_rev) that of the reverse direction,
b_t = A sum_{k <= t} dt'_k. The reverse direction decays from s down to t < s by
A sum_{t <= k < s} dt'_k = e_s - e_t, with e_t = b_t - A dt'_t the *exclusive* cumulative sum, so
both directions live on the same chunks: no flipped copy, no second chunk grid.

The shift (Hydra's form) moves each direction's output one step: out_t takes the forward output
of t - 1 and the reverse output of t + 1. In a chunk that is the same sum with another row decay
and another row of C: the forward row t reads C_{t-1} and decays by r_t = a_{t-1} = a_t - A dt_t
(exclusive), the reverse row reads C'_{t+1} and decays by rho_t = b_t (inclusive); without the
shift r_t = a_t and rho_t = e_t. Columns always decay by a_s (forward) and e_s (reverse). So

    forward  (s <= t; s < t with the shift):  exp(r_t - a_s)  dt_s
    reverse  (s >  t):                        exp(e_s - rho_t) dt'_s

and the state entering chunk c from the left reaches row t decayed by exp(r_t), the state entering
from the right by exp(b_last - rho_t). Without the shift the reverse direction also has the
diagonal s = t, with weight dt'_t and no decay: the kernels add it apart (``Gd``), so that one
Q x Q block of scores holds the forward scores on and below the diagonal and the reverse ones above.
"""
import triton
import triton.language as tl

from ..triton_ops import LOG2E


@triton.jit
def row_decays(a, dt, b, dtr, A, SHIFT: tl.constexpr):
    """(r, rho): the forward and reverse row decays of rows with cumsums a, b and steps dt, dtr."""
    if SHIFT:
        r = a - A * dt
        rho = b
    else:
        r = a
        rho = b - A * dtr
    return r, rho


@triton.jit
def pair_weight(t, s, r_t, rho_t, a_s, e_s, dt_s, dtr_s, keep, SHIFT: tl.constexpr):
    """M's weight for row t and column s (chunk-local positions, broadcast against each other),
    without the score C.B; ``keep`` is False where s and t are in different sequences. Returns the
    weight and where it belongs to the forward direction (else the reverse one)."""
    if SHIFT:
        forward = s < t
    else:
        forward = s <= t
    keep = keep & (forward | (s > t))
    exponent = tl.where(forward, r_t - a_s, e_s - rho_t)
    decay = tl.exp2(tl.where(keep, exponent * LOG2E, float("-inf")))
    return decay * tl.where(forward, dt_s, dtr_s), forward
