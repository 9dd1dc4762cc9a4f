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
# # Blocked scans with carries
#
# In this chapter you will learn:
#
# - how to scan sequences longer than one {term}`block`: three phases (reduce blocks, scan their totals, re-scan with {term}`carries <carry>`) or one {term}`program` walking its blocks with a running carry — and when each wins;
# - how the same two kernels, run in {term}`adjoint` mode, give the backward pass for any length, either direction and an initial state;
# - how `linear_scan`, the book's fast default, compares with accelerated-scan and with the {term}`memory floor`.
#
# It builds on [chapter 2](02_associative_scan.ipynb) (one `tl.associative_scan` over the pairs $(a, b)$ per block, and the backward pass as the reverse scan over $(a_{t+1}, g_t)$) and [chapter 3](03_packing.ipynb) (which kept the tuple scan as the building block).
#
# ```{admonition} Notation (as in chapter 2)
# | symbol | meaning |
# |---|---|
# | $t$, $L$ | time step, sequence length (one row) |
# | $a_t$, $b_t$, $h_t$ | decay, input and state of step $t$; $h_{-1}$ the initial state (`h0`) |
# | $k$, $c_k$ | block index, the carry: the state entering block $k$ |
# | $\pi_t$, $\tilde h_t$ | inside a block: the running product of its decays, the state reached from $h = 0$ |
# | $(a^{(k)}, b^{(k)})$ | the total map of block $k$: one step of the same kind |
# | $g_t$, $\lambda_t$, $\mu_t$ | the upstream gradient, the adjoint $d\mathcal J/dh_t$, and $\mu_t = a_t \lambda_t$ |
# | $(\alpha, p, q)$ | a run of steps in the backward scan (defined in the backward section) |
# ```

# %%
import importlib
import json
import pathlib

import matplotlib.pyplot as plt
import torch

from mamba_annotated import runtime, sequential_scan
from mamba_annotated.bench import gbps, median_ms, memory_floor_ms, print_table
from mamba_annotated.figures import COLORS, show_source
from mamba_annotated.scan import linear_scan
from mamba_annotated.scan.blocked import (scan_block, scan_rows_descending, adjoint_combine, chained_scan_kernel,
                                          linear_scan_backward, linear_scan_forward, plan, segment_totals_kernel)
from mamba_annotated.scan.reference import check_scan_gradients, linear_scan_ref
from mamba_annotated.testing import check, randn, seed_everything, tolerance, uniform

seed_everything(0)

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## Carries: what a block needs from the past
#
# Cut a row into blocks of a fixed number of steps. Inside block $k$, scan the block's pairs on their own, as chapter 2 scanned a whole row. At position $t$ the scan gives the pair $(\pi_t, \tilde h_t)$, which is the composed map $h \mapsto \pi_t h + \tilde h_t$ of the block's steps up to $t$: $\pi_t$ is the product of the block's decays only (chapter 2's ran from the row's start), and $\tilde h_t$ the state the block would reach from $h = 0$. The state that really enters the block, the **carry** $c_k$ (not chapter 2's $c_t$), is what this map is applied to, so it enters linearly:
#
# $$
# \begin{aligned}
# h_t &= \tilde h_t + \pi_t\, c_k, \\
# c_{k+1} &= h_{\text{last step of block } k}.
# \end{aligned}
# $$
#
# So each block needs one number from the past. There are two ways to provide it.
#
# **(a) Three phases.** (1) Reduce every block to its total map $(a^{(k)}, b^{(k)})$, the $(\pi_t, \tilde h_t)$ of its last step, all blocks in parallel. (2) Scan the totals: they form a recurrence of their own, $c_{k+1} = a^{(k)} c_k + b^{(k)}$ with $c_0 = h_{-1}$, one step per block. (3) Re-scan every block in parallel with its carry. Every block runs on its own program, so even a single long row is spread over many {term}`SMs <SM>`; the price is reading $a$ and $b$ twice, and three launches instead of one.
#
# **(b) Chained walk.** One program owns a row and walks its blocks in order, keeping the carry in a {term}`register <registers>`: scan block $k$, add $\pi_t c_k$, store, take the last state as $c_{k+1}$. $a$ and $b$ are read once; the blocks of one row are processed one after another, so parallelism comes from rows alone.
#
# The package uses both in one kernel family: a row is cut into {term}`segments <segment>` of consecutive blocks; one program walks one segment (b), and when there is more than one segment per row, phases 1 and 2 supply each segment's carry (a). With many rows (Mamba's `batch × channels`) each row is one segment; with few long rows, the rows are split.

# %%
def draw_blocks(ax, n_blocks, title, arrows, phase_labels):
    for k in range(n_blocks):
        ax.add_patch(plt.Rectangle((k, 0), 0.92, 0.6, color=COLORS["x"], alpha=0.3, ec="black"))
        ax.text(k + 0.46, 0.3, f"block {k}", ha="center", va="center", fontsize=9)
    for start, end, y, label in arrows:
        ax.annotate("", xy=(end, y), xytext=(start, y), arrowprops=dict(arrowstyle="->", color=COLORS["carry"], lw=1.6))
        if label:
            ax.text((start + end) / 2, y + 0.06, label, ha="center", fontsize=8, color=COLORS["carry"])
    for y, text in phase_labels:
        ax.text(-0.1, y, text, ha="right", va="center", fontsize=9)
    ax.set(xlim=(-2.6, n_blocks + 0.2), ylim=(-1.6, 1.1), title=title)
    ax.axis("off")


