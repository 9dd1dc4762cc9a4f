"""Chapter 2's foil: the log-space scan (Heinsen, 2023) in plain PyTorch, no kernel.

For positive b, h_t = A_t * sum_{s<=t} b_s / A_s with A_t = a_0 a_1 ... a_t, so

    log h_t = log A_t + logcumsumexp_s(log b_s - log A_s),   log A_t = cumsum(log a)_t.

Two library scans (cumsum, logcumsumexp) replace the custom one. The price is precision: log A_t
grows like t * mean|log a|, and float32 stores a number of that size with an absolute error of
about |log A_t| * 2^-24; the two large terms above then cancel, and that absolute error in the
exponent becomes a relative error in h_t that grows with the length. The tuple scan never forms
the large numbers. Shapes: a, b (..., L), a in (0, 1], b > 0; returns h (..., L) in a's dtype.
"""
import torch


def log_space_scan(a, b):
    """h_t = a_t * h_{t-1} + b_t (zero initial state) through cumsum and logcumsumexp; needs b > 0."""
    if not bool((b > 0).all()):
        raise ValueError("b must be positive for the real log-space scan (log b is taken)")
    log_decay = torch.cumsum(torch.log(a), dim=-1)
    return torch.exp(log_decay + torch.logcumsumexp(torch.log(b) - log_decay, dim=-1))
