# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.1
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The sequential recurrence
#
# In this chapter you will learn:
#
# - how Mamba's selective state-space model reduces to the linear recurrence $h_t = a_t h_{t-1} + b_t$, and what the discretization $\bar A = \exp(\Delta A)$, $\bar B \approx \Delta B$ means;
# - how to write that recurrence as a Triton kernel that walks time one step after another, and why its gradient is the same recurrence run backwards;
# - what walking time sequentially costs on a GPU: the baseline every later chapter beats.
#
# It builds on the [introduction](intro.md), which fixes the notation and the colour code, and on the [primer](00_primer.ipynb), whose words ({term}`program`, {term}`block`, {term}`registers`, {term}`warp`, {term}`SM`, {term}`memory floor`) this chapter uses without explaining them again.
#
# ```{admonition} Notation
# | symbol | meaning |
# |---|---|
# | $t$, $L$ | time step, sequence length |
# | $x_t$, $y_t$ | the input and the output of one channel at step $t$ |
# | $h_t$, $h_{-1}$ | the state after step $t$, the initial state |
# | $\Delta_t$, $A$, $B_t$, $C_t$ | step size, state matrix (diagonal), input and readout maps of the SSM |
# | $N$ | the state size (dstate): $h_t \in \mathbb{R}^N$ per channel |
# | $d$, $n$ | a channel (one of the layer's `dim` features, each with its own SSM) and a state ($0 \le n < N$) |
# | $a_t$, $b_t$ | decay and input of the scalar recurrence $h_t = a_t h_{t-1} + b_t$ ($a_t = \bar A_t$, $b_t = \bar B_t x_t$) |
# | $\mathcal J$; $g_t$, $\lambda_t$ | the loss; the gradient arriving at $h_t$ from above, and the total derivative $d\mathcal J/dh_t$ |
# ```

# %%
import matplotlib.pyplot as plt
import torch

from mamba_annotated import runtime, sequential_scan
from mamba_annotated.bench import copy_bandwidth_gbps, gbps, median_ms, memory_floor_ms, print_table
from mamba_annotated.figures import COLORS, show_source
from mamba_annotated.scan.reference import check_scan_gradients, linear_scan_ref, selective_scan_ref
from mamba_annotated.scan.sequential import (sequential_scan_backward, sequential_scan_bwd_kernel,
                                             sequential_scan_forward, sequential_scan_fwd_kernel)
from mamba_annotated.testing import check, randn, seed_everything, tolerance, uniform

