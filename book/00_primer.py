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
# # Triton and the GPU in twenty minutes
#
# In this primer you will learn:
#
# - what a Triton kernel is: a {term}`program` that runs once per point of a {term}`grid`, loads a {term}`block` of numbers through pointers and a {term}`mask`, computes, and stores;
# - where those numbers live on the way, from {term}`HBM` through {term}`L2` and {term}`shared memory` to {term}`registers`, and what {term}`warps <warp>`, {term}`shuffles <shuffle>`, {term}`tensor cores <tensor core>`, {term}`TF32`, `num_warps`, `num_stages` and the {term}`autotuner` are;
# - how to read a {term}`roofline`: every kernel of this book placed by its {term}`arithmetic intensity` against the measured limits of the GPU it ran on.
#
# It assumes Python and PyTorch and nothing else. The chapters after it use every word introduced here; the [glossary](glossary.md) collects them.
#
# ```{admonition} Notation
# | symbol | meaning |
# |---|---|
# | program | one instance of a kernel; `tl.program_id(0)` is its index in the grid |
# | grid | the tuple of program counts a launch asks for: `kernel[grid](...)` |
# | `BLOCK` | how many elements one program handles, a compile-time constant (`tl.constexpr`), a power of two |
# | `x_ptr + offsets` | a block of addresses: a pointer plus a vector of element offsets |
# | lane | one of the `BLOCK` element positions of a block (not a thread) |
# | mask | a vector of booleans: which lanes of a block may load and store |
# | $I$ | arithmetic intensity: floating-point operations per byte moved to or from HBM |
# | $W_{\text{mem}}$, $R_{\text{peak}}$ | memory bandwidth (bytes/s) and peak arithmetic rate (FLOP/s) of a GPU, both measured (a copy, a bfloat16 matmul) rather than taken from the data sheet, which no real kernel reaches |
# ```

# %%
import json
import pathlib

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyBboxPatch

from mamba_annotated import runtime
from mamba_annotated.bench import copy_bandwidth_gbps, gbps, median_ms, print_table
from mamba_annotated.exercises import check as check_exercise
from mamba_annotated.figures import COLORS
from mamba_annotated.testing import check, randn, seed_everything, tolerance

import triton  # after mamba_annotated, which turns the interpreter on where there is no GPU
import triton.language as tl

seed_everything(0)
device = runtime.DEVICE

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# On a machine without a GPU, importing `mamba_annotated` sets `TRITON_INTERPRET=1` before any kernel is defined: Triton's {term}`interpreter` then runs every kernel below on CPU tensors, one program after another, with NumPy doing the arithmetic. The results are the same up to rounding; the timings say nothing about a GPU.
#
# ## Hello, kernel
#
# The smallest useful kernel computes $y_i = 2x_i + 1$. A Triton kernel is a Python function decorated with `@triton.jit`; it receives tensors as pointers to their first element, and it is launched on a *grid*: `kernel[(n,)](...)` starts $n$ programs, and each asks `tl.program_id(0)` which one it is. Here program $i$ handles element $i$.

# %%
@triton.jit
def scale_shift_one_kernel(x_ptr, y_ptr):
    i = tl.program_id(0)       # which program am I? 0, 1, ..., n - 1
    x = tl.load(x_ptr + i)     # read one float32 from global memory (HBM)
    tl.store(y_ptr + i, 2.0 * x + 1.0)


n = 10
x = randn(n)
y = torch.empty_like(x)
scale_shift_one_kernel[(n,)](x, y)  # (on a GPU the launch returns the compiled kernel: not shown)
print(y.shape)

# %% [markdown]
# The next cell checks it against PyTorch in float64 with the book's `check` (from `mamba_annotated.testing`, which every chapter uses), which prints the measured relative error $\lVert y - y_{\text{ref}}\rVert / \lVert y_{\text{ref}}\rVert$ beside its bound: here the float32 bound, $10^{-5}$, about a hundred times float32's rounding (products on the tensor cores, below, get looser bounds; a failure raises):

# %%
check("one element per program", y, 2 * x.double() + 1, tolerance(torch.float32))

