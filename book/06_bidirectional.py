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
# # Bidirectional SSMs: quasiseparable matrices
#
# In this chapter you will learn:
#
# - how a bidirectional SSM is a multiplication by a *{term}`quasiseparable`* matrix, a lower {term}`semiseparable` triangle plus an upper one plus a diagonal, and how Bi-Mamba2's and Hydra's forms differ: Hydra shifts each direction's output by one step, which leaves only $D$ on the diagonal;
# - why the reverse direction needs no flipped copy and no right-to-left sum: its decays are differences of left-to-right cumulative sums, like the forward ones, read one position earlier, so both directions cut the sequence into the same {term}`chunks <chunk>` (this chapter calls that cut the *chunk grid*; it is not a Triton launch {term}`grid`), and share one sum when they share $\Delta$;
# - how one fused pipeline computes the full diagonal blocks, the chunk states of both directions from one read of $x$ (and of $B$, when the directions share it), both state passings in one launch and all outputs in one kernel, and what that saves against running a causal kernel twice.
#
# It builds on [chapter 5](05_ssd.ipynb): there a causal SSM was a lower-triangular semiseparable matrix $M$, multiplied chunk by chunk, quadratic inside a chunk and through $P \times N$ states across chunks. Here a second matrix of the same kind runs backwards in time and both are multiplied in one pass.
#
# ```{admonition} Notation (chapter 5's, a prime for the reverse direction)
# The rows from $\ell_{Q-1}$ on are first used in the section on the chunk grid; a first reading can skip them until then.
#
# | symbol | meaning |
# |---|---|
# | $t, s$ | positions: $t$ the output (row), $s$ the input (column) |
# | $L$, $Q$ | sequence length, chunk size |
# | $x_t \in \mathbb{R}^P$ | input of one head at position $t$ ($P$: headdim) |
# | $\Delta_t$, $\Delta'_t$ | step of the forward and of the reverse direction (after bias, softplus, clamp) |
# | $A$ | one negative number per head; a step decays the state by $e^{\Delta_t A}$ |
# | $B_t, C_t \in \mathbb{R}^N$ | input and readout maps ($N$: dstate); $B'_t, C'_t$ those of the reverse direction |
# | $D$ | the skip, per head (or per channel) |
# | $M$; $\mathcal L$, $\mathcal U$ | the whole matrix, $y = Mx$; its lower (forward) and upper (reverse) semiseparable triangles |
# | $Z$ | the shift down by one row (Hydra's form) |
# | $\ell_t = A \sum_{k \le t} \Delta_k$ | cumulative log-decay of the forward direction, counted from the start of the sequence in the first section and from the start of the chunk from the chunk grid on (`a` in the code) |
# | $\ell'_t$, $\ell'_{t-1}$ | the reverse direction's, inclusive (`b`) and exclusive (`e`) of $t$; $\ell'_{-1} = 0$ |
# | $\ell_{Q-1}$, $\ell'_{Q-1}$ | a chunk's last slot: chapter 5's $\ell_{\text{last}}$ |
# | $S_c$, $S'_c$ | what chunk $c$ adds to the forward state (decayed to its end) and to the reverse state (decayed to its start) |
# | $H_c$, $H'_c$ | the forward state entering chunk $c$ from the left, the reverse state entering it from the right (`states_in[0]`, `states_in[1]` in the code) |
# | $r_t$, $\rho_t$ | the decays of row $t$ for the forward and the reverse terms: $\ell_t$ and $\ell'_{t-1}$, or with the shift $\ell_{t-1}$ and $\ell'_t$ |
# | $q_t$, $q'_t$ | the readouts of row $t$: $C_t$ and $C'_t$, or with the shift $C_{t-1}$ and $C'_{t+1}$ |
# | $G$, $G_d$ | the scores of a diagonal block (`G`: $q_t \cdot B_s$ on and below the diagonal, $q'_t \cdot B'_s$ above it) and, without the shift, the reverse direction's scores on the diagonal itself, $C'_t \cdot B'_t$ (`Gd`) |
# ```

# %%
import json
import pathlib

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from mamba_annotated import runtime
from mamba_annotated.bench import median_ms, print_table
from mamba_annotated.bidirectional import bidirectional_chunk_scan
from mamba_annotated.bidirectional.backward import bidirectional_backward
from mamba_annotated.bidirectional.chunk_outputs import chunk_outputs_kernel
from mamba_annotated.bidirectional.chunk_scores import chunk_scores_kernel
from mamba_annotated.bidirectional.chunk_states import chunk_states, chunk_states_kernel
from mamba_annotated.bidirectional.decays import pair_weight, row_decays
from mamba_annotated.bidirectional.forward import bidirectional_forward
from mamba_annotated.bidirectional.naive import bidirectional_two_calls
from mamba_annotated.bidirectional.state_passing import state_passing_kernel
from mamba_annotated.bidirectional.reference import (bidirectional_ref, quasiseparable_matrix,
                                                     reverse_within_sequences, shift_within_sequences)
from mamba_annotated.exercises import check as check_exercise
from mamba_annotated.figures import COLORS, show_source
from mamba_annotated.ssd import ssd_chunk_scan
from mamba_annotated.ssd.chunk_cumsum import chunk_cumsum
from mamba_annotated.ssd.reference import process_dt
from mamba_annotated.testing import assert_gradients_close, check, randn, seed_everything, tolerance, uniform