n_blocks = 6
fig, axes = plt.subplots(2, 1, figsize=(10, 5.5))
three_phase_arrows = [(k + 0.2, k + 0.75, -0.35, f"(a{k},b{k})") for k in range(n_blocks)]
three_phase_arrows += [(k + 0.75, k + 1.2, -0.8, f"c{k + 1}") for k in range(n_blocks - 1)]
three_phase_arrows += [(k + 0.2, k + 0.75, -1.25, "re-scan") for k in range(n_blocks)]
draw_blocks(axes[0], n_blocks, "(a) three phases: every block on its own program",
            three_phase_arrows, [(-0.35, "1: reduce blocks"), (-0.8, "2: scan totals"), (-1.25, "3: re-scan + carry")])
walk_arrows = [(k + 0.8, k + 1.1, 0.75, f"c{k + 1}") for k in range(n_blocks - 1)]
draw_blocks(axes[1], n_blocks, "(b) chained walk: one program per row, carry in a register",
            walk_arrows, [(0.3, "one program")])
plt.tight_layout()
plt.show()

# %% [markdown]
# In (a) only phase 2 is a chain, one step per block; in (b) the whole row is one chain of blocks, but the data is read once.

# %% [markdown]
# ## The kernels
#
# `chained_scan_kernel` walks the blocks of one (row, segment) in scan order. The carry is the state entering the segment: the initial state for the first segment, or, when phases 1 and 2 ran, the end state of the previous segment. Blocks are aligned at $t = 0$ and the last one is padded with the identity $(1, 0)$. With `DESCENDING` the kernel walks the blocks from the end, which serves both `reverse=True` and the backward pass. Inside a descending block it does not call `tl.associative_scan(..., reverse=True)`, which turned out to be slow; it lays the block out as a tile of 4 or 8 consecutive steps per thread instead, explained in "Scanning backwards without `reverse=True`" below. The last state in scan order is pulled out of the block with a masked sum (`_last_in_scan_order`): a Triton block cannot be indexed by position, so to read one element the kernel zeroes every other lane with `tl.where` and sums.
#
# Read the listing on the path with `ADJOINT` and `DESCENDING` false. The carry starts from the initial state (`HAS_INIT`) or from the previous segment's end state (`FROM_ENDS`, phase 3); each turn of the loop scans one block, adds $\pi_t$ times the carry, stores the states and keeps the last one as the next carry. The `ADJOINT` lines, and `HAS_H0`, serve the backward pass, below.

# %%
show_source(chained_scan_kernel)

# %% [markdown]
# Phase 1, `segment_totals_kernel`, walks a segment the same way but composes the blocks' total maps instead of storing states. Phase 2 needs no kernel of its own: the totals, a `(rows, segments)` array of maps, are a linear recurrence, so the chained kernel scans them (starting from the initial state $h_{-1}$, `h0`) into the segment end states.

# %%
show_source(segment_totals_kernel)

# %% [markdown]
# `plan` decides the segments. It keeps one per row when a row is at most four blocks long (cutting it would add two launches, which cost about as much as walking a few blocks) or when the rows alone reach its target of 8 programs per {term}`SM` (1056 on a GPU of 132 SMs); otherwise it cuts each row into as many segments as it takes to reach that target.

# %%
show_source(plan)

# %% [markdown]
# ## Checking it
#
# We check the forward pass on a length that is neither a multiple of the block nor a power of two, forcing each path: the planned one, the chained walk with many blocks, and three phases with 1 and 3 blocks per segment (the last segment short).

# %%
rows, length = runtime.size(gpu=(64, 100_000), cpu=(3, 300))
block = runtime.size(gpu=2048, cpu=32)
a = uniform(rows, length, low=0.6, high=1.0)
b = randn(rows, length)
h0 = randn(rows)
h = linear_scan_forward(a, b, h0)

# %%
ref = linear_scan_ref(a, b, h0)
check("forward, planned path", h, ref, tolerance(torch.float32))
for name, per_segment in [("chained walk", None), ("three phases, 1 block per segment", 1),
                          ("three phases, 3 blocks per segment", 3)]:
    check(f"forward, {name}", linear_scan_forward(a, b, h0, block=block, blocks_per_segment=per_segment or 10**9),
          ref, tolerance(torch.float32))

