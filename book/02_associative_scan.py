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
# # The associative scan
#
# In this chapter you will learn:
#
# - why the step $h \mapsto a h + b$ composes associatively, and how that turns a chain of $L$ dependent steps into a tree of depth $O(\log L)$ (Hillis–Steele and Blelloch trees);
# - how to write the scan as one `tl.associative_scan` over the tuple $(a, b)$ in Triton, and its backward pass as a reverse scan;
# - why the popular log-space formulation loses precision on long sequences while the tuple scan does not.
#
# It builds on [chapter 1](01_sequential_scan.ipynb): the recurrence $h_t = a_t h_{t-1} + b_t$, its float64 reference, and its gradient $\lambda_t = g_t + a_{t+1}\lambda_{t+1}$, which we computed there one step at a time.
#
# ```{admonition} Notation (as in chapter 1)
# | symbol | meaning |
# |---|---|
# | $t$, $s$, $L$ | time steps ($t$ the output, $s$ an earlier input), sequence length |
# | $a_t$, $b_t$ | decay and input of step $t$: the affine map $h \mapsto a_t h + b_t$, stored as the pair $(a_t, b_t)$ |
# | $\circ$, $\bullet$ | composition of functions, later map on the left ($f_1 \circ f_0$: first $f_0$); the scan operator on pairs, earlier pair on the left |
# | $h_t$, $h_{-1}$ | the state after step $t$, the initial state |
# | $\pi_t = \prod_{s \le t} a_s$ | the running product of the decays, the first component of a scanned pair |
# | $g_t$, $\lambda_t$ | the gradient arriving at $h_t$ from above, and the total derivative $d\mathcal J/dh_t$ |
# ```

# %%
import matplotlib.pyplot as plt
import torch

from mamba_annotated import runtime, sequential_scan
from mamba_annotated.bench import gbps, median_ms, memory_floor_ms, print_table
from mamba_annotated.figures import COLORS, show_source
from mamba_annotated.scan.associative import (combine_both_bracketings, tuple_scan_backward, tuple_scan_bwd_kernel,
                                              tuple_scan_forward, tuple_scan_fwd_kernel)
from mamba_annotated.scan.combine import first_order_combine, first_order_combine_torch
from mamba_annotated.scan.log_space import log_space_scan
from mamba_annotated.scan.reference import check_scan_gradients, linear_scan_ref
from mamba_annotated.testing import assert_associative, check, randn, rel_error, seed_everything, tolerance, uniform