seed_everything(0)
device = runtime.DEVICE

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## Two directions, one matrix
#
# A causal SSM lets position $t$ see the positions $s \le t$. Models that read a whole sequence at once (masked language models, DNA, images cut into patches) want every position to see both sides, and the bidirectional SSMs get there by adding a second SSM that walks time backwards {cite}`hwang2024hydra,schiff2024caduceus,zhu2024vision`. Per head, with its own step $\Delta'$ and maps $B'$, $C'$:
#
# $$
# \begin{aligned}
# h_t &= e^{\Delta_t A} h_{t-1} + \Delta_t\, x_t B_t^\top, \\
# y^{\rightarrow}_t &= h_t C_t,\\
# g_t &= e^{\Delta'_t A} g_{t+1} + \Delta'_t\, x_t B'^{\top}_t, \\
# y^{\leftarrow}_t &= g_t C'_t .
# \end{aligned}
# $$
#
# Unroll both as in chapter 5. The forward direction gives chapter 5's lower-triangular matrix, called $M$ there and $\mathcal L$ here. Unrolled from $t$, the reverse recurrence is
#
# $$
# \begin{aligned}
# g_t ={}& \Delta'_t\, x_t B'^\top_t \\
#   &+ e^{\Delta'_t A}\, \Delta'_{t+1}\, x_{t+1} B'^\top_{t+1} \\
#   &+ e^{(\Delta'_t + \Delta'_{t+1}) A}\, \Delta'_{t+2}\, x_{t+2} B'^\top_{t+2} + \dots,
# \end{aligned}
# $$
#
# so $x_s$ reaches $g_t$ multiplied by the decays of the steps $k = t, \dots, s-1$, the range $[t, s)$; in the forward direction $x_s$ reaches $h_t$ through the steps $k = s+1, \dots, t$, the range $(s, t]$, its mirror image. A sum over a run of steps is a difference of two prefix sums, so no right-to-left sum is needed. With $\ell'_t = A \sum_{k \le t} \Delta'_k$, the same left-to-right sum as $\ell$ but over the reverse steps, $A \sum_{t \le k < s} \Delta'_k = \ell'_{s-1} - \ell'_{t-1}$ (with $\ell'_{-1} = 0$). Both sums are counted here from the start of the sequence; from the section on the chunk grid on, from the start of the chunk. The two triangles are:
#
# $$
# \begin{aligned}
# \mathcal L_{ts} &= (C_t \cdot B_s)\, e^{\ell_t - \ell_s}\, \Delta_s, && s \le t,\\
# \mathcal U_{ts} &= (C'_t \cdot B'_s)\, e^{\ell'_{s-1} - \ell'_{t-1}}\, \Delta'_s, && s \ge t .
# \end{aligned}
# $$
#
# Both are semiseparable: $\mathcal L_{ts} = (e^{\ell_t} C_t) \cdot (e^{-\ell_s} \Delta_s B_s)$ is the dot product of an $N$-vector that depends only on $t$ with an $N$-vector that depends only on $s$. So a block of $\mathcal L$ lying wholly on or below the diagonal is a (rows $\times N$) matrix times an ($N \times$ columns) one, of rank at most $N$ (the same holds on or above the diagonal for $\mathcal U$), and the diagonal belongs to that low-rank structure. A **quasiseparable** matrix {cite}`eidelman1999new` asks less: only the blocks strictly below and strictly above the diagonal must have rank at most $N$, and the diagonal is free. So $\mathcal L + \mathcal U$ plus any diagonal is quasiseparable: its blocks strictly below the diagonal are blocks of $\mathcal L$, and those strictly above are blocks of $\mathcal U$. Two forms of it are in use. Hydra {cite}`hwang2024hydra` is a mixer layer whose reverse SSM has its own $\Delta'$, $B'$, $C'$ and whose two outputs are each shifted by one step; Bi-Mamba2 {cite}`repo_bimamba2` is a package of Triton kernels in which both directions share $\Delta$, $B$ and $C$, with no shift:
#
# $$
# \begin{aligned}
# M_{\text{Bi-Mamba2}} &= \mathcal L + \mathcal U + \operatorname{diag}(D),\\
# M_{\text{Hydra}} &= Z \mathcal L + Z^\top \mathcal U + \operatorname{diag}(D),
# \end{aligned}
# $$
#
# where $Z$ shifts down by one row ($Z\mathcal L$'s row $t$ is $\mathcal L$'s row $t-1$, zero at a sequence start, and $Z^\top \mathcal U$'s row $t$ is $\mathcal U$'s row $t+1$): each direction's output moves one step along its own direction of travel before the two are added. The package calls Hydra's form `shift=True` and Bi-Mamba2's {cite}`repo_bimamba2` `shift=False`.
#
# **What the shift buys.** Without it the diagonal is $M_{tt} = D + \Delta_t\, C_t \cdot B_t + \Delta'_t\, C'_t \cdot B'_t$: both triangles contain it (with shared parameters it is $D + 2\Delta_t\, C_t \cdot B_t$, the same term twice), and it is tied to the same $B$ and $C$ that set every other entry of $M$. $M_{tt}$ is how much of its own input a position keeps. Tied this way, the vectors that decide how much position $t$ mixes with its neighbours also decide how much it keeps of itself. With the shift, $(Z\mathcal L)_{tt} = \mathcal L_{t-1,\,t} = 0$ because $\mathcal L$ is lower-triangular (and likewise $(Z^\top \mathcal U)_{tt} = \mathcal U_{t+1,\,t} = 0$): the shifted forward output at $t$ reads the state *before* $x_t$ entered it. Inside the op the only path from $x_t$ to $y_t$ is then $D$, a free parameter.
#
# Every block of $M_{\text{Hydra}}$ strictly below its diagonal is a block of $Z\mathcal L$, rows of $\mathcal L$ moved down by one: in $\mathcal L$'s own coordinates it lies on or below $\mathcal L$'s diagonal, so its rank is still at most $N$, because $\mathcal L$ is semiseparable with its diagonal. The same holds above, with $\mathcal U$. So $M_{\text{Hydra}}$ is quasiseparable, and its diagonal, $D$, is independent of its low-rank parts: what Hydra argues a bidirectional mixer should be {cite}`hwang2024hydra`. (Outside the op, Hydra's module adds one more diagonal term that depends on the data, $x_t$ times a linear function of $x_t$ (`fc_D`); `mamba_annotated.modules.Hydra` adds it after the op, as Hydra's own module does.)
#
# Inputs are chapter 5's (`x (batch, L, heads, headdim)`, `dt (batch, L, heads)`, `A (heads,)`, `B, C (batch, L, groups, dstate)`), plus the reverse direction's `dt_rev`, `B_rev`, `C_rev`, which default to `dt`, `B`, `C` (Bi-Mamba2 shares them; Hydra has its own).

# %%
def make_inputs(batch=2, length=45, heads=4, headdim=16, groups=2, dstate=16, dtype=torch.float32, separate=True):
    """Random inputs for every argument of bidirectional_chunk_scan; steps > 0 so every step decays.
    ``separate``: the reverse direction has its own dt, B and C (Hydra); else it shares them."""
    inputs = dict(
        x=randn(batch, length, heads, headdim, dtype=dtype),
        dt=uniform(batch, length, heads, low=0.02, high=0.6),
        A=-uniform(heads, low=0.5, high=2.0),
        B=randn(batch, length, groups, dstate, dtype=dtype),
        C=randn(batch, length, groups, dstate, dtype=dtype),
        D=randn(heads),
        z=randn(batch, length, heads, headdim, dtype=dtype),
        dt_bias=randn(heads, scale=0.5),
    )
    if separate:
        inputs.update(dt_rev=uniform(batch, length, heads, low=0.02, high=0.6),
                      B_rev=randn(batch, length, groups, dstate, dtype=dtype),
                      C_rev=randn(batch, length, groups, dstate, dtype=dtype))
    return inputs


# %% [markdown]
# Here are both matrices for one head of a short sequence. Both panels use the same inputs, with separate reverse parameters, so they differ only in the shift (Bi-Mamba2 itself shares $\Delta$, $B$, $C$ between the directions; sharing changes the values, not the structure). The reference builds them from chapter 5's `ssd_matrix`: the reverse triangle is the causal matrix of the reversed sequence, its rows and columns reversed back.

# %%
show_source(quasiseparable_matrix)

# %%
small = make_inputs(batch=1, length=24, heads=1, groups=1, dstate=4)
step, step_rev = (process_dt(small[k], small["dt_bias"], True) for k in ("dt", "dt_rev"))
reverse = dict(dt_rev=step_rev, B_rev=small["B_rev"], C_rev=small["C_rev"], D=small["D"])
M = {shift: quasiseparable_matrix(step, small["A"], small["B"], small["C"], shift=shift, **reverse)[0, 0]
     for shift in (False, True)}
fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.6))
for ax, (shift, matrix) in zip(axes, M.items()):
    image = ax.imshow(matrix.abs().log10().clamp(min=-4).cpu(), cmap="Greens", vmin=-4, vmax=1)
    ax.set(title=("Hydra: shift=True" if shift else "Bi-Mamba2: shift=False") + "\nlog10 |M[t, s]|",
           xlabel="s (input position)", ylabel="t (output position)")
fig.colorbar(image, ax=axes, shrink=0.9)
plt.show()

# %% [markdown]
# The two look alike away from the diagonal: Hydra's lower triangle is the left panel's moved down one row, and its upper triangle the left panel's moved up one row. On the diagonal, Hydra's $M$ holds $D$ and nothing else, exactly, while the unshifted form holds $D + \Delta_t\, C_t \cdot B_t + \Delta'_t\, C'_t \cdot B'_t$, one term from each triangle. On the figure's logarithmic colours the diagonal is hard to tell from its neighbours, so the next cell checks it exactly:

# %%
diagonal = {shift: matrix.diagonal() for shift, matrix in M.items()}
D_row = small["D"].double().expand(24)
both_terms = sum(d[0, :, 0] * (c[0, :, 0].double() * b[0, :, 0].double()).sum(-1)
                 for d, b, c in ((step, small["B"], small["C"]), (step_rev, small["B_rev"], small["C_rev"])))
print("shift=True:  diagonal == D exactly:", torch.equal(diagonal[True], D_row))
check("shift=False: diagonal = D + dt C.B + dt' C'.B'", diagonal[False], D_row + both_terms, 1e-12)

# %% [markdown]
# And the rank structure: every block strictly below the diagonal, $M[i{:},\, {:}i]$, and every block strictly above it has rank at most $N$, for both forms (numerical rank in float64: singular values above $10^{-10}$ of the largest), while $M$ itself has full rank. The test cannot tell the two forms apart: they differ in what sets the diagonal, which the cell above showed.

# %%
def rank(block):
    return int(torch.linalg.matrix_rank(block, rtol=1e-10))


length, dstate = 24, 4
for shift, matrix in M.items():
    below = max(rank(matrix[i:, :i]) for i in range(1, length))
    above = max(rank(matrix[:i, i:]) for i in range(1, length))
    print(f"shift={shift!s:5}: largest rank below the diagonal {below}, above {above}; N = {dstate}; "
          f"rank of M {rank(matrix)} of {length}")
    assert below <= dstate and above <= dstate

# %% [markdown]
# ## The float64 reference, and two calls of chapter 5
#
# `bidirectional_ref` multiplies by $M$ in float64 (the quadratic form), and `tests/test_bidirectional.py` checks it against an independent pair of loops over time. The obvious way to compute the same thing with kernels is chapter 5's causal SSD called twice: once on the sequence, once on its reverse, with the reversals and the sum in PyTorch. That composition, `bidirectional_two_calls`, agrees with the reference:

# %%
chunk = 16
for shift in (False, True):
    inp = make_inputs(separate=shift)
    got = bidirectional_two_calls(**inp, chunk_size=chunk, dt_softplus=True, shift=shift)
    check(f"two calls of ssd_chunk_scan = reference, shift={shift}", got,
          bidirectional_ref(**inp, dt_softplus=True, shift=shift), tolerance(torch.float32))

