"""Chapter 4, second half: Mamba-1's selective scan (S6), forward and backward, discretized on chip.

Algorithm (per batch b, channel d, state n, time t; float32 inside the kernels)
    delta_t = softplus(delta_t + delta_bias_d)       (bias and softplus optional)
    a_t     = exp(delta_t * A_dn)                    the discretized decay A-bar
    x_t     = delta_t * B_nt * u_t                   the discretized input B-bar u
    h_t     = a_t * h_{t-1} + x_t,  h_{-1} = 0       N states per channel, kept on chip
    y_t     = sum_n C_nt * h_t + D_d * u_t,  then y_t * silu(z_t)   (D and z optional)
Only the carries between chunks and, for training, the states at the backward's chunk starts are
written to memory, never all the states.

Forward: one program owns one batch row and BLOCK_D channels and walks time in chunks of BLOCK_L
steps. For each chunk it loads u and delta once, then loops over the N states: state n's decays
and inputs form [BLOCK_D, BLOCK_L] tiles, ``tl.associative_scan`` with the first-order combine
runs along time, the carry is added (h_t = (prod a) * h_carry + scanned x), and C_n h accumulates
into y. Looping over n, as mamba_ssm's CUDA kernel does, keeps every tile two-dimensional: an
earlier version scanned [BLOCK_D, N, BLOCK_L] tiles and was 4-5x slower in bfloat16, most likely
from moving those tiles between threads (not profiled). A carry cannot stay in registers (Triton
cannot index a register tile with the loop's n), so the thread holding a chunk's last step stores
state n to a small buffer and the next chunk loads it after a barrier; two buffers alternate, so
no thread overwrites a carry another thread has still to read. When gradients are wanted the
kernel also stores the state at the start of every backward chunk, (batch, L / BWD_BLOCK_L, dim,
N): BWD_BLOCK_L times fewer numbers than all the states.

Backward: the adjoint lam_t = dLoss/dh_t obeys lam_t = dy_t * C_t + a_{t+1} * lam_{t+1}, the same
recurrence run from the end with the decays shifted by one step. The program walks chunks from the
last and, like the forward kernel, loops over the states inside each chunk with [BLOCK_D, BLOCK_L]
tiles. For state n it recomputes the chunk's decayed previous states g_t = a_t * h_{t-1} from the
stored start state: g_t = a_t * g_{t-1} + a_t * x_{t-1} is a first-order scan of (a_t, a_t x_{t-1}),
with x loaded one step behind, and then h_t = g_t + x_t. (Forming g_t as h_t - x_t cancels when the
decays are small, since x_t is then nearly all of h_t: dA lost three digits at decays near e^-9.)
The adjoint runs as a reverse scan (a_{t+1} is computed from delta loaded one step ahead) and its
carry to the earlier chunk goes through two buffers as in the forward kernel. The program collects
    dx_t = lam_t,   dLoss/da_t * a_t = lam_t * g_t,
summed over n into du and ddelta (written per element, like dz); dA, dD, ddelta_bias are summed over
time in registers and over batch by the caller; dB, dC (shared by all channels of a group) are
summed over the program's channels and written as per-program partial sums, which a second kernel
adds up in a fixed order and casts to B's dtype: no atomics, so gradients are deterministic.

Shapes: u, delta, z, y (batch, dim, L) contiguous; A (dim, N); B, C (batch, groups, N, L); D and
delta_bias (dim,). BLOCK_D divides dim // groups, so every program reads a single group's B and C.

Bytes moved (element size s of u): forward reads u, delta (z) and writes y: 3-4 * batch*dim*L*s,
plus B and C (2 * batch*groups*N*L*s from memory; every program reads its group's again, mostly
from L2), plus the chunk start states when training (4 * batch*dim*N*L/BWD_BLOCK_L). Backward
reads u, delta, z, dy and the chunk states (u, delta and B again one step behind, delta one step
ahead: mostly from cache) and writes du, ddelta, dz:
7 * batch*dim*L*s, plus the float32 partial sums of dB and dC
(2 * 4 * batch*(dim/BLOCK_D)*N*L, written once and read once by the final sum).

The floor is the exponentials, not the bytes: batch*dim*N*L of them per pass, against 16 per clock
per SM (chapter 4.9 measures how close the kernels come).
"""
import torch
import triton
import triton.language as tl