# %% [markdown]
# ## The same kernel in blocks
#
# First, how a GPU runs a launch: each program of the grid runs on one of the chip's processors, its {term}`SMs <SM>` (described below), as a few {term}`warps <warp>`, groups of 32 threads (the GPU's smallest units of execution) that execute in lockstep. Programs start in no guaranteed order and cannot wait for one another, so anything one program needs from another must go through a later launch (chapters 4 to 6 are built around that rule).
#
# One element per program wastes the machine: a program has four warps (128 threads) by default, so a program that touches one float does one thread's work and leaves 127 threads idle. A real kernel gives each program a {term}`block` of `BLOCK` elements. `tl.arange(0, BLOCK)` is the vector $0, 1, \dots, \mathrm{BLOCK}-1$, so `pid * BLOCK + tl.arange(0, BLOCK)` are the offsets program `pid` owns, and one `tl.load` reads the whole block. `BLOCK` is a `tl.constexpr`: the compiler specialises the kernel for each value, and `tl.arange` needs a power of two.
#
# Each of the `BLOCK` positions of a block is a {term}`lane`: element $i$ of every vector in the program. (The word means an element position here, not a thread: Triton decides which thread holds which lanes.) The grid has $\lceil n / \mathrm{BLOCK} \rceil$ programs (`triton.cdiv`). When $n$ is not a multiple of `BLOCK`, the last block runs past the end of the tensor: the {term}`mask` `offsets < n` switches those lanes off, so they neither read nor write. Forgetting it reads and writes memory that belongs to someone else; on a GPU that is silent corruption, not an error.

# %%
@triton.jit
def scale_shift_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)   # the BLOCK elements this program owns
    mask = offsets < n                            # lanes past the end stay off
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, 2.0 * x + 1.0, mask=mask)


def scale_shift(x, block=256):
    y = torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), block),)
    scale_shift_kernel[grid](x, y, x.numel(), BLOCK=block)
    return y