# %% [markdown]
# **Packed sequences.** With `seq_idx` (or `cu_seqlens`) several sequences share a row. No state may cross a boundary in either direction, and "reverse" must mean reversing each sequence within itself; reversing the whole row would hand the last sequence's tail to the first sequence's reverse pass. (Hydra's module stacks the sequence and its whole-row flip along the batch and passes its `seq_idx` on unchanged, which is right only for one sequence per row.) `reverse_within_sequences` sends position $i$ of the sequence that occupies positions $[\text{start}, \text{end})$ to $\text{start} + \text{end} - 1 - i$, and the shift puts a zero at every sequence start:

# %%
seq_idx = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2]], device=device)
positions = torch.arange(8.0, device=device)[None, :, None] + 1
print("positions         ", positions[0, :, 0].int().tolist())
print("reversed per seq. ", reverse_within_sequences(positions, seq_idx)[0, :, 0].int().tolist())
print("shifted per seq.  ", shift_within_sequences(positions, seq_idx)[0, :, 0].int().tolist())

# %% [markdown]
# ## One chunk grid for both directions
#
# The two-call composition reads $x$, $B$ and $C$ twice, writes and reads a reversed copy of every input and of the reverse output, and sums the two outputs in one more pass. The fused algorithm starts from one observation: **the reverse decays are left-to-right cumulative sums (of $\Delta'$), read one position earlier.** With $\ell'$ counted from the start of a chunk like $\ell$ (so $\ell'_{-1} = 0$ there), the decay of the reverse direction from $s$ back to $t$ is $e^{\ell'_{s-1} - \ell'_{t-1}}$, an *exclusive* cumulative sum. When the directions share their step (Bi-Mamba2), $\ell' = \ell$ and one cumulative sum serves both. Either way both directions live on the same chunks of $Q$ positions, and for $t$ in chunk $c$:
#
# $$
# \begin{aligned}
# y_t ={}& \textstyle\sum_{s \in c} (\mathcal L + \mathcal U)_{ts}\, x_s
#   \;+\; e^{\ell_t}\, H_c C_t \\
#   &+\; e^{\ell'_{Q-1} - \ell'_{t-1}}\, H'_c C'_t \;+\; D\, x_t .
# \end{aligned}
# $$
#
# (This is the form without the shift; the shifted one follows below.) The first term is the diagonal block, now full: both triangles, each with its own decay, in one pass over the block. The second is chapter 5's: $H_c$ is the forward state entering chunk $c$ from the left, the state $h$ just before the chunk's first position. The third is its mirror image: $H'_c$ is the reverse state entering chunk $c$ from the right, $g$ at the first position of chunk $c+1$, which holds every $x_s$ after chunk $c$; to reach row $t$ it must still decay through the steps $t, \dots, Q-1$ of chunk $c$, which with $\ell'$ counted from the chunk's start is $e^{\ell'_{Q-1} - \ell'_{t-1}}$ (the reverse decay split at the chunk's end, as chapter 5 split the forward one at its start). Each state is passed along by a short recurrence over chunks, fed by chunk states that decay to the chunk's *end* (forward) or to its *start* (reverse); $\ell_{Q-1}(c)$ is the last slot of chunk $c$'s sum, the log-decay across the whole chunk:
#
# $$
# \begin{aligned}
# S_c &= \textstyle\sum_{s \in c} e^{\ell_{Q-1} - \ell_s}\, \Delta_s\, x_s B_s^\top, \\
# H_{c+1} &= e^{\ell_{Q-1}(c)}\, H_c + S_c,\\
# S'_c &= \textstyle\sum_{s \in c} e^{\ell'_{s-1}}\, \Delta'_s\, x_s B'^{\top}_s, \\
# H'_{c-1} &= e^{\ell'_{Q-1}(c)}\, H'_c + S'_c .
# \end{aligned}
# $$
#
# Read the last line as: the reverse state at the start of chunk $c$, which is $H'_{c-1}$, is the state that came in from the right decayed across all of chunk $c$, plus what chunk $c$ adds. The op takes no initial state, so nothing enters from outside the sequence: $H_0 = 0$, and the reverse state entering the last chunk is 0.
#
# $S_c$ and $S'_c$ are two matmuls over the same tile of $x$ (and, when the directions share it, the same $B$), so one kernel computes both from one read. The two {term}`carries <carry>` are chapter 5's recurrence, one walking the chunks left to right, the other right to left, each only $L/Q$ steps long; they are independent, so one launch runs them side by side.
#
# **The shift.** With `shift=True` nothing new is needed, only other rows. Row $t$ of $Z\mathcal L$ is row $t-1$ of $\mathcal L$, so the forward terms read $C_{t-1}$ and $\ell_{t-1}$ (the exclusive sum again, with $\ell_{-1} = 0$ at a chunk's start, where $C_{t-1}$ comes from the chunk before); row $t$ of $Z^\top \mathcal U$ is row $t+1$ of $\mathcal U$, so the reverse terms read $C'_{t+1}$ and $\ell'_t$. At a chunk's last row, likewise, $C'_{t+1}$ comes from the chunk after. Name what a row reads in each form: its forward and reverse decays $r_t$, $\rho_t$, its readouts $q_t$, $q'_t$, and which columns each triangle takes, written $s \preceq t$ for the forward triangle and $s \succeq t$ for the reverse one.
#
# | form | $r_t$ | $\rho_t$ | $q_t$ | $q'_t$ | $s \preceq t$ | $s \succeq t$ |
# |---|---|---|---|---|---|---|
# | without the shift | $\ell_t$ | $\ell'_{t-1}$ | $C_t$ | $C'_t$ | $s \le t$ | $s \ge t$ |
# | with the shift | $\ell_{t-1}$ | $\ell'_t$ | $C_{t-1}$ | $C'_{t+1}$ | $s < t$ | $s > t$ |
#
# Both forms are then one formula:
#
# $$
# \begin{aligned}
# y_t ={}& \textstyle\sum_{s \in c,\ s \preceq t} (q_t \cdot B_s)\, e^{r_t - \ell_s}\, \Delta_s\, x_s \\
#   &+ \textstyle\sum_{s \in c,\ s \succeq t} (q'_t \cdot B'_s)\, e^{\ell'_{s-1} - \rho_t}\, \Delta'_s\, x_s \\
#   &+ e^{r_t}\, H_c\, q_t + e^{\ell'_{Q-1} - \rho_t}\, H'_c\, q'_t \\
#   &+ D\, x_t .
# \end{aligned}
# $$
#
# Without the shift the diagonal $s = t$ is in both sums; with it, in neither, and $q_t$ ($q'_t$) is zero at a sequence's first (last) position. The kernels below compute exactly these terms.
#
# The pipeline is then chapter 5's, each stage serving both directions: (1) the cumulative sums; (2) $C \cdot B$ on the diagonal blocks; (3) both chunk states; (4) both carries; (5) the outputs. The figure shows which blocks of $M$ each part computes and which way each state travels. On the left, the green diagonal blocks are multiplied whole; every block below them (solid red) reaches its rows through a forward state $H$, and every block above them (hatched) through a reverse state $H'$. On the right, each chunk's $x$ and $B$ give both its chunk states, $S_c$ (drawn above the chunk) and $S'_c$ (below); the solid arrows carry $H$ to the right and the dashed ones $H'$ to the left. The boundary between chunks $c$ and $c+1$ carries $H_{c+1}$ into chunk $c+1$ and $H'_c$ into chunk $c$, and no arrow enters the first chunk from the left or the last from the right: those states are zero.

# %%
Q, n_chunks = 8, 5
span = Q * n_chunks
fig, (ax_m, ax_s) = plt.subplots(1, 2, figsize=(10, 3.9), gridspec_kw=dict(width_ratios=[1, 1.5]))
for c in range(n_chunks):
    for d in range(n_chunks):
        colour = COLORS["y"] if c == d else COLORS["carry"]
        ax_m.add_patch(Rectangle((d * Q, c * Q), Q, Q, facecolor=colour, alpha=0.85 if c >= d else 0.4,
                                 hatch=None if c >= d else "//", edgecolor="white", lw=1.5))
ax_m.set(xlim=(0, span), ylim=(span, 0), aspect="equal", xlabel="s", ylabel="t",
         title="M: diagonal blocks whole (green);\nbelow via H (red), above via H' (hatched)")