from .. import outputs
from ..launch import lean_launch
from ..runtime import INTERPRETED
from ..triton_ops import LOG2E, cdiv, next_power_of_2, sigmoid, softplus
from .combine import first_order_combine

# Block sizes come from benchmarks/sweep_selective_scan.py (its tables are
# book/data/selective_scan_{forward,backward}_sweep.json), each the best worst case against
# mamba_ssm's CUDA kernel over the sweep's four cases. Forward: one channel per program, chunks of
# 1024 steps, 4 warps. Backward: 16 channels per program (dB and dC are summed over them before
# they are written), chunks of 64 steps, 2 warps: the fastest in the sweep, though it too spills
# registers on an H200. In the interpreter the chunks are short, so tiny CPU tests still cross
# several chunk boundaries, and a forward program takes up to 16 channels: programs run one after
# another there, and these two settings halve the model chapter's time on CPU. The block-size test
# in tests/test_selective_scan.py runs one channel per program, as on the GPU, in the interpreter.
FWD_BLOCK_L = 16 if INTERPRETED else 1024
FWD_MAX_BLOCK_D = 16 if INTERPRETED else 1
FWD_NUM_WARPS = 4
BWD_BLOCK_L = 16 if INTERPRETED else 64
BWD_MAX_BLOCK_D = 16
BWD_NUM_WARPS = 2
SUM_BLOCK = 1024  # columns per program of the dB/dC sum (not tuned)


@triton.jit
def load_delta(delta_ptr, offsets, mask, bias, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr):
    """The step size as the scan uses it, and the value before softplus (for its derivative).

    Positions outside ``mask`` get delta = 0, so a = exp(0) = 1 and x = 0 there: padded steps
    leave the state unchanged and the chunk's last column is the state at the last real step.
    """
    raw = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA_BIAS:
        raw += bias[:, None]
    delta = raw
    if DELTA_SOFTPLUS:
        delta = softplus(raw)
    return tl.where(mask, delta, 0.0), raw


@triton.jit
def column(tile, steps, index):
    """Column ``index`` of a [rows, BLOCK_L] tile, as a vector of rows: a masked sum along time,
    in the tile's own layout. (Storing the tile through a pointer tile masked to that column makes
    the compiler first move every element of the tile between threads, through shared memory,
    because the pointers suggest another layout.)"""
    return tl.sum(tl.where(steps[None, :] == index, tile, 0.0), axis=1)