# %% [markdown]
# ## The backward pass: the same kernels in adjoint mode
#
# Chapter 2 showed that $\lambda_t = g_t + a_{t+1}\lambda_{t+1}$ is the recurrence over the pairs $(a_{t+1}, g_t)$, run from the end, and that $\partial\mathcal J/\partial b_t = \lambda_t$, $\partial\mathcal J/\partial a_t = \lambda_t h_{t-1}$, $\partial\mathcal J/\partial h_{-1} = a_0\lambda_0$. With `ADJOINT=True` the kernels scan in the direction opposite to the forward pass (from the end for the default direction, from the start for `reverse=True`) and write $\lambda$ straight into `grad_b`; the last phase also loads $h_{t-1}$ (or $h_{-1}$) and writes `grad_a` in the same pass. For `reverse=True` every "later" and "earlier" mirrors. Only $\partial\mathcal J/\partial h_{-1}$, one number per row, is left to PyTorch.
#
# Chapter 2's backward has two costs that the forward pass lacks: it loads $a$ one step off, and it scans with `reverse=True`. This section removes the first; "Scanning backwards without `reverse=True`", after the benchmarks, removes the second.
#
# The decay $a_{t+1}$ belongs to the step after $t$. Loading it one step off is a misaligned load: a thread's consecutive elements no longer start on a 16-byte boundary, so the compiler cannot use a {term}`vector load` and loads them one by one. So the kernels read $a_t$ where it lies and scan triples instead of pairs. (The backward's load of $h_{t-1}$ for the gradient of $a$ stays one step off; the triples remove the other misaligned load, that of $a$.) Write $\mu_t = a_t\lambda_t$, so that $\lambda_t = g_t + \mu_{t+1}$. A run of consecutive steps $s, \dots, u$ (the scan meets $u$ first and $s$, the one nearest the result, last) is the triple
#
# $$
# \begin{aligned}
# (\alpha, p, q) &= \Big(a_s,\;\; \prod_{i=s+1}^{u} a_i, \\
# &\qquad\;\; \sum_{r=s}^{u} \Big(\prod_{i=s+1}^{r} a_i\Big) g_r\Big), \\
# \lambda_s &= q + p\, \mu_{u+1} :
# \end{aligned}
# $$
#
# $q$ is the part of $\lambda_s$ that the run's own upstream gradients give, each decayed back to step $s$; $p$ carries in what lies beyond the run, through $\mu_{u+1}$; and the run keeps its own first decay $\alpha = a_s$ aside, unused, until it is joined to the run before it in time. A single step is $(a_t, 1, g_t)$.
#
# Join a run 1 of steps $s_1, \dots, u_1$, which the scan met first (later in time), to the run 2 of steps $s_2, \dots, u_2$ just before it, so that $u_2 + 1 = s_1$. Write $\mu$ for $\mu_{u_1 + 1}$, what lies beyond both. Run 1 gives $\lambda_{s_1} = q_1 + p_1 \mu$, hence $\mu_{s_1} = a_{s_1}\lambda_{s_1} = \alpha_1(q_1 + p_1\mu)$. Run 2 sees $\mu_{u_2+1} = \mu_{s_1}$, so
#
# $$
# \begin{aligned}
# \lambda_{s_2} &= q_2 + p_2\,\mu_{s_1} = q_2 + p_2\,\alpha_1 (q_1 + p_1 \mu) \\
# &= \big(q_2 + p_2\,\alpha_1 q_1\big) + \big(p_2\,\alpha_1 p_1\big)\,\mu ,
# \end{aligned}
# $$
#
# and the joined run, whose first step is $s_2$, is the triple
#
# $$
# \begin{aligned}
# &(\alpha_1, p_1, q_1) \bullet (\alpha_2, p_2, q_2) \\
# &\qquad = \big(\alpha_2,\;\; p_2\,\alpha_1 p_1,\;\; q_2 + p_2\,\alpha_1 q_1\big),
# \end{aligned}
# $$
#
# with chapter 2's convention for $\bullet$, now on these triples: the operand the scan meets first on the left. This is `adjoint_combine` below. The carry between blocks and segments is $\mu$, not $\lambda$. Inside a block the scan's result at position $t$ is the run from the block's first step in scan order (the one the scan met first) to $t$, so the kernel gets $\lambda_t = q + p\,c$ with $c$ the carry (the $\mu$ of the first step beyond the block), and hands on $a_t\lambda_t$ at the block's last step in scan order as the next carry. For phases 1 and 2 a whole block is one ordinary pair acting on that carry: the run's $\mu_s = \alpha\lambda_s = (\alpha p)\,\mu + \alpha q$, the pair $(\alpha p, \alpha q)$, which phase 1 composes and phase 2 scans with chapter 2's $\bullet$. (One could instead scan $\mu_t = a_t g_t + a_t \mu_{t+1}$ directly, an ordinary pair $(a_t, a_t g_t)$, and divide, $\lambda_t = \mu_t / a_t$; but that divides by zero wherever a decay is 0.)
#
# ```{admonition} Performance notes: the triples
# :class: dropdown
# On an H200 in bfloat16 the triples made the backward 8% faster than the shifted load of $a$; moving $a$ and $h$ one step in registers with `tl.gather` instead (through {term}`shared memory`) made it 30% slower.
# ```

# %%
show_source(adjoint_combine)

# %%
show_source(scan_block)

# %%
show_source(linear_scan_backward)

# %% [markdown]
# All gradients against autograd through the float64 loop, in both directions and on the three-phase path, with a random upstream gradient:

# %%
kernels = (linear_scan_forward, linear_scan_backward)
check_scan_gradients("planned, forward direction", *kernels, a, b, h0, reverse=False)
check_scan_gradients("planned, reverse direction", *kernels, a, b, h0, reverse=True)
check_scan_gradients("three phases, reverse", *kernels, a, b, h0, reverse=True, block=block, blocks_per_segment=2)

# %% [markdown]
# ## `linear_scan`: the public function
#
# `linear_scan(a, b, *, h0=None, reverse=False)` checks its inputs, flattens the leading dimensions into rows and runs the two launchers as one differentiable op (registered with `torch.library`, so `torch.compile` traces it). It takes float32, float16 and bfloat16 (accumulating in float32) and any length. This is the scan every later chapter uses.