seed_everything(0)
device = runtime.DEVICE

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## From a selective SSM to a linear recurrence
#
# A state-space model maps an input signal $x(t)$ to an output $y(t)$ through a hidden state $h(t) \in \mathbb{R}^N$:
#
# $$
# \begin{aligned}
# h'(t) &= A\,h(t) + B\,x(t), \\
# y(t) &= C\,h(t).
# \end{aligned}
# $$
#
# On a sequence we sample it with a step size $\Delta$. Hold $x$ (and $B$) constant over one step (zero-order hold); the linear ODE is then solved exactly over that step, $h(t+\Delta) = e^{\Delta A} h(t) + \int_0^{\Delta} e^{uA}\,du\; B\,x$ (for the diagonal $A$ Mamba uses, each state obeys a scalar equation $h' = \alpha h + \beta x$, and with $x$ held fixed $h(t + \Delta) = e^{\alpha\Delta} h(t) + \frac{e^{\alpha\Delta} - 1}{\alpha} \beta x$, which you can check by differentiating in $\Delta$), and with $A$ invertible $\int_0^{\Delta} e^{uA}\,du = A^{-1}(e^{\Delta A} - I) = (\Delta A)^{-1}(e^{\Delta A} - I)\,\Delta$. Writing $h_t$ for the state at the end of step $t$, this gives
#
# $$
# \begin{aligned}
# h_t &= \bar A_t\, h_{t-1} + \bar B_t\, x_t, \qquad y_t = C_t\, h_t, \\
# \bar A_t &= \exp(\Delta_t A), \\
# \bar B_t &= (\Delta_t A)^{-1}(\exp(\Delta_t A) - I)\,\Delta_t B_t .
# \end{aligned}
# $$
#
# When $\Delta_t A$ is small, $(\Delta_t A)^{-1}(\exp(\Delta_t A) - I) \approx I$ and $\bar B_t \approx \Delta_t B_t$; for large steps the two part ways (with $A = -1$, $B = 1$ and $\Delta = 3$, the exact $\bar B$ is $1 - e^{-3} \approx 0.95$, the approximation 3).
#
# Mamba {cite}`gu2023mamba` makes the model *selective*: each token carries `dim` channels, channel $d$ runs its own SSM, and $\Delta_t$, $B_t$ and $C_t$ are computed from the input at every step, so the model can decide per token how much to remember. $A$ is diagonal (one decay per channel $d$ and state $n$), so every pair $(d, n)$ is an independent scalar recurrence, and Mamba keeps the exact decay $\bar A_t = \exp(\Delta_t A)$ but replaces $\bar B_t$ by its first-order term, $\bar B_t = \Delta_t B_t$ (the factor $(\Delta_t A)^{-1}(e^{\Delta_t A} - I) = I + \Delta_t A/2 + \dots$ set to $I$, as a forward-Euler step would), at every step size. Writing $a_t = \bar A_t$ and $b_t = \bar B_t x_t$ for one pair, everything reduces to
#
# $$
# \begin{gathered}
# h_t = a_t\, h_{t-1} + b_t \quad (t = 0, \dots, L-1), \\
# h_{-1} \text{ given (zero by default)}.
# \end{gathered}
# $$
#
# $h_{-1}$ is the initial state, the argument `h0` of the code; $h_0$ is the state after step 0.
#
# Unrolled, $h_t = \sum_{s \le t} \big(\prod_{k=s+1}^{t} a_k\big)\, b_s$ (plus the decayed initial state): each output depends on every earlier input through a product of decays. Computed as written, step $t$ needs step $t-1$: a chain of $L$ dependent multiply-adds.
#
# The selectivity is easiest to see on one channel. Here $A = -1$, $B = C = 1$, the input is an impulse train, and $\bar B = \Delta B$ as in Mamba; a large $\Delta$ drives $\bar A$ towards 0 (forget, take the new input), a small one keeps $\bar A$ near 1 (remember).

# %%
length = 64
u = torch.zeros(1, 1, length, dtype=torch.float64)
u[..., ::16] = 1.0
A = -torch.ones(1, 1, dtype=torch.float64)
B = torch.ones(1, 1, length, dtype=torch.float64)
C = torch.ones(1, 1, length, dtype=torch.float64)

fig, (ax_decay, ax_state) = plt.subplots(1, 2, figsize=(10, 3.2))
deltas = torch.logspace(-3, 1, 200, dtype=torch.float64)
ax_decay.semilogx(deltas, torch.exp(-deltas), color=COLORS["decay"])
ax_decay.set(title=r"$\bar A = \exp(\Delta A)$ for $A=-1$", xlabel=r"step size $\Delta$", ylabel=r"$\bar A$")
for delta_value, style in [(0.05, "-"), (0.5, "--"), (3.0, ":")]:
    delta = torch.full((1, 1, length), delta_value, dtype=torch.float64)
    y = selective_scan_ref(u, delta, A, B, C)
    ax_state.plot(y[0, 0], style, color=COLORS["h"], label=rf"$\Delta = {delta_value}$")
ax_state.plot(u[0, 0], color=COLORS["x"], alpha=0.4, label="input $x$")
ax_state.set(title="state after each impulse", xlabel="time step $t$")
ax_state.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# Left: $\bar A$ falls from 1 to 0 as $\Delta$ grows. Right: with a small $\Delta$ the state barely takes in each impulse and holds it for long; with a large one it forgets the past within a step or two and takes in the impulse scaled by $\bar B = \Delta B$, so at $\Delta = 3$ the state jumps to three times the impulse. (The exact zero-order hold would cap that factor at $1/|A| = 1$: 0.95 at $\Delta = 3$.)

# %% [markdown]
# ## The float64 reference
#
# The ground truth is the recurrence as it reads, one step at a time, in float64 (`mamba_annotated/scan/reference.py`). It is slow and obviously right; every kernel in the book is checked against it.

