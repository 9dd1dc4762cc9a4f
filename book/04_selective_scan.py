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
# # The selective scan
#
# In this section you will learn:
#
# - how Mamba's {term}`selective SSM` (S6) becomes one *fused* kernel, one that computes $a_t$, $b_t$, the states, $y$ and the gate in a single pass without writing what lies between them to memory (except the chunks' carries and, for training, every 64th state): the discretization on chip ($a_t = e^{\Delta_t A}$, $b_t = \Delta_t B_t x_t$), the $N$ states of every step kept in {term}`registers`, $y = C h + D x$ and the $z$ gate;
# - how its backward pass is the {term}`adjoint` recurrence run from the end, with the states recomputed {term}`chunk` by chunk from a few stored boundary states;
# - why the kernel loops over the states instead of holding them all in one 3-d tile, what fusing buys over materializing the discretized tensors, and how far the kernel is from {term}`mamba_ssm`'s CUDA kernel and from the hardware floor.
#
# It builds on the earlier sections of this chapter (4.1–4.8), [blocked scans with carries](04_blocked_carries.ipynb): a run of steps is scanned with `tl.associative_scan` over pairs $(a, b)$, and a {term}`carry` links one run to the next. Those sections call such a run a block; here, as in the package's selective-scan code, it is a *chunk* of `BLOCK_L` steps.
#
# ```{admonition} Notation
# | symbol | meaning |
# |---|---|
# | $t$, $L$ | time step, sequence length |
# | $x_t$ | the layer input of one channel at step $t$ (mamba_ssm's argument `u`) |
# | $\Delta_t$ | the step size of one channel (after the bias $\beta$, `delta_bias`, and the softplus) |
# | $A$ | the diagonal state matrix, one negative number per channel $d$ and state $n$ |
# | $B_t, C_t \in \mathbb{R}^N$ | input and readout maps ($N$: the state size, dstate), shared by the channels of a group |
# | $a_t = e^{\Delta_t A}$, $b_t = \Delta_t B_t x_t$ | the decay and the input of the recurrence $h_t = a_t h_{t-1} + b_t$: chapter 1's discretization, $a_t = \bar A_t$ exactly and $b_t = \bar B_t x_t$ in Mamba's Euler form $\bar B_t = \Delta_t B_t$ (not the zero-order hold) |
# | $h_t \in \mathbb{R}^N$, $y_t$ | the states and the output of one channel |
# | $D$, $z_t$ | the skip and the gate |
# | $y^{\text{pre}}_t$ | the output before the gate, $C_t \cdot h_t + D x_t$ |
# | $\Delta^{\text{raw}}_t$ | the `delta` argument, before the bias and the softplus |
# | group | the channels that share one $B$ and one $C$ (`dim / groups` consecutive channels) |
# | $\mathcal J$ | the loss |
# | $\sigma(u) = 1/(1 + e^{-u})$; $\operatorname{softplus}(u) = \log(1 + e^u)$; $\operatorname{silu}(z) = z\,\sigma(z)$ | the sigmoid, which is softplus's derivative; the softplus; silu, whose derivative is $\sigma(z)(1 + z(1 - \sigma(z)))$ |
# | $\lambda_t$ | the adjoint $\partial\mathcal J/\partial h_t$ (a vector of $N$) |
# | $g^y_t$, $g_t$, $g^{\text{last}}$ | the gradient arriving at the output $y_t$; the part of it that reaches $C_t h_t + D x_t$ (times $\operatorname{silu}(z_t)$ when there is a gate); the gradient arriving at the returned last state |
# ```

# %%
import json
import pathlib

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from mamba_annotated import runtime
from mamba_annotated.bench import median_ms, print_table
from mamba_annotated.figures import COLORS, show_fragment, show_source
from mamba_annotated.scan import linear_scan
from mamba_annotated.scan.api import selective_scan
from mamba_annotated.scan.reference import selective_scan_ref
from mamba_annotated.scan.selective import (BWD_BLOCK_L, FWD_BLOCK_L, selective_scan_bwd_kernel,
                                            selective_scan_fwd_kernel)
from mamba_annotated.scan.simple import selective_scan_simple, selective_scan_simple_kernel
from mamba_annotated.testing import check, randn, seed_everything, tolerance, uniform

seed_everything(0)
device = runtime.DEVICE

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## The selective SSM, one channel at a time
#
# Mamba's SSM layer {cite}`gu2023mamba` takes an input $x \in \mathbb{R}^{\text{dim} \times L}$ and, per token, a step size $\Delta_t$ (one per channel) and two vectors $B_t, C_t \in \mathbb{R}^N$ (shared by the channels of a group). Each channel $d$ has its own diagonal $A_d \in \mathbb{R}^N$ ($A < 0$). For channel $d$, state $n$ and step $t$:
#
# $$
# \begin{aligned}
# \Delta_t &= \operatorname{softplus}(\Delta^{\text{raw}}_t + \beta_d), \\
# a_t &= e^{\Delta_t A_{dn}}, \qquad b_t = \Delta_t\, B_{nt}\, x_t, \\
# h_t &= a_t\, h_{t-1} + b_t,
# \end{aligned}
# $$
#
# $$
# y_t = \Big(\sum_n C_{nt}\, h_{nt} + D_d\, x_t\Big)\cdot \operatorname{silu}(z_t).
# $$
#
# The bias $\beta$ (`delta_bias`), the softplus, $D$ and the gate $z$ are each optional; the layout is mamba_ssm's `selective_scan_fn`, whose argument `u` is our $x$: `u`, `delta`, `z` are `(batch, dim, L)`, `A` is `(dim, N)`, `B`, `C` are `(batch, N, L)` or `(batch, groups, N, L)`, channel $d$ using group $d \,/\!/\, (\text{dim}/\text{groups})$.
#
# For each $(d, n)$ this is exactly the recurrence of sections 4.1–4.8, with $a_t$ and $b_t$ *computed* from $(\Delta, A, B, x)$ rather than given. The naive way follows that literally: materialize $a$ and $b$ as `(batch, dim, N, L)` tensors, scan them, contract with $C$. Each materialized tensor is $N$ times the size of an input ($2N$ times the bytes when a 16-bit input is materialized in float32; $N = 16$ in Mamba), and it is written and read several times. That traffic is what the fused kernel avoids: it reads $x$ and $\Delta$ once, and $B$ and $C$ (small, and shared by a group's channels) once per channel, mostly from the {term}`L2` cache; it forms $a_t$ and $b_t$ in registers and writes only $y$.
#
# The float64 reference in `mamba_annotated/scan/reference.py` is the literal version, and the ground truth:

# %%
show_source(selective_scan_ref)

# %% [markdown]
# What "selective" means: the step size $\Delta_t$ depends on the token. A large $\Delta_t$ makes $a_t = e^{\Delta_t A}$ small (forget the past, take in $x_t$); a small one keeps $a_t$ near 1 (ignore $x_t$, remember). Below, one channel with four states sees a random input with a small $\Delta$ everywhere except at $t = 48$: that one large step mostly wipes the state and loads the current input, which then fades as the small steps resume.

# %%
steps = 96
u_demo = randn(1, 1, steps, dtype=torch.float64, device="cpu")
delta_demo = torch.full((1, 1, steps), 0.05, dtype=torch.float64)
delta_demo[..., 48] = 4.0
A_demo = -torch.tensor([[0.5, 1.0, 2.0, 4.0]], dtype=torch.float64)
B_demo = torch.ones(1, 4, steps, dtype=torch.float64)
C_demo = torch.full((1, 4, steps), 0.25, dtype=torch.float64)
y_demo, _ = selective_scan_ref(u_demo, delta_demo, A_demo, B_demo, C_demo, return_last_state=True)

fig, (ax_in, ax_out) = plt.subplots(1, 2, figsize=(11, 3.2))
ax_in.plot(u_demo[0, 0], color=COLORS["x"], label="input $x_t$")
ax_in.plot(delta_demo[0, 0], color=COLORS["decay"], label=r"step size $\Delta_t$")
ax_in.set(title="inputs", xlabel="time step $t$")
ax_in.legend(fontsize="small")
ax_out.plot(y_demo[0, 0], color=COLORS["y"], label="$y_t = C h_t$")
ax_out.axvline(48, color=COLORS["decay"], ls=":", label=r"large $\Delta$: reset")
ax_out.set(title="output of one channel", xlabel="time step $t$")
ax_out.legend(fontsize="small")
plt.show()

# %% [markdown]
# The plot shows selection at work. Before $t = 48$ each input enters with weight $\Delta = 0.05$, so the output stays within about ±0.2 while $x$ swings between about −2 and 2. At $t = 48$ the decays drop to $e^{-2}$ and below, so the old state is almost gone, and the input enters with weight $\Delta = 4$: the output jumps to about $4 x_{48} \approx -2.7$ (here $\sum_n C_n B_n = 1$; the factor 4 is chapter 1's $\bar B = \Delta B$). It does not follow the inputs after that: they enter with weight 0.05 again, and the output fades back towards zero, each state at its own rate $e^{0.05 A_n}$ per step; the slowest state ($A_n = -0.5$) still holds about a third of its value 47 steps later.
#
# ## A first kernel: one channel, one step at a time
#
# The simplest fused kernel gives each {term}`program` one (batch row, channel) pair and walks time in order, as chapter 1 did, but now with a vector of $N$ states in registers instead of one number. Each step loads $x_t$ and $\Delta_t$ (one number each) and the columns $B_t$, $C_t$ ($N$ numbers each), forms $a_t$ and $b_t$, updates the $N$ states and writes the single number $y_t = C_t \cdot h_t$. The `(batch, dim, N, L)` tensors of the naive way never exist. This teaching version (`mamba_annotated/scan/simple.py`) has no $D$, $z$, bias or groups and no backward pass:

# %%
show_source(selective_scan_simple_kernel)

# %% [markdown]
# The next cell checks it against the float64 reference on fresh random inputs, with a state size that is not a power of two (padded to 8 inside, the padding masked):

# %%
x_s, delta_s = randn(2, 3, 37), uniform(2, 3, 37, low=0.02, high=0.6)
A_s, B_s, C_s = -uniform(3, 5, low=0.2, high=2.0), randn(2, 5, 37), randn(2, 5, 37)
check("teaching kernel, float32", selective_scan_simple(x_s, delta_s, A_s, B_s, C_s),
      selective_scan_ref(x_s, delta_s, A_s, B_s, C_s), tolerance(torch.float32))