# %%
x_shape = runtime.size(gpu=(2, 96, 3001), cpu=(2, 3, 77))
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    a_d = uniform(*x_shape, low=0.6, high=1.0, dtype=dtype).requires_grad_()
    b_d = randn(*x_shape, dtype=dtype).requires_grad_()
    h0_d = randn(*x_shape[:-1]).requires_grad_()
    name = str(dtype).removeprefix("torch.")
    for reverse in (False, True):
        h_d = linear_scan(a_d, b_d, h0=h0_d, reverse=reverse)
        check(f"linear_scan {name}, reverse={reverse}", h_d, linear_scan_ref(a_d, b_d, h0_d, reverse), tolerance(dtype))
    grad_h = randn(*x_shape, dtype=torch.float64)
    got = torch.autograd.grad(linear_scan(a_d, b_d, h0=h0_d), (a_d, b_d, h0_d), grad_h.to(dtype))
    leaves = [x.detach().double().requires_grad_() for x in (a_d, b_d, h0_d)]
    want = torch.autograd.grad(linear_scan_ref(*leaves), leaves, grad_h)
    for arg, g, w in zip(("a", "b", "h0"), got, want):
        check(f"linear_scan {name}: grad {arg}", g, w, tolerance(dtype))

# %% [markdown]
# Bad input is refused before anything launches, with the argument named:

# %%
for bad in [dict(a=a, b=b[:, :-1]), dict(a=a, b=b.half()), dict(a=a, b=b, h0=h0[:-1])]:
    try:
        linear_scan(**bad)
    except (TypeError, ValueError) as error:
        print(f"{type(error).__name__}: {error}")

# %% [markdown]
# ## When each approach wins
#
# Forward pass, float32, $L = 2^{20}$ steps, for a growing number of rows. The chained walk reads the data once but runs each row's blocks one after another; three phases read $a$ and $b$ twice but split a row over many programs. The three-phase rows use the segments `plan` chooses; where `plan` keeps one segment per row (2048 rows), only the chained walk is timed.

# %% tags=["nbval-ignore-output"]
length = runtime.size(gpu=1 << 20, cpu=512)
segment_rows = []
for n_rows in runtime.size(gpu=[1, 8, 64, 512, 2048], cpu=[1, 2]):
    a_r, b_r = uniform(n_rows, length, low=0.6, high=1.0), randn(n_rows, length)
    nbytes = 3 * a_r.numel() * a_r.element_size()
    block_r, per_segment, segments = plan(n_rows, length)
    candidates = [("chained walk", 10**9)] + ([("three phases", per_segment)] if segments > 1 else [])
    for name, bps in candidates:
        ms = median_ms(lambda: linear_scan_forward(a_r, b_r, blocks_per_segment=bps))
        segment_rows.append(dict(rows=n_rows, approach=name, ms=ms, GBps=gbps(nbytes, ms)))
print(f"device: {runtime.device_name()}")
print_table(segment_rows)
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for name, color in [("chained walk", COLORS["h"]), ("three phases", COLORS["carry"])]:
    points = [(r["rows"], r["GBps"]) for r in segment_rows if r["approach"] == name]
    if points:
        ax.semilogx(*zip(*points), "o-", base=2, color=color, label=name)
ax.set(xlabel="rows", ylabel="GB/s", title=f"forward, float32, L = {length}")
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The verdict: with one or eight rows three phases win by a wide margin, since the chained walk leaves most of the SMs idle; at 64 rows the two are within 5% of each other; at 512 rows the rows fill the GPU and the chained walk, which reads the data once, wins clearly. In the stored H200 benchmark (`book/data/linear_scan_bench.json`, section `segments`) three phases are 16.8 times faster at one row and 5.3 times at eight, the two are within about 4% at 64 rows, and the chained walk is 1.7 times faster at 512 rows (1.59 against 2.64 ms). The table above gives this GPU's numbers; its ratio at one row (17.3) is close to the stored one (16.8; the two runs stored before it had 17.7 and 4.7), but three phases on a single row take well under 0.1 ms, and timings that short vary between runs (the previous runs of this page had 7.9, 5.6, 18, 18, 17, 6.9, 4.5 and 6.4). Splitting makes a single row much faster but not fast: one row of $2^{20}$ steps still reaches only 5 to 19% of the copy bandwidth of about 4,200 GB/s, eight rows 38 to 41%. For one row: 708 GB/s in the table above, 687 in the stored run, 732 and 196 in the two runs stored before it, 801 in a run of the same script on the same GPU twenty minutes before that 196 run, and 323, 231, 738, 741 and 711 in the five previous runs of this page. (The `GBps` column counts $a$, $b$ and $h$ once, the bytes the result needs, for both approaches; three phases read $a$ and $b$ twice, so they move more than the column says.)
#
# `plan` does not follow this at 512 rows. Its target of 8 programs per SM (1056 on 132 SMs; more programs than SMs, so that an SM can switch to another program while one waits for memory, {term}`occupancy`, and 8 a rule of thumb) is more than 512 rows give, so it cuts each row into 3 segments and `linear_scan` takes the slower three phases there; only from 1056 rows on does it walk each row whole. A target of at most 3 programs per SM (396 on 132 SMs) would pick the chained walk at 512 rows.