# %%
show_source(linear_scan_ref)

# %% [markdown]
# With a constant decay $a$ the state forgets a past input like $a^t$: the memory length is about $1/(1-a)$ steps, since $\sum_{k \ge 0} a^k = 1/(1-a)$. The state is a decaying *sum* of past inputs, not an average: driven by the same random input, decays near 1 move slowly and swing wide, small decays follow the input.

# %%
steps = 200
b = randn(1, steps, dtype=torch.float64, device="cpu")
fig, ax = plt.subplots(figsize=(10, 3.2))
ax.plot(b[0], color=COLORS["x"], alpha=0.3, label="input $b_t$")
for decay, style in [(0.5, ":"), (0.9, "--"), (0.99, "-")]:
    h = linear_scan_ref(torch.full_like(b, decay), b)
    ax.plot(h[0], style, color=COLORS["h"], label=f"$h_t$, $a = {decay}$ (memory ~{1 / (1 - decay):.0f} steps)")
ax.set(xlabel="time step $t$", title="state trajectories for three constant decays")
ax.legend(fontsize="small", loc="upper right")
plt.tight_layout()
plt.show()

# %% [markdown]
# The decay sets the memory: at $a = 0.5$ the state is the input, barely smoothed; at $a = 0.99$ it moves slowly and swings several times wider than the input, because it adds up about a hundred past inputs (for unit-variance input its standard deviation tends to $1/\sqrt{1-a^2} \approx 7$). Multiplied by $1 - a$ it would be a running average.

# %% [markdown]
# ## Walking time on a GPU
#
# The recurrence gives no parallelism along time, but there is plenty across channels: Mamba has `batch × dim × N` independent recurrences (`dim` the model's channels $d$, each with $N$ states $n$). The kernels of chapters 1 to 4 flatten them into the rows of a `(channels, L)` array, one recurrence per row. In this chapter's code and prose a *channel* means such a row, one (batch, $d$, $n$) recurrence, not a model channel $d$; from chapter 2 on, the text calls it a *row*, as the kernels' code does. The first kernel uses exactly that and nothing more. One {term}`program` owns a {term}`block` of `BLOCK_C` channels and loops over all $L$ steps, keeping its block of states $h$ in {term}`registers`. Each step loads one column of $a$ and $b$, does one multiply-add per channel, and stores one column of $h$.

# %%
def draw_sequential_schedule(channels=8, steps=12, block=4):
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for c in range(channels):
        for t in range(steps):
            ax.add_patch(plt.Rectangle((t, c), 0.9, 0.9, color=COLORS["x"], alpha=0.25))
    for program, first in enumerate(range(0, channels, block)):
        ax.add_patch(plt.Rectangle((-0.15, first - 0.1), steps + 0.2, block + 0.1, fill=False, lw=1.5, ls="--"))
        ax.text(steps + 0.3, first + block / 2, f"program {program}", va="center")
        for t in range(steps - 1):
            ax.annotate("", xy=(t + 1.35, first + block / 2), xytext=(t + 0.55, first + block / 2),
                        arrowprops=dict(arrowstyle="->", color=COLORS["h"], lw=1.5))
    ax.set(xlim=(-0.5, steps + 2.5), ylim=(channels + 0.2, -0.4), xlabel="time step $t$ (loop inside a program)",
           ylabel="channel", title="sequential scan: programs split channels, each walks every step in order")
    ax.set_xticks([]), ax.set_yticks([])
    plt.tight_layout()


draw_sequential_schedule()
plt.show()

# %% [markdown]
# Parallel across channels, sequential along time: each program's chain of arrows is as long as the sequence.

# %% [markdown]
# The kernel (`mamba_annotated/scan/sequential.py`). Three lines to look for in it: `row_start = rows.to(tl.int64) * length` makes the offsets 64-bit, because `channels × L` can pass $2^{31}$; the `if REVERSE:` branch picks the step $t$ of iteration $i$, from the front or from the back; and `.to(tl.float32)` on every load carries the state in float32 whatever the input dtype, rounded once to the output dtype at the store. Loads do not depend on the carried state, so the compiler is free to issue them ahead of the multiply-add chain. (The `@lean_launch` line above `@triton.jit`, here and on the package's other production kernels, is the package's wrapper that cuts the Python time of a launch; it does not change what the kernel computes.)