for c in range(n_chunks):
    x0 = c * 2.2
    ax_s.add_patch(Rectangle((x0, 0), 1.6, 0.8, facecolor=COLORS["x"], alpha=0.3, edgecolor="black"))
    ax_s.text(x0 + 0.8, 0.4, f"chunk {c}\n$x$, $B$, $C$", ha="center", va="center", fontsize=7)
    for y0, name in ((1.1, f"$S_{c}$"), (-0.7, f"$S'_{c}$")):
        ax_s.add_patch(Rectangle((x0 + 0.3, y0), 1.0, 0.4, facecolor=COLORS["h"], alpha=0.6))
        ax_s.text(x0 + 0.8, y0 + 0.2, name, ha="center", va="center", fontsize=7)
    if c + 1 < n_chunks:
        ax_s.annotate("", xy=(x0 + 2.5, 1.9), xytext=(x0 + 1.1, 1.9),
                      arrowprops=dict(arrowstyle="->", color=COLORS["carry"], lw=1.6))
        ax_s.text(x0 + 1.8, 2.0, f"$H_{c + 1}$", ha="center", fontsize=7, color=COLORS["carry"])
        ax_s.annotate("", xy=(x0 + 1.1, -1.1), xytext=(x0 + 2.5, -1.1),
                      arrowprops=dict(arrowstyle="->", color=COLORS["carry"], lw=1.6, ls="--"))
        ax_s.text(x0 + 1.8, -1.45, f"$H'_{c}$", ha="center", fontsize=7, color=COLORS["carry"])
ax_s.text(-0.2, 2.45, "one read of x (and of B, if shared) per chunk gives S (to the chunk end) and S' (to its start)",
          fontsize=7)
ax_s.text(-0.2, -1.95, "both carries in one launch: H left to right, H' right to left", fontsize=7)
ax_s.set(xlim=(-0.3, n_chunks * 2.2), ylim=(-2.2, 2.7), title="states of both directions, one chunk grid")
ax_s.axis("off")
plt.tight_layout()

# %% [markdown]
# ## The fused kernel
#
# The package's op is `bidirectional_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, *, dt_limit=(0.0, inf), seq_idx=None, cu_seqlens=None, shift=False, dt_rev=None, B_rev=None, C_rev=None)`: Bi-Mamba2's `bimamba_chunk_scan_combined` arguments in their order, with Hydra's form and separate reverse parameters as keyword-only extras. Its forward pass, `mamba_annotated/bidirectional/forward.py`, is the pipeline above in a few lines:

# %%
show_source(bidirectional_forward)

# %% [markdown]
# The package calls the forward cumulative sum `a` (our $\ell$), the reverse direction's inclusive one `b` (our $\ell'$) and its exclusive one `e`, computed as `b` $- A\Delta'_t$ (our $\ell'_{t-1}$). Two `@triton.jit` helpers hold all the bookkeeping of directions and shift. `row_decays` gives each row $t$ its two decays: $r_t$ (`r`) for the forward terms ($\ell_t$, or $\ell_{t-1}$ with the shift) and $\rho_t$ (`rho`) for the reverse ones ($\ell'_{t-1}$, or $\ell'_t$ with the shift).

# %%
show_source(row_decays)

# %% [markdown]
# `pair_weight` gives one entry $(t, s)$ of a diagonal block its weight, the factor of $x_s$ in the formula above without the score: $e^{r_t - \ell_s}\Delta_s$ in the forward triangle and $e^{\ell'_{s-1} - \rho_t}\Delta'_s$ in the reverse one (in the code `a_s` is $\ell_s$ and `e_s` is $\ell'_{s-1}$). It picks the triangle's exponent and step *before* the one exponential, so a weight costs one `exp2` whichever direction it belongs to, and entries across a sequence boundary get $-\infty$ in the exponent:

# %%
show_source(pair_weight)

# %% [markdown]
# ### The scores of the diagonal blocks
#
# `chunk_scores` writes one $Q \times Q$ block of scores $G$ per chunk and group (`G` in the code; chapter 5's $CB$, now with both triangles): $q_t \cdot B_s$ on and below the diagonal, with the row's readout $q_t = C_t$ ($C_{t-1}$ with the shift), and $q'_t \cdot B'_s$ above it, with $q'_t = C'_t$ ($C'_{t+1}$ with the shift). A tile strictly below or above the diagonal computes only the product its triangle needs; when the directions share $B$ and $C$ and there is no shift, the two triangles are one product. Without the shift the diagonal entry $(t, t)$ needs both scores, $C_t \cdot B_t$ and $C'_t \cdot B'_t$: the block holds the first, and a separate vector $G_d$ (`Gd`) the second. With the shift the diagonal's weight is zero and no $G_d$ is needed.
#
# The kernel writes every entry of the block, including those whose weight will be zero. The kernels that read the scores zero the weight, not the score, and $0 \cdot \text{NaN}$ is NaN, so an entry left as uninitialised memory could put a NaN into the output (chapter 5 gives the same reason for `chunk_cb`).

# %%
show_source(chunk_scores_kernel)

# %% [markdown]
# ### Both chunk states from one read of $x$
#
# One {term}`program` per (batch, chunk, head, tile of the state) walks the chunk in steps, loads a tile of $x$ once (and of $B$ once, when the directions share it; else a tile of $B$ and one of $B'$) and accumulates two matmuls: $S_c$ with the weight $e^{\ell_{Q-1} - \ell_s}\Delta_s$ (to the chunk's end) and $S'_c$ with $e^{\ell'_{s-1}}\Delta'_s$ (to its start). As in chapter 5 the weight scales $x$, the operand `tl.dot` may take from {term}`registers`.
#
# With `GRAD=True` (the launch the backward pass makes) the same kernel forms what a chunk's outputs send to the two states entering it, $dH_c = \sum_{t \in c} e^{r_t}\, dy_t\, q_t^\top$ and $dH'_c = \sum_{t \in c} e^{\ell'_{Q-1} - \rho_t}\, dy_t\, q'^\top_t$: the sums of $S_c$ and $S'_c$ with $dy$ in place of $x$, the readouts in place of $B$, and the weights of $y_t$'s state terms.
#
# With `seq_idx` the two states keep different positions (those of the chunk's last sequence and those of the sequence carried in), each one run of the chunk that `sequence_run` finds before the loop (chapter 5's `chunk_state` does the same), so each $B$ tile is loaded once per direction, each load masked to its own run.

# %%
show_source(chunk_states_kernel)

# %% [markdown]
# The kernel against the two sums written out in float64, on fresh inputs with separate reverse steps and $B'$ (the cumulative sums come from chapter 5's `chunk_cumsum`, run once per direction). One difference from chapter 5: this op's kernels take each cumulative sum as a single float32 number, the float64 sum rounded once (`planes=False`), not as chapter 5's two planes (a high and a low float32 part, which together keep the sum to near float64 accuracy). Near the end of a strongly decaying chunk of 256 that brings back the error chapter 5 measured for sums rounded once, about $2 \cdot 10^{-5}$ relative in the exponents of the decays, and so in the weights made from them; the checks here, at a chunk of 16, are too short to show it. (The performance notes at the end say what stands in the way of the two planes here.)

# %%
inp = make_inputs(length=40, separate=True)
heads, groups = inp["x"].shape[2], inp["B"].shape[2]
# this op's kernels take float32 sums (chapter 5's keep each sum's low part in a second plane)
steps = dict(dt_bias=inp["dt_bias"], dt_softplus=True, planes=False)
a, dt_out = chunk_cumsum(inp["dt"], inp["A"], chunk, **steps)
b, dt_rev_out = chunk_cumsum(inp["dt_rev"], inp["A"], chunk, **steps)
states = chunk_states(inp["x"], inp["B"], inp["B_rev"], a, dt_out, b, dt_rev_out, inp["A"])


def by_chunk(t):
    """(batch, L, heads or groups, ...) -> float64 (batch, chunks, Q, heads, ...), zero-padded."""
    t = t.double().repeat_interleave(heads // t.shape[2], dim=2) if t.shape[2] != heads else t.double()
    pad = a.shape[2] * chunk - t.shape[1]
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], 1).unflatten(1, (a.shape[2], chunk))


A64 = inp["A"].double()[:, None, None]
to_end = torch.exp(a.double()[..., -1:] - a.double()) * dt_out.double()          # (batch, heads, chunks, Q)
to_start = torch.exp(b.double() - A64 * dt_rev_out.double()) * dt_rev_out.double()
for name, weight, B_dir, got in (("S (to the chunk end)", to_end, inp["B"], states[0]),
                                 ("S' (to the chunk start)", to_start, inp["B_rev"], states[1])):
    want = torch.einsum("bhcq,bcqhp,bcqhn->bchpn", weight, by_chunk(inp["x"]), by_chunk(B_dir))
    check(f"chunk_states: {name}", got, want, tolerance(torch.float32))