# %% [markdown]
# ## Speed against the peers and the memory floor
#
# Mamba-like width, `(8, 1536, L)` in float32 and bfloat16, forward and forward+backward, beside chapter 1's sequential kernel and, where installed, accelerated-scan {cite}`repo_accelerated_scan` (an open-source PyTorch package for the same recurrence, introduced with the stored run below): its Triton scan (`accelerated_scan.scalar` in version 0.3.1). Its CUDA {term}`warp` scan (`accelerated_scan.warp`) compiles a C++ extension and only takes power-of-two lengths from 32 to 65536; `benchmarks/bench_linear_scan.py` times it, with everything else, in one run (on bfloat16 inputs it stopped with an illegal memory access on an H200, at $L = 4096$ in one run and $L = 65536$ in another, which ends the process's use of the GPU, so the script times it on bfloat16 only when asked: `--sections warp_bfloat16`). The floor counts the bytes that must move: forward reads $a$, $b$ and writes $h$; backward reads $a$, $h$, $g$ and writes two gradients.

# %% [markdown]
# The stored run of the benchmark script (`python benchmarks/bench_linear_scan.py --json book/data/linear_scan_bench.json` on the GPU box), with both kernels of accelerated-scan {cite}`repo_accelerated_scan`, an open-source PyTorch package that computes the same recurrence along the last dimension with its own forward and backward kernels, one in Triton (`accelerated_scan.scalar`) and one in CUDA; `ours_faster_by` is a peer's time over `linear_scan`'s. The cell after it times this machine. At $L = 4096$ the kernels are short enough for the host to matter: the host is the CPU, which runs the Python, autograd and launch code of each call and queues the kernels for the GPU, and when that work takes longer than the kernels, the GPU waits and the timing measures the CPU. The host's work for one call, measured at the small shape (1, 64, 4096), where the kernels take about 0.03 ms, is 0.22 ms for `linear_scan` forward and backward through autograd (0.02 ms for the forward alone) and 0.20 ms for accelerated-scan's Triton scan forward and backward (`book/data/host_cost_bench.json`). The three host-cost runs stored before it had 0.33 ms (ours) and 0.30 ms (theirs), then 0.19 and 0.19 ms, then 0.30 and 0.26 ms (newest first): the host's speed varies that much between runs. The bfloat16 kernels at (8, 1536, 4096) take about 0.2 ms: the linear-scan benchmark, a separate run, times `linear_scan`'s whole call there at 0.20 ms, and its three runs stored before at 0.20, 0.25 and 0.20 ms (newest first). So the host's work for one call is about as long as those kernels or longer, depending on the host, and a timing at this length can follow how busy the host is rather than the kernels (the GPU waits for launches); the longer rows time the kernels.

# %% tags=["nbval-ignore-output"]
stored = pathlib.Path("data/linear_scan_bench.json")
if stored.exists():
    result = json.loads(stored.read_text())
    print(f"stored run: {result['device']}, measured copy bandwidth {result['copy_GBps']:.0f} GB/s")
    stored_rows = result["sections"].get("linear_scan", []) + result["sections"].get("warp_bfloat16", [])
    print_table([{("L" if k == "T" else k): r.get(k, "") for k in ("impl", "dtype", "T", "pass_", "ms", "pct_floor",
                                                                      "ours_faster_by")} for r in stored_rows])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, passes in zip(axes, ("fwd", "fwd+bwd")):
        for name in dict.fromkeys(r["impl"] for r in stored_rows):
            color = COLORS["y"] if name == "linear_scan" else COLORS["decay"] if name.startswith("sequential") \
                else COLORS["x"] if "scalar" in name else COLORS["carry"]
            for dtype, style in [("float32", "o-"), ("bfloat16", "s--")]:
                points = sorted((r["T"], r["pct_floor"]) for r in stored_rows
                                if r["impl"] == name and r["pass_"] == passes and r["dtype"] == dtype)
                if points:
                    ax.semilogx(*zip(*points), style, base=2, color=color, label=f"{name}, {dtype}")
        ax.axhline(100, color="black", ls=":", label="memory floor")
        ax.set(title=f"{passes} ({result['device']})", xlabel="sequence length L", ylabel="% of memory-floor speed")
    axes[0].legend(fontsize="x-small")
    plt.tight_layout()
    plt.show()
else:
    print("no stored benchmark run (run benchmarks/bench_linear_scan.py --json book/data/linear_scan_bench.json)")

# %% tags=["nbval-ignore-output"]
try:
    peer_scan = importlib.import_module("accelerated_scan.scalar").scan
except ImportError:
    peer_scan = None
    print("accelerated_scan is not installed here: timing the book's kernels only")
