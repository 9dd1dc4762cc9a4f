"""The exercise checkers (mamba_annotated.exercises) accept the chapters' solutions, reject wrong
answers with an AssertionError that names the exercise, and report an untouched stub. The
solutions of the kernel-writing exercises (chapters 1-5 and 7) are the Triton kernels of the
chapters' solution cells; they run in the interpreter here."""
import pytest
import torch

from mamba_annotated.exercises import check
from mamba_annotated.scan import sequential_scan
from mamba_annotated.ssd.reference import per_head

import triton  # after mamba_annotated, which turns the interpreter on where there is no GPU
import triton.language as tl


def shift_adjoint(g, seq_idx):
    """Chapter 6's solution to 6.1: shift left, zero at the end of each packed sequence."""
    out = torch.zeros_like(g)
    out[:, :-1] = g[:, 1:]
    if seq_idx is not None:
        ends = torch.zeros(seq_idx.shape, dtype=torch.bool, device=g.device)
        ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
        out[ends] = 0
    return out


def shift_adjoint_ignoring_sequences(g, seq_idx):
    """Wrong: right for one sequence per row, but lets gradients cross packed boundaries."""
    return shift_adjoint(g, None)


def shift_right(g, seq_idx):
    """Wrong: the shift itself, not its adjoint."""
    out = torch.zeros_like(g)
    out[:, 1:] = g[:, :-1]
    return out