# %% [markdown]
# It is correct, but built like chapter 1's kernel: every step waits for the previous one, and each step loads a handful of numbers and does only $N$ multiply-adds, so it keeps few bytes in flight. We do not time it here; it shares the limits chapter 1 measured. The production kernel keeps the fusion and removes the chain, with the blocked scan of sections 4.1–4.8.
#
# ## The production kernel: one channel per program, time in chunks, one state at a time
#
# There are `batch × dim × N` independent recurrences, but they are not independent in their *inputs*: the $N$ states of a channel share $x_t$ and $\Delta_t$, and all channels of a group share $B_t$ and $C_t$. So one {term}`program` owns one batch row and `BLOCK_D` channels, and walks time in chunks of `BLOCK_L` steps. On a GPU `BLOCK_D` is 1 and `BLOCK_L` is 1024. These sizes come from a sweep on an H100 (`benchmarks/sweep_selective_scan.py`, `book/data/selective_scan_forward_sweep.json`): over the sweep's four cases, this setting with 4 warps had the best worst case, its slowest case at 0.89× the CUDA kernel's speed beating every other setting's slowest. For each chunk the program:
#
# 1. loads $x$ (`u`) and $\Delta$ once, with contiguous loads along time, and forms $\Delta x$;
# 2. then, for each state $n$ in turn:
#    1. loads row $n$ of `B` and `C` for the chunk and forms $a = \exp_2(\Delta \cdot A_n \log_2 e)$ and $b = \Delta B_n x$ (exp2 is the GPU's native instruction);
#    2. scans the pairs $(a, b)$ along time with `tl.associative_scan` and the first-order {term}`combine` of chapter 2; the scan returns both the product of the chunk's decays so far, $\prod_{t_0 \le s \le t} a_s$ with $t_0$ the chunk's first step, and the local state, started from zero at $t_0$;
#    3. adds the carry: $h_t = \big(\prod_{t_0 \le s \le t} a_s\big)\, h_{\text{carry}} + h^{\text{local}}_t$, as in the chained walk of section 4.1;
#    4. adds $C_{nt} h_{nt}$ to $y_t$, and keeps the last step's $h$ as state $n$'s next carry;
# 3. adds $D x$, multiplies by $\operatorname{silu}(z)$ and stores $y$.
#
# The loop over $n$ is the design's one decision, and it came from a measurement. The first version of this kernel built `BLOCK_D × N × BLOCK_L` tiles, all $N$ states of a chunk at once, and summed over the state axis for $y$. On an H100 it ran 4 to 5 times slower than mamba_ssm's CUDA kernel in bfloat16 (`benchmarks/bench_selective_scan_cuda.py`). Triton gives every tile a *layout*, which thread holds which elements; the 3-d tile wanted one layout for the scan along time and another for the sum over states, and at each change the compiler moves a tile between threads through {term}`shared memory` (a *layout conversion*). That is the likely cost, though we did not profile the old kernel to prove it. mamba_ssm's CUDA kernel {cite}`repo_mamba` instead gives each thread a run of time steps of one channel and loops over $n$, so no 3-d tile exists. Looping over $n$ here too keeps every tile two-dimensional, `BLOCK_D × BLOCK_L`, in the one layout that the loads, the scan and the accumulation of $y$ share.
#
# It has one cost: the carries. Every step of the next chunk needs state $n$'s carry, since $h_t$ adds $(\prod a) \cdot h_{\text{carry}}$, but after the scan that value sits in the one thread that holds the chunk's last step. Triton cannot pick an element of a register tile by a loop variable (there is no `carries[n]`), and gathering it into a register tile with a masked sum across the threads measured slower (next paragraph). So the carries go through memory: the thread that holds the chunk's last step stores state $n$'s value into a small `(2, batch, dim, N)` float32 buffer, and the next chunk loads it. Two things make this safe. A barrier (`tl.debug_barrier()`) at the start of every chunk makes the stores of the previous chunk visible to every thread of the program. And two buffers alternate, each chunk reading the one the previous chunk wrote and writing the other, so no thread can overwrite a carry that a slower thread has still to read. The parity is chosen so that the last chunk writes buffer 0, which `return_last_state` returns without a copy (and which, starting at offset 0 of its storage, matches the output shape `torch.compile` is told of, `fake_selective_forward` in `scan/api.py`).
#
# Storing one column has a cost that the listing does not show: the store's pointers suggest a different layout from the tile's, so the compiler first moves the whole tile between threads. Picking the column out with a masked sum along time measured slower here (1.29 against 1.10 ms in bfloat16 on the H200, a development run not stored in `book/data`), so the forward kernel keeps the store; the backward kernel below, whose tiles are laid out differently, uses the masked sum.
#
# Steps past $L$ get $\Delta = 0$: $a = 1$, $b = 0$, so the last column of the last chunk is the state at step $L - 1$. When gradients will be needed, the kernel also stores, for every run of 64 steps (the backward pass's chunk, explained there), the state just *before* the run's first step, $h_{t_0 - 1}$: that is the previous run's last column, so the kernel views $h$ as runs of 64 steps (`tl.reshape`), picks the last column of each run with a masked sum and stores it in the next run's slot (the `+ 1` in the slot index; the first run's slot holds zeros).

# %%
def draw_state_loop(dstate=3, chunks=3, chunk_len=4):
    """One program's walk: chunks of time, inside each the states one after another (numbered),
    each a scan along the chunk; carries (red) go from a chunk's last step to the next chunk through
    memory; every state adds C h into the chunk's y (green)."""
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for c in range(chunks):
        x0 = c * (chunk_len + 1.5)
        for n in range(dstate):
            for s in range(chunk_len):
                ax.add_patch(Rectangle((x0 + s, n), 0.9, 0.9, color=COLORS["h"], alpha=0.3 + 0.2 * n))
            ax.text(x0 - 0.15, n + 0.45, f"{c * dstate + n + 1}", ha="right", va="center", fontsize=7)
        ax.annotate("", xy=(x0 + chunk_len - 0.1, -0.4), xytext=(x0, -0.4),
                    arrowprops=dict(arrowstyle="->", color=COLORS["h"]))
        ax.text(x0 + chunk_len / 2, -1.0, f"chunk {c}: one scan per state", ha="center", fontsize=8, color=COLORS["h"])
        for s in range(chunk_len):
            ax.add_patch(Rectangle((x0 + s, dstate + 0.5), 0.9, 0.9, color=COLORS["y"], alpha=0.6))
        if c + 1 < chunks:
            for n in range(dstate):
                ax.add_patch(FancyArrowPatch((x0 + chunk_len - 0.1, n + 0.45), (x0 + chunk_len + 1.3, n + 0.45),
                                             arrowstyle="->", color=COLORS["carry"], mutation_scale=8))
    for n in range(dstate):
        ax.text(-0.8, n + 0.45, f"state n = {n}", ha="right", va="center", fontsize=8)
    ax.text(-0.8, dstate + 0.95, "y (sum over n of C h)", ha="right", va="center", fontsize=8, color=COLORS["y"])
    ax.set_xlim(-5, chunks * (chunk_len + 1.5))
    ax.set_ylim(-1.4, dstate + 1.8)
    ax.axis("off")
    ax.set_title("one program (one channel): chunks in order, states in order (numbers), carries through memory (red)")


draw_state_loop()
plt.show()

# %% [markdown]
# The numbers give the order of the work: all states of chunk 0, then all states of chunk 1, and so on. Inside a scan, every step of the chunk is computed in parallel; the red carries are the only dependence from one chunk to the next, and each state's row adds into the same row of outputs.
#
# The forward kernel, from `mamba_annotated/scan/selective.py`, in two parts. In the kernel's names, `u` is the input $x$ (mamba_ssm's name) and `x` is the discretized input $b = \Delta B x$. First the setup: which channels and group the program owns, where its two carry buffers are, and the bias and skip $D$ that stay in registers for the whole walk.

# %%
show_fragment(selective_scan_fwd_kernel, "def selective_scan_fwd_kernel(", "for n in range(dstate):")

# %% [markdown]
# That fragment ends inside the walk over chunks: each chunk loads its inputs along time (the step sizes get their bias and softplus in `load_delta`, which also sets $\Delta = 0$ past the end), starts $y$ at $D x$, picks the carry buffer to read and the one to write, and waits at the barrier. The heart of it is the loop over states, steps 2.1 to 2.4 of the list above: `decay` and `x` are the `BLOCK_D × BLOCK_L` tiles of $a$ and $b$; the scan returns $\prod a$ and the state started from zero; adding the decayed carry (zero in the first chunk: the masked load) gives $h$; $C h$ adds into $y$; the last column is stored as the next carry, and, for training, the backward chunks' start states are stored. After the loop, the gate and the store of $y$.