seed_everything(0)

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## One step is an affine map, and affine maps compose
#
# Read one step of the recurrence as a function of the previous state: $f_t(h) = a_t h + b_t$. The whole scan is the composition $h_t = f_t \circ f_{t-1} \circ \dots \circ f_0\,(h_{-1})$, written as usual for functions: the map applied first stands on the right. Store an affine map as the pair $(a, b)$; applying $(a_1, b_1)$ and then $(a_2, b_2)$ gives $a_2(a_1 h + b_1) + b_2 = (a_1 a_2)\, h + (a_2 b_1 + b_2)$, the affine map with pair $(a_1 a_2,\; a_2 b_1 + b_2)$. For pairs we write the operator the other way round, with its own symbol $\bullet$: the earlier map on the left, the order in which a scan meets them,
#
# $$
# \begin{gathered}
# (a_1, b_1) \bullet (a_2, b_2) = (a_1 a_2,\; a_2 b_1 + b_2), \\
# \text{the pair of } f_2 \circ f_1 .
# \end{gathered}
# $$
#
# **Associativity.** Both bracketings of three maps give the same pair:
#
# $$
# \begin{aligned}
# &\big((a_1,b_1)\bullet(a_2,b_2)\big)\bullet(a_3,b_3) \\
# &\qquad = (a_1 a_2 a_3,\; a_3(a_2 b_1 + b_2) + b_3),
# \end{aligned}
# $$
# $$
# \begin{aligned}
# &(a_1,b_1)\bullet\big((a_2,b_2)\bullet(a_3,b_3)\big) \\
# &\qquad = (a_1 a_2 a_3,\; a_2 a_3 b_1 + a_3 b_2 + b_3),
# \end{aligned}
# $$
#
# and the second components are equal after expanding. (Shorter: composition of functions is always associative, and the pair is just a function.) The operator is *not* commutative: the order of time matters.
#
# **Identity.** $(1, 0)$, the map $h \mapsto h$: $(1,0)\bullet(a,b) = (a, b) = (a,b)\bullet(1,0)$. The kernel pads a block past the end of the row (one recurrence: chapter 1's channel) with it. In a forward scan the padding comes after every real element and cannot reach them; in a reverse scan it comes first, and there the identity makes sure it changes nothing.
#
# **The prefixes are the states.** Write the prefix up to step $t$ as $(\pi_t, c_t) = (a_0, b_0) \bullet \dots \bullet (a_t, b_t)$, the map $h \mapsto \pi_t h + c_t$ that takes $h_{-1}$ to $h_t$. One more step gives $(\pi_{t-1}, c_{t-1}) \bullet (a_t, b_t) = (\pi_{t-1} a_t,\; a_t c_{t-1} + b_t)$: $\pi_t$ is the running product of the decays, and $c_t$ obeys the recurrence itself from $c_0 = b_0$, so it is the state started from $h_{-1} = 0$. **The initial state** is one more map: $h_{-1}$ folds into the first element as $b_0 \leftarrow b_0 + a_0 h_{-1}$ (that is $f_0(h_{-1})$), which makes $c_t = h_t$ exactly. The scan of the pairs therefore returns the states in its second component and the running products $\pi_t$ in its first.
#
# **Why this gives $O(\log L)$ depth.** Write $e_t = (a_t, b_t)$ for the pair of step $t$. Two counts describe a parallel scan: its *depth*, the number of rounds that must run one after another (the combines within a round are independent), and its *work*, the total number of combines.
#
# Because $\bullet$ is associative, the prefix $e_0 \bullet e_1 \bullet \dots \bullet e_t$ can be bracketed in any way. Combine neighbours: $L/2$ independent combines give the runs $0..1$, $2..3$, .... Combine those: $L/4$ combines give $0..3$, $4..7$, .... After $\log_2 L$ rounds the composition of the whole sequence is known.
#
# Some prefixes came out on the way ($0..1$, $0..3$, $0..7$ for $L = 8$); each of the others is one more combine of runs already known: $0..5 = (0..3) \bullet (4..5)$, then $0..2 = (0..1) \bullet e_2$, $0..4 = (0..3) \bullet e_4$, $0..6 = (0..5) \bullet e_6$. Blelloch's tree (the right panel of the figure below) does these in a second pass of $\log_2 L - 1$ rounds back down the tree; the next section shows another schedule. Either way, with enough processors, the chain of $L$ dependent steps becomes $O(\log L)$ dependent rounds {cite}`blelloch1990prefix,martin2018parallelizing`.
#
# The implementation in the package, in Triton and in PyTorch (`mamba_annotated/scan/combine.py`):

# %%
show_source(first_order_combine)

# %% [markdown]
# Before trusting any scan, we test the claim itself: random triples, both bracketings, in float64. (This matters more than it looks: Triton's {term}`interpreter` folds a scan strictly left to right, so a non-associative {term}`combine` passes every CPU test, and then fails on a GPU, which brackets differently.)

# %%
def random_element():
    return uniform(64, low=-1.5, high=1.5, dtype=torch.float64), randn(64, dtype=torch.float64)


assert_associative(first_order_combine_torch, random_element, tol=1e-12)
print("PyTorch combine: associative on 100 random triples: True")

# %% [markdown]
# And the Triton function itself, applied in both bracketings inside a tiny kernel (`combine_both_bracketings`), then compared with the PyTorch twin in float64:

# %%
a3, b3 = uniform(3, 64, low=-1.5, high=1.5), randn(3, 64)
left, right = combine_both_bracketings(a3, b3)
x, y, z = [(a3[i].double(), b3[i].double()) for i in range(3)]
check("Triton combine: (x • y) • z vs x • (y • z)", left, right, tolerance(torch.float32))
check("Triton combine vs PyTorch combine", left, torch.stack(first_order_combine_torch(first_order_combine_torch(x, y), z)),
      tolerance(torch.float32))