# %% [markdown]
# ### Both carries in one launch
#
# Each carry is chapter 5's blocked recurrence, $L/Q$ dependent steps of a multiply and an add per state element, the multiply by the decay across a chunk, $\gamma_c = e^{\ell_{Q-1}(c)}$ forward and $\gamma'_c = e^{\ell'_{Q-1}(c)}$ in reverse; each step waits for the one before it. One grid holds the programs of both directions (the first half walks the forward states left to right on $\ell$, `a`, the second the reverse ones right to left on $\ell'$, `b`), so neither direction waits for the other to finish. At the benchmark's shapes that does not make two walks as cheap as one: one direction alone already starts more programs than there are SMs (10,240 at the first shape and 1,024 at the second, for 132 SMs), enough to keep every SM busy, so the second direction's programs add their whole time. In the stored kernel table at the end of the chapter the fused carry takes 0.367 ms against 0.187 ms for the causal one at the first shape, and 0.616 against 0.319 at the second: about twice, like most of the other kernels (each row adds the forward pass's launch and the backward pass's). Each program emits the state entering a chunk before it adds the chunk's own; with `GRAD` the same kernel walks each direction the other way on the gradients, and forms each carry's term of the decay gradients, $\langle dS_c, \gamma_c H_c\rangle$, from the float32 gradient before it rounds it for storage (chapter 5 says why).

# %%
show_source(state_passing_kernel)

# %% [markdown]
# ### The outputs
#
# The last kernel sums, for a block of rows of one chunk and head, the four terms of $y_t$: the forward state, $e^{r_t} H_c q_t$, the reverse state, $e^{\ell'_{Q-1} - \rho_t} H'_c q'_t$ (each one matmul over dstate, with the row's readouts $q_t$, $q'_t$ of the notation box), the diagonal block, and $D x_t$, then the gate. Unlike chapter 5's chunk scan, it reads columns across the whole chunk, because the part above the diagonal is now the reverse direction's. In the listing, look for three loops over columns. Only the middle one, over the row block's own band, mixes the two triangles and takes its weights from `pair_weight`. Every column before the band is a forward one and every column after it a reverse one, and there the weights are factored through a reference position $u$ between the rows and the columns: the position just before the row block for the forward columns, $e^{r_t - \ell_u}\, e^{\ell_u - \ell_s}$, and the position just after it for the reverse ones, $e^{\ell'_{s-1} - \ell'_u}\, e^{\ell'_u - \rho_t}$. The first factor depends on the row alone and the second on the column alone, so a tile costs one exponential per row and one per column instead of one per entry (the performance notes at the end say why no factor overflows).

# %%
show_source(chunk_outputs_kernel)

# %% [markdown]
# **The next cell checks it** against the float64 reference on fresh inputs, in both forms: Bi-Mamba2's (no shift, shared reverse parameters) and Hydra's (the shift, separate reverse parameters), each in float32, float16 and bfloat16, at a length (45) that is not a multiple of the chunk (16), with $D$, $z$, `dt_bias` and softplus.

# %%
for shift in (False, True):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        inp = make_inputs(dtype=dtype, separate=shift)
        got = bidirectional_chunk_scan(**inp, chunk_size=chunk, dt_softplus=True, shift=shift)
        check(f"shift={shift!s:5} {'separate' if shift else 'shared  '} {str(dtype)[6:]:8}", got,
              bidirectional_ref(**inp, dt_softplus=True, shift=shift), tolerance(dtype))

# %% [markdown]
# Packed sequences, by `seq_idx` (two rows, one sequence of length 1, a boundary on a chunk edge) and by `cu_seqlens` (one row), with a clamp on the step:

# %%
length = 45
cuts = torch.tensor([5, 6, 16], device=device)
seq_idx = torch.stack([(torch.arange(length, device=device)[:, None] >= cuts).sum(-1),
                       (torch.arange(length, device=device) >= 30).long()]).to(torch.int32)
cu_seqlens = torch.tensor([0, 5, 6, 16, length], dtype=torch.int32, device=device)
for shift in (False, True):
    inp = make_inputs(length=length, separate=shift)
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.0), shift=shift)
    check(f"seq_idx, shift={shift}", bidirectional_chunk_scan(**inp, chunk_size=chunk, seq_idx=seq_idx, **kw),
          bidirectional_ref(**inp, seq_idx=seq_idx, **kw), tolerance(torch.float32))
    one_row = {k: (v[:1] if v.dim() > 1 and v.shape[1] == length else v) for k, v in inp.items()}
    got = bidirectional_chunk_scan(**one_row, chunk_size=chunk, cu_seqlens=cu_seqlens, **kw)
    check(f"cu_seqlens, shift={shift}", got, bidirectional_ref(**one_row, cu_seqlens=cu_seqlens, **kw),
          tolerance(torch.float32))

# %% [markdown]
# **A NaN stays in its sequence.** One diverged sequence in a packed batch should not spoil the others. A weight of 0 for a position of another sequence is not enough to keep it out, because each product still computes $0 \cdot \text{NaN} = \text{NaN}$. Three places had this leak in every form, and the non-finite probe of the GPU reliability scripts (`scripts/reliability/nonfinite.py`, chapter 5) found all three (a fourth, with the shift only, is told with the backward pass below):
#
# - the diagonal block's matmul with $x$;
# - the chunk states, whose weights scaled $x$ and multiplied $B$;
# - the carry, which cut a sequence off by multiplying its state by $\gamma = 0$.
#
# Each now selects instead. The diagonal block uses chapter 5's `drop_hidden_nonfinite`. The chunk states zero both operands of each product (a select on the weighted $x$, the mask of the load on $B$), and the carry selects the carried state. `test_a_non_finite_value_reaches_exactly_the_outputs_that_read_it` in `tests/test_bidirectional.py` checks the result. A NaN or $\infty$ at position $t$ makes the outputs that read it non-finite, and with one exception below, no others. In the form the test runs (no shift, separate reverse parameters), a bad value at $t$ reaches:
#
# - in $x$: its whole sequence;
# - in the forward direction's $\Delta$ or $B$: $t$ and the positions after it;
# - in the reverse direction's $\Delta'$ or $B'$: $t$ and the positions before it;
# - in $C$: $y_t$ alone.
#
# With shared parameters a bad $B_t$ reaches both sides. Every other output keeps its bits. The exception: the reverse decays are differences of chunk-local cumulative sums of $\Delta'$. A bad $\Delta'_t$ makes every later sum of its chunk non-finite, so it also spoils the later positions of its chunk, within its sequence, though they do not read it. Other sequences keep their bits, for two reasons: the sums restart at every sequence boundary (chapter 5's kernel 1), and a weight that crosses a boundary, whose factors may then overflow, is dropped by a select in the forward kernels (and in the backward kernels) rather than multiplied by 0.