# %%
show_fragment(selective_scan_fwd_kernel, "for n in range(dstate):")

# %% [markdown]
# `selective_scan` validates its inputs, makes them contiguous and launches it. The next cell checks it against the float64 reference with every option on (bias, softplus, $D$, $z$) and the last state, on a length that is not a multiple of the chunk, in every input dtype (float32 accumulation inside; the output is rounded once to the input dtype). The last state is returned in float32 whatever the input dtype, so its error stays near $10^{-7}$ in every row:

# %%
def make_inputs(batch, dim, dstate, length, dtype=torch.float32, groups=None):
    bc_shape = (batch, dstate, length) if groups is None else (batch, groups, dstate, length)
    return dict(
        u=randn(batch, dim, length, dtype=dtype),
        delta=randn(batch, dim, length, dtype=dtype, scale=0.5),    # raw: softplus makes it a step size
        A=-uniform(dim, dstate, low=0.2, high=2.0),
        B=randn(*bc_shape, dtype=dtype),
        C=randn(*bc_shape, dtype=dtype),
        D=randn(dim),
        z=randn(batch, dim, length, dtype=dtype),
        delta_bias=randn(dim, scale=0.3),
    )


batch, dim, dstate = runtime.size(gpu=(4, 256, 16), cpu=(1, 4, 8))
length = runtime.size(gpu=2000, cpu=3 * FWD_BLOCK_L + 5)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    inputs = make_inputs(batch, dim, dstate, length, dtype)
    y, last_state = selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    y_ref, last_ref = selective_scan_ref(**inputs, delta_softplus=True, return_last_state=True)
    name = str(dtype).removeprefix("torch.")
    check(f"y, {name}", y, y_ref, tolerance(dtype))
    check(f"last state, {name}", last_state, last_ref, tolerance(dtype))

# %% [markdown]
# Edge cases: a single step, exactly one chunk, a state size that is not a power of two (the teaching kernel padded $N$ to a power of two; this one loops over the 5 states one by one and needs no padding), and groups (here 3 groups of 2 channels; a program's channels never straddle two groups):

# %%
cases = {
    "one step": make_inputs(2, 4, 4, 1),
    "exactly one chunk": make_inputs(1, 4, 4, FWD_BLOCK_L),
    "N = 5 (not a power of two)": make_inputs(1, 4, 5, 21),
    "3 groups of 2 channels": make_inputs(2, 6, 4, 19, groups=3),
}
for name, inputs in cases.items():
    check(name, selective_scan(**inputs, delta_softplus=True), selective_scan_ref(**inputs, delta_softplus=True),
          tolerance(torch.float32))

