"""The first-order combine: the associative operator behind every parallel linear scan.

An element (a, b) stands for the affine map h -> a*h + b. Applying (a1, b1) and then (a2, b2)
gives h -> a2*(a1*h + b1) + b2, so

    (a1, b1) o (a2, b2) = (a1*a2, a2*b1 + b2),   identity (1, 0).

Composition of maps is associative, so any bracketing (a scan tree) gives the same result.
"""
import triton
import triton.language as tl  # noqa: F401  (the interpreter needs it visible to run the combine outside a scan)


@triton.jit
def first_order_combine(a_left, b_left, a_right, b_right):
    """Compose the earlier map (left) with the later one (right)."""
    return a_left * a_right, a_right * b_left + b_right


def first_order_combine_torch(left, right):
    """The same operator on tuples of tensors, for tests and figures."""
    (a_left, b_left), (a_right, b_right) = left, right
    return a_left * a_right, a_right * b_left + b_right