def draw_blocks(n=10, block=4):
    fig, ax = plt.subplots(figsize=(8, 1.9))
    programs = -(-n // block)
    for i in range(programs * block):
        inside = i < n
        ax.add_patch(plt.Rectangle((i, 0), 0.9, 0.9, color=COLORS["x"], alpha=0.6 if inside else 0.12))
        ax.text(i + 0.45, 0.45, str(i) if inside else "off", ha="center", va="center", fontsize=8)
    for pid in range(programs):
        ax.add_patch(plt.Rectangle((pid * block - 0.08, -0.1), block - 0.04, 1.1, fill=False, ls="--", lw=1.2))
        ax.text(pid * block + block / 2 - 0.1, 1.25, f"program {pid}", ha="center", fontsize=9)
    ax.set(xlim=(-0.3, programs * block + 0.2), ylim=(-0.3, 1.6),
           title=f"n = {n}, BLOCK = {block}: {programs} programs, the mask switches off {programs * block - n} lanes")
    ax.axis("off")
    plt.tight_layout()
    plt.show()


draw_blocks()

# %% [markdown]
# The figure shows the whole idea: three programs of four lanes cover ten elements, and the two lanes past the end are masked off. The next cell checks the blocked kernel on a length that is not a multiple of the block, and on a single element:

# %%
for length in (runtime.size(gpu=1_000_003, cpu=1003), 1):
    x = randn(length)
    check(f"blocks of 256, n = {length}", scale_shift(x), 2 * x.double() + 1, tolerance(torch.float32))

# %% [markdown]
# ## Where the numbers live
#
# A kernel's time is mostly spent moving numbers, so it pays to know where they are. The GPU is built from many identical processors, the streaming multiprocessors ({term}`SMs <SM>`): 132 on an H100 SXM or an H200. A launch's programs are spread over the SMs, each SM runs several programs at once, and each SM has its own registers, shared memory and L1 cache; all SMs share the L2 cache and HBM. On an NVIDIA H100 SXM {cite}`nvidia2022h100,nvidia2022hopperblog`:
#
# - **HBM** ({term}`HBM`, the GPU's main memory, "global memory"): 80 GB of HBM3 at 3.35 TB/s peak. Every tensor argument lives here; `tl.load` and `tl.store` on a pointer go here. The H200 has the same chip with 141 GB of HBM3e at 4.8 TB/s {cite}`nvidia2024h200`. The stored benchmarks of this book (`book/data/*.json`) ran on an H200 and measured a device-to-device copy there at about 4.2 TB/s (88% of its peak): the practical bandwidth $W_{\text{mem}}$. A kernel's {term}`memory floor` is the time its unavoidable bytes take at that rate, $n_{\text{bytes}}/W_{\text{mem}}$; the chapters report each kernel's speed as a percentage of it, and a good memory-bound kernel comes close to 100 %.
# - **L2** ({term}`L2`): a 50 MB cache shared by the whole chip. A second read of recently used data comes from here; kernels do not manage it.
# - **Shared memory** ({term}`shared memory`): 256 KB of on-chip memory per {term}`SM`, split between the L1 cache and shared memory; up to 228 KB can be shared memory, and one program may use up to 227 KB {cite}`nvidia2024hoppertuning`. Triton places data here itself: for the operands of `tl.dot`, the stages of a software pipeline and the exchanges of a reduction or scan.
# - **Registers** ({term}`registers`): 64K 32-bit registers (256 KB) per SM {cite}`nvidia2024cudaguide`, private to each thread. A block that a program holds between loads (the state of a scan, an accumulator) lives here if it fits.
#
# The H100 SXM has 132 SMs, so the chip holds about 33 MB of registers and about as much again of L1 and shared memory, 66 MB together, more than its 50 MB L2, small beside HBM, and far faster. Every kernel in the book follows one rule: read each input from HBM once, keep what is reused on chip, write each output once.

# %%
def draw_memory_hierarchy():
    levels = [  # (name and reach, size, bandwidth or note, relative width)
        ("registers (per thread)", "64K x 32-bit = 256 KB per SM", "read every clock by the ALUs", 0.40),
        ("shared memory / L1 (per SM)", "256 KB per SM: up to 228 KB shared, 227 KB for one program",
         "32 banks x 4 B per clock: ~33 TB/s over 132 SMs", 0.58),
        ("L2 cache (whole chip)", "50 MB", "shared by all 132 SMs", 0.72),
        ("HBM3 (off chip: every tensor)", "80 GB (H200: 141 GB HBM3e)", "3.35 TB/s peak (H200: 4.8 TB/s)", 0.86),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for row, (name, size, speed, width) in enumerate(levels):
        y = 3 - row
        ax.add_patch(FancyBboxPatch((0.55 - width / 2, y + 0.08), width, 0.8, boxstyle="round,pad=0.01",
                                    facecolor=COLORS["x"], alpha=0.15 + 0.2 * row, edgecolor="black"))
        ax.text(0.55, y + 0.62, name, ha="center", va="center", fontsize=11, weight="bold")
        ax.text(0.55, y + 0.33, f"{size}\n{speed}", ha="center", va="center", fontsize=8)
    ax.annotate("", xy=(0.03, 3.9), xytext=(0.03, 0.1), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(0.045, 3.5, "smaller,\nfaster,\ncloser", fontsize=8, va="center")
    ax.set(xlim=(0, 1), ylim=(0, 4), title="H100 SXM memory hierarchy (132 SMs)")
    ax.axis("off")
    plt.tight_layout()
    plt.show()


draw_memory_hierarchy()

# %% [markdown]
# Each level up is faster and closer to the arithmetic, and smaller in what one thread or program can reach: a thread's registers (at most 255, about 1 KB), an SM's shared memory (up to 227 KB for one program), the chip's L2 (50 MB), HBM (80 GB). Counted over the whole chip the upper levels are closer in size (33 MB of registers, 33 MB of L1 and shared memory, 50 MB of L2); what keeps them small is that each SM reaches only its own. A kernel is fast when the data it reuses stays in the upper levels.
#
# ## Warps, shuffles and reductions
#
# A program does not run on one thread. Triton compiles it for `num_warps` warps of 32 threads each (4 by default): the `BLOCK` {term}`lanes <lane>` of a vector are spread over $32 \times$ `num_warps` threads, a few per thread, and all 32 threads of a warp execute the same instruction at once. Elementwise code like `2.0 * x + 1.0` needs no communication. A reduction (`tl.sum`, `tl.max`) or a scan (`tl.cumsum`, `tl.associative_scan`) does: the threads of a warp exchange registers directly with {term}`shuffles <shuffle>` (`shfl.sync`, five rounds to combine 32 values), and the warps of a program meet in shared memory. Chapters 2 and 3 are built on exactly this machinery. A row sum, one program per row:

# %%
@triton.jit
def row_sum_kernel(x_ptr, out_ptr, length, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * length + t, mask=t < length, other=0.0)  # masked lanes read 0: no effect on a sum
    tl.store(out_ptr + row, tl.sum(x, axis=0))   # shuffles inside each warp, shared memory across warps


rows, length = 6, 300
x = randn(rows, length)
sums = torch.empty(rows, device=device)
row_sum_kernel[(rows,)](x, sums, length, BLOCK=triton.next_power_of_2(length))
check("row sums", sums, x.double().sum(-1), tolerance(torch.float32))

# %% [markdown]
# The `other=0.0` of the load matters: a masked lane must hold the *identity* of the reduction (0 for a sum, $-\infty$ for a maximum, 1 for a product), or the tail of the block changes the result.
#
# ## Tensor cores: `tl.dot` and TF32
#
# Each SM of an H100 has four {term}`tensor cores <tensor core>`: units that multiply small matrix tiles in one instruction, at up to 989 TFLOP/s for 16-bit inputs on the whole chip against 67 TFLOP/s of ordinary float32 arithmetic {cite}`nvidia2022h100`. Triton uses them through `tl.dot(a, b)` on two blocks of at least $16 \times 16$. With float32 inputs the tensor cores run in {term}`TF32`: each input is rounded to 10 bits of mantissa (unit roundoff $2^{-11} \approx 4.9 \cdot 10^{-4}$) before the products, which are accumulated in float32. `input_precision="ieee"` asks for full float32 arithmetic instead, each multiply-add rounded to float32 as on a CPU (slower: no tensor cores). 
#
# The next cell is a tiled matrix product: each program computes one $32 \times 32$ {term}`tile` of the output, walking the inner dimension in steps of 32. To read it: a matrix is stored row by row, so element $(r, c)$ of an $M \times K$ matrix is at offset $r K + c$; `rows[:, None]` is a column and `inner[None, :]` a row, and broadcasting (as in NumPy) turns their sum into a tile of addresses. The grid is two-dimensional: `tl.program_id(0)` picks the tile's row and `tl.program_id(1)` its column. (The `# on the tensor cores` comment holds when `PRECISION` is TF32; with `"ieee"` the same line runs without them.)

# %%
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)             # the output tile, in registers
    for k in range(0, K, BLOCK):
        inner = k + tl.arange(0, BLOCK)
        a = tl.load(a_ptr + rows[:, None] * K + inner[None, :], mask=(rows[:, None] < M) & (inner[None, :] < K), other=0.0)
        b = tl.load(b_ptr + inner[:, None] * N + cols[None, :], mask=(inner[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)           # on the tensor cores
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(a, b, precision, block=32):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, device=a.device)
    matmul_kernel[(triton.cdiv(M, block), triton.cdiv(N, block))](a, b, c, M, N, K, PRECISION=precision, BLOCK=block)
    return c


M = N = K = runtime.size(gpu=1000, cpu=70)
a, b = randn(M, K), randn(K, N)
for precision, bound in (("ieee", tolerance(torch.float32)), ("tf32", 2e-3)):
    check(f"matmul, input_precision={precision!r}", matmul(a, b, precision), a.double() @ b.double(), bound)

# %% [markdown]
# On a GPU the TF32 product is a few $10^{-4}$ off, relative, and the IEEE one about $10^{-6}$ (in the interpreter both are exact float32 products). The book's kernels follow PyTorch's rule (`mamba_annotated.triton_ops.dot_precision`): float32 tiles are multiplied in full float32 unless the caller allowed TF32 with `torch.set_float32_matmul_precision("high")`; 16-bit tiles always go to the tensor cores, with float32 accumulation. Chapters 5 to 7 are built on `tl.dot`.
#
# ## `num_warps`, `num_stages` and the autotuner
#
# Besides its `constexpr` arguments, a launch takes two knobs. `num_warps` sets how many warps run one program: more warps give a big block more threads, but fewer programs fit on an SM at once. `num_stages` sets how deep the software pipeline of a `for` loop is: with 3 stages, the loads of iterations $k+1$ and $k+2$ are issued into shared memory while iteration $k$ computes, which hides the latency of HBM. Both trade against the registers and shared memory an SM has, which bound how many programs it can keep resident (its {term}`occupancy`).
#
# The best values depend on the GPU and the problem size, so Triton can measure them: `@triton.autotune(configs=[...], key=["n"])` times every configuration the first time the kernel meets a new value of the arguments named in `key`, and keeps the fastest for that value. Since `BLOCK` is no longer chosen by the caller, the grid cannot be a fixed tuple: the launch passes a function instead, which Triton calls with the chosen configuration's values (its *meta-parameters*, here `meta["BLOCK"]`) to get the grid. (The interpreter cannot time anything, so it gets one configuration.)

# %%
tuned_configs = runtime.size(
    gpu=[triton.Config({"BLOCK": block}, num_warps=warps) for block in (256, 1024, 4096) for warps in (2, 4, 8)],
    cpu=[triton.Config({"BLOCK": 256}, num_warps=4)])


@triton.autotune(configs=tuned_configs, key=["n"])
@triton.jit
def scale_shift_tuned_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, 2.0 * tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)


def scale_shift_tuned(x):
    y = torch.empty_like(x)
    scale_shift_tuned_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
    return y


x = randn(runtime.size(gpu=1 << 25, cpu=1000))
check("autotuned blocks", scale_shift_tuned(x), 2 * x.double() + 1, tolerance(torch.float32))

# %% tags=["nbval-ignore-output"]
print(f"device: {runtime.device_name()}; the autotuner chose {scale_shift_tuned_kernel.best_config} for n = {x.numel()}")
rows = []
for block in (64, 256, 1024, 4096):
    ms = median_ms(lambda: scale_shift(x, block))
    rows.append(dict(implementation=f"scale_shift, BLOCK={block}", ms=ms, GBps=gbps(2 * x.numel() * 4, ms)))
for name, fn in (("autotuned", lambda: scale_shift_tuned(x)), ("PyTorch 2 * x + 1 (two kernels)", lambda: 2 * x + 1)):
    ms = median_ms(fn)
    rows.append(dict(implementation=name, ms=ms, GBps=gbps(2 * x.numel() * 4, ms)))
for row in rows:
    row["pct_copy_bandwidth"] = 100 * row["GBps"] / copy_bandwidth_gbps()
print_table(rows)
fig, ax = plt.subplots(figsize=(8, 3))
ax.barh([r["implementation"] for r in rows], [r["pct_copy_bandwidth"] for r in rows],
        color=[COLORS["y"] if r["implementation"].startswith(("scale", "auto")) else COLORS["decay"] for r in rows])
ax.axvline(100, color="black", ls="--", lw=1, label="measured copy bandwidth")
ax.set(xlabel="% of the measured copy bandwidth", title=f"y = 2x + 1, {x.numel()} float32 elements")
ax.invert_yaxis()
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()
best = max(rows, key=lambda r: r["GBps"])
print(f"verdict: the fastest is {best['implementation']} at {best['pct_copy_bandwidth']:.0f}% of the copy bandwidth")

# %% [markdown]
# On a GPU the smallest block falls far short of the copy bandwidth. The reason is latency: a load from {term}`HBM` takes about half a microsecond to come back, and a memory system streams at full rate only if enough bytes are on their way at once: bytes in flight = bandwidth × latency (Little's law). Spread over 132 SMs, 4.2 TB/s (bytes read plus bytes written) is about 32 bytes per nanosecond per SM, so over 0.5 µs each SM must keep some 16 KB of reads and writes in flight. An SM holds at most 64 warps, so 16 programs of four warps; with 64 elements per program (256 bytes read and 256 written) that is about 8 KB in flight, half of what is needed, and 64 elements also leave half of each program's 128 threads idle. Latency alone does not explain the whole shortfall, then, but it is the first limit a small block meets. With 256 elements per program the kernel reaches three quarters of the copy bandwidth, and from about a thousand on it moves data about as fast as a copy does (89–93 % in the table; the autotuner picked `BLOCK = 1024` with 8 warps; `num_stages` matters only for loops, which this kernel has none of, and `num_ctas` and `maxnreg` are options this book leaves at their defaults): an elementwise kernel has nothing to do but move bytes, and large enough blocks are what let it do that at full speed. PyTorch's `2 * x + 1` lands near half of the copy bandwidth, and not because its kernels are slow: eager PyTorch runs `2 * x` and `+ 1` as two kernels, each reading and writing the whole tensor, so it moves twice the bytes the table counts. (In the interpreter the numbers measure Python.)
#
# ## The roofline: where the book's kernels sit
#
# A kernel that performs $F$ floating-point operations and moves a number of bytes $n_{\text{bytes}}$ to and from HBM has an {term}`arithmetic intensity` $I = F / n_{\text{bytes}}$. Moving its bytes takes at least about $n_{\text{bytes}}/W_{\text{mem}}$ seconds and computing at least $F/R_{\text{peak}}$, so its rate $F/\text{time}$ is at most $F \cdot W_{\text{mem}}/n_{\text{bytes}} = W_{\text{mem}} \cdot I$, and at most $R_{\text{peak}}$ (both are measured rates, not hardware peaks, so a kernel can land a few percent above them, as below):
#
# $$
# \min(R_{\text{peak}},\; W_{\text{mem}} \cdot I).
# $$
#
# Plotted on log axes this is the {term}`roofline` {cite}`williams2009roofline`: a slope where the kernel is {term}`memory-bound`, a flat roof where it is {term}`compute-bound`, meeting at the ridge $I = R_{\text{peak}} / W_{\text{mem}}$ (on an H200 with the measured $W_{\text{mem}} \approx 4.2$ TB/s and a measured bfloat16 matmul rate $R_{\text{peak}} \approx 790$ TFLOP/s, about 187 FLOP per byte; the other stored benchmark runs timed the same matmul at 736 TFLOP/s (chapter 5, `ssd_bench.json`), 786 TFLOP/s (chapter 6, `bidirectional_bench.json`) and 799 TFLOP/s (`ssd_variants_bench.json`), and earlier runs at 706 to 805, so take the ridge as 165 to 190: a matmul on random data runs at a rate that varies by a tenth from run to run). The next cell places every kernel of the book on it, from the GPU benchmark results stored in `book/data/*.json`. Those were measured on an H200 (the `device` field of each file, printed first); the other cells of this page ran on the GPU that the environment cell at the top names. For the plot: a first-order scan does one multiply-add (2 FLOP) per time step of a channel, for which it reads $a_t$ and $b_t$ and writes $h_t$, 12 bytes in float32, so $I = 2/12 \approx 0.17$ FLOP per byte (6 bytes and $I \approx 0.33$ in bfloat16). The selective scan is counted as 3 multiply-adds (6 FLOP) per element of its (batch, channels, $N$, $L$) state; its exponential is not counted as a FLOP but gets its own ceiling, the dotted line: the rate these 6 FLOP per element would reach if the exponential units were the only limit. SSD and attention count their matmul FLOPs. Each point is the forward pass of one measured shape: the largest for the scans and attention, and for SSD the first one listed, (batch 4, $L$ = 4096, 80 heads, headdim 64, $N$ = 128).

# %%
def load(name):
    return json.loads(pathlib.Path("data", name).read_text())


scans, selective, ssd, attention = (load(f"{n}_bench.json") for n in ("linear_scan", "selective_scan", "ssd", "attention"))
bandwidth = scans["copy_GBps"] * 1e9                               # measured copy bandwidth, bytes/s
peak = next(r["fwd_tflops"] / (r["fwd_pct_peak"] / 100) for r in attention["rows"]) * 1e12  # measured bf16 matmul
points = []  # (label, chapter, intensity FLOP/byte, achieved FLOP/s)


def scan_point(label, chapter, row):
    """A first-order scan: one multiply-add per element, 3 elements (a, b, h) moved per element."""
    intensity = 2 / (3 * {"float32": 4, "bfloat16": 2}[row["dtype"]])
    points.append((label, chapter, intensity, row["GBps"] * 1e9 * intensity))


def largest(rows, **match):
    rows = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return max(rows, key=lambda r: (r["T"], r["shape"]))


sections = scans["sections"]
scan_point("sequential scan", 1, largest(sections["linear_scan"], impl="sequential_scan (ch. 1)", dtype="float32", pass_="fwd"))
scan_point("tuple scan", 2, largest(sections["packing"], impl="tuple", dtype="float32"))
scan_point("packed scan", 3, largest(sections["packing"], impl="packed", dtype="float32"))
scan_point("linear_scan (chained)", 4, largest(sections["linear_scan"], impl="linear_scan", dtype="float32", pass_="fwd"))
scan_point("three phases, 1 row", 4, largest(sections["segments"], impl="three phases", shape="1x1048576"))

elements = selective["batch"] * selective["dim"] * selective["dstate"] * selective["length"]
forward = next(r for r in selective["rows"] if r["implementation"] == "selective_scan (ours)" and r["passes"] == "forward")
floors = selective["floors"]["forward"]
selective_bytes = floors["memory_ms"] * 1e-3 * selective["copy_bandwidth_gbps"] * 1e9
points.append(("selective scan", 4.9, 6 * elements / selective_bytes, 6 * elements / (forward["ms"] * 1e-3)))
exp_ceiling = 6 * elements / (floors["exp_ms"] * 1e-3)             # FLOP/s when every exponential is busy
fp32_peak = 6 * elements / (floors["fma_ms"] * 1e-3)               # 3 FMAs per element on the float32 units

for row in ssd["rows"]:
    if row["impl"] == "ours" and row["pass_"] == "fwd" and row["shape"] == ssd["rows"][0]["shape"]:
        batch, length, heads, headdim, dstate = json.loads(row["shape"].replace("(", "[").replace(")", "]"))
        # bytes: x and y, B and C (one group) in bfloat16, dt in float32
        nbytes = 2 * batch * length * heads * headdim * 2 + 2 * batch * length * dstate * 2 + batch * length * heads * 4
        flop = row["TFLOPs"] * 1e12 * row["ms"] * 1e-3
        points.append(("SSD chunk scan", 5, flop / nbytes, row["TFLOPs"] * 1e12))
row = max((r for r in attention["rows"] if r["impl"] == "ours (split)" and not r["causal"]), key=lambda r: (r["N"], r["d"]))
batch, heads = attention["batch"], attention["heads"]
flop = 4 * batch * heads * row["N"] ** 2 * row["d"]
nbytes = 4 * batch * row["N"] * heads * row["d"] * 2 + batch * heads * row["N"] * 4   # q, k, v, out (bf16); lse
points.append((f"attention, L={row['N']}, d={row['d']}", 7, flop / nbytes, row["fwd_tflops"] * 1e12))

print(f"devices: {sorted({d['device'] for d in (scans, selective, ssd, attention)})}; measured copy bandwidth "
      f"{bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s, ridge at {peak / bandwidth:.0f} FLOP/byte")
print_table([dict(kernel=label, chapter=chapter, FLOP_per_byte=intensity, TFLOPs=rate / 1e12,
                  pct_of_roof=100 * rate / min(peak, bandwidth * intensity)) for label, chapter, intensity, rate in points])

# %%
fig, ax = plt.subplots(figsize=(9, 5.2))
intensity = torch.logspace(-1.5, 4.5, 200, dtype=torch.float64)
ax.plot(intensity, torch.minimum(torch.full_like(intensity, peak), bandwidth * intensity) / 1e12, color="black", lw=2,
        label="roofline: measured copy bandwidth and bf16 matmul rate")
ax.axhline(fp32_peak / 1e12, color=COLORS["decay"], ls="--", lw=1, label="float32 FMA peak (no tensor cores)")
ax.axhline(exp_ceiling / 1e12, color=COLORS["decay"], ls=":", lw=1.5,
           label="exponentials: the selective scan's own ceiling")
markers = {1: "v", 2: "s", 3: "D", 4: "o", 4.9: "P", 5: "*", 7: "X"}
label_offsets = {"tuple scan": (8, 9), "packed scan": (8, 0), "linear_scan (chained)": (8, -9)}  # one point, three labels
for label, chapter, x_value, rate in points:
    ax.scatter(x_value, rate / 1e12, marker=markers[chapter], s=70, color=COLORS["y"], edgecolor="black", zorder=3)
    ax.annotate(f"{label} (ch. {chapter})", (x_value, rate / 1e12), textcoords="offset points",
                xytext=label_offsets.get(label, (7, -3)), fontsize=7.5, va="center")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte of HBM traffic)",
       ylabel="achieved TFLOP/s", ylim=(0.02, 2000), xlim=(0.03, 3e4),
       title=f"the book's kernels on the roofline of an {scans['device']} (forward passes, book/data)")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize="small", loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# The plot sorts the book into three regimes. The scans (chapters 1 to 4) do one multiply-add per 6 or 12 bytes and sit on the memory slope: `linear_scan`, the tuple and the packed scan touch the roof (the tuple and packed scans even pass it, by 3 %: the slope is the speed of PyTorch's copy kernel, a measured reference rather than a hard limit, and [chapter 1](01_sequential_scan.ipynb) explains how a scan can beat it), the three-phase split of a single row and the sequential scan of chapter 1 fall well short of it (one row of $2^{20}$ steps gives too few programs to fill the GPU; the sequential scan keeps too few bytes in flight, it is {term}`latency-bound`, as chapter 1 explains). The selective scan does about 16 FLOP per byte, past the point where its own ceiling, the exponentials of the {term}`special-function units <special-function unit>` (dotted line), takes over from bandwidth: it is bound by exponentials, not bytes, and sits well below even that ceiling (section 4.9 says why; the table's `pct_of_roof` measures every kernel against the black roofline, which gives the selective scan 9 %, where against its exponential ceiling it reaches 23 %). SSD and attention turn the work into matmuls and reach the flat roof's region: attention at about two thirds of the roof (64 %), SSD lower (14 %), mostly because its main kernel, `chunk_scan`, runs its small matmuls far below the peak rate (0.38 of its 0.60 ms in the stored run; chapter 5's table gives 15 % of its floor). Its point is also plotted at the ridge (186 FLOP per byte), with bytes counting each input read once and each output written once; the chunk states it also writes and reads are not counted, so its real intensity is lower.