# %% [markdown]
# ## The backward pass
#
# Let $g^y_t = \partial \mathcal{J} / \partial y_t$ be the gradient arriving at the output, and $g_t = g^y_t \operatorname{silu}(z_t)$ the part of it that reaches $y^{\text{pre}}_t = C_t h_t + D x_t$, the output before the gate ($g_t = g^y_t$ without a gate). The state $h_t$ influences the loss through $y_t$ and through $h_{t+1} = a_{t+1} h_t + b_{t+1}$, so the adjoint $\lambda_t = \partial \mathcal{J} / \partial h_t$ satisfies
#
# $$
# \begin{aligned}
# \lambda_t &= g_t\, C_t + a_{t+1}\, \lambda_{t+1}, \\
# \lambda_{L-1} &= g_{L-1} C_{L-1} + g^{\text{last}},
# \end{aligned}
# $$
#
# the same first-order recurrence run from the end, with the decays shifted by one step (chapter 2); $g_t C_t$ plays the part of chapter 1's $g_t$, the gradient arriving at $h_t$ from above, and $g^{\text{last}}$ is the gradient of the returned last state, if it is used. (A note on the name: in chapter 1 the state was one number and $g_t$ was the gradient arriving at it; here $g_t$ arrives at the scalar $y^{\text{pre}}_t$, and what reaches the state vector $h_t$ is $g_t C_t$, since $\partial y^{\text{pre}}_t / \partial h_t = C_t$.) The kernel gets $a_{t+1}$ by loading $\Delta$ one step ahead, and runs the adjoint as `tl.associative_scan(..., reverse=True)` inside a chunk, with a carry from the chunk after it. For a chunk of steps $t_0, \dots, t_1 - 1$ the reverse scan over the pairs $(a_{t+1}, g_t C_t)$ returns $\lambda^{\text{local}}_t$, the adjoint as if $\lambda_{t_1}$ were 0, and the products $\prod_{t < s \le t_1} a_s$; the true adjoint is $\lambda_t = \lambda^{\text{local}}_t + \big(\prod_{t < s \le t_1} a_s\big)\lambda_{t_1}$, the mirror image of the forward kernel's carry. So the carry handed to the earlier chunk is $\lambda_{t_0}$, the chunk's first column: the adjoint itself, not section 4.4's $\mu = a\lambda$, because the linking decay $a_{t_0}$ is already in the earlier chunk's products, from $\Delta$ loaded one step ahead. In the last chunk the carry is $g^{\text{last}}$ (zero when the last state is unused), and past the end $a = 1$. Then, per element,
#
# $$
# \frac{\partial \mathcal{J}}{\partial b_t} = \lambda_t, \qquad
# \frac{\partial \mathcal{J}}{\partial a_t}\, a_t = \lambda_t\, a_t h_{t-1},
# $$
#
# and the chain rule through $b = \Delta B x$ and $a = e^{\Delta A}$ gives every input. Why the product with $a_t$: from $h_t = a_t h_{t-1} + b_t$, $\partial\mathcal J/\partial b_t = \lambda_t$ and $\partial\mathcal J/\partial a_t = \lambda_t h_{t-1}$ (chapter 1), and the inputs reach $a_t = e^{\Delta_t A}$ through the exponent, whose derivative is $a_t$ itself: $\partial a_t/\partial\Delta_t = A\,a_t$ and $\partial a_t/\partial A = \Delta_t\,a_t$. So only $\lambda_t\, a_t h_{t-1}$, the adjoint times the decayed previous state, is needed. $x_t$ and $\Delta_t$ are shared by a channel's $N$ states, so their gradients sum over $n$; $B_t$ and $C_t$ by a group's channels, so theirs sum over $d$; $A$, $D$ and $\beta$ do not depend on $t$, so theirs sum over $t$ and the batch ($\partial v$ stands for $\partial \mathcal{J} / \partial v$ for any variable $v$; $A$ and $D$ belong to channel $d$, whose index is dropped except where a sum runs over it):
#
# $$
# \begin{aligned}
# \partial x_t &= \Delta_t \sum_n \lambda_{nt} B_{nt} + D\, g_t, \\
# \partial \Delta_t &= x_t \sum_n \lambda_{nt} B_{nt} \\
# &\quad + \sum_n A_n \lambda_{nt}\, a_{nt} h_{n,t-1}, \\
# \partial A_n &= \sum_{\text{batch}, t} \Delta_t \lambda_{nt}\, a_{nt} h_{n,t-1},
# \end{aligned}
# $$
#
# $$
# \begin{aligned}
# \partial B_{nt} &= \sum_{d \in \text{group}} \lambda_{dnt}\, \Delta_{dt} x_{dt}, \\
# \partial C_{nt} &= \sum_{d \in \text{group}} g_{dt}\, h_{dnt}, \\
# \partial D &= \sum_{\text{batch},t} g_t x_t, \\
# \partial z_t &= g^y_t\, y^{\text{pre}}_t\, \operatorname{silu}'(z_t),
# \end{aligned}
# $$
#
# and, with `delta_softplus`, through the softplus, $\partial \Delta^{\text{raw}} = \partial \Delta \cdot \sigma(\Delta^{\text{raw}} + \beta)$ (without it, $\partial \Delta^{\text{raw}} = \partial \Delta$), summed over batch and time for $\beta$ (`delta_bias`).
#
# The backward kernel needs every state $h_t$, but the forward pass stores only a few: all of them would take `(batch, dim, N, L)` float32, 4.3 GB at Mamba's sizes. Instead, when gradients are needed, the forward pass saves the state at the start of every backward chunk of 64 steps, `(batch, ⌈L / 64⌉, dim, N)` float32, 64 times fewer numbers, and the backward kernel, walking chunks from the last, recomputes each chunk's states from its saved start. Its chunks are shorter than the forward's 1024 steps because the backward keeps many more tiles alive at once; the sweep in the speed section chose 64. Like the forward kernel it loops over the states inside each chunk, so its tiles are `BLOCK_D × BLOCK_L` too, and the adjoint's carry from one chunk to the earlier one goes through two alternating buffers, as the forward kernel's carries do.
#
# What it recomputes is not $h_t$ but the decayed previous state $p_t = a_t h_{t-1}$, because that is what $\partial\Delta$ and $\partial A$ need at step $t$ (the listing calls it `decayed_prev`). Scanning $h$, as the forward kernel does, would leave $h_{t-1}$ one position along the tile, in another {term}`lane` and often another thread, and the kernel does not shift tiles along time. Since $h_{t-1} = a_{t-1} h_{t-2} + b_{t-1} = p_{t-1} + b_{t-1}$, multiplying by $a_t$ gives $p_t = a_t\, p_{t-1} + a_t b_{t-1}$: a first-order scan over the pairs $(a_t, a_t b_{t-1})$, with $b_{t-1}$ formed from $x$, $\Delta$ and $B$ loaded one step behind. In a chunk starting at $t_0$ the kernel scans these pairs from zero, with $b_{t_0 - 1}$ set to 0 (the loads one step behind are masked at the chunk's first step, since the saved state $h_{t_0 - 1}$ already holds it), then adds the saved state as the forward kernel adds its carry: $p_t = p^{\text{local}}_t + \big(\prod_{t_0 \le s \le t} a_s\big) h_{t_0 - 1}$, which at $t = t_0$ is $a_{t_0} h_{t_0 - 1}$, as it should be. Then $h_t = p_t + b_t$, which $\partial C$ and $\partial z$ need, costs one addition. Scanning $h$ and forming $p_t = h_t - b_t$ would save the loads one step behind, but it cancels when the decays are small, because $b_t$ is then nearly all of $h_t$ (the module's docstring records that $\partial A$ lost three digits this way at decays near $e^{-9}$).
#
# $\partial B$ and $\partial C$ are sums over the channels of a group, which many programs hold: each program writes its own partial sum and a second, small kernel adds them up in a fixed order (casting to $B$'s dtype as it stores), so there are no {term}`atomics <atomic add>` and the gradients are deterministic.
#
# The kernel in four parts. The setup is the forward kernel's, plus the adjoint's carry buffers, this program's slice of the $\partial B$, $\partial C$ partial sums (`part_base`) and the registers that sum $\partial A$, $\partial D$ and $\partial\beta$ over time. $\partial A$ has a column per state; the loop over states fills column $n$ with `tl.where`, which picks an element by comparison where indexing by a loop variable is not allowed:

# %%
show_fragment(selective_scan_bwd_kernel, "def selective_scan_bwd_kernel(", "chunks = tl.cdiv(length, BLOCK_L)")

# %% [markdown]
# Chunks are walked from the last. Each loads what every state shares: $x$ and $\Delta$, $\Delta$ one step ahead (for $a_{t+1}$), $x$ and $\Delta$ one step behind (for $b_{t-1}$; inside the loop over states, $B$ one step behind too), and the gradient arriving at the output. Section 4.4 avoided such loads one step off, which lose the {term}`vector loads <vector load>`, by scanning triples; this kernel keeps them. They read what the aligned loads have just read, so they mostly come from the cache, and the kernel runs far above its memory floor; what they cost has not been measured. The gate: with $z$, the gradient reaching $C h + D x$ is $g_t = g^y_t \operatorname{silu}(z_t)$, and $\partial z$ needs $y^{\text{pre}}$, the output before the gate, which the loop over states sums up as it recomputes them. Only the tiles the loop over states needs stay in registers: $x$ and $\Delta^{\text{raw}}$ are loaded again after the loop, and of $z$ only one tile stays, $g^y_t \operatorname{silu}'(z_t)$ (`grad_gate`), because tiles that live through the whole loop compete for the registers its work needs:

# %%
show_fragment(selective_scan_bwd_kernel, "chunks = tl.cdiv(length, BLOCK_L)", "for n in range(dstate):")

# %% [markdown]
# For each state $n$, the recomputation: $a_t h_{t-1}$ (`decayed_prev`) by a scan from the chunk's stored start state, then $h_t$, and, with a gate, $C h$ added into $y^{\text{pre}}$ for $\partial z$. (In the listing's comments `g_t` is $p_t$, the decayed previous state, not this section's $g_t$, and `x` is $b$. In the code, after the gate's lines `grad_y` holds $g_t$, not $g^y_t$; `y` is $y^{\text{pre}}$; and `delta_raw` already includes the bias $\beta$.)