# %% [markdown]
# ### The backward pass
#
# The backward pass walks the same chunk grid, and each of chapter 5's backward steps serves both directions at once:
#
# 1. what the outputs of a chunk send to the two states that reach it, $dH_c$ and $dH'_c$, from the chunk-state kernel with `grad=True` (one read of $dy$, and of $C$ when the directions share it);
# 2. the two carries again, each walked the other way;
# 3. $dx$, through the full diagonal block and both states;
# 4. $dG$, the gradient of the diagonal block's scores, and the pair sums of the decay gradients (the next paragraph says what they are);
# 5. $dB$, $dC$ and the reverse direction's $dB'$, $dC'$;
# 6. the gradients of $\Delta$, $\Delta'$, $A$ and `dt_bias` from the decay gradients of both directions, each step's gradient summed over the pairs and positions whose decay holds that step, as in chapter 5.
#
# A reverse pair $(t, s)$, $s > t$, decays by $A \sum_{t \le k < s} \Delta'_k$ (without the shift), so its share of the decay gradient goes to the steps $k$ with $t \le k < s$, the steps it *straddles* in chapter 5's word: the mirror image of a forward pair, which straddles $s < k \le t$. As in chapter 5, the kernels add each step's gradient from the pairs that straddle it (the pair sums of step 4), instead of forming $\partial\mathcal J/\partial \ell_j$ ($\mathcal J$: the loss) at every position $j$ and summing it over $j \ge k$, where most terms cancel in float32. That took the relative error of $dA$ on a float32 case at chunk 256 from $1.3 \cdot 10^{-4}$ to $5.9 \cdot 10^{-6}$ and that of $d\,\mathrm{dt\_bias}$ from $2.7 \cdot 10^{-5}$ to $7.5 \cdot 10^{-7}$ (in the interpreter). Every contribution lands in a slot of its own, so the gradients are the same bits on every run. With the shift, row $t$ read $C_{t-1}$ and $C'_{t+1}$: the gradient formed at row $t$ goes to $C_{t-1}$, one row back, and to $C'_{t+1}$, one row on (`queries_to_rows`).
#
# A NaN in $dy_t$ reaches only the gradients of the inputs that output $t$ reads, and no gradient of another packed sequence, as in chapter 5; a NaN in $x_s$ reaches only the gradients that read $x_s$. The $dG$ kernel (the scores $G$ it loads included) and every state term drop what they must with a select after the product, never by a multiplication by 0. With `seq_idx` a state term is kept only on the rows whose sequence the state belongs to: the sequence carried in from the previous chunk (none in chunk 0, since this op takes no initial state), and the chunk's last sequence when it goes on into the next chunk; never a row past $L$, whatever the ids.
#
# The $dx$ kernel runs a checked second launch over the row blocks whose rows came out non-finite. When the reverse direction has its own step $\Delta'$, the kernel keeps one accumulator per direction, and that launch counts for each only the NaN its own direction sees: $dx_s$ for $s > t$ reads $dy_t$ through the reverse direction alone. With one step for both directions there is one accumulator (see the performance notes).
#
# With the shift a row's own step is in neither of its decays, so the $dG$ kernel's pair sums leave the row itself out (the steps strictly between the pair's two positions), rather than taking its own pairs back by a difference, which made the gradients of step $t$ NaN − NaN when $dy_t$ held a NaN.
#
# A NaN in $B$ or $C$ (or $B'$, $C'$) is kept to the rows that read it by a checked second launch of the $dB$/$dC$ kernel, as chapter 5's $dB$/$dC$ kernel does: the first launch flags the rows whose gradients come out non-finite, and the second recomputes them with `drop_hidden_nonfinite` on the $B$ and query tiles, per accumulator. (With the shift the forward pass had a leak of the same kind, on the diagonal it leaves out: the diagonal's weight is 0, but its score and $x_t$ entered the band's product, so a NaN in $B_t$ (or, without $D$, in $x_t$) made $y_t$ NaN, and one in a sequence's last $C$ the next sequence's first $y$, though neither output reads it. `chunk_outputs_kernel` now drops that entry from the band's tiles and, without $D$, checks the band's $x$ tiles, as it checks every $x$ tile with `seq_idx`. With $D$ it need not: $y_t$ then reads $x_t$ itself, through $D x_t$, so a NaN in a channel of $x_t$ belongs in that channel of $y_t$, where the product puts it.)

# %%
show_source(bidirectional_backward)

# %% [markdown]
# Every gradient, against float64 autograd through the reference, with packed sequences. Bi-Mamba2's form shares its parameters between the directions, so it has no reverse gradients of its own; Hydra's form adds those of $\Delta'$, $B'$ and $C'$ (`ddt_rev`, `dB_rev`, `dC_rev`):

# %%
for shift in (False, True):
    inp = make_inputs(length=37, heads=2, groups=1, separate=shift)
    grad_inputs = {k: v.clone().requires_grad_() for k, v in inp.items()}
    kw = dict(dt_softplus=True, seq_idx=seq_idx[:, :37].contiguous(), shift=shift)
    errors = assert_gradients_close(lambda **a: bidirectional_chunk_scan(**a, chunk_size=chunk, **kw),
                                    lambda **a: bidirectional_ref(**a, **kw), grad_inputs, tol=1e-4)
    for name, err in errors.items():
        print(f"shift={shift!s:5} d{name}: rel err {err:.1e} < 1e-04")

# %% [markdown]
# ## The foil: two calls
#
# The naive way, from `mamba_annotated/bidirectional/naive.py`, is a few lines of PyTorch around chapter 5's kernel. It is correct (we checked it above), and it is how a bidirectional SSM is computed wherever no fused kernel is at hand:

# %%
show_source(bidirectional_two_calls)

# %% [markdown]
# Counting the passes over memory makes its cost plain. The reverse call reads reversed copies of $x$, $\Delta'$, $B'$ and $C'$, each made by a flip (or a gather, for packed sequences) that reads and writes the whole tensor; its output is reversed again; then the casts to float32, the sum, the skip and the cast back each make one more pass over an output-sized tensor. Each call reads $x$ twice (its chunk-state and output kernels), so the two calls read it four times, and each reads its own $B$ and $C$. The fused pipeline reads $x$ twice in all and makes no copy: the reverse direction reads the same tiles through the same chunk grid, and the outputs of both directions meet in registers. Both give the same numbers:

# %%
for shift in (False, True):
    inp = make_inputs(separate=shift)
    check(f"fused = two calls, shift={shift}", bidirectional_chunk_scan(**inp, chunk_size=chunk, shift=shift),
          bidirectional_two_calls(**inp, chunk_size=chunk, shift=shift), tolerance(torch.float32))

# %% [markdown]
# Timed on this machine at the benchmark's first shape ((batch, L, heads, headdim, dstate) = (4, 4096, 80, 64, 128), one group, chunk 256, shared reverse parameters, no gate), forward only, beside one causal call for scale (bfloat16 on a GPU; on a CPU the {term}`interpreter`'s times say nothing about a GPU):

# %% tags=["nbval-ignore-output"]
size = runtime.size(gpu=dict(batch=4, length=4096, heads=80, headdim=64, groups=1, dstate=128, dtype=torch.bfloat16),
                    cpu=dict(batch=1, length=32, heads=2, headdim=16, groups=1, dstate=16, dtype=torch.float32))
chunk_t = runtime.size(gpu=256, cpu=16)
big = make_inputs(**size, separate=False)
big.pop("z")
rows = []
for name, fn in (("fused", bidirectional_chunk_scan), ("two calls", bidirectional_two_calls),
                 ("causal ssd_chunk_scan (one direction)", ssd_chunk_scan)):
    rows.append(dict(impl=name, forward_ms=median_ms(lambda: fn(**big, chunk_size=chunk_t, dt_softplus=True))))
print(f"device: {runtime.device_name()}")
print_table(rows)

# %% [markdown]
# When this page was executed, on an H200, the fused call took 1.03 ms: about 1.7 times one causal call (0.594 ms), and under a third of the two-call composition (3.16 ms), which pays for its flips and copies on top of two causal calls. In the benchmark below, stored from another run on an H200, the fused-to-causal ratio, forward at this same shape, is 1.72.
#
# The benchmark below also has a "naive two calls (mamba_ssm)" row, faster than this cell's composition, `bidirectional_two_calls` (forward at the first shape: 1.92 ms in the stored benchmark run, 3.16 ms in this page's cell, two runs on H200s) although our causal kernel is faster than mamba_ssm's (chapter 5). The difference is outside the kernels: `bidirectional_two_calls` adds the two outputs and $D x$ in float32 and rounds once at the end, the arithmetic the fused kernel does in registers, but here each of those operations is a full pass over an output-sized float32 tensor, twice the bytes of the bfloat16 $x$; the naive row passes $D$ to the first call, flips the second output back and adds the two in bfloat16.
#
# The benchmark below measures both directions of each model's form, forward and backward, beside mamba_ssm.

# %% [markdown]
# ## Speed and memory
#
# `benchmarks/bench_bidirectional.py` times, in one run on a GPU (bfloat16, chunk 256, with $D$, `dt_bias` and softplus, at the shapes (batch, L, heads, headdim, dstate) = (4, 4096, 80, 64, 128) and (1, 65536, 32, 64, 128)):
#
# - ours with `shift=False` and shared parameters, against our causal `ssd_chunk_scan` on the same shape (the bar: at most 1.25× its time) and against the naive way on mamba_ssm's `mamba_chunk_scan_combined` {cite}`repo_mamba` (flip, two causal calls, flip, add; the bar: at least 1.6× faster);
# - ours with `shift=True` and separate reverse parameters, against Hydra's own method {cite}`repo_hydra` (both directions stacked along the batch through one `mamba_chunk_scan_combined` call, then a roll, a flip and a sum; the bar: at least 1.5× faster);
# - peak memory over a forward and backward pass, and the time of each kernel of our pipeline.
#
# When its JSON is beside the book, it is shown here. The first table gives each implementation's time in ms, with `pct_floor`, the op's floor as a percentage of its time (20 means five times slower than the floor; the floor is the time of its FLOPs at the measured matmul rate or of its bytes at the measured copy bandwidth, whichever is longer, as for the {term}`memory floor`); the second lists the bars. The "where the time goes" tables list every kernel a forward and backward pass launches, with its total time, `calls` (how many launches) and `pct` (its share of all the kernels' time in the pass). The chunk-state and state-passing kernels run once in the forward pass and once, with `GRAD`, in the backward pass, so their `calls` is 2 although each launch serves both directions. To set a bidirectional row against its causal counterpart: `chunk_outputs` ↔ `chunk_scan`, `chunk_states` ↔ `chunk_state`, `chunk_scores` ↔ `chunk_cb`, `chunk_scan_bwd_dscores` ($dG$, two launches, see the performance notes) ↔ `chunk_scan_bwd_dcb`, `step_backward` ↔ `dt_backward`; the dx and dB/dC kernels and `state_passing` keep chapter 5's names. The `reduce_kernel` and `Memset` rows are PyTorch's own small kernels. The figure divides each time by our causal SSD's on the same shape and pass, and draws the 1.25× bar; its third panel is the peak memory, and the hatched bars are Hydra's form (ours with `shift=True`, and Hydra's own method):