#
# ## What we have, and what comes next
#
# A Triton kernel is a program run over a grid; it loads blocks through pointers and masks, computes on vectors that the compiler spreads over warps, and stores. Reductions and scans communicate through shuffles and shared memory, `tl.dot` runs on the tensor cores (in TF32 for float32 unless asked otherwise), and `num_warps`, `num_stages` and the autotuner choose how a program uses an SM. The roofline says which resource a kernel should exhaust: bytes for the scans, exponentials for the selective scan, matmul throughput for SSD and attention.
#
# [Chapter 1](01_sequential_scan.ipynb) writes the first kernel of the book, the linear recurrence walked in time, and measures how far from the memory roof a chain of dependent steps leaves it.
#
# **Exercise 0.1.** Write `axpy(alpha, x, y)` that returns $\alpha x + y$ for float32 vectors of any length with a blocked Triton kernel (a scalar argument such as `alpha` is passed to the kernel as a plain Python float, with no tensor around it). Replace the `raise` in the stub and run the cell; the checker compares your function with float64 on fresh random inputs, including lengths that are not a multiple of your block.

# %%
def axpy(alpha, x, y):
    raise NotImplementedError  # your code here


attempted = check_exercise("0.1", axpy)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n   # the last block runs past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, alpha * x + y, mask=mask)


def axpy(alpha, x, y):
    out = torch.empty_like(x)
    axpy_kernel[(triton.cdiv(x.numel(), 256),)](x, y, out, alpha, x.numel(), BLOCK=256)
    return out


assert check_exercise("0.1", axpy)