shape_bc = runtime.size(gpu=(8, 1536), cpu=(1, 4))
speed_rows = []
for dtype in (torch.float32, torch.bfloat16):
    for length_case in runtime.size(gpu=[4096, 65536, 100_000], cpu=[64, 100]):
        shape = (*shape_bc, length_case)
        a_s = uniform(*shape, low=0.6, high=1.0, dtype=dtype).requires_grad_()
        b_s = randn(*shape, dtype=dtype).requires_grad_()
        grad_h = randn(*shape, dtype=dtype)
        elements, size_of = a_s.numel(), a_s.element_size()
        impls = {"linear_scan": linear_scan}
        if length_case <= 4096:
            impls["sequential (ch. 1)"] = sequential_scan
        if peer_scan is not None:
            impls["accelerated_scan.scalar"] = peer_scan
        for name, fn in impls.items():
            with torch.no_grad():
                ms = median_ms(lambda: fn(a_s, b_s))
            speed_rows.append(dict(dtype=str(dtype).removeprefix("torch."), L=length_case, impl=name, passes="fwd",
                                   ms=ms, pct_of_floor=100 * memory_floor_ms(3 * elements * size_of) / ms))
            ms = median_ms(lambda: torch.autograd.grad(fn(a_s, b_s), (a_s, b_s), grad_h))
            speed_rows.append(dict(dtype=str(dtype).removeprefix("torch."), L=length_case, impl=name, passes="fwd+bwd",
                                   ms=ms, pct_of_floor=100 * memory_floor_ms(8 * elements * size_of) / ms))
        del a_s, b_s, grad_h
print(f"device: {runtime.device_name()}")
print_table(speed_rows)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, passes in zip(axes, ("fwd", "fwd+bwd")):
    for name, color in [("linear_scan", COLORS["y"]), ("accelerated_scan.scalar", COLORS["x"]),
                        ("sequential (ch. 1)", COLORS["decay"])]:
        for dtype, style in [("float32", "o-"), ("bfloat16", "s--")]:
            points = [(r["L"], r["pct_of_floor"]) for r in speed_rows
                      if r["impl"] == name and r["passes"] == passes and r["dtype"] == dtype]
            if points:
                ax.semilogx(*zip(*points), style, base=2, color=color, label=f"{name}, {dtype}")
    ax.axhline(100, color="black", ls=":", label="memory floor")
    ax.set(title=f"{passes}, shape {shape_bc} x L", xlabel="sequence length L", ylabel="% of memory-floor speed")
