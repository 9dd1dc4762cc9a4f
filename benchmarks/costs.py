"""How much work each benchmarked kernel does: matmul FLOPs and the bytes that must move.

Plain arithmetic on shapes, with no torch import, so that the benchmark scripts (which time the
kernels and divide by these counts) and the book's scoreboard page (which places stored results on
a roofline at build time, book/_ext/scoreboard.py) use one definition of each count.
"""

CHUNK = 256  # the chunk size of the SSD and bidirectional benchmarks


def ssd_flops(batch, length, heads, headdim, dstate, groups=1, Q=CHUNK):
    """Matmul FLOPs of the chunked algorithm (causal halves of the diagonal blocks), fwd and fwd+bwd."""
    chunks = -(-length // Q)
    P, N = headdim, dstate
    state = 2 * Q * P * N                     # one (Q x P) x (Q x N) product per chunk and head
    diag_p, diag_n = Q * Q * P, Q * Q * N     # causal half of a (Q x Q) x (Q x P|N) product
    fwd = batch * chunks * (heads * (2 * state + diag_p) + groups * diag_n)
    # backward as mamba_ssm runs it, one count for both implementations' TFLOP/s: recompute CB and the
    # chunk states (ours keeps them from the forward pass: about 7% of the fwd+bwd count at the bar
    # shapes, by which its fwd+bwd rate is overstated); dH; dx (state + diag); dC, dB (state, dy.x, diag each)
    bwd = batch * chunks * (heads * (state + state + state + diag_p + 2 * (state + diag_p + diag_n))
                            + groups * diag_n)
    return fwd, fwd + bwd


def ssd_min_bytes(batch, length, heads, headdim, dstate, groups=1):
    """Bytes that must move: inputs read and outputs written once (bf16 tensors, float32 dt)."""
    x = batch * length * heads * headdim * 2
    bc = 2 * batch * length * groups * dstate * 2
    dt = batch * length * heads * 4
    fwd = x + bc + dt + x                                   # read x, B, C, dt; write y
    return fwd, fwd + (x + x + bc + dt) + (x + bc + dt)     # + read dy, x, B, C, dt; write dx, dB, dC, ddt


def bidirectional_flops(shape, Q=CHUNK):
    """Matmul FLOPs of the bidirectional chunked algorithm: both directions' states and
    state-output products, full diagonal blocks (both halves) and C.B over both halves, i.e.
    twice the causal count, forward and forward+backward."""
    return tuple(2 * f for f in ssd_flops(*shape, Q=Q))


def bidirectional_min_bytes(shape, separate):
    """Bytes that must move: the causal minimum plus, with separate reverse parameters, reading
    dt_rev, B_rev, C_rev (forward) and writing their gradients (backward)."""
    batch, length, heads, headdim, dstate = shape
    fwd, total = ssd_min_bytes(*shape)
    extra = (2 * batch * length * dstate * 2 + batch * length * heads * 4) if separate else 0
    return fwd + extra, total + 3 * extra


def attention_flops(batch, heads, seqlen, head_dim, causal):
    """FlashAttention's count: 4*B*H*N^2*d forward (two matmuls), halved when causal; the backward
    (five matmuls) 2.5 times the forward. Returns (forward, backward)."""
    forward = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return forward, 2.5 * forward


def attention_forward_bytes(batch, heads, seqlen, head_dim, element_bytes=2):
    """The forward's minimum traffic: read q, k, v and write the output (16-bit), write the float32
    log-sum-exp per row."""
    return 4 * batch * seqlen * heads * head_dim * element_bytes + batch * heads * seqlen * 4


def scan_intensity(element_bytes):
    """FLOP per byte of a first-order scan: one multiply-add per step, reading a and b and writing h."""
    return 2 / (3 * element_bytes)