# %%
show_source(sequential_scan_fwd_kernel)

# %% [markdown]
# The public function `sequential_scan(a, b, *, h0=None, reverse=False)` flattens the leading dimensions into channels, checks its arguments, and launches one program per 32 channels. We run it and, in the next cell, check it against the float64 loop on fresh random inputs: decays in $(0.6, 1)$, inputs normal, a random initial state. On a GPU the cell uses 4 × 1536 = 6144 channels, exactly 192 blocks of 32; in the interpreter it uses 37, so the last block is partly masked. The tests (`tests/test_sequential_scan.py`) use 333 channels, which covers the masked last block on a GPU too.

# %%
channels, length = runtime.size(gpu=(4 * 1536, 2048), cpu=(37, 100))
a = uniform(channels, length, low=0.6, high=1.0)
b = randn(channels, length)
h0 = randn(channels)
h = sequential_scan(a, b, h0=h0)

# %%
check("forward, float32", h, linear_scan_ref(a, b, h0), tolerance(torch.float32))

# %% [markdown]
# The edge cases: a single step, a length of 7, the reverse direction $h_t = a_t h_{t+1} + b_t$, no initial state, and 16-bit inputs (accumulated in float32, rounded once on output, hence the looser bound).

# %%
for length_case in [1, 7]:
    a_s, b_s = uniform(channels, length_case, low=0.6, high=1.0), randn(channels, length_case)
    check(f"length {length_case}", sequential_scan(a_s, b_s, h0=h0), linear_scan_ref(a_s, b_s, h0), tolerance(torch.float32))
check("reverse", sequential_scan(a, b, h0=h0, reverse=True), linear_scan_ref(a, b, h0, reverse=True), tolerance(torch.float32))
check("no initial state", sequential_scan(a, b), linear_scan_ref(a, b), tolerance(torch.float32))
for dtype in (torch.float16, torch.bfloat16):
    a_16, b_16 = a.to(dtype), b.to(dtype)
    check(f"forward, {str(dtype).removeprefix('torch.')}", sequential_scan(a_16, b_16, h0=h0), linear_scan_ref(a_16, b_16, h0), tolerance(dtype))

# %% [markdown]
# ## The gradient is the same recurrence, run backwards
#
# Write $\mathcal{J}$ for the loss (the book keeps $\mathcal L$ for a matrix in chapter 6) and let $g_t = \partial \mathcal{J} / \partial h_t$ be the gradient that autograd hands the scan for its output $h_t$ ("from above": it counts only the paths from $h_t$ to the loss through the layers above, not through $h_{t+1}$). $h_t$ also reaches the loss through the next step, $h_{t+1} = a_{t+1} h_t + b_{t+1}$, whose derivative in $h_t$ is $a_{t+1}$; so by the chain rule the total derivative $\lambda_t = d\mathcal{J}/dh_t$, the {term}`adjoint` of $h_t$, obeys
#
# $$
# \lambda_t = g_t + a_{t+1}\,\lambda_{t+1}, \qquad \lambda_{L-1} = g_{L-1}:
# $$
#
# the same first-order recurrence, walking from the end, with the decays shifted by one step ($\lambda_{L-1} = g_{L-1}$ because no step follows the last). The inputs $a_t$ and $b_t$ enter only step $t$, with $\partial h_t / \partial a_t = h_{t-1}$ and $\partial h_t / \partial b_t = 1$, and the initial state enters only step 0, with $\partial h_0 / \partial h_{-1} = a_0$; multiplying each by $\lambda_t$,
#
# $$
# \begin{gathered}
# \frac{\partial \mathcal{J}}{\partial b_t} = \lambda_t, \qquad
# \frac{\partial \mathcal{J}}{\partial a_t} = \lambda_t\, h_{t-1}, \\
# \frac{\partial \mathcal{J}}{\partial h_{-1}} = a_0\, \lambda_0 .
# \end{gathered}
# $$
#
# So besides the upstream gradients $g$, the backward pass needs the decays $a$, the forward outputs $h$ and the initial state $h_{-1}$ (autograd saves all three; $b$ is not needed); for `reverse=True` it walks forwards. The backward kernel fuses all three gradients into its one loop. In the listing, `a_next` starts at 0, which makes $\lambda_{L-1} = g_{L-1}$; it is loaded *after* its use, so at step $t$ it holds $a_{t+1}$, and after the loop it holds $a_0$, which gives $\partial\mathcal J / \partial h_{-1} = a_0 \lambda_0$. `prev` is only clamped to keep the load in bounds, and `tl.where` (the elementwise select of `torch.where`) puts $h_{-1}$ in its place at $t = 0$ (the forward pass's first step, the loop's last iteration):

