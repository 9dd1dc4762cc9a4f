"""Chapter 4.9's first version of the selective scan: a teaching kernel, not used by the package.

One program per (batch row, channel) walks time one step after another with the channel's N states
in registers. Per step t it loads x_t and Delta_t (one number each) and the columns B_t, C_t (N
numbers each), forms the decay a_t = exp(Delta_t A) and the input b_t = Delta_t B_t x_t, updates
h_t = a_t h_{t-1} + b_t and writes y_t = C_t . h_t. Nothing of size N x L ever reaches memory.

Shapes: x, delta, y (batch, dim, L); A (dim, N); B, C (batch, N, L); all contiguous; forward only.
No D, z, delta_bias, softplus or groups: the production kernel (selective.py) adds them, and walks
time in chunks with an associative scan inside each.
"""
import triton
import triton.language as tl

from .. import outputs


@triton.jit
def selective_scan_simple_kernel(x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, y_ptr, dim, dstate, length,
                                 BLOCK_N: tl.constexpr):
    batch, channel = tl.program_id(0), tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    n_mask = n < dstate                                   # N padded to a power of two
    A = tl.load(A_ptr + channel * dstate + n, mask=n_mask, other=0.0).to(tl.float32)
    row = (batch * dim + channel) * length                # this channel's x, delta, y
    columns = (batch * dstate + n) * length               # B and C of this batch row
    h = tl.zeros([BLOCK_N], dtype=tl.float32)             # the N states, in registers
    for t in range(length):
        x = tl.load(x_ptr + row + t).to(tl.float32)
        delta = tl.load(delta_ptr + row + t).to(tl.float32)
        B = tl.load(B_ptr + columns + t, mask=n_mask, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + columns + t, mask=n_mask, other=0.0).to(tl.float32)
        h = tl.exp(delta * A) * h + delta * B * x         # h_t = a_t h_{t-1} + b_t
        tl.store(y_ptr + row + t, tl.sum(C * h, axis=0).to(y_ptr.dtype.element_ty))


def selective_scan_simple(x, delta, A, B, C):
    """y (batch, dim, L) like x, for contiguous x, delta (batch, dim, L), A (dim, N), B, C (batch, N, L)."""
    batch, dim, length = x.shape
    dstate = A.shape[1]
    y = outputs.empty(x.shape, x.dtype, x.device)
    selective_scan_simple_kernel[(batch, dim)](x, delta, A, B, C, y, dim, dstate, length,
                                               BLOCK_N=triton.next_power_of_2(dstate))
    return y