# %%
show_fragment(selective_scan_bwd_kernel, "for n in range(dstate):", "# the adjoint: reverse scan")

# %% [markdown]
# The adjoint and the gradients. The reverse scan is `tl.associative_scan(..., reverse=True)`. (Section 4.7.1 replaced it by tiles of rows because in 16-bit it held the linear scan's backward near 60 % of its floor, against 94 % with row tiles. Here it stays, for two reasons. The linear scan does one multiply-add per element and runs at the {term}`memory floor`, so any extra work per element shows; the selective scan's backward does, per state and element, two exponentials, two scans and about twenty multiply-adds, and runs many times above its floor (the speed section below), so the reverse scan's extra {term}`shuffles <shuffle>` are a small share of it. And the axis is short: chunks of 64 steps on a GPU, so the reverse scan has six rounds. We have not measured its share; the row-tile trick of section 4.7.1 is the candidate if it ever matters.)
#
# After the scan the kernel does four things, in the listing's order:
#
# 1. `column` picks the adjoint's first column out of the tile (a masked sum along time, which keeps the tile where it is; a store masked to one column, as in the forward kernel, made the compiler move the whole tile between threads first) and stores it as the earlier chunk's carry;
# 2. it adds $\lambda B_n$ into `lam_B` (the $\sum_n \lambda B$ that $\partial x$ and $\partial \Delta$ need) and $\lambda\, a h_{t-1} A_n$ into $\partial\Delta$;
# 3. it fills column $n$ of $\partial A$ with `tl.where`;
# 4. it writes this program's partial sums of $\partial B_n$ and $\partial C_n$ over its channels.
#
# After the loop over states, $\partial z$, $\partial x$ and $\partial \Delta$ are formed and stored:

# %%
show_fragment(selective_scan_bwd_kernel, "# the adjoint: reverse scan")

# %% [markdown]
# The next cell checks every gradient against float64 autograd through the reference loop, with a random upstream gradient, on a length that crosses several backward chunks (`BLOCK_L` is 16 steps in the {term}`interpreter`, 64 on a GPU), and once more through the last state. On a GPU the length, 1500, crosses the boundary between the first two forward chunks (1024 steps each) and spans 24 backward chunks of 64 steps, the last one partial; `test_every_block_size_the_sweeps_may_pick` in `tests/test_selective_scan.py` crosses forward chunks with shorter ones too. $A$, $D$ and the bias are float32 parameters, and so are their gradients: only the gradients of the 16-bit inputs are rounded, which is why those rows show errors near $10^{-3}$ and the others near $10^{-7}$:

# %%
def check_gradients(label, inputs, dtype, use_last_state=False):
    def run(scan, **kw):
        y, last = scan(**kw, delta_softplus=True, return_last_state=True)
        return torch.cat([y.flatten().double(), last.flatten().double()]) if use_last_state else y
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    out = run(selective_scan, **leaves)
    grad_out = randn(*out.shape, dtype=out.dtype).double()  # the same upstream values for both
    got = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    want = torch.autograd.grad(run(selective_scan_ref, **ref_leaves), list(ref_leaves.values()), grad_out)
    for name, g, w in zip(leaves, got, want):
        check(f"{label}: grad {name}", g, w, tolerance(dtype))


grad_length = runtime.size(gpu=1500, cpu=2 * BWD_BLOCK_L + 3)
check_gradients("float32", make_inputs(2, 4, 4, grad_length), torch.float32)
check_gradients("bfloat16", make_inputs(1, 4, 4, grad_length, torch.bfloat16), torch.bfloat16)
check_gradients("through the last state", make_inputs(1, 4, 4, grad_length), torch.float32, use_last_state=True)

# %% [markdown]
# ## Speed
#
# **The floor.** At Mamba's sizes (batch 8, dim 2048, $N$ = 16, $L$ = 4096, bfloat16) the forward pass must read $x$, $\Delta$ and write $y$ (3 × 134 MB; $B$, $C$ are small), about 0.1 ms at the copy bandwidth of an H200. But it must also evaluate $\text{batch} \cdot \text{dim} \cdot N \cdot L \approx 1.07 \cdot 10^9$ exponentials, and the {term}`special-function units <special-function unit>`, which compute them, deliver 16 per clock per {term}`SM`: $1.07 \cdot 10^9 / (16 \cdot 132 \cdot 1.98\,\text{GHz}) = 0.26$ ms. The float32 multiply-adds run eight times faster, 128 per clock per SM, so the three per element that any kernel must do ($b$, the update $a h + b$, $C h$) take 0.10 ms. Memory, the special-function units and the multiply-add units work in parallel, so the floor is the largest of the three times, not their sum: the selective scan is bound by exponentials, not bytes. The backward pass needs at least one exponential per element again, so the floor of both passes together is 0.51 ms. This *exponential floor* is what "% of the floor" means in this section, not the memory floor of sections 4.1–4.8.
#
# **The peers**, timed in one run by `benchmarks/bench_selective_scan.py`: mamba_ssm's compiled CUDA kernel `selective_scan_fn` {cite}`repo_mamba` (what Mamba-1 users run; `benchmarks/build_selective_scan_cuda.py` builds it), mamba.py's parallel scan {cite}`repo_mambapy` (`mambapy.pscan.pscan` fed the materialized $a = e^{\Delta A}$ and $b = \Delta B x$ in its layout `(batch, L, dim, N)`, then the $C$ contraction, exactly as its `selective_scan` does) and mamba_ssm's PyTorch reference {cite}`repo_mamba` (a Python loop over time; its backward ran once, not repeated). The cell below prints and plots the stored run. `ms` is the median time (for the PyTorch loop's backward, a single run); `pct_of_floor` is the floor's time over the measured time, in percent, against the exponential floor above (0.26 ms forward, 0.51 ms forward and backward), not the memory floor that this column meant in sections 4.1–4.8; `speedup_vs_mambapy` is mamba.py's time over the row's, for the same passes. The bars are on a log scale, and the dashed line, "floor (exp units)", is the exponential floor: the time the special-function units need for the exponentials alone.