# %% tags=["nbval-ignore-output"]
results = pathlib.Path("data/bidirectional_bench.json")  # python benchmarks/bench_bidirectional.py --json ...
if results.is_file():
    data = json.loads(results.read_text())
    print(f"device: {data['device']}")
    print_table(data["rows"])
    print()
    print_table(data["bars"])
    for shape, stages in data["stages"].items():
        print(f"\nwhere the time goes, {shape}:")
        print_table(stages)
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    impls = [i for i in dict.fromkeys(r["impl"] for r in data["rows"]) if i != "causal ssd_chunk_scan (ours)"]
    style = {impl: dict(color=COLORS["y"] if impl.startswith("ours") else COLORS["x"] if "naive" in impl
                        else COLORS["decay"], hatch="//" if "shift=True" in impl or "hydra" in impl else None)
             for impl in impls}
    fig, axes = plt.subplots(1, len(shapes) + 1, figsize=(4.2 * (len(shapes) + 1), 3.8))
    for ax, shape in zip(axes, shapes):
        for p, pass_ in enumerate(("fwd", "fwd+bwd")):
            causal = next(r["ms"] for r in data["rows"] if r["shape"] == shape and r["pass_"] == pass_
                          and r["impl"] == "causal ssd_chunk_scan (ours)")
            for i, impl in enumerate(impls):
                ms = [r["ms"] for r in data["rows"]
                      if r["shape"] == shape and r["pass_"] == pass_ and r["impl"] == impl]
                if ms:
                    ax.bar(p + 0.2 * (i - 1.5), ms[0] / causal, width=0.2, edgecolor="black",
                           label=impl if p == 0 else None, **style[impl])
        ax.axhline(1.0, color="black", lw=1, label="causal ssd_chunk_scan")
        ax.axhline(1.25, color="black", ls="--", lw=1, label="bar: 1.25 x causal")
        ax.set(xticks=[0, 1], xticklabels=["forward", "forward + backward"], ylabel="time / causal SSD", title=shape)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4,
               fontsize="small")
    memory = [r for r in data["rows"] if r["pass_"] == "fwd+bwd" and r["impl"] in impls]
    for i, impl in enumerate(impls):
        values = [r["peak_MB"] / 1024 for r in memory if r["impl"] == impl]
        axes[-1].bar([k + 0.2 * (i - 1.5) for k in range(len(values))], values, width=0.2, edgecolor="black",
                     **style[impl])
    axes[-1].set(xticks=range(len(shapes)), xticklabels=shapes, ylabel="GiB", title="peak memory, fwd + bwd")
    axes[-1].tick_params(axis="x", labelsize=6)
    plt.tight_layout()
    missed = [b for b in data["bars"] if not b["holds"]]
    print(f"\nverdict on {data['device']}: {len(data['bars']) - len(missed)} of {len(data['bars'])} bars hold"
          + "".join(f"; {b['bar']} ({b['pass_']}, {b['shape']}) is {b['ratio']:.2f}, bar {b['target']}"
                    for b in missed))
else:
    print("no stored benchmark run: on a GPU, python benchmarks/bench_bidirectional.py "
          "--json book/data/bidirectional_bench.json writes it (bash scripts/gpu_benchmarks.sh bidirectional)")

# %% [markdown]
# **Verdict.** Of its 14 bars, 12 of speed and 2 of peak memory, 9 hold; the 5 that miss are ours over causal (at most 1.25×) at both shapes and both passes, and naive over ours (at least 1.6×) forward and backward at the first shape. The fused pipeline beats the two-call composition on mamba_ssm and Hydra's doubled batch at both shapes (Bi-Mamba2's own fused kernels were not measured). With shared parameters (`shift=False`) it is 1.87× (first shape) and 2.00× (second) faster than the two mamba_ssm calls forward, and 1.56× and 1.63× over a forward and backward pass, with 1.6× less peak memory in that pass at both shapes; the 1.56× is short of the 1.6× bar. In Hydra's form (`shift=True`) it is 2.7–2.8× faster than Hydra's doubled batch forward and 2.1× forward and backward.
#
# With shared parameters it misses the bar against our own causal SSD: forward it takes 1.72× the causal op's time (first shape) and 1.73× (second), forward and backward 1.80× and 1.85×.
#
# The tables of where the time goes say why. Each kernel does about twice the work of its causal counterpart (both triangles of every diagonal block, two states per chunk, two carries). At the first shape the $dx$ kernel takes 1.34 ms against 0.72 ms, the states 0.43 against 0.23, the outputs 0.66 against 0.37, and the $dB$/$dC$ kernel 0.68 against 0.32 (2.2× the time for twice the work: a slightly lower rate), while the $dG$ kernel (`chunk_scan_bwd_dscores`, two launches) takes 1.01 ms against the causal $dCB$ kernel's 0.63 (1.6×). Added up over the pass, the op's time is 1.7× to 1.9× the causal op's. Twice the work in 1.25× the time would need 2 ÷ 1.25 = 1.6× the causal op's rate; the whole op now runs at 1.08–1.16× it (the `TFLOPs` column).
#
# Neither op is near its floor: for ours (`shift=False`) the floor's time is 16–18 % of the measured time, for the causal op 14–16 % (the `pct_floor` column: the time of their FLOPs at the measured matmul rate or of their bytes at the measured copy bandwidth, whichever is longer, as a percentage of the measured time; see {term}`memory floor`). So both have room, and the way to 1.25× is a higher rate inside each kernel, not more fusion.
#
# *About the stored run.* The stored run used one H200 of a two-GPU host while the other GPU ran the strict nbval checks of chapters 5 and 7 for the first 289 s of its 491 (then chapter 0's for 12 s); its times are within 0.6 % of the run before it (made beside chapter 8's model benchmark), the causal op's forward at the second shape aside (1.4 % faster), and its peers' are close to those of a run made alone (README). A run that measures a faster matmul rate computes a shorter floor and so a lower percentage; this run measured 786 TFLOP/s, earlier runs of this benchmark 707 to 805, which moves these percentages by a point or two.
#
# :::{admonition} Performance notes
# :class: dropdown
# The first version of the backward pass computed $dG$, the gradient of the scores $G$, one (row, column) tile per program with one exponential per weight, and the whole pass took 5.67 ms (forward + backward, first shape). All times in these notes but those of the last five paragraphs (an H200 probe, four H200 A/B runs and an H200 sweep) were measured on an H100 when the changes were made; they are not comparable with the H200 tables above. Two changes brought it to 4.74 ms, with the same results to float32 rounding:
# - **A cheaper weight off the diagonal band.** Off the row block's band every weight of a tile belongs to one direction, and it factors through a position $u$ between the rows and the columns: $e^{\ell_t - \ell_s} = e^{\ell_t - \ell_u} e^{\ell_u - \ell_s}$. Both exponents have the sign of $A$, so no factor overflows where the weight does not, and a tile costs one exponential per row and per column instead of one per entry. The output kernel and the $dx$ kernel walk their columns in three runs (before the band, the band, after it) to use it.
# - **The $dG$ kernel split in two launches.** The diagonal tiles keep the full weights; the others use the factored ones, with the loop over the heads of a group software-pipelined and autotuned. $dG$ went from 1.62 ms to 0.78 ms.
#
# The output kernel and the $dx$ kernel gained little from the cheaper weights (0.68 → 0.66 ms, 1.51 → 1.43 ms), so their exponentials were not what bound them. The factored weights are also why these kernels take single float32 sums (`chunk_cumsum(..., planes=False)`) rather than chapter 5's two planes: each factor would need the low plane carried through it, and that conversion has not been done.
#
# The $dx$ kernel's tuned list now also offers 32 rows with two warps. In a probe on an H200 that appended it and other configurations to each kernel's list, the tuner's trials gave it 1.402 ms against 1.448 ms for the former pick, while the same tile with four warps took 2.04 ms (`book/data/kernel_config_probe.json`); the whole forward and backward pass went from 4.76 to 4.70 ms. None of the other configurations tried there beat a tuned list's pick by more than a trial's noise, for this chapter's output kernel or chapter 5's kernels.
#
# **Fewer products where the directions share.** With one step for both directions (no $\Delta'$) and, for $dB$/$dC$, no shift and shared $B$ and $C$, the two directions' diagonal terms only ever enter a gradient as their sum. So the $dx$ kernel now takes both into one accumulator after the state terms, and the band's tile in one product instead of two, and the $dB$/$dC$ kernel takes each triangle pair of the diagonal block in one product into one pair of accumulators: two products per step where it took four. Two A/B runs on an H200 (two alternating rounds each, each version of the package in its own process, while the host's other GPU ran tests or a benchmark; `book/data/chunked_backward_ab.json`) measured these changes and the ones that keep a NaN where it belongs (described under "The backward pass"). In Bi-Mamba2's form (shared parameters, no shift: the benchmark's `ours shift=False`) the backward pipeline went from 3.445 to 3.338 ms and the forward and backward pass from 4.749 to 4.622 ms with the fewer products, then to 4.630 ms with the $dB$/$dC$ checked launch. Hydra's form gained nothing from the first changes and paid for the others, one step each: the band's checks took its forward pass from 1.156 to 1.223 ms and its forward and backward pass from 4.797 to 4.859 ms, the $dB$/$dC$ checked launch to 4.916 ms, and the pair sums without the row's own step to 4.978 ms (1.2–1.3 % each; the forward pass's step was 5.8 %).
#
# **Checks and sums only where they are needed.** With the shift and $D$, $y_t$ reads $x_t$ itself through $D x_t$, so a NaN in a channel of $x_t$ belongs in that channel of $y_t$, which is where the band's product puts it; the output kernel now checks the band's $x$ tiles only with `seq_idx` or without $D$. And the $dG$ kernel computes and stores the row sums of its tiles only with the shift, the one form whose step kernel reads them; without the shift their two float32 planes (21 MB each at the first shape) are not allocated either. A third A/B run (`book/data/shift_band_ab.json`, the same method, while the other GPU executed chapter 8) took Hydra's forward pass from 1.217 to 1.167 ms and its forward and backward pass from 4.955 to 4.908 ms with the first change. With the second, Bi-Mamba2's forward and backward pass went from 4.611 to 4.597 ms and its backward pipeline from 3.328 to 3.319 ms; Hydra's forward and backward pass read 4.95 ms in both rounds (4.953 and 4.947), though the shift's path computes what it did before, a difference this run does not explain. The benchmark above was stored after all of these changes.
#
# **Splitting a group's heads among programs (tried, not kept).** At the first shape the $dG$ kernel's diagonal launch has 256 programs for the H200's 132 SMs, and each walks all 80 heads of its group for one tile. Two branches divided a tile's heads among 2, 4 or 8 programs, each writing its own float32 plane of the tile's gradient, with the planes added in a fixed order after the launch (no atomics); one of them split the $dB$/$dC$ kernel's heads in two as well. An A/B run (`book/data/head_split_ab.json`: the same alternating processes, on a one-GPU H200 with nothing else running) found every split slower than none, and more splits slower still: the backward pipeline took 3.33 ms unsplit, 3.35, 3.36 and 3.41 ms with 2, 4 and 8 $dG$ splits, and 3.44 ms with the $dB$/$dC$ split added. Whatever the fuller launch gained, it did not pay for the planes' extra bytes and their sum.
#
# **The $dB$/$dC$ kernel's launch (swept, kept).** The $dB$/$dC$ kernel is not autotuned: its partial sums go to slots whose layout the launch fixes. A sweep on an H200 tried thirteen launches of it, 32 or 64 rows and 32 to 128 state columns per program, 4 or 8 warps, 2 to 4 pipeline stages, at both shapes in both forms, each checked against the present launch's gradients (`benchmarks/sweep_bidirectional_dbc.py`, `book/data/bidirectional_dbc_sweep.json`). The present one, 64 rows, 64 columns, 8 warps and 3 stages, gave the fastest backward pipeline in all four cases. At the first shape in Bi-Mamba2's form the kernel took 0.683 ms and the pipeline 3.587 ms; 4 stages took 0.686 and 3.591 ms, the next launch (32 columns, 4 warps) 0.721 and 3.636 ms, and the slowest 1.35 and 4.27 ms. In Hydra's form 4 stages asked for more shared memory than the GPU has, and the next-fastest launch (2 stages) took 3.3 % longer over the pipeline. The kernel's 2.2 times the causal one's time is not in its launch. Making the launch settable for the sweep changed no launch; the benchmark above was stored again after that change, and the bidirectional op's times are within 0.6 % of the run before it.
# :::