# %% [markdown]
# ## Two scan trees on eight elements
#
# *Hillis–Steele* {cite}`hillis1986data`: in round $k = 1, \dots, \log_2 L$ (row $k$ of the figure below) every element $i \ge 2^{k-1}$ combines with element $i - 2^{k-1}$. Depth $\log_2 L$, but every round touches almost every element: work $O(L \log L)$.
#
# *Blelloch* {cite}`blelloch1990prefix`, drawn here in its inclusive form: every output includes its own element, as our scan needs, where Blelloch's original scan is exclusive (output $t$ combines elements $0..t-1$); this inclusive tree is also known as the Brent–Kung tree. An up-sweep builds a reduction tree (the pairs, the quadruples, ...), and a down-sweep pushes the partial results back down to the elements that still miss a prefix. Depth $2\log_2 L - 1$, work $2L - 2 - \log_2 L$ combines: $O(L)$, 11 for $L = 8$.
#
# On a GPU the two are mixed: each thread first folds its few consecutive elements sequentially (work-efficient), the threads of a {term}`warp` then run a Hillis–Steele scan through {term}`register <registers>` {term}`shuffles <shuffle>` (shallow), and warps exchange their totals through {term}`shared memory`. `tl.associative_scan` generates that code for us from the combine function.

# %%
def hillis_steele_edges(n):
    rounds, step = [], 1
    while step < n:
        rounds.append([(i - step, i) for i in range(step, n)])
        step *= 2
    return rounds


def blelloch_edges(n):
    rounds, step = [], 1
    while step < n:  # up-sweep: the last element of each block of 2*step gathers the block
        rounds.append([(i - step, i) for i in range(2 * step - 1, n, 2 * step)])
        step *= 2
    step //= 2
    while step >= 1:  # down-sweep: a block total feeds the element half a block further on
        rounds.append([(i, i + step) for i in range(2 * step - 1, n - step, 2 * step)])
        step //= 2
    return [r for r in rounds if r]


def draw_tree(ax, rounds, n, title):
    for level in range(len(rounds) + 1):
        ax.scatter(range(n), [level] * n, s=90, zorder=3,
                   color=COLORS["x"] if level == 0 else COLORS["h"] if level == len(rounds) else "white",
                   edgecolor="black")
    for level, edges in enumerate(rounds):
        targets = {dst for _, dst in edges}
        for i in range(n):
            if i not in targets:
                ax.plot([i, i], [level, level + 1], color="lightgrey", zorder=1)
        for src, dst in edges:
            ax.plot([src, dst], [level, level + 1], color=COLORS["carry"], zorder=2)
            ax.plot([dst, dst], [level, level + 1], color="black", lw=0.8, zorder=2)
    work = sum(len(e) for e in rounds)
    ax.set(title=f"{title}\ndepth {len(rounds)}, work {work} combines", xticks=range(n), xlabel="element",
           yticks=range(len(rounds) + 1), ylabel="round")
    ax.invert_yaxis()