axes[0].legend(fontsize="x-small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The verdict: in the stored H200 run `linear_scan` runs at 92–100% of the memory floor in every case, forward and backward, float32 and bfloat16, including the row that the host can slow (above and below): forward and backward in bfloat16 at $L = 4096$, 93%, as in the run stored before it (the one before that had 76%). accelerated-scan's Triton scan is close in float32 (1–7% slower) and falls behind in bfloat16 (8–11% forward, 1.5× forward and backward at every length, near 61–63% of the floor); its CUDA warp scan reaches 72–87% in float32; chapter 1's sequential kernel is 6 to 14 times slower. This machine's run above tells the same story except in the bfloat16 forward-and-backward row at $L = 4096$ (below). On the H200 that ran it, `linear_scan` runs at 92–100% of the floor in every other row, and it beats accelerated-scan's Triton scan in each of them. The Triton scan trails by 1–6% in float32 and, in bfloat16, by 8–10% forward and 1.5× forward and backward at $L$ = 65536 and 100000, where it stays at 62–63% of the floor. The sequential kernel is 6 to 13.5 times slower forward. The row to read with care is forward and backward in bfloat16 at $L = 4096$, where this run has the order reversed: 0.392 ms for `linear_scan` (49% of the floor) against 0.313 ms for the Triton scan (61%). That row times the host as much as the kernels: the host work measured for the two calls (0.22 and 0.20 ms in the stored host-cost run, above, another run; 0.33 and 0.30, 0.19 and 0.19, and 0.30 and 0.26 ms in the three stored before it, newest first) is as long as the kernels or longer; the six previous runs of this page had 0.270, 0.281, 0.292, 0.265, 0.257 and 0.205 ms for `linear_scan` there, and the one before them had the order reversed too (0.331 against 0.312 ms; the dropdown lists more). In float32 this run has `linear_scan` at 0.388 ms (98% of the floor) against the Triton scan's 0.413 ms, as the stored run (0.388 ms, 98%) and two of the three previous runs of this page (0.389 ms, 98%, in both) had. The other, the run before the previous one, had 0.572 ms (66%) there, which it read as that run's outlier, without proof; the two runs since, with the same kernels (the change after that run is on the host side: the op's inputs are made contiguous by the package's shared helper), do not repeat it, and the Triton scan's bfloat16 row, 0.394 ms in that run, was back at 0.314 ms in the previous run and is at 0.313 ms in this one. The dropdown below says what ran beside the earlier runs. Cutting the host cost is open work.
#
# :::{admonition} The bfloat16 forward and backward at L = 4096 in other runs
# :class: dropdown
# This page's run was on one H200 on 2026-12-02, from the code of `9eff10d`: a one-GPU host where nothing else of this project ran meanwhile; this page was the first of its device call, and chapters 0–3 had executed in the call before it. The previous run, of 0.270 ms (2026-11-30), was on a host with two H200s whose other GPU was executing chapter 8 (training its models) the whole time. On its GPU that run followed chapters 7, 4.9 and 0, run one after another; nothing was compiling CUDA code on the host, and the processes of the two GPUs were pinned to separate halves of its 32 cores. `linear_scan` took 0.270, 0.281, 0.292, 0.265, 0.257, 0.205, 0.331, 0.443, 0.423, 0.348, 0.495, 0.561, 0.634, 0.561, 0.277, 0.316 and 0.53 ms in the earlier runs of this page, newest first (the first nine on H200s, the others on H100s, with other hosts), and the Triton scan 0.314, 0.394, 0.313, 0.313, 0.313, 0.313, 0.312, 0.313, 0.376, 0.606 and 0.336 ms in the eleven runs before this one. The run of 0.281 ms also had chapter 8 on the host's other GPU, and came about 85 s after the SSD tests, run by 16 worker processes, had been stopped at their time limit (chapters 0–3 ran in between); `timeout` stops the workers with the test runner (their process group; checked on a CPU machine, not on that host), so its GPU was most likely idle apart from that page. The run of 0.292 ms ran while the host's other GPU executed chapter 7; the runs of 0.265 and 0.443 ms ran while mamba_ssm's CUDA extension (section 4.9's peer) was being compiled on the host's processors for its other GPU; the run of 0.331 ms had a one-GPU host to itself.
# :::

# %% [markdown]
# ### Scanning backwards without `reverse=True`
#
# The backward pass of the forward recurrence, and `reverse=True`, scan from the end of the block. The first version used `tl.associative_scan(..., reverse=True)`, and in bfloat16 its backward kernel ran at about 60% of the floor. The bytes were not the problem: on the H200 a kernel with the backward's exact loads and stores (the load of $h$ one step off included) but no scan ran at 95% of the floor. The reverse scan was: even the forward pass fell, in bfloat16, from 97% to 44% of its floor with `reverse=True`. Triton implements a reverse scan by reversing the values across the threads of a warp with {term}`shuffles <shuffle>`, and it does so even along an axis that one thread holds entirely. Half precision halves the bytes per step but not this work, which is why only 16-bit inputs showed it.
#
# So a descending block is laid out as a **tile**: `BLOCK / ROW` *tile rows* of `ROW` consecutive steps each, 16 bytes (`ROW` = 16 / element size: 4 steps in float32, 8 in 16-bit), which one thread fetches with one {term}`vector load`. A tile row is a short piece of one sequence, not a row of the input (a whole sequence of $L$ steps). Each thread scans its own tile row from the end in registers: `tl.flip`, an ascending scan, `tl.flip` back, none of which moves data between threads. The carry entering tile row $j$ is the composition of the maps of tile rows $j+1, j+2, \dots$ applied to the block's carry: one scan over the tile rows, of one value per tile row, the only place where `reverse=True` remains. That scan needs, in tile row $j$, the map of tile row $j+1$ (an *exclusive* scan); rather than move that value one thread over, each thread loads the next tile row again, from cache mostly, and reduces it itself.
#
# On the H200 the bfloat16 backward kernel went from about 60% to 94% of its floor, and the `reverse=True` forward from 44% to 96%; in float32 the descending row tiles run at 94–96% ("Performance notes: launch shapes"), and the float32 backward kernel at 92–96% of its floor (95.9, 94.0 and 91.7% at $L$ = 4096, 65536 and 100000 in the stored sweep `book/data/linear_scan_backward_sweep.json`). The other figures are timings of the single kernels taken while developing the tiles, not stored. The tables above agree with them: with the forward at 98% of its floor and the backward at 94%, forward and backward together (3 units of bytes forward, 5 backward) would take $3/0.98 + 5/0.94$ floor-units of time for 8 units of bytes, 95.5% of the floor, and the stored run gives 96.2% in bfloat16 at $L = 65536$.
#
# ```{admonition} Performance notes: what did not help
# :class: dropdown
# The backward kernel with `reverse=True` ran at 58% of the floor with blocks of 1024 steps and 60% with 2048; forward and backward together stopped near 70%, since the forward pass, near the floor, is part of the total. In PTX compiled for `sm_90` by Triton 3.9 (a newer Triton than the 3.6 of the book's GPU runs), one block of that backward had 139 shuffles against 43 for the ascending scan.
#
# Measured on the way to the row tiles, bfloat16 backward on an H200, % of the memory floor: an ascending scan over loads taken in reversed order (56%: the loads lose their vectors), the same tile but with `reverse=True` within each row, along the steps one thread holds (43%: the shuffles stay), two input rows (whole sequences) per program (59%), a {term}`software pipeline` over the loop of blocks (57%), and a backward block of 2048 steps alone (60%; kept, with the tiles, for fewer carries per row).
# ```

# %% [markdown]
# ```{admonition} Performance notes: launch shapes
# :class: dropdown
# The (largest block, warps) of each kind of scan in `scan/blocked.py` come from a sweep on an H200 at (12288, L) for L = 4096, 65536 and 100000, beside `accelerated_scan.scalar` (its Triton scan uses blocks of 2048 steps and 4 warps):
#
# - ascending, float32: 8192 steps × 8 warps ran at 98.6–99.7% of the copy floor; 1024 × 4 lost 0.5–2 points, which at L = 100000 left it 1% behind the peer; 4096 × 16 lost 3;
# - ascending, 16-bit: 4096 × 4 ran at 92.8–98.7%, 8192 × 8 at 91.7–95.6%, 4096 × 8 at 89.7–92.9%;
# - descending (`reverse=True`) row tiles: 1024 × 4 was best in both dtypes (94–96%); larger tiles lost 4–40 points;
# - the backward: 2048 × 4 with row tiles (bfloat16 at L = 65536: 94.5% against 93.8% with 1024); 8 warps or 4096 steps lost 15–20 points.
#
# That sweep is not stored in `book/data`. The stored benchmark's `tuning` section, another run at L = 65536 alone (float32, ascending), reads a little above that sweep's range for 8192 steps: 8192 × 8 at 100.3%, 8192 × 4 slightly ahead at 100.7%; 1024 × 4 is at 99.4%.
#
# The backward's shape was chosen in bfloat16 and serves float32 too, where forward and backward together stay at or under 97% of the floor at long rows (97.0% at L = 65536 and 95.1% at L = 100000 in the stored benchmark). A second sweep, stored, timed the backward kernel alone in both dtypes on an H200, every block of 512 to 4096 steps with 2, 4 and 8 warps, each checked against the default's gradients (`benchmarks/sweep_linear_scan_backward.py`, `book/data/linear_scan_backward_sweep.json`). In float32 no shape beats 2048 × 4 where it is weakest: at L = 100000 it runs at 91.7% of the floor and the best other shapes at 91.3–91.6%. At L = 4096 and 65536 some shapes gain one to two and a half points (4096 × 8: 98.4% against 95.9% at 4096; 4096 × 4: 95.0% against 94.0% at 65536), but neither is ahead at 100000 (88.7% and 91.6%). In bfloat16, 2048 × 2 is level with 2048 × 4 (90.9% against 90.2% at L = 100000). This sweep does not repeat the first one's losses for the backward in bfloat16 at L = 65536: 8 warps lost 7 points here (85.9% against 93.2%) and 4096 steps 1 point (92.1%), not 15–20, and 1024 steps were 0.5 points behind (92.7%), where the first sweep had 93.8% against 94.5%. The backward's remaining gap is in the kernel, not its launch shape.
# ```

# %%
show_source(scan_rows_descending)

# %% [markdown]
# ## What we have, and what comes next
#
# A row of any length is a chain of blocks, and a block needs one number from the past: its carry. Three phases compute the carries in parallel (read twice, scale to one long row); a chained walk carries them in a register (read once, needs many rows). One kernel family does both, forward and — in adjoint mode, over the triples $(a_t, 1, g_t)$ — backward, for float32 and 16-bit inputs, either direction and an initial state. That is `linear_scan`, which the remaining chapters use.
#
# Next, in [section 4.9](04_selective_scan.ipynb), Mamba's selective scan: the decays and inputs are no longer given but computed on the fly from $\Delta$, $A$, $B$ and $x$, with a state of size $N$ per channel and an output contraction with $C$ — the same carries, with more work per element.
#
# **Exercises** (a test in `tests/test_linear_scan.py` checks 1; the answer to 2 is in a dropdown below them; 3 has a checker):
#
# 1. Show that the result cannot depend on how a row is cut into segments: any `blocks_per_segment` gives the same $h$ and gradients up to rounding. `test_every_path_forward_and_backward` runs one, two, three and all blocks per segment.
# 2. On a GPU with 132 SMs, what does `plan(512, 1 << 20)` return, and why? How many bytes does each of the three phases read and write for float32 rows, and what does that predict for the time of three phases against the chained walk once the rows alone fill the GPU? Compare with the table in "When each approach wins". (Answer in the dropdown below.)
# 3. *A blocked cumulative sum.* Write `blocked_cumsum(x, block)`, the cumulative sum along the last dimension of `x` (rows, L), float32, for any $L$, as a Triton kernel that walks each row in blocks of `block` elements with the carry in a register: the chained walk of this chapter with every decay 1. `tl.cumsum(x, 0)` scans one block; the carry is a scalar, started with `tl.zeros([], dtype=tl.float32)` and grown by `tl.sum(x, 0)` of each block, as in the primer's row sum.
#
# ```{admonition} Answer to exercise 4.2 (click to show)
# :class: dropdown
# A row of $2^{20}$ float32 steps is 128 blocks of 8192 (the largest float32 block). 512 rows are fewer than the target of $8 \cdot 132 = 1056$ programs, so `plan` asks for $\lceil 1056 / 512 \rceil = 3$ segments per row: 43 blocks per segment, and it returns `(8192, 43, 3)`. Phase 1 reads $a$ and $b$ (2 arrays); phase 2 touches only the $512 \times 3$ totals; phase 3 reads $a$ and $b$ again and writes $h$ (3 arrays): 5 arrays against the chained walk's 3. Once both run near the memory floor, three phases should take about $5/3 \approx 1.7$ times as long, which is the ratio the stored H200 run shows at 512 rows.
# ```
#
# Replace the `raise` in the stub and run the cell; the checker (`mamba_annotated.exercises`) calls it with `block = 16` on rows shorter than a block, exactly one block and many blocks with a partial last one, against the float64 scan.

# %%
import triton  # the exercises write their own kernels
import triton.language as tl

from mamba_annotated.exercises import check as check_exercise


def blocked_cumsum(x, block):
    raise NotImplementedError  # your code here


attempted = check_exercise("4.3", blocked_cumsum)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
@triton.jit
def blocked_cumsum_kernel(x_ptr, y_ptr, length, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    carry = tl.zeros([], dtype=tl.float32)  # the sum of every earlier block
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


assert check_exercise("4.3", blocked_cumsum)