# %%
show_source(sequential_scan_bwd_kernel)

# %% [markdown]
# We check all three gradients that the backward launcher returns against autograd through the float64 loop, with a random upstream gradient (never ones: they hide sign and index errors), in both directions and for bfloat16 inputs. (The tests also check them through `sequential_scan`'s autograd Function.)

# %%
kernels = (sequential_scan_forward, sequential_scan_backward)
check_scan_gradients("forward direction", *kernels, a, b, h0, reverse=False)
check_scan_gradients("reverse direction", *kernels, a, b, h0, reverse=True)
check_scan_gradients("bfloat16 inputs", *kernels, a.bfloat16(), b.bfloat16(), h0, reverse=False)

# %% [markdown]
# ## What walking time costs
#
# The kernel moves the fewest bytes possible: it reads $a$ and $b$ once and writes $h$ once, $3 \cdot \text{channels} \cdot L \cdot 4$ bytes in float32 (the backward pass reads $a$, $h$, $g$ and writes two gradients: 5 arrays of that size in all). Dividing by the measured device-to-device copy bandwidth gives the **{term}`memory floor`**: the time it takes to stream that many bytes at the speed `torch`'s own copy kernel reaches.
#
# The floor is a measured reference, not a hard bound, and a kernel that streams well can land a few percent above 100% of it (chapter 2's tuple scan does). The copy is itself a kernel, with its own inefficiencies, and it moves one read stream and one write stream of equal size, while the scans read two arrays for every one they write; DRAM most likely serves a read-heavy mix a little more efficiently, since every switch between reading and writing costs bus cycles. The cache does not explain it: the copy (1 GiB) and the problems timed here (150 MB and up) are all far larger than the L2 cache. The HBM peak itself (4.8 TB/s on the H200 these cells ran on; 3.35 TB/s on an H100 SXM) lies 14% above the measured copy bandwidth (4.22 TB/s in the stored benchmark and in this page's run): the copy reaches about 88% of it.
#
# We time the kernel (median of `triton.testing.do_bench`) beside the naive PyTorch loop (the same loop as the reference, in float32 on the device: one small launch per operation per step) on `8 × 1536` = 12288 channels (batch 8 and 1536 model channels $d$, one state each). (A Mamba layer of that width with $N = 16$ states would have 16 times as many rows, and 16 times as many programs.)
#
# On a GPU the kernel's time grows with $L$ like the floor, but sits well above it. The multiply-add chain is not the reason: one multiply-add takes a few clock cycles. At $L = 16384$ the kernel takes 3.54 ms, about 216 ns per step, several hundred cycles: the time scale of a trip to memory.
#
# In each step the whole launch moves 384 programs × 3 arrays × 32 channels × 4 bytes = 147 KB, and 147 KB per 216 ns is the 0.68 TB/s in the table; to reach the copy bandwidth in the same time per step, about six times as many bytes would have to be in flight at once. Two things keep that number small. The launch has few, small programs: `8 × 1536` channels in blocks of 32 (`BLOCK_C`) give 384 programs of one warp each (`NUM_WARPS = 1`), about three warps per {term}`SM` on a 132-SM GPU, which can hold 64. And each step of a program loads a *column*: 32 elements, one per channel, $L$ elements apart in memory, and memory is read in 32-byte *sectors* (eight float32 numbers), so every load instruction touches 32 separate sectors to use 4 bytes of each (the rest of each sector serves the following seven steps, from cache). The PyTorch loop is far slower still, since each step costs several kernel launches.