fig, axes = plt.subplots(1, 2, figsize=(11, 4))
draw_tree(axes[0], hillis_steele_edges(8), 8, "Hillis–Steele")
draw_tree(axes[1], blelloch_edges(8), 8, "Blelloch (up-sweep, then down-sweep)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Each red edge is one combine (the element it starts from is the *earlier* map); grey lines carry a value unchanged. Blue dots are the inputs $(a_t, b_t)$, orange dots the prefixes $(\pi_t, h_t)$. The trade is visible in the titles: on eight elements Hillis–Steele needs 3 rounds and 17 combines, Blelloch 5 rounds and only 11.
#
# A quick check that both trees, run with our combine in float64, compute every prefix:

# %%
def run_tree(rounds, elements):
    values = list(elements)
    for edges in rounds:
        updated = list(values)
        for src, dst in edges:
            updated[dst] = first_order_combine_torch(values[src], values[dst])
        values = updated
    return values


elements = [(uniform(1, low=0.5, high=1.0, dtype=torch.float64), randn(1, dtype=torch.float64)) for _ in range(8)]
a8 = torch.cat([e[0] for e in elements])
b8 = torch.cat([e[1] for e in elements])
for name, rounds in [("Hillis–Steele", hillis_steele_edges(8)), ("Blelloch", blelloch_edges(8))]:
    h_tree = torch.cat([value[1] for value in run_tree(rounds, elements)])
    check(f"{name} tree on 8 elements", h_tree, linear_scan_ref(a8, b8), 1e-12)

# %% [markdown]
# ## The kernel: one `tl.associative_scan` over a tuple
#
# `tl.associative_scan(inputs, axis, combine_fn)` scans a block along one axis with any associative `combine_fn`. When `inputs` is a tuple of $k$ tensors, the combine takes $2k$ arguments, flattened: the $k$ components of the left (earlier) operand, then the $k$ of the right one, and it returns a tuple of $k$. For the pairs that is the four-argument `first_order_combine(a_left, b_left, a_right, b_right)` shown above, returning `(a, b)`; a single tensor gets a two-argument combine, as in exercise 2.3. The scan of the pairs gives at position $t$ the composed map $(\pi_t,\, h_t)$: its second component *is* the state. One {term}`program` owns one row and holds all of it in one block; padding is the identity $(1, 0)$; the initial state folds into the first element; `reverse=True` scans from the end, which is exactly $h_t = a_t h_{t+1} + b_t$.

# %%
show_source(tuple_scan_fwd_kernel)

# %% [markdown]
# Run it on fresh inputs and a row length that is not a power of two (the block is the next power of two, padded with the identity):

# %%
rows, length = runtime.size(gpu=(4 * 1536, 2000), cpu=(5, 100))
a = uniform(rows, length, low=0.6, high=1.0)
b = randn(rows, length)
h0 = randn(rows)
h = tuple_scan_forward(a, b, h0)

# %%
check("forward, float32", h, linear_scan_ref(a, b, h0), tolerance(torch.float32))

# %% [markdown]
# The edge cases: one step, 7 steps, the reverse direction, no initial state, 16-bit inputs (accumulated in float32, rounded once on output).

# %%
for length_case in [1, 7]:
    a_s, b_s = uniform(rows, length_case, low=0.6, high=1.0), randn(rows, length_case)
    check(f"length {length_case}", tuple_scan_forward(a_s, b_s, h0), linear_scan_ref(a_s, b_s, h0), tolerance(torch.float32))
check("reverse", tuple_scan_forward(a, b, h0, reverse=True), linear_scan_ref(a, b, h0, reverse=True), tolerance(torch.float32))
check("no initial state", tuple_scan_forward(a, b), linear_scan_ref(a, b), tolerance(torch.float32))
for dtype in (torch.float16, torch.bfloat16):
    check(f"forward, {str(dtype).removeprefix('torch.')}", tuple_scan_forward(a.to(dtype), b.to(dtype), h0),
          linear_scan_ref(a.to(dtype), b.to(dtype), h0), tolerance(dtype))

# %% [markdown]
# ## The backward pass is a reverse scan
#
# Chapter 1 derived the {term}`adjoint` $\lambda_t = d\mathcal J / dh_t$, the total derivative of the loss $\mathcal J$, from the upstream gradients $g_t = \partial\mathcal J / \partial h_t$:
#
# $$
# \lambda_t = g_t + a_{t+1}\lambda_{t+1}, \qquad \lambda_{L-1} = g_{L-1}.
# $$
#
# This is the same first-order recurrence, run from the end, over the pairs $(a_{t+1}, g_t)$: the decay that multiplies $\lambda_{t+1}$ belongs to the *next* step. So it is one more {term}`associative scan`, with `reverse=True` and the decays loaded one position later (past the end the kernel loads 0 for both $a$ and $g$; that is not the identity, but composed it is the map $h \mapsto 0$, which is exactly right here, since the reverse scan must start from $\lambda_L = 0$). Then, as before,
#
# $$
# \begin{gathered}
# \frac{\partial\mathcal J}{\partial b_t} = \lambda_t, \qquad \frac{\partial\mathcal J}{\partial a_t} = \lambda_t h_{t-1}, \\
# \frac{\partial\mathcal J}{\partial h_{-1}} = a_0\lambda_0 ,
# \end{gathered}
# $$
#
# with $h_{-1}$ the initial state. For `reverse=True` every index mirrors: $\lambda_t = g_t + a_{t-1}\lambda_{t-1}$ runs forwards, $\partial\mathcal J/\partial a_t = \lambda_t h_{t+1}$ and $\partial\mathcal J/\partial h_{-1} = a_{L-1}\lambda_{L-1}$. The kernel reads $a$, $h$, $g$ and $h_{-1}$ once and writes all three gradients:

# %%
show_source(tuple_scan_bwd_kernel)

# %% [markdown]
# We check all three gradients against autograd through the float64 loop, with a random upstream gradient, in both directions:

# %%
kernels = (tuple_scan_forward, tuple_scan_backward)
check_scan_gradients("forward direction", *kernels, a, b, h0, reverse=False)
check_scan_gradients("reverse direction", *kernels, a, b, h0, reverse=True)
check_scan_gradients("bfloat16 inputs", *kernels, a.bfloat16(), b.bfloat16(), h0, reverse=False)

# %% [markdown]
# ## Numerics: the tuple scan against the log-space scan
#
# A popular way to avoid writing a custom scan {cite}`heinsen2023efficient` rewrites the recurrence with library scans. With the running product $\pi_t = \prod_{s \le t} a_s$, each product of decays in chapter 1's unrolled sum is a ratio, $\prod_{k=s+1}^{t} a_k = \pi_t / \pi_s$, so from a zero initial state
#
# $$
# \begin{aligned}
# h_t &= \pi_t \sum_{s \le t} \frac{b_s}{\pi_s}
# \quad\Longrightarrow \\
# \log h_t &= \underbrace{\textstyle\sum_{s\le t}\log a_s}_{\texttt{cumsum}} \\
# &\quad + \underbrace{\log \textstyle\sum_{s \le t} e^{\log b_s - \log \pi_s}}_{\texttt{logcumsumexp}}
# \end{aligned}
# $$
#
# (for positive $b$; signs need complex logarithms). The catch is the size of the numbers: $\log \pi_t$ grows like $t$ times the mean of $|\log a|$, and a float32 number of that size carries an absolute error of about $|\log \pi_t| \cdot 2^{-24}$. The two large terms then cancel to give $\log h_t$, which is of order one, and their absolute error survives as a *relative* error of $h_t$ (an error $\delta$ in $\log h_t$ multiplies $h_t$ by $e^{\delta} \approx 1 + \delta$) — growing linearly with the length. The tuple scan never forms a large number: every combine multiplies decays below one and adds bounded states, so its error stays near float32 resolution.

# %%
show_source(log_space_scan)

# %% tags=["nbval-ignore-output"]
lengths = runtime.size(gpu=[2**k for k in range(6, 17, 2)], cpu=[16, 64, 256, 1024])
errors = {"tuple scan (Triton, float32)": [], "log-space scan (PyTorch, float32)": []}
for length_case in lengths:
    a_l = uniform(8, length_case, low=0.9, high=1.0)
    b_l = uniform(8, length_case, low=0.1, high=1.1)
    ref = linear_scan_ref(a_l, b_l)
    errors["tuple scan (Triton, float32)"].append(rel_error(tuple_scan_forward(a_l, b_l), ref))
    errors["log-space scan (PyTorch, float32)"].append(rel_error(log_space_scan(a_l, b_l), ref))
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for (name, errs), color in zip(errors.items(), [COLORS["y"], COLORS["decay"]]):
    ax.loglog(lengths, errs, "o-", color=color, label=name)
ax.set(xlabel="sequence length L", ylabel=r"$\|h - h_{ref}\| / \|h_{ref}\|$", title="relative error against float64")
ax.grid(alpha=0.3)
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The plot's verdict: the log-space error grows in proportion to the length at long lengths, about fourfold for every fourfold $L$ from $L = 1024$ on, from about $2 \cdot 10^{-7}$ at $L = 64$ to about $10^{-4}$ at $L = 65536$, and passes the book's float32 bound of $10^{-5}$ between $L = 4096$ and $16384$. Its size is what the estimate above predicts: with decays in $(0.9, 1)$ the mean $|\log a|$ is about 0.05, so $|\log \pi_t|$ reaches about 3400 at the last step and $3400 \cdot 2^{-24} \approx 2 \cdot 10^{-4}$ there; the plotted error is a norm over all steps, whose errors grow in proportion to $t$, so it lands near $1/\sqrt 3$ of the last step's, about $1.2 \cdot 10^{-4}$, close to the $10^{-4}$ measured. The tuple scan's error stays flat at about $7 \cdot 10^{-8}$, float32's resolution. The check below asserts less than the plot shows: the tuple scan within the float32 bound at every length, and the log-space error more than ten times the tuple scan's at the longest length (it is over a thousand times).

# %%
tuple_errors = errors["tuple scan (Triton, float32)"]
assert all(e < tolerance(torch.float32) for e in tuple_errors)
print(f"tuple scan, worst length: rel err {max(tuple_errors):.1e} < {tolerance(torch.float32):.0e}")
assert errors["log-space scan (PyTorch, float32)"][-1] > 10 * errors["tuple scan (Triton, float32)"][-1]
print("log-space error > 10x tuple-scan error at the longest length: True")

# %% [markdown]
# ## Speed: a tree instead of a chain
#
# Same problem as chapter 1's timing (`8 × 1536` rows, float32), with rows of 1024 to 16384 steps (the one-block limit, `MAX_LENGTH`, is 65536). The tuple scan reads $a$, $b$ once and writes $h$ once, like the sequential kernel, but each program now loads a whole row at once, contiguous along time, with several warps per program: many bytes in flight, where the sequential kernel had a few scattered columns.

# %% tags=["nbval-ignore-output"]
rows = runtime.size(gpu=8 * 1536, cpu=8)
timing_rows, lengths = [], runtime.size(gpu=[1024, 4096, 16384], cpu=[64, 256])
for length_case in lengths:
    a_t, b_t = uniform(rows, length_case, low=0.6, high=1.0), randn(rows, length_case)
    nbytes = 3 * a_t.numel() * a_t.element_size()
    for name, fn in [("sequential (ch. 1)", sequential_scan), ("tuple scan", tuple_scan_forward)]:
        ms = median_ms(lambda: fn(a_t, b_t))
        timing_rows.append(dict(L=length_case, kernel=name, ms=ms, GBps=gbps(nbytes, ms),
                                pct_of_floor=100 * memory_floor_ms(nbytes) / ms))
print(f"device: {runtime.device_name()}")
print_table(timing_rows)
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for name, color in [("sequential (ch. 1)", COLORS["decay"]), ("tuple scan", COLORS["y"])]:
    points = [(r["L"], r["pct_of_floor"]) for r in timing_rows if r["kernel"] == name]
    ax.semilogx(*zip(*points), "o-", base=2, color=color, label=name)
ax.axhline(100, color="black", ls="--", label="memory floor")
ax.set(xlabel="sequence length L", ylabel="% of memory-floor speed", title=f"forward, float32, {rows} rows")
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The verdict: the tuple scan is several times as fast as the sequential kernel and close to the memory floor. In this page's run it reaches 88%, 99% and 103% of the floor at $L$ = 1024, 4096 and 16384, and at $L = 4096$ it takes 0.145 ms against the sequential kernel's 0.879 ms, six times as fast. The stored H200 benchmark agrees (87%, 98% and 103%; 0.146 against 0.905 ms; its tuple-scan rows are the `tuple` rows of the `packing` section of `book/data/linear_scan_bench.json`). Passing 100% is possible because the floor is the speed of `torch`'s copy kernel, a measured reference rather than a hard bound, as chapter 1 explains. The table above gives this GPU's numbers.

# %% [markdown]
# ## What we have, and what comes next
#
# The step of the recurrence is an affine map; composing affine maps ($\bullet$ on pairs) is associative with identity $(1, 0)$; so the recurrence is a scan, computable in $O(\log L)$ depth. One `tl.associative_scan` over the tuple $(a, b)$ is the whole forward kernel, and the backward pass is the same scan run the other way over $(a_{t+1}, g_t)$. Working on pairs keeps float32 precision at any length, where the log-space rewrite loses accuracy linearly with length.
#
# One question and one limit remain. Chapter 3 looks back at a trick from before Triton could scan tuples — packing $(a, b)$ into one 64-bit word — and asks whether it still pays. Chapter 4 lifts the one-block limit (`MAX_LENGTH`, 65536 steps in one program, the package's cap: at that length a block's 131072 32-bit values are already twice the register file of an H100's or H200's {term}`SM`, so it {term}`spills <spill>` to local memory) by chaining blocks with {term}`carries <carry>`.
#
# **Exercises** (the tests in `tests/test_associative_scan.py` check the answers):
#
# 1. Show that $(1, 0)$ is a two-sided identity of the combine, and that no other pair is (`test_identity_element` checks the first part on random pairs).
# 2. The scan computes the pairs $(\pi_t, h_t)$ with $\pi_t = \prod_{s \le t} a_s$, but `tuple_scan_forward` returns only $h_t$. Make $h_t$ equal $\pi_t$ by choosing $b$ and the initial state `h0`, and so compute the running product of a (rows, L) tensor with `tuple_scan_forward` alone. Compare with `torch.cumprod`; `test_running_product_from_the_scan` holds one answer.
# 3. *A cumulative sum.* With every decay $a_t = 1$ the recurrence is a running sum. Write `cumsum(x)`, the inclusive cumulative sum along the last dimension of `x` (rows, L), float32, $L \le 1024$, as a Triton kernel: one program per row, the whole row in one block, and `tl.associative_scan` with an `add` combine of your own.
#
# ```{admonition} Answers to exercises 2.1 and 2.2 (click to show)
# :class: dropdown
# 2.1. $(1,0)\bullet(a,b) = (a,\; a\cdot 0 + b) = (a,b)$ and $(a,b)\bullet(1,0) = (a,\; 1\cdot b + 0) = (a,b)$. If $(e, f)$ is a left identity, $(e,f)\bullet(a,b) = (ea,\; af + b)$ must equal $(a, b)$ for every $(a, b)$: $a = 1$ forces $e = 1$, and $a = 1$, any $b$, forces $f = 0$.
#
# 2.2. With $b = 0$ the recurrence is $h_t = a_t h_{t-1}$, so $h_t = h_{-1}\,\pi_t$; with $h_{-1} = 1$ it is $\pi_t$: `tuple_scan_forward(a, torch.zeros_like(a), torch.ones(rows, device=a.device))`.
# ```
#
# Replace the `raise` in the stub and run the cell; the checker (`mamba_annotated.exercises`) compares your function with the float64 scan on fresh random rows, lengths that are not a power of two included.

# %%
import triton  # the exercises write their own kernels
import triton.language as tl

from mamba_annotated.exercises import check as check_exercise


def cumsum(x):
    raise NotImplementedError  # your code here


attempted = check_exercise("2.3", cumsum)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
@triton.jit
def add(x, y):
    return x + y


@triton.jit
def cumsum_kernel(x_ptr, y_ptr, length, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * length + t, mask=t < length, other=0.0)  # 0: the identity of the combine
    tl.store(y_ptr + row * length + t, tl.associative_scan(x, 0, add), mask=t < length)


def cumsum(x):
    rows, length = x.shape
    y = torch.empty_like(x)
    cumsum_kernel[(rows,)](x, y, length, BLOCK=triton.next_power_of_2(length))
    return y


assert check_exercise("2.3", cumsum)