# %% [markdown]
# ## What we have, and what comes next
#
# A bidirectional SSM multiplies by a quasiseparable matrix: chapter 5's lower semiseparable triangle, an upper one running backwards in time, and a diagonal. Bi-Mamba2 counts the diagonal in both triangles; Hydra shifts each direction by one step, which leaves the diagonal to $D$ alone. Because the reverse decays are left-to-right cumulative sums too (of $\Delta'$, the forward ones when the directions share $\Delta$), read one position earlier, both directions share one chunk grid, and one pipeline computes full diagonal blocks, both directions' chunk states from one read of $x$ (and of $B$, when shared), both carries in one launch and all outputs in one kernel, checked against the float64 reference in both forms, every dtype, packed sequences and every gradient. The two-call composition is the foil it replaces.
#
# [Chapter 7](07_attention.ipynb) turns to the model Mamba set out to replace, softmax attention, whose $L \times L$ matrix has no low-rank structure to exploit, and computes it without ever storing it.
#
# **Exercises.** A warm-up without code: with $B = C = 0$ in both directions (and no gate $z$), what is $y$, with and without the shift? It has no cell; two tests in `tests/test_bidirectional.py` assert the answer, `test_zero_B_and_C_give_D_x` on the reference and the two-call composition and `test_fused_zero_B_and_C_give_D_x` on the fused kernel.
#
# 1. *The backward of the shift.* `shift_within_sequences` moves every row one position later, with a zero at each sequence start. Its backward pass is its adjoint: write `shift_adjoint(g, seq_idx)` that returns $\partial \langle \mathrm{shift}(x), g\rangle / \partial x$ for `g` of shape (batch, L, ...) and `seq_idx` (batch, L) or None.
# 2. *The diagonal of Bi-Mamba2's matrix.* Write `diagonal(dt, B, C, D, dt_rev, B_rev, C_rev)` that returns the diagonal of $M$ for `shift=False`, shape (batch, heads, L), without building $M$ (steps already processed, (batch, L, heads); $B$, $C$ of shape (batch, L, groups, dstate); $D$ of shape (heads,)). Heads map to groups as in chapter 5: head $h$ reads group $h \,/\!/\, (\text{heads}/\text{groups})$, so the heads of a group are consecutive (with 4 heads on 2 groups, heads 0 and 1 read group 0); the checker uses such a case.
#
# Replace the `raise` in each stub and run the cell; the checker compares your function with the float64 reference on fresh random inputs, packed sequences and groups included.

# %%
def shift_adjoint(g, seq_idx):
    raise NotImplementedError  # your code here


def diagonal(dt, B, C, D, dt_rev, B_rev, C_rev):
    raise NotImplementedError  # your code here


for number, answer in (("6.1", shift_adjoint), ("6.2", diagonal)):
    check_exercise(number, answer)

# %% [markdown]
# The solutions (click to show), run through the same checker:

# %% tags=["hide-input"]
def shift_adjoint(g, seq_idx):
    """The shift moves row i to i + 1, so its adjoint moves row i + 1 back to i: shift left, with a
    zero at the last position of each sequence (whose row the shift sent into the next sequence's
    zero)."""
    out = torch.zeros_like(g)
    out[:, :-1] = g[:, 1:]
    if seq_idx is not None:
        ends = torch.zeros(seq_idx.shape, dtype=torch.bool, device=g.device)
        ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
        out[ends] = 0
    return out


def diagonal(dt, B, C, D, dt_rev, B_rev, C_rev):
    """M[t, t] = D + dt_t C_t.B_t + dt'_t C'_t.B'_t: the decay over no step is 1, so A drops out;
    the heads of a group share its B and C."""
    heads = dt.shape[2]

    def per_head(t):
        return t.repeat_interleave(heads // t.shape[2], dim=2)

    terms = [d * (per_head(c) * per_head(b)).sum(-1) for d, b, c in ((dt, B, C), (dt_rev, B_rev, C_rev))]
    return (terms[0] + terms[1] + D).transpose(1, 2)


for number, answer in (("6.1", shift_adjoint), ("6.2", diagonal)):
    check_exercise(number, answer)