# %% tags=["nbval-ignore-output"]
stored = pathlib.Path("data/selective_scan_bench.json")
if stored.exists():
    result = json.loads(stored.read_text())
    print(f"stored run: {result['device']}, batch {result['batch']}, dim {result['dim']}, N {result['dstate']}, "
          f"L {result['length']}, {result['dtype']} inputs")
    print_table([{k: r[k] for k in ("implementation", "passes", "ms", "pct_of_floor", "speedup_vs_mambapy")}
                 for r in result["rows"]])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    colors = {"selective_scan (ours)": COLORS["y"], "mamba_ssm selective_scan_cuda": COLORS["h"],
              "mamba.py pscan": COLORS["x"], "mamba_ssm selective_scan_ref": COLORS["decay"]}
    for ax, passes in zip(axes, ("forward", "forward+backward")):
        rows = [r for r in result["rows"] if r["passes"] == passes]
        ax.bar([r["implementation"].replace(" ", "\n", 1) for r in rows], [r["ms"] for r in rows],
               color=[colors[r["implementation"]] for r in rows])
        ax.axhline(result["floors"][passes]["floor_ms"], color="black", ls="--", label="floor (exp units)")
        ax.set_yscale("log")
        ax.set(title=f"{passes} ({result['device']})", ylabel="median time (ms), log scale")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize="small")
    plt.tight_layout()
    plt.show()
else:
    print("no stored benchmark run (run benchmarks/bench_selective_scan.py --json book/data/selective_scan_bench.json)")

# %% [markdown]
# In the stored H200 run (on one GPU of a two-GPU host whose other GPU ran the bidirectional benchmark of chapter 6 meanwhile; with $D$; without $z$, the bias or the softplus) the forward kernel takes 1.10 ms against 1.04 ms for mamba_ssm's CUDA kernel (0.94× its speed), 41× faster than mamba.py and far ahead of the PyTorch loop; the backward of mamba_ssm's loop is slowest, probably because autograd writes a full-size gradient of the `(batch, dim, L, N)` tensors for every time-step slice it reads. Both compiled kernels take about four times the exponential floor: ours reaches 23 % of the speed the floor allows, the CUDA kernel 25 %. Looping over the states was what closed the gap: the 3-d-tile version of this kernel took 5.2 ms here (a development run, not stored). `benchmarks/bench_selective_scan_cuda.py` times more cases against the CUDA kernel (`book/data/selective_scan_cuda_bench.json`): in bfloat16 ours is at 0.91–0.98× of it forward, in float32 1.3–1.5× faster. We have not profiled where the remaining three quarters of the forward's time goes. Plain arithmetic is one candidate: beside the exponential, every element costs about eight multiply-adds (the decay's argument, $b$, about three in the scan, the carry, $C h$), not the three the floor counts, and an SM does eight multiply-adds in the time of one exponential, so those eight alone take about as long as the exponential floor, 0.26 ms. They add time only insofar as they fail to overlap the exponentials, and would still explain at most a third of the gap. Every state of every chunk also pays the scan's rounds between threads.
#
# Forward+backward is where the CUDA kernel still leads. In the stored run ours takes 8.1 ms and the CUDA kernel 5.5 ms (6 % and 9 % of the floor); over the cases of `bench_selective_scan_cuda.py` ours runs at 0.63–0.70× the CUDA kernel's speed in bfloat16 and 0.77–0.87× in float32. The backward kernel moved to the same loop over states as the forward kernel, which, with the forward's own move, halved forward and backward together (16 ms with the 3-d tiles, a development run, not stored, against 8.1 ms). Its block sizes come from `benchmarks/sweep_selective_scan.py --backward` (`book/data/selective_scan_backward_sweep.json`): 16 channels and 64 steps per program over 2 warps had the best worst case. Larger tiles were slower, not faster. A profile of this configuration (Nsight Compute, H200, not stored in `book/data`, taken just before the adjoint's carry moved to `column`, a change that left the time as it was) shows why the kernel is far from its floor: every thread at the limit of 255 registers, with some {term}`spilled <spill>`, so only four programs of two {term}`warps <warp>` fit on a multiprocessor (12.5% {term}`occupancy`); and the L1 and shared-memory pipe busier (70%) than the arithmetic units (51%), most of it shared-memory traffic between threads. Each state also costs the backward two exponentials and two scans per element where the forward pays one of each: $a_{t+1}$ is computed again from $\Delta$ loaded one step ahead. By the same count as the forward's, its twenty or so multiply-adds per element take about 0.64 ms on their own, more than the time of its own two exponentials per element, 2 × 0.26 = 0.51 ms (by coincidence the two-pass floor above, which counts one exponential per element and pass). mamba_ssm's CUDA kernel computes each exponential once and hands $a_{t+1}$ to the neighbouring thread through shared memory. The same here, the decay tile shifted one step along time with `tl.gather`, passes the tests but needs more registers than the kernel has: compiled for the H200 without running it (`scripts/compile_offline.py selective`, Triton 3.6, `book/data/selective_gather_compile.json`), it spills 600 bytes per thread with $D$, $z$, the bias and softplus, where the kernel as it is spills 184, so it was not timed. The other way round, fewer live registers: forming the gate's factor for $dz$ after the loop over states, from $z$ and the output gradient loaded a second time, so that no gate tile lives through the loop, spills 152 bytes instead of 184, and gives the same bits; timed on an H200 it made forward and backward through autograd slower at the Mamba-130M training shape with $D$, $z$, the bias and softplus, in each of three rounds (0.3 to 0.45 %; medians 6.85 against 6.82 ms, `book/data/selective_late_gate_ab.json`), so the 32 bytes of spills it saves are worth less than its second loads cost.
#
# A different comparison, timed on this machine: the fused kernel against the naive way built from this chapter's own pieces, which materializes $a$ and $b$ as `(batch, dim, N, L)` float32 tensors and calls `linear_scan`. On a GPU it uses the stored run's size; on a CPU, a tiny one:

# %% tags=["nbval-ignore-output"]
def materialized_selective_scan(u, delta, A, B, C, D):
    """Discretize in PyTorch, scan with linear_scan, contract with C: N times the bytes of the fused kernel."""
    a = torch.exp(delta.float()[:, :, None, :] * A[None, :, :, None])
    x = (delta.float() * u.float())[:, :, None, :] * B.float()[:, None, :, :]
    h = linear_scan(a, x)
    return ((h * C.float()[:, None, :, :]).sum(2) + D[:, None] * u.float()).to(u.dtype)