@lean_launch
@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr,
    y_ptr, carries_ptr, chunk_states_ptr,
    batch_size, dim, dstate, length, groups, channels_per_group,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, STATE_EVERY: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_d, batch = tl.program_id(0), tl.program_id(1)
    channels = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)          # all < dim: BLOCK_D divides dim
    steps = tl.arange(0, BLOCK_L)
    group = (pid_d * BLOCK_D) // channels_per_group
    rows = (batch * dim + channels).to(tl.int64) * length        # 64-bit: batch*dim*L may pass 2^31
    bc_base = (batch * groups + group).to(tl.int64) * dstate * length
    # the carries: two (batch, dim, N) buffers, each chunk reading one and writing the other; the
    # last chunk writes buffer 0, which the caller returns as the last state
    carry_rows = (batch * dim + channels).to(tl.int64) * dstate
    carry_buffer = batch_size * dim * dstate
    chunks = tl.cdiv(length, BLOCK_L)
    slots = tl.cdiv(length, STATE_EVERY)                        # start states kept for the backward
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + channels).to(tl.float32)
    if HAS_D:
        skip = tl.load(D_ptr + channels).to(tl.float32)

    for chunk in range(chunks):
        t = chunk * BLOCK_L + steps
        mask = (t < length)[None, :]
        offsets = rows[:, None] + t[None, :]
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        delta, _ = load_delta(delta_ptr, offsets, mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        delta_u = delta * u
        y = tl.zeros([BLOCK_D, BLOCK_L], dtype=tl.float32)
        if HAS_D:
            y = skip[:, None] * u
        read = carries_ptr + ((chunks - chunk) % 2) * carry_buffer + carry_rows
        write = carries_ptr + ((chunks - 1 - chunk) % 2) * carry_buffer + carry_rows
        tl.debug_barrier()                                      # the previous chunk's carries are stored
        for n in range(dstate):
            A2 = tl.load(A_ptr + channels * dstate + n).to(tl.float32) * LOG2E   # exp(x) = exp2(x log2 e)
            B = tl.load(B_ptr + bc_base + n * length + t, mask=t < length, other=0.0).to(tl.float32)
            C = tl.load(C_ptr + bc_base + n * length + t, mask=t < length, other=0.0).to(tl.float32)
            decay = tl.exp2(delta * A2[:, None])                # [BLOCK_D, BLOCK_L]: state n of each channel
            x = delta_u * B[None, :]
            decay_prod, h = tl.associative_scan((decay, x), 1, first_order_combine)
            carry = tl.load(read + n, mask=chunk > 0, other=0.0)    # state n before the chunk
            h += decay_prod * carry[:, None]
            y += h * C[None, :]
            # the last column is state n after the chunk: the thread holding it stores it. Here,
            # unlike in the backward kernel, this beat column() although the compiler moves the
            # tile between threads first (H200, bfloat16: 1.10 ms, against 1.29 with column(),
            # which sums across the program's 4 warps; the backward's warps hold whole rows).
            tl.store(write[:, None] + n + 0 * steps[None, :], h, mask=(steps == BLOCK_L - 1)[None, :])
            if STORE_CHUNK_STATES:
                # the backward pass starts a chunk every STATE_EVERY steps from the state before it:
                # the last column of each run of STATE_EVERY steps, picked as column() does
                runs = tl.reshape(h, [BLOCK_D, BLOCK_L // STATE_EVERY, STATE_EVERY])
                run_steps = tl.arange(0, STATE_EVERY)
                run_ends = tl.sum(tl.where(run_steps[None, None, :] == STATE_EVERY - 1, runs, 0.0), axis=2)
                slot = chunk * (BLOCK_L // STATE_EVERY) + 1 + tl.arange(0, BLOCK_L // STATE_EVERY)
                slot_rows = ((batch * slots + slot[None, :]) * dim + channels[:, None]).to(tl.int64) * dstate
                tl.store(chunk_states_ptr + slot_rows + n, run_ends, mask=(slot < slots)[None, :])
                first_rows = ((batch * slots) * dim + channels).to(tl.int64) * dstate
                tl.store(chunk_states_ptr + first_rows + n, tl.zeros([BLOCK_D], dtype=tl.float32), mask=chunk == 0)
        if HAS_Z:
            z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            y *= z * sigmoid(z)
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@lean_launch
@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, chunk_states_ptr,
    grad_y_ptr, grad_last_state_ptr,
    grad_u_ptr, grad_delta_ptr, grad_z_ptr,
    grad_A_part_ptr, grad_D_part_ptr, grad_bias_part_ptr, grad_B_part_ptr, grad_C_part_ptr, carries_ptr,
    batch_size, dim, dstate, length, groups, channels_per_group,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr,
    HAS_GRAD_LAST_STATE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_d, batch = tl.program_id(0), tl.program_id(1)
    channels = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    states = tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_L)
    group = (pid_d * BLOCK_D) // channels_per_group
    rows = (batch * dim + channels).to(tl.int64) * length
    bc_base = (batch * groups + group).to(tl.int64) * dstate * length
    # this program's slice of the dB, dC partial sums: (batch, dim / BLOCK_D, N, L)
    part_base = (batch * tl.num_programs(0) + pid_d).to(tl.int64) * dstate * length
    channel_state = (batch * dim + channels).to(tl.int64) * dstate
    # the adjoint's carries, as in the forward kernel: two (batch, dim, N) buffers taking turns
    carry_buffer = batch_size * dim * dstate
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + channels).to(tl.float32)
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(D_ptr + channels).to(tl.float32)
    # dA sums over time in registers; column n is filled by the loop over states
    grad_A = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    grad_D = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_bias = tl.zeros([BLOCK_D], dtype=tl.float32)

    chunks = tl.cdiv(length, BLOCK_L)
    for i in range(chunks):
        chunk = chunks - 1 - i                                   # walk from the end
        t = chunk * BLOCK_L + steps
        t_mask = t < length
        mask = t_mask[None, :]
        offsets = rows[:, None] + t[None, :]
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        delta, _ = load_delta(delta_ptr, offsets, mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        delta_u = delta * u
        # one step behind (none before the chunk's first step: its start state stands for them)
        # for the recomputed states; delta one step ahead for a_{t+1} (0 past the end: a = 1)
        prev_mask = (steps > 0)[None, :] & mask
        u_prev = tl.load(u_ptr + offsets - 1, mask=prev_mask, other=0.0).to(tl.float32)
        delta_prev, _ = load_delta(delta_ptr, offsets - 1, prev_mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        delta_u_prev = delta_prev * u_prev
        delta_next, _ = load_delta(delta_ptr, offsets + 1, (t + 1 < length)[None, :], bias,
                                   HAS_DELTA_BIAS, DELTA_SOFTPLUS)
        # few tiles live through the loop over states (they would spill): u and the step size
        # before softplus are loaded again after it, and of z only one tile stays, the part of
        # dz that is grad_out * d silu(z)/dz
        grad_y = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            gate = sigmoid(z)
            grad_gate = grad_y * gate * (1.0 + z * (1.0 - gate))
            grad_y *= z * gate
        y = skip[:, None] * u                                    # y before the gate, for dz
        lam_B = tl.zeros([BLOCK_D, BLOCK_L], dtype=tl.float32)  # sum_n lam_t B_t
        grad_delta = tl.zeros([BLOCK_D, BLOCK_L], dtype=tl.float32)
        read = carries_ptr + (i % 2) * carry_buffer + channel_state
        write = carries_ptr + ((i + 1) % 2) * carry_buffer + channel_state
        start_states = chunk_states_ptr + ((batch * chunks + chunk) * dim + channels).to(tl.int64) * dstate
        tl.debug_barrier()                                      # the later chunk's carries are stored
        for n in range(dstate):
            A = tl.load(A_ptr + channels * dstate + n).to(tl.float32)
            A2 = A * LOG2E
            B = tl.load(B_ptr + bc_base + n * length + t, mask=t_mask, other=0.0).to(tl.float32)
            B_prev = tl.load(B_ptr + bc_base + n * length + t - 1, mask=t_mask & (steps > 0),
                             other=0.0).to(tl.float32)
            C = tl.load(C_ptr + bc_base + n * length + t, mask=t_mask, other=0.0).to(tl.float32)
            # recompute the decayed previous states g_t = a_t h_{t-1} from the chunk's stored start
            # state by scanning (a_t, a_t x_{t-1}); then h_t = g_t + x_t
            decay = tl.exp2(delta * A2[:, None])
            x = delta_u * B[None, :]
            decay_prod, g_local = tl.associative_scan((decay, decay * (delta_u_prev * B_prev[None, :])), 1,
                                                      first_order_combine)
            h_start = tl.load(start_states + n)
            decayed_prev = g_local + decay_prod * h_start[:, None]
            h = decayed_prev + x
            if HAS_Z:
                y += h * C[None, :]
            # the adjoint: reverse scan of lam_t = dy_t C_t + a_{t+1} lam_{t+1}, plus the carry
            # from the later chunk (or dLoss/d(last state) in the last chunk)
            decay_next = tl.exp2(delta_next * A2[:, None])
            decay_next_prod, lam_local = tl.associative_scan(
                (decay_next, grad_y * C[None, :]), 1, first_order_combine, reverse=True)
            carry = tl.load(read + n, mask=i > 0, other=0.0)
            if HAS_GRAD_LAST_STATE:
                carry += tl.load(grad_last_state_ptr + channel_state + n, mask=i == 0, other=0.0).to(tl.float32)
            lam = lam_local + decay_next_prod * carry[:, None]
            tl.store(write + n, column(lam, steps, 0))              # the carry for the earlier chunk

            grad_decay = lam * decayed_prev                       # dLoss/da_t * a_t = lam_t * a_t * h_{t-1}
            lam_B += lam * B[None, :]
            grad_delta += grad_decay * A[:, None]
            grad_A += tl.where(states[None, :] == n, tl.sum(grad_decay * delta, axis=1)[:, None], 0.0)
            # dB and dC summed over this program's channels
            tl.store(grad_B_part_ptr + part_base + n * length + t, tl.sum(lam * delta_u, axis=0), mask=t_mask)
            tl.store(grad_C_part_ptr + part_base + n * length + t, tl.sum(h * grad_y, axis=0), mask=t_mask)

        if HAS_Z:
            tl.store(grad_z_ptr + offsets, (grad_gate * y).to(grad_z_ptr.dtype.element_ty), mask=mask)
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad_D += tl.sum(grad_y * u, axis=1)
        grad_u = lam_B * delta + grad_y * skip[:, None]
        grad_delta += lam_B * u
        if DELTA_SOFTPLUS:
            _, delta_raw = load_delta(delta_ptr, offsets, mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
            grad_delta *= sigmoid(delta_raw)
        grad_delta = tl.where(mask, grad_delta, 0.0)             # padded steps carry lam but no gradient
        grad_bias += tl.sum(grad_delta, axis=1)
        tl.store(grad_u_ptr + offsets, grad_u.to(grad_u_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_delta_ptr + offsets, grad_delta.to(grad_delta_ptr.dtype.element_ty), mask=mask)

    tl.store(grad_A_part_ptr + channel_state[:, None] + states[None, :], grad_A, mask=(states < dstate)[None, :])
    tl.store(grad_D_part_ptr + batch * dim + channels, grad_D)
    tl.store(grad_bias_part_ptr + batch * dim + channels, grad_bias)


@lean_launch
@triton.jit
def sum_group_partials_kernel(grad_B_part_ptr, grad_C_part_ptr, grad_B_ptr, grad_C_ptr, parts, columns,
                              BLOCK: tl.constexpr):
    """dB and dC from the backward kernel's partial sums, in B's dtype: for each row r (a batch row
    and group) and column c (a state and step), grad[r, c] = sum over p of part[r, p, c], the
    ``parts`` channel blocks of the group added in order (so the bits do not change from run to
    run). One launch for both, where summing and casting with PyTorch took four."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < columns
    part = row.to(tl.int64) * parts * columns + cols
    grad_B = tl.zeros([BLOCK], dtype=tl.float32)
    grad_C = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(parts):
        grad_B += tl.load(grad_B_part_ptr + part, mask=mask, other=0.0)
        grad_C += tl.load(grad_C_part_ptr + part, mask=mask, other=0.0)
        part += columns
    out = row.to(tl.int64) * columns + cols
    tl.store(grad_B_ptr + out, grad_B.to(grad_B_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_C_ptr + out, grad_C.to(grad_C_ptr.dtype.element_ty), mask=mask)


def channel_block(channels_per_group, largest):
    """The largest power of two <= ``largest`` dividing ``channels_per_group`` (a block stays in one group)."""
    block = 1
    while block < largest and channels_per_group % (2 * block) == 0:
        block *= 2
    return block


def chunk_states_shape(batch, dim, dstate, length):
    """The shape of the chunk start states that the forward pass stores for the backward pass."""
    return batch, cdiv(length, BWD_BLOCK_L), dim, dstate


def selective_scan_forward(u, delta, A, B, C, D, z, delta_bias, *, delta_softplus, store_chunk_states):
    """u, delta, z: (batch, dim, L); B, C: (batch, groups, N, L); all contiguous.

    Returns y (like u), the last state (batch, dim, N) float32, and the chunk start states
    (batch, chunks, dim, N) float32 when ``store_chunk_states`` (for the backward pass), else None.
    """
    batch, dim, length = u.shape
    groups, dstate = B.shape[1], B.shape[2]
    block_d = channel_block(dim // groups, FWD_MAX_BLOCK_D)
    y = outputs.empty(u.shape, u.dtype, u.device)
    # the kernel's two carry buffers; the last chunk writes the last state into carries[0]
    carries = outputs.empty((2, batch, dim, dstate), torch.float32, u.device)
    chunk_states = None
    # the forward kernel picks the backward's start states out of its own chunks
    assert FWD_BLOCK_L % BWD_BLOCK_L == 0, "the forward's chunks must hold whole backward chunks"
    if store_chunk_states:
        chunk_states = outputs.empty(chunk_states_shape(batch, dim, dstate, length), torch.float32, u.device)
    selective_scan_fwd_kernel[(dim // block_d, batch)](
        u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u,
        y, carries, chunk_states if chunk_states is not None else carries,
        batch, dim, dstate, length, groups, dim // groups,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=delta_softplus, STORE_CHUNK_STATES=store_chunk_states, STATE_EVERY=BWD_BLOCK_L,
        BLOCK_D=block_d, BLOCK_L=FWD_BLOCK_L, num_warps=FWD_NUM_WARPS,
    )
    return y, carries[0], chunk_states


def selective_scan_backward(u, delta, A, B, C, D, z, delta_bias, *, delta_softplus, chunk_states,
                            grad_y, grad_last_state):
    """Gradients of every input of :func:`selective_scan_forward` (None for absent ones), float32
    for A, D, delta_bias (the caller casts), B's dtype for B and C, u's dtype for u, delta, z."""
    batch, dim, length = u.shape
    groups, dstate = B.shape[1], B.shape[2]
    block_d = channel_block(dim // groups, BWD_MAX_BLOCK_D)
    blocks = dim // block_d
    grad_u = outputs.empty(u.shape, u.dtype, u.device)
    grad_delta = outputs.empty(delta.shape, delta.dtype, u.device)
    grad_z = outputs.empty(z.shape, z.dtype, u.device) if z is not None else None
    grad_A_part = outputs.empty((batch, dim, dstate), torch.float32, u.device)
    grad_D_part = outputs.empty((batch, dim), torch.float32, u.device)
    grad_bias_part = outputs.empty((batch, dim), torch.float32, u.device)
    grad_B_part = outputs.empty((batch, blocks, dstate, length), torch.float32, u.device)
    grad_C_part = outputs.empty((batch, blocks, dstate, length), torch.float32, u.device)
    carries = outputs.empty((2, batch, dim, dstate), torch.float32, u.device)   # the adjoint's carries
    selective_scan_bwd_kernel[(blocks, batch)](
        u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, chunk_states,
        grad_y, grad_last_state if grad_last_state is not None else grad_y,
        grad_u, grad_delta, grad_z if grad_z is not None else grad_u,
        grad_A_part, grad_D_part, grad_bias_part, grad_B_part, grad_C_part, carries,
        batch, dim, dstate, length, groups, dim // groups,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=delta_softplus, HAS_GRAD_LAST_STATE=grad_last_state is not None,
        BLOCK_D=block_d, BLOCK_N=next_power_of_2(dstate), BLOCK_L=BWD_BLOCK_L, num_warps=BWD_NUM_WARPS,
    )
    # sum the per-program partials: over a group's blocks for B and C (one launch, cast included),
    # over batch for A, D, delta_bias
    grad_B = outputs.empty(B.shape, B.dtype, u.device)
    grad_C = outputs.empty(C.shape, C.dtype, u.device)
    columns = dstate * length
    sum_group_partials_kernel[(cdiv(columns, SUM_BLOCK), batch * groups)](
        grad_B_part, grad_C_part, grad_B, grad_C, blocks // groups, columns, BLOCK=SUM_BLOCK)
    return dict(
        u=grad_u, delta=grad_delta, z=grad_z, B=grad_B, C=grad_C,
        A=sum_over(grad_A_part, 0),
        D=sum_over(grad_D_part, 0) if D is not None else None,
        delta_bias=sum_over(grad_bias_part, 0) if delta_bias is not None else None,
    )


def sum_over(partials, dim):
    """``partials.sum(dim)``, without a launch when that dimension has one element (one batch row):
    at small shapes a launch costs the host more than the sum the GPU."""
    return partials.squeeze(dim) if partials.shape[dim] == 1 else partials.sum(dim)