# %% tags=["nbval-ignore-output"]
channels = runtime.size(gpu=8 * 1536, cpu=16)
lengths = runtime.size(gpu=[1024, 4096, 16384], cpu=[32, 64])
rows, floor = [], {}
for length in lengths:
    a, b = uniform(channels, length, low=0.6, high=1.0), randn(channels, length)
    nbytes = 3 * a.numel() * a.element_size()
    floor[length] = memory_floor_ms(nbytes)
    timings = {
        "sequential kernel": median_ms(lambda: sequential_scan(a, b)),
        "PyTorch loop": median_ms(lambda: linear_scan_ref(a, b, dtype=torch.float32)),
    }
    for name, ms in timings.items():
        rows.append(dict(length=length, implementation=name, ms=ms, GBps=gbps(nbytes, ms),
                         x_floor=ms / floor[length]))
print(f"device: {runtime.device_name()}, measured copy bandwidth {copy_bandwidth_gbps():.0f} GB/s")
print_table(rows)
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for name, color in [("sequential kernel", COLORS["y"]), ("PyTorch loop", COLORS["x"])]:
    ax.loglog(*zip(*[(r["length"], r["ms"]) for r in rows if r["implementation"] == name]), "o-", base=2,
              color=color, label=name)
ax.loglog(*zip(*sorted(floor.items())), "k--", base=2, label="memory floor")
ax.set(title=f"forward, float32, {channels} channels", xlabel="sequence length L", ylabel="median time (ms)")
ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# The verdict: on the GPU the sequential kernel takes 6.18 to 6.31 times the memory floor at every length. The `x_floor` column is the measured time divided by the floor, so 6.2 means the kernel moves its bytes at about 16% of the copy bandwidth (670–683 of 4223 GB/s); the stored H200 benchmark, `book/data/linear_scan_bench.json`, records the same 16% at shape `(8, 1536, 4096)` (batch × channels × L) in float32. The PyTorch loop is 100 to 148 times slower than the kernel (630 to 916 times the floor; it is bound by the host's launches, so its time moves with whatever else the host is running). Walking time in order leaves most of the memory system idle.

# %% [markdown]
# ## What we have, and what comes next
#
# We reduced Mamba's selective SSM to the scalar recurrence $h_t = a_t h_{t-1} + b_t$, wrote it as a Triton kernel that walks time in order with the state in registers, derived its gradient (the same recurrence backwards, with shifted decays), and checked forward and backward against float64. The kernel moves the minimum number of bytes, yet stays far from the memory floor: with time a chain of dependent steps, the only parallelism is across channels, which gives few programs, each loading one scattered column per step.
#
# [Chapter 2](02_associative_scan.ipynb) breaks that chain: the step $h \mapsto a h + b$ is an affine map, composing affine maps is associative, and an associative operator can be scanned in $O(\log L)$ depth.
#
# **Exercises** (the tests in `tests/test_sequential_scan.py` check both identities):
#
# 1. Show that an initial state can be folded into the first input: `sequential_scan(a, b, h0=h0)` equals `sequential_scan(a, b2)` where `b2` is `b` with $b_0$ replaced by $b_0 + a_0 h_{-1}$ ($h_{-1}$ is `h0`).
# 2. Show that the reverse scan is the forward scan of the time-flipped inputs, flipped back: `sequential_scan(a, b, reverse=True)` equals `sequential_scan(a.flip(-1), b.flip(-1)).flip(-1)`.
# 3. *A reverse walk in Triton.* Write `reverse_scan(a, b)`, the recurrence $h_t = a_t h_{t+1} + b_t$ for `a`, `b` of shape (channels, L), float32, as a Triton kernel of your own: one program per block of channels, the states in registers, time walked from the last step to the first (the forward kernel above, read from the end).
#
# Replace the `raise` in the stub and run the cell; the checker (`mamba_annotated.exercises`) compares your function with the float64 loop on fresh random inputs, with channel counts that are not a multiple of your block and a single step.

# %%
import triton  # the exercises write their own kernels
import triton.language as tl

from mamba_annotated.exercises import check as check_exercise


def reverse_scan(a, b):
    raise NotImplementedError  # your code here


attempted = check_exercise("1.3", reverse_scan)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
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


assert check_exercise("1.3", reverse_scan)