def diagonal(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Chapter 6's solution to 6.2: D + dt_t C_t.B_t + dt'_t C'_t.B'_t, per head."""
    heads = dt.shape[2]
    both = [d * (per_head(c, heads) * per_head(b, heads)).sum(-1) for d, b, c in ((dt, B, C), (dt_rev, B_rev, C_rev))]
    return (both[0] + both[1] + D).transpose(1, 2)


def diagonal_counted_once(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Wrong: the Hydra-like mistake of counting one direction only."""
    heads = dt.shape[2]
    return (dt * (per_head(C, heads) * per_head(B, heads)).sum(-1) + D).transpose(1, 2)


def diagonal_one_group(dt, B, C, D, dt_rev, B_rev, C_rev):
    """Wrong with groups: every head reads group 0's B and C."""
    return diagonal(dt, B[:, :, :1], C[:, :, :1], D, dt_rev, B_rev[:, :, :1], C_rev[:, :, :1])


# 0.1: alpha x + y in blocks, the tail masked
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.load(y_ptr + i, mask=i < n)
    tl.store(out_ptr + i, alpha * x + y, mask=i < n)


def axpy(alpha, x, y):
    out = torch.empty_like(x)
    axpy_kernel[(triton.cdiv(x.numel(), 256),)](x, y, out, alpha, x.numel(), BLOCK=256)
    return out


# 1.3: the reverse recurrence, time walked backwards by one program per block of channels
@triton.jit
def reverse_scan_kernel(a_ptr, b_ptr, h_ptr, channels, length, BLOCK_C: tl.constexpr):
    channel = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = channel < channels
    h = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for step in range(length):
        t = length - 1 - step  # walk time backwards
        a = tl.load(a_ptr + channel * length + t, mask=mask)
        b = tl.load(b_ptr + channel * length + t, mask=mask)
        h = a * h + b
        tl.store(h_ptr + channel * length + t, h, mask=mask)


def reverse_scan(a, b):
    channels, length = a.shape
    h = torch.empty_like(a)
    reverse_scan_kernel[(triton.cdiv(channels, 16),)](a, b, h, channels, length, BLOCK_C=16)
    return h


# 2.3: a cumulative sum with tl.associative_scan and an add combine
@triton.jit
def add(x, y):
    return x + y


@triton.jit
def cumsum_kernel(x_ptr, y_ptr, length, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * length + t, mask=t < length, other=0.0)
    tl.store(y_ptr + row * length + t, tl.associative_scan(x, 0, add), mask=t < length)


def cumsum(x):
    rows, length = x.shape
    y = torch.empty_like(x)
    cumsum_kernel[(rows,)](x, y, length, BLOCK=triton.next_power_of_2(length))
    return y


# 3.3, 3.4: two float16 in one int32 word and back
@triton.jit
def pack_kernel(high_ptr, low_ptr, word_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    high = tl.load(high_ptr + i, mask=i < n).to(tl.uint16, bitcast=True).to(tl.int32)
    low = tl.load(low_ptr + i, mask=i < n).to(tl.uint16, bitcast=True).to(tl.int32)  # zero-extended
    tl.store(word_ptr + i, (high << 16) | low, mask=i < n)


def pack_halves(high, low):
    words = torch.empty(high.shape, dtype=torch.int32, device=high.device)
    pack_kernel[(triton.cdiv(high.numel(), 128),)](high, low, words, high.numel(), BLOCK=128)
    return words


@triton.jit
def unpack_kernel(word_ptr, high_ptr, low_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    word = tl.load(word_ptr + i, mask=i < n)
    tl.store(high_ptr + i, (word >> 16).to(tl.int16).to(tl.float16, bitcast=True), mask=i < n)
    tl.store(low_ptr + i, word.to(tl.int16).to(tl.float16, bitcast=True), mask=i < n)


def unpack_halves(words):
    high = torch.empty(words.shape, dtype=torch.float16, device=words.device)
    low = torch.empty_like(high)
    unpack_kernel[(triton.cdiv(words.numel(), 128),)](words, high, low, words.numel(), BLOCK=128)
    return high, low


# 4.3: a cumulative sum of any length, block by block with a carry
@triton.jit
def blocked_cumsum_kernel(x_ptr, y_ptr, length, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    carry = tl.zeros([], dtype=tl.float32)
    for start in range(0, length, BLOCK):
        t = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * length + t, mask=t < length, other=0.0)
        tl.store(y_ptr + row * length + t, tl.cumsum(x, 0) + carry, mask=t < length)
        carry += tl.sum(x, 0)


def blocked_cumsum(x, block):
    rows, length = x.shape
    y = torch.empty_like(x)
    blocked_cumsum_kernel[(rows,)](x, y, length, BLOCK=block)
    return y


# 5.3: what each chunk adds to the state, by one tl.dot per (batch, chunk, head)
@triton.jit
def chunk_states_kernel(x_ptr, b_ptr, dt_ptr, a_ptr, s_ptr, length, heads, chunks,
                        Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, chunk, head)
    head = pid % heads
    chunk = (pid // heads) % chunks
    batch = pid // (heads * chunks)
    s = chunk * Q + tl.arange(0, Q)  # positions of the chunk
    inside = s < length
    rows = (batch * length + s) * heads + head  # (batch, L, heads, ...) rows
    x = tl.load(x_ptr + rows[:, None] * P + tl.arange(0, P)[None, :], mask=inside[:, None], other=0.0)
    B = tl.load(b_ptr + rows[:, None] * N + tl.arange(0, N)[None, :], mask=inside[:, None], other=0.0)
    steps = ((batch * heads + head) * chunks + chunk) * Q + tl.arange(0, Q)
    dt = tl.load(dt_ptr + steps)
    a = tl.load(a_ptr + steps)
    a_last = tl.load(a_ptr + ((batch * heads + head) * chunks + chunk) * Q + Q - 1)
    weight = tl.exp(a_last - a) * dt  # (Q,)
    states = tl.dot(tl.trans(x * weight[:, None]), B)  # (P, Q) @ (Q, N)
    out = (pid * P + tl.arange(0, P))[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(s_ptr + out, states)


def chunk_states(x, B, dt, dA_cumsum):
    batch, length, heads, P = x.shape
    N, (chunks, Q) = B.shape[-1], dt.shape[-2:]
    states = torch.empty(batch, chunks, heads, P, N, dtype=torch.float32, device=x.device)
    chunk_states_kernel[(batch * chunks * heads,)](x, B, dt, dA_cumsum, states, length, heads, chunks, Q=Q, P=P, N=N)
    return states


# 7.1: attention over two parts of the keys, merged by their log-sum-exps
@triton.jit
def merge_kernel(o1_ptr, l1_ptr, o2_ptr, l2_ptr, o_ptr, l_ptr, seqlen, heads, D: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, query, head) row of out
    head = pid % heads
    query = (pid // heads) % seqlen
    batch = pid // (heads * seqlen)
    at = ((batch * heads) + head) * seqlen + query  # lse is (batch, heads, Nq)
    lse1, lse2 = tl.load(l1_ptr + at), tl.load(l2_ptr + at)
    lse = tl.maximum(lse1, lse2) + tl.log(1.0 + tl.exp(-tl.abs(lse1 - lse2)))
    d = pid * D + tl.arange(0, D)
    out = tl.exp(lse1 - lse) * tl.load(o1_ptr + d) + tl.exp(lse2 - lse) * tl.load(o2_ptr + d)
    tl.store(o_ptr + d, out)
    tl.store(l_ptr + at, lse)


def merge_attention(out1, lse1, out2, lse2):
    batch, seqlen, heads, D = out1.shape
    out, lse = torch.empty_like(out1), torch.empty_like(lse1)
    merge_kernel[(batch * seqlen * heads,)](out1, lse1, out2, lse2, out, lse, seqlen, heads, D=D)
    return out, lse


# 7.3: softmax by passes over a row: its maximum, the sum of exp(x - max), the output
@triton.jit
def softmax_kernel(x_ptr, y_ptr, length, BLOCK: tl.constexpr):
    row = x_ptr + tl.program_id(0) * length
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, length, BLOCK):  # pass 1: the maximum
        t = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.max(tl.load(row + t, mask=t < length, other=float("-inf")), 0))
    total = tl.zeros([], dtype=tl.float32)
    for start in range(0, length, BLOCK):  # pass 2: the sum of exp(x - m), every term <= 1
        t = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.exp(tl.load(row + t, mask=t < length, other=float("-inf")) - m), 0)
    for start in range(0, length, BLOCK):  # pass 3: write
        t = start + tl.arange(0, BLOCK)
        p = tl.exp(tl.load(row + t, mask=t < length, other=float("-inf")) - m) / total
        tl.store(y_ptr + tl.program_id(0) * length + t, p, mask=t < length)


def softmax(x, block):
    y = torch.empty_like(x)
    softmax_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=block)
    return y


# 7.4: the log-sum-exp of a row in one pass: running maximum, rescaled running sum
@triton.jit
def logsumexp_kernel(x_ptr, out_ptr, length, BLOCK: tl.constexpr):
    row = x_ptr + tl.program_id(0) * length
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    for start in range(0, length, BLOCK):
        t = start + tl.arange(0, BLOCK)
        x = tl.load(row + t, mask=t < length, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)  # rescale the old sum
        m = m_new
    tl.store(out_ptr + tl.program_id(0), m + tl.log(total))


def logsumexp(x, block):
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    logsumexp_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=block)
    return out

# --- wrong answers ------------------------------------------------------------------------------------


def axpy_unmasked_tail(alpha, x, y):
    """Wrong for 0.1: the last partial block is dropped (what a grid of n // BLOCK programs does)."""
    out = alpha * x + y
    out[x.numel() // 256 * 256:] = float("nan")
    return out


def forward_scan(a, b):
    """Wrong for 1.3: the forward recurrence."""
    return sequential_scan(a, b)


def exclusive_cumsum(x):
    """Wrong for 2.3: the sum of the elements before t, not up to t."""
    return torch.cumsum(x, -1) - x


def pack_sign_extended(high, low):
    """Wrong for 3.3: the low half widened with its sign, which fills the high half with ones."""
    return (high.view(torch.int16).to(torch.int32) << 16) | low.view(torch.int16).to(torch.int32)


def unpack_swapped(words):
    """Wrong for 3.4: the halves the wrong way round."""
    high, low = unpack_halves(words)
    return low, high


def cumsum_without_carry(x, block):
    """Wrong for 4.3: every block starts again from zero."""
    pad = -x.shape[-1] % block
    blocks = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, block))
    return torch.cumsum(blocks, -1).flatten(-2)[..., :x.shape[-1]]