sizes = runtime.size(gpu=(8, 2048, 16, 4096), cpu=(1, 8, 16, 64))
inputs = dict(u=randn(*sizes[:2], sizes[3], dtype=torch.bfloat16),
              delta=uniform(*sizes[:2], sizes[3], low=0.01, high=0.2, dtype=torch.bfloat16),
              A=-uniform(sizes[1], sizes[2], low=0.5, high=16.0),
              B=randn(sizes[0], sizes[2], sizes[3], dtype=torch.bfloat16),
              C=randn(sizes[0], sizes[2], sizes[3], dtype=torch.bfloat16),
              D=randn(sizes[1]))
grad_y = randn(*sizes[:2], sizes[3], dtype=torch.bfloat16)
timing_rows = []
for name, fn in [("selective_scan (fused)", selective_scan), ("materialized + linear_scan", materialized_selective_scan)]:
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    with torch.no_grad():
        forward_ms = median_ms(lambda: fn(**leaves))
    both_ms = median_ms(lambda: torch.autograd.grad(fn(**leaves), list(leaves.values()), grad_y))
    timing_rows.append(dict(implementation=name, forward_ms=forward_ms, forward_backward_ms=both_ms))
print(f"device: {runtime.device_name()}; batch, dim, N, L = {sizes}, bfloat16")
print_table(timing_rows)

# %% [markdown]
# Fusion pays even this far from the floor: in the H200 run above the fused kernel is 15 times faster forward (1.12 against 16.9 ms) and 6 times faster forward and backward (8.12 against 52.1 ms). The difference is the traffic of the $N$-times larger tensors: the materialized forward alone writes or reads a 4.3 GB float32 tensor about ten times (forming the decay's argument, the exponential, $b$, the scan, the product with $C$ and the sum), about 43 GB, or 10 ms at the copy bandwidth.

# %% [markdown]
# ## What we have, and what comes next
#
# The selective scan is the first-order scan of sections 4.1–4.8 with the inputs computed on chip. A first kernel walked time step by step, one channel per program; the production kernel keeps its fusion and scans chunks in parallel: per chunk and per state, the kernel forms $a = e^{\Delta A}$ and $b = \Delta B x$ for `BLOCK_D × BLOCK_L` elements, scans them, adds the carry, adds $C h$ into $y$ and moves on, so the `(batch, dim, N, L)` tensors of the naive version never exist, and the tiles stay two-dimensional, which brought the forward pass to about the speed of mamba_ssm's CUDA kernel. The backward pass is the reverse scan of the adjoint, with the states recomputed from stored chunk starts and every gradient — $x, \Delta, A, B, C, D, z$ and the bias — checked against float64.
#
# The state update is elementwise in $n$, which is why the work is exponentials and scalar multiply-adds that {term}`tensor cores <tensor core>` cannot help with. [Chapter 5](05_ssd.ipynb), Mamba-2's {term}`state-space duality <SSD>` {cite}`dao2024transformers`, changes the model so that they can: channels are grouped into *heads* that share $\Delta_t$, $B_t$ and $C_t$, $A$ becomes one scalar per head, so the decay between two steps of a chunk is the same for every state, and the chunk's input–output map becomes a masked, decayed matrix product $(C B^\top \odot \text{decay}) X$, with $X$ the chunk's inputs: a matmul. The chunks are still linked by carries of states, as here.
#
# **Exercise 4.9.** Make the model time-invariant: $\Delta_t = \Delta$, $B_t = B$ and $C_t = C$ constant in time, the linear time-invariant setting of S4 {cite}`gu2022efficiently` (here with Mamba's $\bar B = \Delta B$). Show that then $y = K * x$, a causal convolution with the kernel $K_k = \sum_n C_n\, e^{k \Delta A_n}\, \Delta B_n$, and compute $K$ (the stub below; the checker compares it with the float64 reference scan's response to a unit impulse, which is $K$ itself). Why does this stop working as soon as $\Delta$, $B$ or $C$ depend on $t$ — and what did Mamba buy, and give up, by making them depend on the input?
#
# ```{admonition} Answer (click to show)
# :class: dropdown
# Fix a channel $d$ and drop its index. With $\Delta$, $B$, $C$ constant, every step of state $n$ has the same decay $e^{\Delta A_n}$ and input $\Delta B_n x_t$, so from $h_{-1} = 0$
#
# $$
# \begin{aligned}
# h_{nt} &= \sum_{s \le t} e^{(t-s)\Delta A_n}\, \Delta B_n\, x_s, \\
# y_t &= \sum_n C_n h_{nt} = \sum_{s \le t} K_{t-s}\, x_s, \\
# K_k &= \sum_n C_n\, e^{k \Delta A_n}\, \Delta B_n
# \end{aligned}
# $$
#
# (plus $D x_t$, which adds $D$ to $K_0$). Fed a unit impulse at $t = 0$, the scan returns $y_t = K_t$: that is what the checker compares with. `test_exercise_time_invariant_scan_is_a_convolution` in `tests/test_selective_scan.py` also convolves a random input with $K$ and compares it with `selective_scan` itself.
#
# With $\Delta_t$, $B_t$ or $C_t$ varying, the weight of $x_s$ in $y_t$ is $C_t \cdot \big(\prod_{s < r \le t} a_r\big) \Delta_s B_s$: it depends on $s$ and $t$ separately, not on $t - s$ alone, so there is no single kernel $K$ and no convolution. Mamba bought selection: per token, the model decides what to keep and what to forget. It gave up the convolution view, in which one precomputed $K$ and an FFT process a whole sequence in $O(L \log L)$, and needs a scan such as this section's instead.
# ```
#
# Write `convolution_kernel(delta, A, B, C, length)`: $K$ as a `(dim, L)` tensor, for `delta` `(dim,)`, `A` `(dim, N)` and `B`, `C` `(N,)`, all float32. Replace the `raise` and run the cell:

# %%
from mamba_annotated.exercises import check as check_exercise


def convolution_kernel(delta, A, B, C, length):
    raise NotImplementedError  # your code here


attempted = check_exercise("4.9", convolution_kernel)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
def convolution_kernel(delta, A, B, C, length):
    k = torch.arange(length, dtype=torch.float64, device=delta.device)
    decay = torch.exp(k * (delta.double()[:, None] * A.double())[..., None])       # (dim, N, L)
    return (C.double()[None, :, None] * decay * (delta.double()[:, None] * B.double())[..., None]).sum(1)


assert check_exercise("4.9", convolution_kernel)