def convolution_kernel(delta, A, B, C, length):
    """Chapter 4.9's solution to 4.9: K[d, k] = sum_n C_n exp(k delta_d A_dn) delta_d B_n."""
    k = torch.arange(length, dtype=torch.float64, device=delta.device)
    decay = torch.exp(k * (delta.double()[:, None] * A.double())[..., None])       # (dim, N, L)
    return (C.double()[None, :, None] * decay * (delta.double()[:, None] * B.double())[..., None]).sum(1)


def convolution_kernel_without_step_on_input(delta, A, B, C, length):
    """Wrong for 4.9: the input taken as B x, not delta B x (the decay discretized, the input not);
    delta_d is a factor of every term of channel d's kernel, so this is K / delta."""
    return convolution_kernel(delta, A, B, C, length) / delta.double()[:, None]


def chunk_states_without_decay(x, B, dt, dA_cumsum):
    """Wrong for 5.3: dt_s x_s B_s^T summed over the chunk, forgetting the decay to its end."""
    return chunk_states(x, B, dt, torch.zeros_like(dA_cumsum))


def merge_by_averaging(out1, lse1, out2, lse2):
    """Wrong for 7.1: the two parts weighted equally, whatever their sums."""
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)


def softmax_without_max(x, block):
    """Wrong for 7.3: exp(x) / sum exp(x), which overflows or underflows in float32."""
    return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)


def logsumexp_without_max(x, block):
    """Wrong for 7.4: log(sum exp(x)), which overflows to inf or underflows to log(0)."""
    return torch.log(torch.exp(x).sum(-1))



def ssd_step(h, x, dt, A, B, C, D):
    """Chapter 8's solution to 8.1."""
    heads_per_group = h.shape[1] // B.shape[1]
    B, C = (t.repeat_interleave(heads_per_group, dim=1) for t in (B, C))
    new_h = torch.exp(dt * A)[..., None, None] * h + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return new_h, (new_h * C[:, :, None, :]).sum(-1) + D[:, None] * x


def ssd_step_groups_tiled(h, x, dt, A, B, C, D):
    """Wrong for 8.1: heads assigned to groups round-robin (repeat) instead of in runs."""
    heads_per_group = h.shape[1] // B.shape[1]
    B, C = (t.repeat(1, heads_per_group, 1) for t in (B, C))
    new_h = torch.exp(dt * A)[..., None, None] * h + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return new_h, (new_h * C[:, :, None, :]).sum(-1) + D[:, None] * x


def ssd_step_output_before_update(h, x, dt, A, B, C, D):
    """Wrong for 8.1: y read from the old state (the update comes after the readout)."""
    new_h, _ = ssd_step(h, x, dt, A, B, C, D)
    heads_per_group = h.shape[1] // B.shape[1]
    C = C.repeat_interleave(heads_per_group, dim=1)
    return new_h, (h * C[:, :, None, :]).sum(-1) + D[:, None] * x


def conv_step(window, x, weight, bias):
    """Chapter 8's solution to 8.2."""
    new_window = torch.cat([window[..., 1:], x[..., None]], dim=-1)
    return new_window, (new_window * weight).sum(-1) + bias


def conv_step_reversed_filter(window, x, weight, bias):
    """Wrong for 8.2: the filter applied newest-first (a correlation with the flipped filter)."""
    new_window = torch.cat([window[..., 1:], x[..., None]], dim=-1)
    return new_window, (new_window * weight.flip(-1)).sum(-1) + bias

SOLUTIONS = [("0.1", axpy), ("1.3", reverse_scan), ("2.3", cumsum), ("3.3", pack_halves), ("3.4", unpack_halves),
             ("4.3", blocked_cumsum), ("4.9", convolution_kernel), ("5.3", chunk_states), ("6.1", shift_adjoint), ("6.2", diagonal),
             ("7.1", merge_attention), ("7.3", softmax), ("7.4", logsumexp), ("8.1", ssd_step), ("8.2", conv_step)]

WRONG = [("0.1", axpy_unmasked_tail), ("1.3", forward_scan), ("2.3", exclusive_cumsum), ("3.3", pack_sign_extended), ("3.4", unpack_swapped),
         ("4.3", cumsum_without_carry), ("4.9", convolution_kernel_without_step_on_input), ("5.3", chunk_states_without_decay), ("6.1", shift_adjoint_ignoring_sequences),
         ("6.1", shift_right), ("6.2", diagonal_counted_once), ("6.2", diagonal_one_group),
         ("7.1", merge_by_averaging), ("7.3", softmax_without_max), ("7.4", logsumexp_without_max),
         ("8.1", ssd_step_groups_tiled), ("8.1", ssd_step_output_before_update), ("8.2", conv_step_reversed_filter)]


@pytest.mark.parametrize("exercise, solution", SOLUTIONS)
def test_solution_accepted(exercise, solution, capsys):
    assert check(exercise, solution) is True
    assert f"exercise {exercise}: correct" in capsys.readouterr().out


@pytest.mark.parametrize("exercise, wrong", WRONG)
def test_wrong_answer_rejected(exercise, wrong):
    with pytest.raises(AssertionError, match=f"exercise {exercise}"):
        check(exercise, wrong)


def test_wrong_shape_rejected():
    with pytest.raises(AssertionError, match="expected a tensor of shape"):
        check("6.1", lambda g, seq_idx: g[:, 1:])
    with pytest.raises(AssertionError, match="expected a tensor of shape"):
        check("7.4", lambda x, block: torch.logsumexp(x, -1, keepdim=True))


def test_wrong_dtype_rejected():
    with pytest.raises(AssertionError, match="expected int32 words"):
        check("3.3", lambda high, low: pack_halves(high, low).to(torch.int64))
    with pytest.raises(AssertionError, match="expected float16"):
        check("3.4", lambda words: tuple(half.float() for half in unpack_halves(words)))


@pytest.mark.parametrize("exercise", [number for number, _ in SOLUTIONS])
def test_stub_reported(exercise, capsys):
    def stub(*args):
        raise NotImplementedError

    assert check(exercise, stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_unknown_exercise():
    with pytest.raises(ValueError, match="no checker"):
        check("9.9", shift_adjoint)
