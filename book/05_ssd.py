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
# # Mamba-2: state-space duality, chunk by chunk
#
# In this chapter you will learn:
#
# - how Mamba-2's SSM is a multiplication by a *{term}`semiseparable`* matrix $M$, and how the attention-like form, of quadratic cost, and the recurrent form, of linear cost, are two ways to do that multiplication;
# - how cutting $M$ into {term}`chunks <chunk>` gives an algorithm that is quadratic (matmuls on {term}`tensor cores <tensor core>`) inside chunks and linear (a short {term}`carry` of states) across them, and what each part costs as the chunk size varies;
# - the Triton kernels of the forward pass (five steps, and a second, checked kernel for the last one that runs only where a non-finite input needs it) and of the backward pass (four kernels of its own, beside the forward's chunk-state and state-passing kernels run again on gradients), derived, including the reverse cumulative sum that turns gradients of the decays into gradients of $\Delta$ and $A$.
#
# :::{admonition} Notation
# | symbol | meaning |
# |---|---|
# | $t, s$ | positions: $t$ the output (row), $s$ the input (column) |
# | $L$, $Q$ | sequence length, chunk size |
# | $x_t \in \mathbb{R}^P$ | input of one head at position $t$ ($P$: headdim) |
# | $h_t \in \mathbb{R}^{P \times N}$, $y_t$ | state ($N$: dstate) and output |
# | $\Delta_t$ | step (after bias, softplus, clamp) |
# | $A$ | one negative number per head; a step decays the state by $e^{\Delta_t A}$ |
# | $B_t, C_t \in \mathbb{R}^N$ | input and readout maps |
# | $\ell_t = A \sum_{k \le t} \Delta_k$ | cumulative log-decay, counted from the start of the chunk inside the kernels (`a` or `l` in the teaching code; stored by `chunk_cumsum` in `dA_cumsum` as two float32 planes, `hi` and `lo`, in units of $\log_2$) |
# | $\Gamma_{ts} = e^{\ell_t - \ell_s}$, $\gamma_c = e^{\ell_{\text{last}}(c)}$ | decay from $s$ to $t$; decay across chunk $c$ |
# | $S_c$, $H_c$ | the state chunk $c$ adds, the state entering chunk $c$ |
# | $D$ | the skip, per head (or per channel) |
# | heads, groups | counts, written out (no letter: $H_c$ is a state); the heads of a group share $B$ and $C$, and head $h$ reads group $h \,/\!/\, (\text{heads}/\text{groups})$ |
# | $\mathcal J$; $dy$, $dx$, $dB$, … | the loss; its gradients ($dy = \partial \mathcal J / \partial y$, …) |
# | $dH_c$, $\Lambda_c$ | backward pass: the gradient that chunk $c$'s outputs send to $H_c$; the whole gradient of $H_c$ |
# :::
#
# It builds on chapter 4's [blocked scans with carries](04_blocked_carries.ipynb): there blocks of a scalar scan passed one number to the next block; here chunks pass a (headdim × dstate) state.

# %%
import matplotlib.pyplot as plt
import torch

from mamba_annotated import runtime
from mamba_annotated.bench import matmul_tflops, median_ms, print_table, tflops
from mamba_annotated.figures import COLORS, show_fragment, show_source
from mamba_annotated.ssd import ssd_chunk_scan
from mamba_annotated.ssd.backward import chunk_gradients, ssd_backward
from mamba_annotated.ssd.chunk_cumsum import (add_or_restart, chunk_cumsum, chunk_cumsum_kernel, dt_backward,
                                              dt_backward_kernel, log_decay_step_gradient, spanned_tiles)
from mamba_annotated.ssd.chunk_scan import chunk_scan, chunk_scan_checked_kernel, diagonal_block, output_rows, write_tile
from mamba_annotated.ssd.chunk_scan_bwd import chunk_scan_bwd_dcb_kernel, dbc_tile
from mamba_annotated.ssd.chunk_state import (cb_offsets, chunk_cb, chunk_cb_kernel, chunk_state, chunk_state_kernel,
                                              unpacked_cb)
from mamba_annotated.ssd.forward import ssd_forward
from mamba_annotated.ssd.log_decays import natural_sums
from mamba_annotated.ssd.reference import (process_dt, ssd_chunked_ref, ssd_matrix, ssd_quadratic_ref,
                                           ssd_recurrent_ref)
from mamba_annotated.ssd.simple import (chunk_scan_dx_simple, chunk_scan_dx_simple_kernel, chunk_scan_simple,
                                        chunk_scan_simple_kernel, chunk_state_simple, chunk_state_simple_kernel)
from mamba_annotated.ssd.state_passing import state_passing, state_passing_kernel
from mamba_annotated.ssd.teaching import dt_backward_flip, ssd_backward_flip
from mamba_annotated.testing import (assert_gradients_close, check, poisoned_outputs, randn, seed_everything,
                                     tolerance, uniform)

seed_everything(0)
device = runtime.DEVICE

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## The SSM as a matrix
#
# Mamba-2 {cite}`dao2024transformers` restricts Mamba's decay to a scalar per head: $\bar A_t = \exp(\Delta_t A)$ with one number $A$ per head. A head is $P$ of the channels of [section 4.9](04_selective_scan.ipynb)'s selective scan that share $\Delta_t$, $B_t$ and $C_t$, with the $N$ numbers $A_{dn}$ of each channel replaced by that one $A$: row $p$ of the head's state is channel $p$'s $N$-vector state, and the outer product $x_t B_t^\top$ stacks the $P$ channels' updates. So a head has an input $x_t \in \mathbb{R}^P$ (headdim $P$), a state $h_t \in \mathbb{R}^{P \times N}$ (dstate $N$), and
#
# $$
# \begin{aligned}
# h_t &= e^{\Delta_t A}\, h_{t-1} + \Delta_t\, x_t B_t^\top, \\
# y_t &= h_t\, C_t .
# \end{aligned}
# $$
#
# Write $\ell_t = \sum_{k \le t} \Delta_k A$ for the cumulative log-decay (the teaching code calls it `a`; the kernels keep a per-chunk version, `dA_cumsum`, see kernel 1). The decay from $s$ to $t$ is $\exp(\sum_{k=s+1}^{t} \Delta_k A) = e^{\ell_t - \ell_s}$, so the recurrence unrolls to $h_t = \sum_{s \le t} e^{\ell_t - \ell_s}\, \Delta_s\, x_s B_s^\top$. Multiply by $C_t$ and use $x_s B_s^\top C_t = (C_t \cdot B_s)\, x_s$:
#
# $$
# \begin{aligned}
# y_t &= \sum_{s \le t} \underbrace{(C_t \cdot B_s)\; e^{\ell_t - \ell_s}\; \Delta_s}_{M_{ts}}\; x_s , \\
# \text{i.e.}\quad y &= M x, \qquad M_{ts} = 0 \text{ for } s > t .
# \end{aligned}
# $$
#
# (This takes no initial state. An initial state $h_{-1}$ adds $e^{\ell_t} h_{-1} C_t$ to $y_t$, and the skip $D x_t$ and the gate act on $y$ afterwards; the check below includes all three.)
#
# $M$ is lower-triangular and *semiseparable*: every block of $M$ that lies wholly on or below the diagonal (every entry with $s \le t$) has rank at most $N$. There $M_{ts} = (e^{\ell_t} C_t) \cdot (e^{-\ell_s} \Delta_s B_s)$ is a dot product of an $N$-vector of $t$ with an $N$-vector of $s$, so the block is a (rows × $N$) matrix times an ($N$ × columns) one. A block that straddles the diagonal is not of this kind: zeroing its upper part generally makes it full rank (the lower triangle of a rank-one matrix with no zero entries is invertible), which is why the chunked algorithm below handles the diagonal blocks separately. Two ways to multiply by $M$ follow:
#
# - **quadratic** (the "attention" form): build $M$, $O(L^2 N + L^2 P)$ work, all of it matmuls; $C$ plays the query, $B$ the key, $\Delta_s x_s$ the value, and $e^{\ell_t - \ell_s}$ a causal mask with decay (a matrix of weights, zero above the diagonal);
# - **linear** (the recurrent form): walk $t$ and carry $h_t$, $O(L N P)$ work, but a chain of $L$ dependent steps.
#
# That one multiplication by $M$ can be done either way, as masked attention or as a recurrence, is what Mamba-2's authors call *state-space duality* ({term}`SSD`); the chunked algorithm below uses both forms.
#
# Inputs follow mamba_ssm's `mamba_chunk_scan_combined`: `x (batch, L, heads, headdim)`, `dt (batch, L, heads)`, `A (heads,)`, `B, C (batch, L, groups, dstate)`, with the optional skip $D$, gate $z$ ($y \cdot \mathrm{silu}(z)$), `dt_bias`, softplus and a clamp on $\Delta$. The heads come in `groups` consecutive runs of `heads // groups`, and the heads of a run share their group's $B$ and $C$: head $h$ reads group $g = h \,/\!/\, (\text{heads}/\text{groups})$ (`g = h // (heads // groups)` in the kernels), as in mamba_ssm. With 4 heads on 2 groups, heads 0 and 1 read group 0, heads 2 and 3 group 1.

# %%
def make_inputs(batch=2, length=40, heads=4, headdim=16, groups=2, dstate=16, dtype=torch.float32):
    """Random inputs for every argument of ssd_chunk_scan; dt > 0 so every step decays."""
    return dict(
        x=randn(batch, length, heads, headdim, dtype=dtype),
        dt=uniform(batch, length, heads, low=0.02, high=0.6),
        A=-uniform(heads, low=0.5, high=2.0),
        B=randn(batch, length, groups, dstate, dtype=dtype),
        C=randn(batch, length, groups, dstate, dtype=dtype),
        D=randn(heads, headdim),
        z=randn(batch, length, heads, headdim, dtype=dtype),
        dt_bias=randn(heads, scale=0.5),
        initial_states=randn(batch, heads, headdim, dstate),
    )


# Float64 against float64, so far below float32's rounding (1e-7). The bound is 1e-9 rather than
# float64's own 1e-15: two CI runs on a 2-core CPU measured 3e-10 between the quadratic and the other
# forms, for a reason not yet found (hundreds of repeats, in and out of Jupyter, give 4.8e-16).
FLOAT64_BOUND = 1e-9
inputs = make_inputs()
as64 = {k: v.double() for k, v in inputs.items()}
y_quadratic, h_quadratic = ssd_quadratic_ref(**as64, dt_softplus=True, return_final_states=True)
y_recurrent, h_recurrent = ssd_recurrent_ref(**as64, dt_softplus=True, return_final_states=True)
check("quadratic form = recurrent form (y)", y_quadratic, y_recurrent, FLOAT64_BOUND)
check("quadratic form = recurrent form (final state)", h_quadratic, h_recurrent, FLOAT64_BOUND)

# %% [markdown]
# Here is $M$ for one head: large near the diagonal, fading with the decay as $t - s$ grows, with the low-rank texture of $C_t \cdot B_s$ on top.

# %%
dt_heat = process_dt(inputs["dt"][:1, :, :1], inputs["dt_bias"][:1], True)
M = ssd_matrix(dt_heat, inputs["A"][:1], inputs["B"][:1, :, :1], inputs["C"][:1, :, :1])[0, 0]
fig, ax = plt.subplots(figsize=(4.2, 3.6))
image = ax.imshow(M.abs().log10().clamp(min=-4).cpu(), cmap="Greens")
fig.colorbar(image, ax=ax, label="log10 |M[t, s]|")
ax.set(title="M of one head: y = M x", xlabel="s (input position)", ylabel="t (output position)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The heatmap is zero above the diagonal, largest along it, and fades towards the bottom-left corner: the further $s$ lies behind $t$, the more the decay $e^{\ell_t - \ell_s}$ has shrunk its weight.

# %% [markdown]
# ## The chunk decomposition
#
# Cut time into chunks of $Q$ positions. $M$ falls into $Q \times Q$ blocks:
#
# - **diagonal blocks** (inside a chunk) are small triangular matrices: multiply by them in the quadratic form, a pair of matmuls per chunk;
# - **off-diagonal blocks** have rank $\le N$ and factor through the state. For $t$ in chunk $c$ and $s$ in an earlier chunk, $M_{ts} x_s$ summed over those $s$ is $e^{\ell^{(c)}_t} H_c C_t$, with $H_c$ the state entering chunk $c$ and $\ell^{(c)}_t$ defined next. To see it, split the decay at the chunk's edge: with $t_0$ the chunk's first position, $e^{\ell_t - \ell_s} = e^{\ell_t - \ell_{t_0-1}}\, e^{\ell_{t_0-1} - \ell_s}$. The first factor depends on $t$ alone: it is $e^{\ell^{(c)}_t}$ with $\ell^{(c)}_t = \ell_t - \ell_{t_0-1}$, the log-decay counted from chunk $c$'s start. The second, times $\Delta_s x_s B_s^\top$ and summed over all $s < t_0$, is the state $H_c$. **From here on, and in the kernels, $\ell$ means this chunk-local $\ell^{(c)}$.**
#
# The states entering the chunks obey a short recurrence, one step per chunk. It is chapter 4's carry $c_{k+1} = a^{(k)} c_k + b^{(k)}$ with a matrix in place of a number: the chunk's total decay $\gamma_c = e^{\ell_{\text{last}}(c)}$ plays $a^{(k)}$, the state $S_c$ that the chunk builds from zero plays $b^{(k)}$, and inside the chunk $e^{\ell_t}$ plays $\pi_t$. Here $\ell$ is the chunk-local one, and $\ell_{\text{last}}$ (or $\ell_{\text{last}}(c)$) is its value at the chunk's last position, the log-decay of the whole chunk:
#
# $$
# \begin{aligned}
# S_c &= \sum_{s \in c} e^{\ell_{\text{last}} - \ell_s} \Delta_s\, x_s B_s^\top, \\
# H_{c+1} &= e^{\ell_{\text{last}}(c)}\, H_c + S_c, \qquad H_0 = h_{\text{init}} .
# \end{aligned}
# $$
#
# So the algorithm is: (1) the cumulative sums $\ell$ inside each chunk; (2) $C \cdot B$ inside each chunk; (3) the chunk states $S_c$; (4) the carry $H_c$; (5) the outputs, diagonal block plus $e^{\ell_t} H_c C_t$. Steps 2, 3 and 5 are matmuls; step 4 is sequential but has only $L/Q$ steps. The figure colours the blocks of $M$ by the path they take.

# %%
Q, n_chunks = 8, 5
blocks = torch.full((Q * n_chunks, Q * n_chunks), float("nan"))
for c in range(n_chunks):
    for d in range(c + 1):
        blocks[c * Q:(c + 1) * Q, d * Q:(d + 1) * Q] = 1.0 if c == d else 0.0
blocks = torch.where(torch.ones_like(blocks).tril().bool(), blocks, torch.nan)
fig, ax = plt.subplots(figsize=(4.2, 3.8))
ax.imshow(blocks, cmap=plt.matplotlib.colors.ListedColormap([COLORS["carry"], COLORS["y"]]))
for k in range(1, n_chunks):
    ax.axhline(k * Q - 0.5, color="white", lw=1.5)
    ax.axvline(k * Q - 0.5, color="white", lw=1.5)
ax.set(title="diagonal blocks: quadratic (green)\noff-diagonal: through the states (red)",
       xlabel="s", ylabel="t")
plt.tight_layout()
plt.show()

# %% [markdown]
# Only the $L/Q$ green blocks on the diagonal are multiplied in the quadratic form; every red block, most of $M$ once $L \gg Q$, is reached through the $L/Q$ states.

# %% [markdown]
# The float64 chunked reference does exactly these five steps in PyTorch (`ssd_chunked_ref` in `mamba_annotated/ssd/reference.py`). It agrees with the quadratic form for any chunk size, including lengths that are not a multiple of the chunk (the last chunk is padded with $\Delta = 0$, which changes nothing).

# %%
for chunk in (8, 16, 64):
    y_chunked = ssd_chunked_ref(**as64, chunk_size=chunk, dt_softplus=True)
    check(f"chunked reference, chunk {chunk}, L = 40", y_chunked, y_quadratic, FLOAT64_BOUND)

# %% [markdown]
# ## The kernels
#
# Each kernel below is shown from the package source, run, and checked against the matching step of the chunked reference (`return_intermediates=True` returns each step in the kernels' layouts). They run at chunk 16 here, small enough for the {term}`interpreter` on a CPU; the benchmarks below use 256.

# %%
chunk = 16
length = inputs["x"].shape[1]
_, steps = ssd_chunked_ref(**as64, chunk_size=chunk, dt_softplus=True, return_intermediates=True)

# %% [markdown]
# ### 1. The cumulative log-decay inside each chunk
#
# Two words first, used by every kernel below. **Packed sequences:** several sequences can be laid end to end in one row of the batch; `seq_idx[b, t]` names the sequence of position $t$ (the public function below takes it), and no weight may cross from one sequence to the next. **A select** is `tl.where(condition, a, b)`: it picks `a` or `b` element by element and never multiplies, so a value it does not pick cannot leak into the result, even a NaN.
#
# One {term}`program` per (batch, chunk, 8 heads) loads $\Delta$, adds the bias, applies the softplus and the clamp, multiplies by $A$ and takes `tl.cumsum` along the chunk. Positions past $L$ get $\Delta = 0$, so the chunk's last slot holds the decay of the whole chunk. With packed sequences the sum restarts wherever the sequence changes inside the chunk: `tl.associative_scan` with `add_or_restart`, a *segmented* sum (a running sum that starts again from zero at the start of each segment, here each sequence), whose combine uses a select to drop everything before a run's first position.
#
# The restart leaves every weight the later kernels keep unchanged. Those weights are of two kinds. A difference $\ell_t - \ell_s$ is kept only when $t$ and $s$ lie in one sequence, and a restart before both shifts both sums by the same amount, which cancels. A weight $e^{\ell_t}$ counted from the chunk's start is kept only for rows of the sequence carried in from the previous chunk, and those rows come before any restart. What the restart does change is how far a non-finite step reaches; the note on non-finite inputs below shows it.
#
# **The sums keep their low part.** Every weight the later kernels form is $e^{\ell_t - \ell_s}$ (or $e^{\ell_{\text{last}} - \ell_t}$, or $e^{\ell_t}$), and in a chunk that decays strongly $|\ell|$ grows into the hundreds. A float32 number between 256 and 512 is only good to half an {term}`ulp`, $1.5 \cdot 10^{-5}$, so the difference of two such sums is off by up to $3 \cdot 10^{-5}$ from the rounding of each sum alone, however small the difference is, and a sum accumulated in float32 adds to the difference $\ell_t - \ell_s$ the rounding of every addition between $s$ and $t$. The weights hit hardest are those near the chunk's end, which make up most of the chunk's state: on an H100 they came out $3.5 \cdot 10^{-5}$ off in relative terms, and the float32 final state six times further from float64 than mamba_ssm's (whose sums are float32 too; why ours fared worse was not pinned down).
#
# So `chunk_cumsum` adds $\Delta_k A$ in float64 (the product of two float32 numbers is exact there) and stores each sum as two float32 numbers, $\ell = \ell^{hi} + \ell^{lo}$, the nearest float32 and the rest (scaled by $\log_2 e$ for `exp2`; `natural_sums` turns them back into float64 sums for the check below). No later kernel does float64 arithmetic (only `chunk_cumsum` does, once per step): a kernel that forms a weight subtracts $\ell^{hi}_t - \ell^{hi}_s$, which float32 does exactly where the two are within a factor 2 of each other (Sterbenz's lemma; where they are further apart, the difference is at least half the larger of the two, so its one rounding is small relative to the difference itself), takes the exponential per weight and folds $e^{\ell^{lo}_t}$ and $e^{-\ell^{lo}_s}$ into a row and a column it scales anyway (`mamba_annotated/ssd/log_decays.py`). The next cell measures what float32 sums lose on one such chunk.

# %%
show_source(add_or_restart, chunk_cumsum_kernel)

# %%
dA_cumsum, dt_out = chunk_cumsum(inputs["dt"], inputs["A"], chunk, dt_bias=inputs["dt_bias"], dt_softplus=True)
check("chunk_cumsum: a", natural_sums(dA_cumsum), steps["dA_cumsum"], tolerance(torch.float32))
check("chunk_cumsum: dt", dt_out, steps["dt"], tolerance(torch.float32))
dA_lim, dt_lim = chunk_cumsum(inputs["dt"], inputs["A"], chunk, dt_bias=inputs["dt_bias"], dt_softplus=True,
                              dt_limit=(0.3, 0.9))
_, steps_lim = ssd_chunked_ref(**as64, chunk_size=chunk, dt_softplus=True, dt_limit=(0.3, 0.9), return_intermediates=True)
check("chunk_cumsum with dt_limit (0.3, 0.9): dt", dt_lim, steps_lim["dt"], tolerance(torch.float32))

# %%
# one chunk of 256 steps of dt*A around -1.27, as in a strongly decaying head: the exponents
# a_last - a_t of the chunk's last 9 positions, from sums kept in float32 and in float64
decay_steps = -(1.0 + 0.5 * torch.rand(256, generator=torch.Generator().manual_seed(0)))
sums32, sums64 = torch.cumsum(decay_steps, 0), torch.cumsum(decay_steps.double(), 0)
exact = sums64[-1] - sums64[-9:]
for name, sums in (("float32 sums", sums32.double()), ("float64 sums", sums64)):
    exponents = (sums[-1] - sums[-9:]).float().double()  # the difference, rounded once to float32
    error = (exponents - exact).abs().max().item()  # an exponent's error is its weight's relative error
    print(f"{name}: |a_last| = {sums[-1].abs().item():.0f}, largest error of a_last - a_t: {error:.1e}")

# %% [markdown]
# Both rows add the same steps. In the first the sums are float32 numbers, but `torch.cumsum` on a CPU adds float32 in float64 and rounds each sum once, so this row shows the rounding of each sum alone: the exponents of the chunk's last weights come out $1.7 \cdot 10^{-5}$ off, within the $3 \cdot 10^{-5}$ that two such roundings can give (an exponent's error is its weight's relative error). A sum added step by step in float32, as a kernel's `tl.cumsum` adds, also carries the rounding of each addition between $s$ and $t$; that is how the H100's weights came out $3.5 \cdot 10^{-5}$ off, beyond that bound. Summed in float64 and kept so, only the final rounding of the difference to float32 is left, $4.8 \cdot 10^{-7}$.

# %% [markdown]
# ### 2. $C \cdot B$ inside each chunk, once per group
#
# The heads of a group share $B$ and $C$, so $CB_{ts} = C_t \cdot B_s$ is computed once per group, a $Q \times Q$ block per chunk. Not all of the block is needed. Cut it into squares of 64 rows and columns (`SCAN_ROWS`; one square when $Q$ is smaller). The kernels that read $CB$ (the outputs' kernel and the backward pass's $dx$ and $dCB$ kernels; the $dB$/$dC$ kernel reads $dCB$, stored in the same squares) work in row blocks of at most 64 rows, and a row never reads right of its diagonal square. So `chunk_cb` computes and stores the squares on the diagonal and every square left of them, and nothing else. The squares of a chunk lie one after another, a row of squares at a time, each square row by row, so square $(i, j)$ with $j \le i$ starts after the $i(i+1)/2$ squares of the rows above it and the $j$ squares left of it (`cb_offsets`, below). A tile of a reading kernel stays inside one square, so it is still a block of rows of contiguous floats. At $Q = 256$ that is 10 of the 16 squares: 40,960 floats per chunk and group instead of 65,536, which is 24 MiB less at the benchmark's second shape, (1, 65536, 32, 64, 128). The diagonal squares are stored whole. A select after the products discards their entries above the diagonal ("5. The outputs" below), so those values never matter, but they are written, so that no kernel reads memory nobody wrote (which compute-sanitizer's initcheck would report). The figure after the check shows the pattern at $Q = 256$.

# %%
show_source(cb_offsets)

# %%
show_source(chunk_cb_kernel)

# %%
CB = chunk_cb(inputs["C"], inputs["B"], chunk)
lower = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
check("chunk_cb (lower triangle)", unpacked_cb(CB, chunk)[..., lower], steps["CB"][..., lower], tolerance(torch.float32))

# %% [markdown]
# What `chunk_cb` stores, for one chunk of the benchmarks' size, $Q = 256$, laid out as a $Q \times Q$ matrix again by `unpacked_cb`, which fills the squares that are not stored with NaN. Under `poisoned_outputs()` every output starts as NaN too, so the print's count of NaN in the stored floats is the count of floats that were never written:

# %%
wide = make_inputs(batch=1, length=256, heads=1, groups=1)
with poisoned_outputs():
    CB_stored = chunk_cb(wide["C"], wide["B"], 256)
print(f"stored: {CB_stored.shape[-1]} floats per chunk and group (of {256 * 256}); "
      f"never written: {int(CB_stored.isnan().sum())}")
CB_wide = unpacked_cb(CB_stored, 256)[0, 0, 0].cpu()
below = torch.ones(256, 256, dtype=torch.bool).tril()
stored = ~torch.isnan(CB_wide)
kind = stored.long() + (stored & below).long()  # 0 not stored, 1 stored above the diagonal, 2 used
fig, ax = plt.subplots(figsize=(4.2, 3.8))
shades = [(0.87, 0.87, 0.87, 1.0), (*plt.matplotlib.colors.to_rgb(COLORS["y"]), 0.35), COLORS["y"]]
ax.imshow(kind, cmap=plt.matplotlib.colors.ListedColormap(shades), vmin=0, vmax=2)
for k in range(64, 256, 64):
    ax.axhline(k - 0.5, color="white", lw=1)
    ax.axvline(k - 0.5, color="white", lw=1)
labels = ("on or below the diagonal: used", "above it: stored, weight 0", "not stored")
ax.legend(handles=[plt.matplotlib.patches.Patch(color=c, label=label) for c, label in zip(shades[::-1], labels)],
          loc="upper right", fontsize="x-small")
ax.set(title="CB of one chunk (Q = 256) after chunk_cb", xlabel="s", ylabel="t")
plt.tight_layout()
plt.show()
print(f"stored above the diagonal: {int((stored & ~below).sum())} entries; not stored: {int((~stored).sum())}")

# %% [markdown]
# Of the sixteen $64 \times 64$ squares, the four on the diagonal and the six left of them are stored; the six right of the diagonal (24576 entries) are not. The light triangles, $4 \cdot 64 \cdot 63 / 2 = 8064$ entries above the diagonal, are computed, stored and read, and always meet a zero weight.

# %% [markdown]
# ### 3. The chunk states
#
# $S_c = (x \odot w)^\top B$ with $w_s = e^{\ell_{\text{last}} - \ell_s}\Delta_s$: a (headdim × Q) by (Q × dstate) matmul per chunk and head. First the plainest kernel that does it, the chapter's first version from `mamba_annotated/ssd/simple.py`: one program per (batch, chunk, head) loads the chunk's $x$ and $B$ whole, weighs $x$ and makes one `tl.dot`. (The teaching kernels call `dot`, a one-line helper in `simple.py`: `tl.dot(a, b, input_precision="ieee")`, exact float32 products as PyTorch's default, where a plain `tl.dot` would round float32 tiles to {term}`TF32` on a GPU.) It assumes contiguous float32 inputs, one group and a length that is a multiple of $Q$, so it needs no strides and no masks.

# %%
show_source(chunk_state_simple_kernel)

# %% [markdown]
# Checked against the reference's chunk states (the reference also supplies $\Delta$ and $\ell$ in the kernels' layout, so only this kernel is under test), on inputs it accepts: one group, $L = 48$, three chunks of 16.

# %%
simple = {k: v for k, v in make_inputs(length=3 * chunk, groups=1).items() if k not in ("D", "z")}
_, simple_steps = ssd_chunked_ref(**{k: v.double() for k, v in simple.items()}, chunk_size=chunk, dt_softplus=True,
                                  return_intermediates=True)
simple_dt, simple_l = (simple_steps[k].float().contiguous() for k in ("dt", "dA_cumsum"))
check("chunk_state_simple", chunk_state_simple(simple["x"], simple["B"], simple_dt, simple_l),
       simple_steps["states"], tolerance(torch.float32))

# %% [markdown]
# The production kernel computes the same product for any strides, groups, length and dtype, in tiles of dstate and steps of the chunk chosen by its {term}`autotuner`. The weight goes on $x$, not on $B$, though both are the same mathematics: on a Hopper GPU the first operand of `tl.dot` may come from {term}`registers`, the second must sit in {term}`shared memory`, so a scaled $B$ would be written back to shared memory before every matmul (the Performance notes of the backward pass give the times). The same kernel, with the weight $w_t = e^{\ell_t}$ and `(dy, C)` in place of `(x, B)`, will give the backward pass the gradient of the states, so it takes a flag. Here it is in three pieces.

# %%
show_fragment(chunk_state_kernel, "@lean_launch", "pid = tl.program_id(0)")

# %% [markdown]
# The tuning list and the arguments. The operands are named `u` and `v`, not `x` and `B`, because the backward pass passes `(dy, C)`. `TO_END` picks the weight and `HAS_SEQ_IDX` turns on the sequence test; both are `tl.constexpr`, so each combination compiles to its own kernel with no branch left at run time. On a GPU the tuner times the seven configurations (those whose steps fit the chunk) once per key (headdim, dstate, chunk, `TO_END`) and keeps the fastest; in the interpreter `autotune` from `ssd/tuning.py` uses only the 16-wide one. `u`, `v` and `seq_idx` come with their strides, so views need no copy.

# %%
show_fragment(chunk_state_kernel, "pid = tl.program_id(0)", "acc = tl.zeros")

# %% [markdown]
# Which tile the program owns, and what the weights need. The first grid axis counts (batch, chunk, head), head fastest; the second counts the tiles of the $P \times N$ state, `BLOCK_P` rows of headdim by `BLOCK_N` columns of dstate. Head `h` reads the $B$ of its group `g`. The batch offset is widened to 64 bits before it meets a stride, so tensors of more than $2^{31}$ elements are addressed correctly. `hi_last` and `lo_last` are the two planes of $\ell_{\text{last}}$, the chunk's last slot of $\ell$: in a chunk cut short by the end of the sequence the missing slots have $\Delta = 0$, so that slot holds the decay of the whole chunk. With `seq_idx`, `seq_owner` is the sequence the state belongs to: for `TO_END` the sequence of the chunk's last position; otherwise the sequence of the state entering the chunk, that of the position before it (0 for the first chunk, as in mamba_ssm).

# %%
show_fragment(chunk_state_kernel, "acc = tl.zeros")

# %% [markdown]
# The loop walks the chunk in steps of `BLOCK_K` positions and accumulates $u^\top \operatorname{diag}(w)\, v$ in float32. The weight is $w_t = e^{\ell_{\text{last}} - \ell_t}\Delta_t$ for the chunk state $S_c$ and $w_t = e^{\ell_t}$ for the gradient $dH_c$. $\ell \le 0$ and never rises along a sequence's run inside the chunk, so for the positions the state keeps both exponents are $\le 0$ and neither exponential overflows; across a packed-sequence boundary, where $\ell$ restarts, the weight is dropped by a select. With `seq_idx`, a position of another sequence than `seq_owner` adds nothing, and neither does any position of a chunk whose last position is padding (a negative id). Because `seq_idx` never decreases (the public op checks it, except while torch.compile traces or a CUDA graph captures, where a decreasing one is not refused and gets a different result), the positions the state keeps are one run of the chunk, `[first, stop)`; `sequence_run` (in `triton_ops.py`) finds it once, before the loop, and the loop starts at the run's first step: from the chunk's first and last ids alone where both are `seq_owner` (then so is every id between them), and from all the chunk's ids, reduced across the block, only in a chunk where a sequence starts or ends. Outside the run a position's $B$ row loads as zeros, by the mask of the load, and its weighted $u$ column is zeroed by a select, since its weight may be infinite across a boundary and its $u$ is loaded unmasked. (Both operands, because a zero on one side alone would let a NaN on the other through as $0 \cdot \text{NaN}$.) Positions past the end of the sequence load as zeros. The $u$ tile is loaded transposed, (`BLOCK_P`, `BLOCK_K`), so one `mm` (the package's wrapper of `tl.dot` in `triton_ops.py`, with the dot-precision policy every kernel shares) gives a (`BLOCK_P`, `BLOCK_N`) tile of the state. The weighted tile is rounded back to the input dtype, so 16-bit inputs still multiply on the tensor cores. The store is masked at the edges of headdim and dstate; the output is contiguous float32, (batch, chunks, heads, $P$, $N$).

# %%
states = chunk_state(inputs["x"], inputs["B"], dA_cumsum, dt_out, to_end=True)
check("chunk_state", states, steps["states"], tolerance(torch.float32))

# %% [markdown]
# ### 4. Passing the state across chunks
#
# One program per (batch, head, block of the state) walks the chunks in order: emit $H_c$, then $H_{c+1} = e^{\ell_{\text{last}}(c)} H_c + S_c$. A `REVERSE` flag walks the other way for the backward pass, where `CARRY` also forms each chunk's term of the decay gradients (the backward section below says which, and why here). Reading the listing for the forward pass, the loop is: store $H$, load $\gamma_c$, multiply, add $S_c$. The `CARRY` and `HAS_H0` lines serve only the backward pass. With `seq_idx`, a select zeroes the carried state where the chunk ends in another sequence than the one carried into it (`end_this` against `end_prev`: the ids at the last positions of this chunk and of the one before, each loaded a step before its use), so no state crosses a boundary.

# %%
show_source(state_passing_kernel)

# %%
states_in, final = state_passing(states, dA_cumsum, length=length, initial=inputs["initial_states"])
check("state_passing: states entering each chunk", states_in, steps["states_in"], tolerance(torch.float32))
check("state_passing: final state", final, steps["final_states"], tolerance(torch.float32))

# %% [markdown]
# ### 5. The outputs
#
# The teaching version first: one program per (batch, chunk, head) reads the state entering the chunk out, $e^{\ell_t} H_c C_t$, then adds the diagonal block, $\sum_{s \le t} (C_t \cdot B_s)\, e^{\ell_t - \ell_s}\, \Delta_s\, x_s$, as a matrix of scores $C B^\top$, a decay mask and one more `tl.dot`. Above the diagonal $\ell_t - \ell_s > 0$ and the exponential may overflow to $\infty$; the select (`tl.where`) puts 0 in its place before it multiplies anything, since $\infty \cdot 0$ would be NaN.

# %%
show_source(chunk_scan_simple_kernel)

# %%
simple_y = chunk_scan_simple(simple["x"], simple["B"], simple["C"], simple_steps["states_in"].float().contiguous(),
                             simple_dt, simple_l)
check("chunk_scan_simple = the whole forward pass (no D, z)", simple_y,
       ssd_quadratic_ref(**simple, dt_softplus=True), tolerance(torch.float32))

# %% [markdown]
# The production kernel tiles the same two steps. One program per (batch, chunk, head, block of rows, block of headdim): first $e^{\ell_t} H_c C_t$ (a matmul over dstate), then the diagonal block, looping over column blocks only up to the diagonal (the causal half is skipped), then $D x_t$ and the gate $y \cdot \mathrm{silu}(z)$.
#
# The loop over the diagonal block runs $Q^2/2$ weights per chunk and head, and it is the kernel's hot spot: the tensor cores finish a step's matmul sooner than the {term}`SM` can compute the step's weights $CB_{ts}\, e^{\ell_t - \ell_s} \Delta_s$. So its body is kept to a few instructions per weight:
#
# - the decay is `exp2` of $\ell$ pre-scaled by $\log_2 e$ (`tl.exp` would multiply every element by $\log_2 e$ first);
# - one select applies the causal mask (and, with `seq_idx`, the sequence boundaries), and it comes last, after the products: `weight = tl.where(keep, CB * tl.exp2(...) * dt_s, 0.0)`;
# - nothing tests $s$ against the end of the sequence, because for a row $t$ inside it every $s \le t$ is inside too, and rows past the end are never stored.
#
# **Why the select comes after the products.** Above the diagonal the column is a later position $s > t$. There $\ell_t - \ell_s > 0$, so `exp2` may overflow to $\infty$, and a NaN or $\infty$ in a later step $\Delta_s$ or a later $B_s$ (and so in $CB_{ts}$) makes the product NaN. Selecting the finished product replaces whatever it is with 0, so a non-finite $\Delta_s$, $B_s$ or exponential at a later position $s$ never reaches an earlier output $t < s$ ($x_s$ is the exception, next; `test_a_non_finite_value_never_reaches_earlier_outputs` in `tests/test_ssd.py` checks this). A select on the exponent alone, $-\infty$ above the diagonal so that the decay is 0, would leave $CB_{ts} \cdot 0 \cdot \Delta_s$, which is NaN whenever $CB_{ts}$ or $\Delta_s$ is not finite.
#
# **A non-finite $x_s$ needs more than a select.** $x$ enters through the matmul itself, which multiplies the zero weight by it, and $0 \cdot \text{NaN}$ is NaN. So the blocks where the mask hides some column from some row (the block on the diagonal, and every block when there is `seq_idx`) must test their $x$ tile, with `drop_hidden_nonfinite` from `triton_ops.py` (the checked launch below does): the helper zeroes the bad entries and counts, for each row, the bad values that row does see; at the end, rows with a nonzero count are set to NaN, as the plain product would have made them. (Two simplifications: an $\infty$ comes out as NaN, and the row's `BLOCK_P` columns in that tile are set to NaN, not just the affected column. A count per column would need a second accumulator tile in registers.)
#
# **Why two launches.** Testing every such tile costs more than it seems. On an H100 the forward pass went from 0.570 to 0.660 ms with the test inside the loop (from 0.73 to 1.06 ms with `seq_idx`): with 64-row blocks and 32-wide steps at chunk 256, two of every five iterations of the column loop fall on a diagonal block, and the test sits between the load and the matmul, so the matmul waits for it. A second, checked copy of the loop compiled into the same kernel, used only when a tile comes out non-finite, was hardly better (0.64 ms): the kernel already uses 255 registers, and the copy made it spill. So the work is split across two launches. The kernel below computes every tile as if $x$ were finite and, for each row that comes out non-finite, sets a flag: the NaN may come from an $x_s$ the row sees, or from one it does not see, carried in as $0 \cdot \text{NaN}$. A second, light kernel reads the flags, a few hundred programs of 64 tiles each, and computes again, checked, only the tiles with a flagged row. Usual inputs pay a reduction along each row, a zeroed flag per row and that launch: the forward pass takes 0.599 against 0.570 ms without any containment, in the same run (0.874 against 0.809 ms with `seq_idx`). `book/data/nonfinite_check_cost.json` holds the measurements, from three A/B runs of `benchmarks/bench_package_ab.py`, each timing copies of the package against the code before the fix. The chunk-state kernel needs no second launch: a position outside the state's sequence adds nothing to it at all, so the kernel zeroes both operands of its product (a select on the weighted $x$, the mask of the load on $B$). The leak was found on the GPU by `scripts/reliability/nonfinite.py`, which puts a NaN or $\infty$ into one input and checks which outputs change: a NaN in $x$ at $t = 25$ had changed $y_{16}, \dots, y_{24}$.
#
# **Non-finite steps** need no test at all. The cumulative sums $\ell$ restart at every sequence boundary (kernel 1), so a non-finite step spoils the decays of its own sequence only; the weights that cross a boundary, whose exponents may now be large and positive, are dropped by the selects above, never multiplied by 0. (Before the restart, a NaN step reached the later sequences of its chunk.) (Since the sums are kept in two planes, the restart no longer matters for rounding: each exponent $\ell_t - \ell_s$ is as exact as float32 can hold it, however large $|\ell|$ has grown; see "The sums keep their low part".)
#
# The backward pass's $dx$ kernel runs the same loop transposed, and it too selects after the products: its weights are `tl.where(keep, CBT * decay, 0.0)`, so a NaN in $CB$ or an overflowed decay above the diagonal stays out of the row. It still reads only entries `chunk_cb` wrote, as the forward kernel does: `chunk_cb` writes the diagonal squares whole (the figure of step 2), and the row blocks of both kernels are no taller than `SCAN_ROWS` (`check_row_blocks` in `chunk_state.py` enforces it for every tuned configuration), so no kernel reads memory that nobody wrote, which compute-sanitizer's initcheck would report. The Performance notes of the backward pass give the times of these choices.

# %% [markdown]
# The kernel in five pieces. Its arguments carry what the teaching kernel left out: strides for any layout, groups, the optional $D$, $z$ and `seq_idx`, tiles, and the row flags that the first launch writes and the checked launch reads. `write_tile` computes and stores one tile; the kernel of the first launch is one call of it, and the checked kernel calls it again for flagged tiles. A tile is `BLOCK_M` rows and `BLOCK_P` columns of headdim of one (chunk, head), and `tile_coordinates` numbers the row blocks of one chunk and head next to each other. Row block $i$ reads the $x$ rows of blocks 0 to $i$, so programs that share $x$ tiles run together and find them still in {term}`L2`:

# %%
show_fragment(write_tile, "def write_tile(", "acc = output_rows(")

# %% [markdown]
# `output_rows` computes the tile before $D$ and the gate. It first loads each row's $\ell_t$, as its planes `hi_t` and `lo_t`, and with `seq_idx`, the row's sequence (`seq_t`) and that of the previous chunk's last position (`seq_carry`). Then the state entering the chunk, read out: $e^{\ell_t} H_c C_t$, a matmul over dstate in blocks of `BLOCK_N`. With `seq_idx`, a row of another sequence than the carried state's gets none of it (a select), and a block none of whose rows continues the carried sequence skips the matmul altogether (`n_stop` is 0):

# %%
show_fragment(output_rows, "# off-diagonal blocks: C_t . H_c", "# diagonal block (diagonal_block)")

# %% [markdown]
# Then the diagonal block. With `seq_idx`, a row block whose rows and the keys before them all belong to one sequence runs the loop of the unpacked case: since the ids never decrease, it is enough that the id at the chunk's first position equals the id at the block's last row. Only a block where those ids differ (`mixed`: a sequence starts in it, or earlier in the chunk) loads the keys' ids and compares them with the rows' in every step. Both versions of the loop are compiled into the kernel (`MIXED` is a compile-time constant of `diagonal_block`), and each program takes one. With 8 sequences of 512 tokens per row at the first shape below, no block mixes sequences; the kernel went from 0.379 to 0.355 ms, under the 0.361 ms it takes without `seq_idx` (there, blocks that start a sequence also skip the entering state). The packed forward pass went from 0.645 to 0.617 ms against 0.572 without `seq_idx` (two rounds per copy on an H200, `book/data/chunk_scan_one_sequence_ab.json`):

# %%
show_fragment(output_rows, "# diagonal block (diagonal_block)")

# %% [markdown]
# The loop, with the body described above: column blocks of `BLOCK_K` up to the diagonal, the weights formed in registers, one select after the products, one matmul with the $x$ tile. The `DROP_HIDDEN_NONFINITE` lines are compiled only into the checked pass, whose loop is not pipelined (`STAGES=1`):

# %%
show_fragment(diagonal_block, "for k0 in")

# %% [markdown]
# Back in `write_tile`: the unchecked pass flags the rows that came out non-finite (a reduction along the row, within one warp; the flags start at zero and every writer writes 1, so no two writes disagree), then the skip $D x_t$ and the gate. With $z$ the kernel stores the ungated $y$ too (the backward pass needs it) before it multiplies by $\mathrm{silu}(z)$. Compiled for the H200, this gated epilogue (the steps after the main loop: the skip, the gate, the stores) makes the kernel {term}`spill <spill>` registers (88 to 104 bytes per thread in its 4-warp configurations of 64 columns); forming each pointer where it is used, from a 64-bit offset per row and a 32-bit one per column, removed the spill (96 bytes to none in the configuration timed) but saved no time: 0.5135 against 0.5130 ms before, in an A/B on an H200 (`book/data/gated_epilogue_ab.json`), so the code below keeps its precomputed tiles of offsets:

# %%
show_fragment(write_tile, "acc = output_rows(")

# %% [markdown]
# The checked kernel. One program reads the flags of 64 row tiles in one load (a row tile is one row block of one chunk and head, all of headdim); only when one is set does it walk those tiles and recompute the flagged ones, every column block of each. The usual launch is therefore a few hundred programs that read and leave:

# %%
show_source(chunk_scan_checked_kernel)

# %%
out, _ = chunk_scan(CB, inputs["x"], inputs["C"], states_in, dA_cumsum, dt_out, z=inputs["z"], D=inputs["D"])
check("chunk_scan = the whole forward pass", out, y_quadratic, tolerance(torch.float32))

# %% [markdown]
# ### The public function, every argument
#
# `ssd_chunk_scan` checks its inputs, runs the five kernels and wires the backward pass into autograd. It takes the arguments of mamba_ssm's `mamba_chunk_scan_combined`. With `seq_idx`, several sequences are packed into one row: no term $M_{ts}$ crosses a boundary, no state is carried into another sequence, and `initial_states` belong to the sequence with id 0 (as in mamba_ssm, whose carried sequence id starts at 0). With `cu_seqlens` and `return_varlen_states=True` (batch 1) it also returns the state at the end of each packed sequence, computed as mamba_ssm computes it. Two checks need the values of a tensor: `seq_idx` must never decrease, and the offsets in `cu_seqlens` must lie in the row and never decrease. Their answers are never read back on the host, because reading a GPU tensor's value makes the host wait for every kernel queued before it; in a model that packs sequences that would be a pause at every layer, during which the host could not queue work ahead of the GPU. The checks run on the device instead, in stream order before the kernels (`torch._assert_async`, through `validation.refuse_unless`): a bad value stops the stream with the check's message and leaves the CUDA context unusable, as PyTorch's own device-side index checks do (under the interpreter, on a CPU, it raises at once).

# %%
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    inp = make_inputs(dtype=dtype)
    got = ssd_chunk_scan(**inp, chunk_size=chunk, dt_softplus=True)
    check(f"ssd_chunk_scan, {str(dtype)[6:]}", got, ssd_quadratic_ref(**inp, dt_softplus=True), tolerance(dtype))

seq_idx = (torch.arange(length, device=device)[None] >= torch.tensor([[7], [23]], device=device)).to(torch.int32)
kw = dict(dt_softplus=True, dt_limit=(0.05, 1.0), seq_idx=seq_idx, return_final_states=True)
got, got_final = ssd_chunk_scan(**inputs, chunk_size=chunk, **kw)
want, want_final = ssd_quadratic_ref(**inputs, **kw)
check("packed sequences (seq_idx) and dt_limit: y", got, want, tolerance(torch.float32))
check("packed sequences (seq_idx) and dt_limit: final state", got_final, want_final, tolerance(torch.float32))

# %% [markdown]
# ## The backward pass
#
# Given the gradient of the loss $\mathcal J$ with respect to $y$, $dy = \partial\mathcal J/\partial y$, walk the forward steps backwards. With the gate, the function returns $\text{out} = y \cdot \mathrm{silu}(z)$, and one elementwise kernel (`mamba_annotated/ssd/gate.py`) turns the incoming $d\text{out} = \partial\mathcal J/\partial\,\text{out}$ into $dy = d\text{out} \cdot \mathrm{silu}(z)$ and $dz$. It also sums $D$'s gradient, $\sum_t dy_t\, x_t$, in float32 before it rounds $dy$ to $x$'s dtype: summed from the rounded $dy$ instead, a bfloat16 $dD$ of one head was 2.2e-3 off in a GPU sweep. With $\Gamma_{ts} = e^{\ell_t - \ell_s}$ on the diagonal block, and everything but $B$, $C$ and $CB$ belonging to one head $h$ ($\ell$, $\Delta$, $\Gamma$, $x$, $dy$, $H_c$, $S_c$; a superscript $(h)$ marks it only where the heads of a group meet):
#
# - **Into the states.** $y_t$ reads $H_c$ through $e^{\ell_t} C_t$, so $dH_c = \sum_{t \in c} e^{\ell_t} dy_t\, C_t^\top$: the chunk-state kernel with weight $e^{\ell_t}$. The carry $H_{c+1} = \gamma_c H_c + S_c$ transposes: the whole gradient of $H_c$, its {term}`adjoint` (chapter 1's $\lambda_t$, here a matrix), is $\Lambda_c = \gamma_c \Lambda_{c+1} + dH_c$ (what $H_{c+1}$ passes back, plus what chunk $c$'s outputs send), walked from the last chunk, with $dS_c = \Lambda_{c+1}$, $\Lambda_{\text{chunks}} = d h_{\text{final}}$ and $d h_{\text{init}} = \Lambda_0$: the state-passing kernel, reversed.
# - **Into $x$.** $dx_s = \Delta_s\big(e^{\ell_{\text{last}} - \ell_s}\, dS_c B_s + \sum_{t \ge s} CB_{ts} \Gamma_{ts}\, dy_t\big) + D\, dy_s$; the bracket, dotted with $x_s$, is also the direct part of $d\Delta_s$: the part through the factor $\Delta_s$ in $M_{ts}$ and in $S_c$ (the part through the decays $\ell$ comes in the last item).
# - **Into $B$ and $C$.** Head $h$ sends $C_t$ and $B_s$ the gradients
#
#   $$
#   \begin{aligned}
#   dC^{(h)}_t &= e^{\ell_t} H_c^\top dy_t + \textstyle\sum_{s \le t} dCB^{(h)}_{ts} B_s, \\
#   dB^{(h)}_s &= e^{\ell_{\text{last}}-\ell_s}\Delta_s\, dS_c^\top x_s \\
#   &\quad + \textstyle\sum_{t \ge s} dCB^{(h)}_{ts} C_t,
#   \end{aligned}
#   $$
#
#   where $dCB^{(h)}_{ts} = \Gamma_{ts}\Delta_s (dy_t \cdot x_s)$ is its gradient of $CB_{ts} = C_t \cdot B_s$. The group's $C$ and $B$ get the sums over its heads, $dC_t = \sum_{h \in g} dC^{(h)}_t$ and $dB_s = \sum_{h \in g} dB^{(h)}_s$. Summing $dCB = \sum_{h \in g} dCB^{(h)}$ first means the diagonal-block products with $B$ and $C$ run once per group, not once per head.
# - **Into the decays.** Every term of $y_t$ holds $\ell$ as $e^{\ell_t - \ell_s}$ or $e^{\ell_t}$: $+$ for the row $t$, $-$ for the column $s$. Take the row part first. $\ell_t$ reaches the loss through $dy_t \cdot y_t$, in the diagonal block and in the state term, and an exponential is its own derivative, so (with $CB_{ts} = C_t \cdot B_s$)
#
#   $$
#   \begin{aligned}
#   &\frac{\partial}{\partial \ell_t} \Big(\textstyle\sum_{s \le t} CB_{ts}\, \Gamma_{ts} \Delta_s\, (dy_t \cdot x_s) \\
#   &\qquad + e^{\ell_t}\, dy_t \cdot H_c C_t\Big) \\
#   &= \textstyle\sum_{s \le t} (C_t \cdot B_s)\, dCB^{(h)}_{ts} \\
#   &\qquad + C_t \cdot e^{\ell_t} dy_t H_c \\
#   &= C_t \cdot dC^{(h)}_t .
#   \end{aligned}
#   $$
#
#   In the same way, for a position $r$, the terms where $r$ is the column give $-B_r \cdot dB^{(h)}_r$ (the term $s = t$, where $\ell_t$ is row and column at once, appears in both sums and cancels): the diagonal block's through $e^{-\ell_r}$ in $\Gamma_{tr}$, the state term's through $e^{\ell_{\text{last}} - \ell_r}$ in $S_c$. The chunk's last slot also receives $\langle dS_c, H_{c+1}\rangle$ from the carry ($\langle U, V \rangle = \sum_{p,n} U_{pn} V_{pn}$, the sum of the elementwise products of two $P \times N$ matrices; through both $\gamma_c = e^{\ell_{\text{last}}}$ and the $e^{\ell_{\text{last}} - \ell_s}$ inside $S_c$). So, per head,
#
# $$
# \begin{aligned}
# \frac{\partial\mathcal J}{\partial \ell_r} &= C_r \cdot dC^{(h)}_r - B_r \cdot dB^{(h)}_r \\
# &\quad \big(+\, \langle dS_c, H_{c+1}\rangle \text{ if } r \text{ ends } c\big),
# \\
# \frac{\partial\mathcal J}{\partial(\Delta_k A)} &= \sum_{r \ge k,\ r \in c} \frac{\partial\mathcal J}{\partial \ell_r},
# \end{aligned}
# $$
#
# a **reverse** cumulative sum inside each chunk, because $\ell_r = \sum_{k \le r} \Delta_k A$. Then $d\Delta_k \mathrel{+}= A\, \partial\mathcal J/\partial(\Delta_k A)$, $dA = \sum_k \Delta_k\, \partial\mathcal J/\partial(\Delta_k A)$, and $d\Delta$ goes back through the clamp (zero outside the limits), the softplus (times its derivative, the sigmoid $\sigma(\mathrm{dt} + \mathrm{dt\_bias})$) and the bias (summed).
#
# **Sums that cancel, and sums that do not.** That formula is right, and in float32 it is not good enough. Write $W_{ts} = (C_t \cdot B_s)\, dCB^{(h)}_{ts}$ for one pair of the diagonal block. It reaches $\partial\mathcal J/\partial \ell_t$ with a plus and $\partial\mathcal J/\partial \ell_s$ with a minus, so in the reverse sum over $r \ge k$ it cancels whenever both $t$ and $s$ are at or after $k$. Those are most pairs, and the largest ones: near the diagonal $\Gamma_{ts} \approx 1$. What is left is a small number made from two large sums, each carrying the rounding of the whole chunk. The property sweep of the reliability work found it: a float32 case at chunk 256 had $dA$ off by $1.6 \cdot 10^{-4}$ of its size (the bound is $10^{-4}$), and the error grew with the chunk ($4.8 \cdot 10^{-5}$ at chunk 64), while $dx$ stayed at $10^{-6}$.
#
# So the kernels sum only the terms that survive. Pair $(t, s)$ holds step $k$ in its exponent when $t \ge k > s$: it **straddles** $k$. The state entering the chunk, read at $r$ through $e^{\ell_r}$, holds the steps $k \le r$; row $r$'s share of the chunk state, through $e^{\ell_{\text{last}} - \ell_r}$, the steps $k > r$; and the carry $\gamma_c H_c$ all of them:
#
# $$
# \begin{aligned}
# \frac{\partial\mathcal J}{\partial(\Delta_k A)} &= \textstyle\sum_{t \ge k > s} W_{ts} \\
# &\quad + \textstyle\sum_{r \ge k} C_r \cdot e^{\ell_r} dy_r H_c \\
# &\quad + \textstyle\sum_{r < k} B_r \cdot e^{\ell_{\text{last}} - \ell_r} \Delta_r\, x_r\, dS_c \\
# &\quad + \langle dS_c, \gamma_c H_c\rangle .
# \end{aligned}
# $$
#
# Every term appears once, and nothing is subtracted. On that case $dA$ is now $1.5 \cdot 10^{-5}$ off (in the interpreter; the minimal case is `test_sweep_cases_of_the_sums_over_positions` in `tests/test_reliability_smoke.py`). mamba_ssm's backward also sums $dA$ over the straddling pairs, in a kernel of its own.
#
# **What the forward pass keeps.** The backward pass needs $\ell$, $\Delta$, $CB$ and the states $H_c$ entering each chunk. mamba_ssm recomputes them (a chunk-state pass and a state-passing pass); we keep them from the forward pass. $H_c$, stored in the inputs' dtype, is half the size of $x$ at $N = 128$, $Q = 256$ ($N/Q$ of it), and recomputing would allocate the float32 chunk states, twice that, so keeping them lowers the peak memory as well as the time. Likewise $dS_c$ is stored in the inputs' dtype: every kernel that reads it rounds it to that dtype for its matmuls anyway.
#
# Beside the chunk-state kernel (for $dH_c$), the reversed state passing and the gate's kernel (with $z$), four kernels of its own make the backward pass: `dt_backward` (the step gradients, at the end, below) and three that do most of the work: `chunk_scan_bwd_dx` (rows $s$, all of headdim, with a second, checked launch where a non-finite $dy$ needs it), `chunk_scan_bwd_dcb` (one $(t, s)$ tile of $dCB$, looping over the heads of the group and storing each head's sums of $W = CB \odot dCB^{(h)}$ over the pairs that straddle each step, in slots of its own) and `chunk_scan_bwd_dbc` (rows $r$, a block of dstate: the state terms per head, then the $dCB$ products once).
#
# **Non-finite values in the backward pass.** The forward pass keeps a NaN or $\infty$ to the outputs that read it; its gradients should reach only the inputs those outputs read. A NaN in $dy_t$ enters every product with a $dy$ tile, as $x$ entered the forward pass's, and a zeroed weight (a row $s > t$, or a row of another sequence) turns it into $0 \cdot \text{NaN}$ there. So the backward pass does what the forward pass does. The $dCB$ kernel and the state terms of `chunk_scan_bwd_dbc` select after their products, not before. `chunk_scan_bwd_dx` runs twice: the first launch computes every row block as if $dy$ were finite and flags the rows that come out non-finite, and a checked launch computes those row blocks again with `drop_hidden_nonfinite` on the $dy$ tiles (with no flag set, its programs read the flags and leave). These changes (the selects, the $dx$ kernel's two launches, and the state-term rows below) cost the backward pass 1.6 %: 1.680 ms before them and 1.707 ms after, at the first shape below on an H200 (medians of two alternating rounds, each version of the package in its own process, `book/data/nonfinite_backward_ab.json`; the backward pipeline alone, called without $D$ and `dt_bias`, so these times are lower than the whole backward pass in the tables below); chapter 6's backward pass, timed the same way, went from 3.415 to 3.454 ms (1.2 %). With packed sequences the forward and backward passes together came out 1.4 % faster (2.514 to 2.478 ms), which was not looked into. `tests/test_ssd.py` (`test_a_non_finite_value_keeps_to_the_gradients_that_see_it`) and `tests/test_bidirectional.py` (`test_a_non_finite_value_stays_in_its_packed_sequence`) check it, for one sequence and for packed ones. The dx kernel's weights, which hold $CB$, are selected after their products too, so a NaN in a $B$ or $C$ that a row does not see stays out of its $dx$. With `seq_idx`, the id carried into chunk 0 is 0 (mamba_ssm's convention: the initial state belongs to sequence 0), so the state terms there are kept for the rows of id 0 only when an initial state is given (`HAS_INITIAL_STATES`). Without one, a sequence of id 0 that starts after negative ids would take a term of a zero state; that term counts toward every step of the chunk up to its row, so $0 \cdot \text{NaN}$ from a NaN in its $dy$ would reach the step gradients of the sequences before it (`test_a_non_finite_dy_in_chunk_0_stays_in_its_sequence_whatever_the_ids` in `tests/test_bidirectional.py`). $B$ and $C$ enter the diagonal products of `chunk_scan_bwd_dbc` as $dy$ enters the dx kernel's, where a zeroed $dCB$ entry would multiply a NaN in a $B_s$ or $C_t$ that the row does not read, in its own sequence or another that shares the chunk; so that kernel runs twice too: the first launch flags the rows (and blocks of dstate) of $dB$ and $dC$ that come out non-finite, and a checked launch recomputes them with `drop_hidden_nonfinite` on the $B$ and $C$ tiles (`test_a_non_finite_B_or_C_reaches_only_the_gradients_that_read_it` in `tests/test_ssd.py`). In a later A/B run on an H200 (`book/data/chunked_backward_ab.json`, timed as above but on another day, so not comparable with the 1.707 ms) the backward pipeline took 1.701 and 1.705 ms before that second launch (two copies of the package) and 1.704 ms after it: no measurable difference.
#
# **Reproducible gradients.** Many programs contribute to each $\partial\mathcal J/\partial(\Delta_k A)$: every tile of $dCB$ whose pairs straddle $k$, every block of dstate in `chunk_scan_bwd_dbc`. Gathered by atomic adds (`tl.atomic_add`: a read-modify-write of a memory word that no other program can interleave with, so concurrent adds to one word all count), they would be summed in the order the programs happen to finish, and float32 addition is not associative: $dA$, $d\Delta$ and $d\,\mathrm{dt\_bias}$ would change in their last bits from run to run. So each program stores its share in a slot of its own (one per tile of the chunk, one per block of dstate; the row block of the $dCB$ kernel is fixed at launch, and the $dB\,dC$ kernel's slots are as wide as its narrowest tuned block, so every configuration writes the same slots), and `dt_backward_kernel`, which reads them anyway, adds the slots in a fixed order. The gradients are then the same bits on every run.
#
# ```{admonition} Performance notes
# :class: dropdown
# Measurements on an H200 (bfloat16, chunk 256; the first shape is (4, 4096, 80 heads, 64, 128), the second (1, 65536, 32, 64, 128)) behind choices in the kernels:
#
# - `chunk_state` scales $x$ (the dot's register operand), not $B$: 0.139 → 0.118 ms for the chunk states, 0.128 → 0.107 for the state gradients, at the first shape. Its tuner picks the whole dstate (128) in one tile with 4 {term}`warps <warp>` and steps of 32 (0.118 and 0.107 ms) over steps of 64 (0.122, 0.116), 8 warps (0.151, 0.156) and half of dstate per tile (0.165, 0.146).
# - `chunk_scan`'s diagonal loop body (exp2 of pre-scaled $\ell$, one select, no end-of-chunk test; measured while the select was still on the exponent, before it moved after the products): 0.389 → 0.330 ms at the first shape, 0.608 → 0.531 at the second. Steps of 32 through the diagonal block with 3 stages: 0.390 ms against 0.499 with steps of 64 (0.612 against 0.787 at the second shape). Row blocks of 128 measured 0.369 against 0.330 ms with that loop body.
# - With `seq_idx`, `chunk_state` finds the run of positions the state keeps before its loop. `scripts/compile_offline.py states` (the kernels compiled for sm_90 as launched, on a machine without a GPU, with Triton 3.6) shows what the two earlier forms cost. A select on the loaded $B$ tile sent both operands of the dot, the $B$ tile and the weighted $x$, from registers into shared memory again. A mask on the $B$ load made from the ids of the same step avoided that, but the tiles were then copied one step ahead of their use instead of three, since each waited on the ids; the packed forward pass went from 0.696 to 0.685 ms and forward+backward from 2.600 to 2.558 ms on an H200 with sequences of 1000 (`book/data/packed_state_load_ab.json`). With the run found first, the masks are arithmetic on the step, and the packed kernel is compiled with the unpacked one's prefetch depth (`tests/test_foundation.py` checks both properties). On the same H200 that took the packed forward pass from 0.690 to 0.654 ms and forward+backward from 2.571 to 2.511 ms, while one sequence stayed at 0.612 ms (medians of two rounds, `book/data/packed_state_runs_ab.json`). Chapter 6's `chunk_states` finds its two runs the same way; its packed forward pass went from 1.586 to 1.538 ms. Later, `sequence_run` stopped reading every id of a chunk whose first and last ids are both the state's sequence (with nondecreasing ids the whole chunk is then the run): only a chunk where a sequence starts or ends loads its ids and reduces them across the block, a wait before the loop's first loads. The kernel alone went from 0.157 to 0.152 ms with 8 sequences of 512 tokens per row, where every chunk lies in one sequence, and from 0.139 to 0.135 ms with sequences of 1000; it stayed at 0.126 ms without `seq_idx` and at 0.084 ms with sequences of 100, where most chunks hold a boundary. The packed forward pass went from 0.644 to 0.640 ms, about 0.6 % (two rounds per copy on an H200, `book/data/sequence_run_ab.json`; the scoreboard's variants run was stored after this change and the next).
# - `state_passing` prefetches the next chunks' states (`tl.range` stages): 0.079 → 0.073 ms at the first shape, 0.150 → 0.124 at the second.
# - With `seq_idx`, a block of `chunk_scan`'s rows none of which continues the carried sequence skips the product with $H_c$, which the select would zero anyway; and `state_passing` loads one id per chunk, a step ahead of its use, where it loaded two in the step that needed them. With 8 sequences of 512 tokens per row at the first shape (every second chunk starts one; all of them but chunk 0, whose rows continue the carried id 0, skip), the packed forward pass went from 0.665 to 0.652 ms with the first change (`chunk_scan` alone 0.392 → 0.379) and, in a run of its own, from 0.653 to 0.647 ms with the second, against 0.574 ms without `seq_idx`: 1.16× → 1.13× (`book/data/packed_skip_ab.json`; without $D$ and `dt_bias`, unlike the scoreboard's variants table). A variants run stored after both changes, with $D$ and `dt_bias`, had the packed forward pass at 1.12× the unpacked one (0.668 against 0.598 ms), still over the scoreboard's bar of 1.1×. With sequences of 1000 no block of 64 rows lies wholly in a new sequence, and the first change measured no difference beyond the noise between processes (+0.2 % forward).
# - With `seq_idx`, a row block of `chunk_scan` whose rows and the keys before them hold one sequence runs the unpacked diagonal loop, which loads and compares no ids ("5. The outputs" above shows the two loops). An earlier version made the same test per chunk but kept one loop, with the compare under a branch inside it; in its A/B the packed kernel took 0.4 % less, within the noise (`book/data/packed_mixed_branch_ab.json`). With a separate loop the kernel went from 0.379 to 0.355 ms with 8 sequences of 512 tokens and from 0.3953 to 0.3785 ms with sequences of 1000, and the packed forward pass from 0.645 to 0.617 ms and from 0.645 to 0.623 ms, against 0.572 ms without `seq_idx`, whose kernels keep their registers and time (`book/data/chunk_scan_one_sequence_ab.json`). The same split in `chunk_state` (an unpacked loop for a chunk the state keeps whole) was slower with every packing, 0.152 → 0.173 ms for the kernel with sequences of 512: the choice between the loops still waits on the ids before either starts, and the two loops' pipeline buffers, which the compiler did not share, took its shared memory from 50 to 92 KB, so half as many blocks fit on an SM. It was not kept. The variants run stored after the `chunk_scan` change has the packed forward pass at 1.06× the unpacked one (0.634 against 0.596 ms): under the bar of 1.1×.
# - The $dCB$ kernel's software-pipelined loop over heads took the $dCB$ and $dB\,dC$ kernels together from 1.57 to 1.34 ms at the first shape and from 2.55 to 2.18 ms at the second, against a plain loop.
# - Before the slots, $\partial\mathcal J/\partial \ell$ (the row and column sums of the first form above) gathered atomic adds. `tl.atomic_add` defaults to acquire-release order, which makes every add a fence (the program's other memory operations may not be moved across it), so the head loop's prefetched loads wait behind each add; relaxed adds (`sem="relaxed"`) took the two kernels from 1.35 to 0.88 ms at the first shape and from 2.20 to 1.57 ms at the second. The slots replaced them for reproducibility.
# ```

# %% [markdown]
# The teaching version of the diagonal block's share of $dx$ shows the transposed loop on its own: $dx_s = \Delta_s \sum_{t \ge s} (C_t \cdot B_s)\, \Gamma_{ts}\, dy_t$, the forward's scores and decay mask transposed (rows $s$, columns $t \ge s$) and one `tl.dot` with $dy$. One program per (batch, chunk, head), the same assumptions as the other teaching kernels:

# %%
show_source(chunk_scan_dx_simple_kernel)

# %% [markdown]
# Its check is a gradient: the diagonal blocks alone are the quadratic reference run on each chunk as if it were a whole sequence, and float64 autograd through that gives the $dx$ the kernel must match.

# %%
simple_length = simple["x"].shape[1]
x64 = simple["x"].double().requires_grad_()
simple_dy = randn(*x64.shape)
alone = lambda t: t.reshape(t.shape[0] * (simple_length // chunk), chunk, *t.shape[2:])  # each chunk a sequence
y_diagonal = ssd_quadratic_ref(alone(x64), alone(simple["dt"]), simple["A"], alone(simple["B"]), alone(simple["C"]),
                               dt_bias=simple["dt_bias"], dt_softplus=True)
(dx_diagonal,) = torch.autograd.grad(y_diagonal.reshape(x64.shape), x64, simple_dy.double())
check("chunk_scan_dx_simple = d(diagonal blocks)/dx", chunk_scan_dx_simple(simple_dy, simple["B"], simple["C"],
                                                                           simple_dt, simple_l),
       dx_diagonal, tolerance(torch.float32))

# %% [markdown]
# The production $dx$ kernel adds the state term $e^{\ell_{\text{last}} - \ell_s} dS_c B_s$, the skip and the direct part of $d\Delta$ to this loop. The $dCB$ kernel: one $(t, s)$ tile per program, looping over the heads of the group; each head's sums of $W = CB \odot dCB^{(h)}$ over the pairs that straddle each step go to slots of their own. In three pieces:

# %%
show_fragment(chunk_scan_bwd_dcb_kernel, "@lean_launch", "pid = tl.program_id(0)")

# %% [markdown]
# The tuner varies `HEAD_STAGES`, the depth of the software pipeline of the loop over the heads (the next heads' tiles load while one head computes), and, in one configuration, the warps and `num_stages`. The row block `BLOCK_M` is fixed at launch, not tuned: the slots of the step gradients are laid out per tile, and every configuration must write the same slots. The second grid axis counts the tiles $(i, j)$ of the chunk (`pid_t`, `pid_s`: row tile $i$ of positions $t$, column tile $j$ of positions $s$), `n_m` by `n_m`. A tile above the diagonal returns at once: $dCB_{ts}$ for $s > t$ is never read.

# %%
show_fragment(chunk_scan_bwd_dcb_kernel, "pid = tl.program_id(0)", "dCB = tl.zeros")

# %% [markdown]
# The first grid axis counts (batch, chunk, group). `mt` and `ms` are the tile's rows and columns, counted from the chunk's start. One program covers all of headdim (`BLOCK_P` $\ge P$; the public function accepts $P \le 128$). `keep` marks the entries that enter the gradient: on or below the diagonal, both positions inside the sequence, and with `seq_idx` both in the same sequence. The $CB$ tile is the same for every head of the group, so it is loaded once, before the head loop, with zeros where `keep` is false. `off_diagonal` is the test `pid_t > pid_s` as a vector, because it serves as a mask in a store below.

# %%
show_fragment(chunk_scan_bwd_dcb_kernel, "dCB = tl.zeros")

# %% [markdown]
# The loop over the heads of the group. For head $h$ it loads $dy_t$ (rows $t$) and $x_s^\top$ (columns $s$), and one `mm` gives the products $dy_t \cdot x_s$; times the decay and $\Delta_s$ they make that head's term $\Gamma_{ts} \Delta_s (dy_t \cdot x_s)$. The decay is `exp2` of the difference of the sums' hi planes, taken for every entry, so above the diagonal, where $\ell_t - \ell_s > 0$, it may overflow to $\infty$; as in the forward kernel, the select comes after the products (`tl.where(keep, mm(dyt, xsT, PRECISION) * weights * dt_s[None, :], 0.0)`), so an overflowed weight, or a NaN in $dy_t$ or $x_s$, never reaches a pair that is kept. The terms of all heads add up in `dCB`. Times $CB$, a head's term gives $W$, and the tile $(i, j)$ (row block $i$, column block $j$) stores its sums over the pairs that straddle each step $k$:
#
# - $k$ in the column block $j$: the pairs with $s < k$ and $t \ge k$. With $u = k - 1$, `tl.cumsum(W, axis=1)` holds $\sum_{s \le u} W_{ts}$ in column $u$, and the rows that count are those with $t > u$ on the diagonal tile, and all of them on a tile left of the diagonal ($t \ge k$ always), where the sum over rows can come first: the cumulative sum of the column sums, a vector rather than a tile. The branch is the same for every head of the program's loop. The sum over those rows belongs to $k = u + 1$, so it is stored one position on, and the block's first position, which no pair of this tile straddles, gets 0. Slot $i$.
# - $k$ in the row block $i$ of a tile left of the diagonal: every column has $s < k$, so it is the row sums summed over $t \ge k$, a reverse `tl.cumsum`. Slot $j$.
# - $k$ in a block strictly between $j$ and $i$: all the tile's pairs, which is what slot $j$ holds at the first position of block $i$; `dt_backward_kernel` reads it from there.
#
# So each slot of each position is written by exactly one program, and `dt_backward_kernel` adds the slots in a fixed order. `dCB` itself is stored once, after the last head.
#
# What the accurate form costs: with the tile-wide cumulative sum on every tile, the whole backward pass took 1.87 ms, against 1.68 ms for the reverse sum of $\partial\mathcal J/\partial \ell$ (H100, the first benchmark shape, `benchmarks/bench_package_ab.py`). The vector branch for the tiles left of the diagonal barely changed that (1.86 ms). The remaining 10 % is the price of the accurate form: the cumulative sums in the head loop (a scan needs its warps to exchange partial sums, a reduction less), the second state slot and the longer gather.
#
# The $dB\,dC$ kernel, in five pieces. First its arguments and the rows it owns:

# %%
show_fragment(dbc_tile, "def dbc_tile(", "# this program's slots of the step gradients")

# %% [markdown]
# The first grid axis counts (batch, chunk, group), the second the pairs (block of rows, block of dstate): a program owns rows $r$ of one chunk and group and `BLOCK_N` columns of dstate. It loads $B_r$ and $C_r$ once, in float32, for all the heads of the group; rows past the end of the sequence load as zeros and are never stored. With `seq_idx`, `seq_r`, `seq_last` and `seq_carry` are the sequences of the rows, of the chunk's last position and of the state carried into the chunk, as in the forward kernels.

# %%
show_fragment(dbc_tile, "# this program's slots of the step gradients", "for i in range(heads_per_group):")

# %% [markdown]
# The slots of the step gradients that this program writes: one per row and per `SLOT_N` columns of dstate, `SLOT_N` being the narrowest block the tuner tries. A program whose block spans several slots writes each of them, so every configuration writes the same slots and none keeps a stale value from a trial run of another configuration. `dB` and `dC` accumulate in float32, over the heads of the group and then over the diagonal block.

# %%
show_fragment(dbc_tile, "for i in range(heads_per_group):", "# the state terms' shares")

# %% [markdown]
# Head by head, the state terms. The first term of $dC^{(h)}_r$, $e^{\ell_r} dy_r H_c$, is one `mm` of the $dy$ tile with the tile of $H_c$; the first term of $dB^{(h)}_r$, $e^{\ell_{\text{last}} - \ell_r}\Delta_r\, x_r\, dS_c$, one `mm` of the $x$ tile with the tile of $dS_c$; each is scaled row by row afterwards. With `seq_idx`, a row of another sequence than the carried state's gets nothing from $H_c$, and a row of another sequence than the chunk's last position (or of padding, id $< 0$) nothing from $dS_c$.

# %%
show_fragment(dbc_tile, "# the state terms' shares", "# diagonal blocks, once per group")

# %% [markdown]
# Each head's state terms of the step gradients, $C_r \cdot (e^{\ell_r} dy_r H_c)$ (`from_start`) and $B_r \cdot (e^{\ell_{\text{last}} - \ell_r}\Delta_r\, x_r\, dS_c)$ (`to_end`), summed over each slot's `SLOT_N` columns and stored in this program's slots, apart: `dt_backward` sums the first over $r \ge k$ and the second over $r < k$. Then the head's terms join the group's sums `dC` and `dB`.
#
# The carry's term $\langle dS_c, \gamma_c H_c\rangle$ is not formed here but in the reversed state passing, which holds $dS_c$ in float32 before rounding it to the inputs' dtype, and reads $H_0$ from `initial_states` as given rather than from the stored (rounded) $H_c$. Formed here from the two rounded tiles, it gave bfloat16 $dA$ at one position with float32 initial states 2.8 times the error of mamba_ssm's (the reliability sweep, on an H100), whose backward forms it from float32 states.

# %%
show_fragment(dbc_tile, "# diagonal blocks, once per group")

# %% [markdown]
# Last the diagonal-block products, once per group: $dC_r \mathrel{+}= \sum_{s \le r} dCB_{rs} B_s$ and $dB_r \mathrel{+}= \sum_{t \ge r} dCB_{tr} C_t$. The loop walks the chunk in steps of `BLOCK_K` positions $u$ and reads each tile of $dCB$ in the orientation it needs: the tiles up to the row block's diagonal as $dCB_{ru}$, times $B_u$, into `dC`; the tiles from the diagonal on, transposed, as $dCB_{ur}$, times $C_u$, into `dB`. The selects zero the entries of the other triangle and past the end of the sequence. Then `dB` and `dC` are rounded to the inputs' dtype and stored.
#
# And the step gradients: `dt_backward_kernel` adds the slots in a fixed order, sums the state terms over their ranges inside the chunk (a reverse cumulative sum for `from_start`, a forward one of the terms shifted one position on for `to_end`) and goes back through the clamp, softplus and bias:

# %%
show_source(log_decay_step_gradient)

# %% [markdown]
# The tiles that straddle a whole row block, $(i, j)$ with $j < b < i$, are read from the slot where their $dCB$ program left their total; at chunk 256 with row blocks of 64 there are three of them per head and chunk:

# %%
show_source(spanned_tiles)

# %% [markdown]
# The kernel itself gathers, then finishes through `step_gradients` (the clamp, softplus and bias, and this program's partial sums of $dA$ and $d\,\mathrm{dt\_bias}$):

# %%
show_source(dt_backward_kernel)

# %% [markdown]
# Every gradient, including those of `initial_states` and through the final state, against float64 autograd through the quadratic reference (packed sequences, groups, a length that is not a multiple of the chunk):

# %%
kw = dict(dt_softplus=True, dt_limit=(0.05, 1.0), seq_idx=seq_idx, return_final_states=True)


def both_outputs(pair):
    y, final = pair
    return torch.cat([y.flatten(), final.flatten().to(y.dtype)])


grad_inputs = {k: v.clone().requires_grad_() for k, v in inputs.items()}
bound = 1e-4
errors = assert_gradients_close(lambda **a: both_outputs(ssd_chunk_scan(**a, chunk_size=chunk, **kw)),
                                lambda **a: both_outputs(ssd_quadratic_ref(**a, **kw)), grad_inputs, tol=bound)
for name, err in errors.items():  # assert_gradients_close has raised if any error is not below the bound
    print(f"grad {name}: rel err {err:.1e} < {bound:.0e}")

# %% [markdown]
# ### The cumulative sums: in PyTorch or in the kernel
#
# The sums over $r \ge k$ and $r < k$ can be done in PyTorch, `flip(cumsum(flip(...)))` and a `cumsum` of the terms shifted one position on, which launch several kernels and write temporaries of the size of $\Delta$, or inside `dt_backward_kernel`, where the chunk's values are already in registers: `tl.associative_scan`, reversed for the first. The first is the foil in `mamba_annotated/ssd/teaching.py` (`ssd_backward_flip`); both give the same gradients:

# %%
inp = make_inputs()
dy = randn(*inp["x"].shape)


def backward_of(inp, dy, chunk_size, how):
    """The backward pass after the forward pass that saves what it needs (dt_softplus, no z):
    ssd_backward, or the foil from ssd/teaching.py that does the step gradients' sums in PyTorch."""
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    saved = ssd_forward(*args, chunk_size, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True).saved
    backward = ssd_backward if how == "kernel" else ssd_backward_flip
    return lambda: backward(dy, *args, saved, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)


grads = {how: backward_of(inp, dy, chunk, how)() for how in ("kernel", "flip")}
for name in ("dt", "A", "dt_bias"):
    check(f"in-kernel vs PyTorch cumulative sums: grad {name}", grads["kernel"][name], grads["flip"][name], 1e-6)

# %% [markdown]
# Timed alone and inside the whole backward pass, on the machine that runs the cell (it prints its device; `benchmarks/bench_ssd.py` times the same two at the benchmark shapes):

# %% tags=["nbval-ignore-output"]
size = runtime.size(gpu=dict(batch=4, length=4096, heads=80, headdim=64, groups=1, dstate=128, dtype=torch.bfloat16),
                    cpu=dict(batch=1, length=32, heads=2, headdim=16, groups=1, dstate=16, dtype=torch.float32))
chunk_t = runtime.size(gpu=256, cpu=16)
big = make_inputs(**size)
big.pop("z"), big.pop("initial_states")
dy = randn(*big["x"].shape, dtype=big["x"].dtype)
saved_b = ssd_forward(big["x"], big["dt"], big["A"], big["B"], big["C"], chunk_t, D=big["D"], dt_bias=big["dt_bias"],
                      dt_softplus=True).saved
_, decay = chunk_gradients(dy, big["x"], big["B"], big["C"], saved_b, D=big["D"])  # the step gradients' slots
rows = []
for how, step_backward in (("kernel", dt_backward), ("flip", dt_backward_flip)):
    rows.append(dict(cumulative_sums=how,
                     alone_ms=median_ms(lambda: step_backward(big["dt"], big["A"], saved_b.dt_out, decay,
                                                              dt_bias=big["dt_bias"], dt_softplus=True)),
                     whole_backward_ms=median_ms(backward_of(big, dy, chunk_t, how))))
print(f"device: {runtime.device_name()}")
print_table(rows)

# %% [markdown]
# On the H200 that ran this page the in-kernel sums take 0.052 ms alone and the flip form 0.776 ms, yet the whole backward pass differs by only 0.13 ms (2.02 against 2.15 ms, 6 %), under a fifth of the 0.72 ms between the two alone. The flip form is about twenty small PyTorch operations and a kernel. Timed alone, most of its time is probably the host launching them rather than work on the GPU, which would explain why it varies so much from run to run (0.776 ms on this run, from 0.33 to 1.15 ms on the twenty-three earlier runs of this page, on H200s and H100s). Inside the whole backward pass the host issues those launches while the GPU is still busy with earlier kernels, so there the flip form costs about its GPU time. The column to read is `whole_backward_ms`: on this GPU the in-kernel sums save about 0.13 ms of a 2 ms pass. `benchmarks/bench_ssd.py` times the same functions (`dt_backward` and `dt_backward_flip` on the same saved slots of the step gradients, then `ssd_backward` and `ssd_backward_flip` without the forward pass) at the same shape and chunk; its stored run on an H200, made before four changes to the packed-sequence (`seq_idx`) path that these calls, which pass no `seq_idx`, do not run, had 0.050 against 0.35 ms alone and 1.97 against 2.10 ms for the whole pass: the whole-pass times within about 3 % of this page's, the flip form alone 0.43 ms under this page's 0.776 ms, and the in-kernel sums alone 0.0495 ms against this page's 0.052 ms (the previous runs had 0.0494, 0.048, 0.056 and 0.067, the last the slowest this page has measured, for a cause not known; the runs before them 0.049, 0.0487, 0.0486, 0.052, 0.0496, 0.055, 0.057 and 0.049 ms); a kernel that short is timed close to its launch cost. On a CPU the interpreter's timings say nothing about a GPU.

# %% [markdown]
# ## Speed
#
# How the time splits as the chunk size $Q$ varies. The diagonal blocks cost $O(L Q (N + P))$ FLOPs (`chunk_cb`, and the diagonal half of `chunk_scan`), so their work grows with $Q$. The chunk states and the state-to-output products cost $O(L N P)$ FLOPs whatever $Q$, but they are bound by bytes, and their bytes fall as $Q$ grows: there are $L/Q$ states of $P \times N$ per head, $N/Q$ of the size of $x$. `chunk_state` writes them in float32; `state_passing` reads those and writes the states entering each chunk, $H_c$, in the inputs' dtype, as `ssd_forward` stores them; `chunk_scan` reads $H_c$ back for its product $e^{\ell_t} H_c C_t$. And the carry's sequential steps, $L/Q$ of them, shrink with $Q$ too. The next cell times each kernel alone, on the tensors and with the arguments the forward pass gives it, and the forward pass whole (bfloat16 on a GPU).

# %% tags=["nbval-ignore-output"]
fwd = lambda c: ssd_chunk_scan(big["x"], big["dt"], big["A"], big["B"], big["C"], c, D=big["D"],
                               dt_bias=big["dt_bias"], dt_softplus=True)
chunk_sizes = runtime.size(gpu=[32, 64, 128, 256], cpu=[16, 32])
rows = []
for c in chunk_sizes:
    dA_c, dt_c = chunk_cumsum(big["dt"], big["A"], c, dt_bias=big["dt_bias"], dt_softplus=True)
    S_c = chunk_state(big["x"], big["B"], dA_c, dt_c, to_end=True)
    states_in = dict(length=big["x"].shape[1], out_dtype=big["x"].dtype)  # H_c in x's dtype, as ssd_forward
    H_c, _ = state_passing(S_c, dA_c, **states_in)
    CB_c = chunk_cb(big["C"], big["B"], c)
    rows.append(dict(chunk=c, forward_ms=median_ms(lambda: fwd(c)),
                     cb_ms=median_ms(lambda: chunk_cb(big["C"], big["B"], c)),
                     chunk_state_ms=median_ms(lambda: chunk_state(big["x"], big["B"], dA_c, dt_c, to_end=True)),
                     state_passing_ms=median_ms(lambda: state_passing(S_c, dA_c, **states_in)),
                     chunk_scan_ms=median_ms(lambda: chunk_scan(CB_c, big["x"], big["C"], H_c, dA_c, dt_c, D=big["D"]))))
print_table(rows)
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for key, colour in (("cb_ms", COLORS["decay"]), ("chunk_state_ms", COLORS["h"]),
                    ("state_passing_ms", COLORS["carry"]), ("chunk_scan_ms", COLORS["y"])):
    ax.plot([r["chunk"] for r in rows], [r[key] for r in rows], marker="o", color=colour, label=key[:-3])
ax.set(xscale="log", xlabel="chunk size Q", ylabel="median ms", title="forward kernels vs chunk size")
ax.set_xscale("log", base=2)
ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# On a GPU `state_passing` moves only the $L/Q$ states (it reads the float32 $S_c$ and writes $H_c$), so its time about halves with each doubling of $Q$: 0.546, 0.282, 0.143, 0.0772 ms. `chunk_state` writes those states too, but it also reads all of $x$, whose bytes do not depend on $Q$ (at $Q = 256$ the float32 states, $N/Q = 1/2$ of $x$'s elements, weigh as many bytes as the bfloat16 $x$), so its time falls less at each step: 0.39, 0.231, 0.168, 0.125 ms. `chunk_scan` does two things at once: the product with $H_c$, whose bytes fall as $Q$ grows, and the diagonal block, whose work grows with it. So its time need not move in one direction: the product with $H_c$ weighs most at small $Q$, the diagonal block at large $Q$, and the table shows where the two balance on the GPU that ran this page: `chunk_scan` is fastest at $Q = 64$ (0.273 ms) and slowest at 256 (0.389 ms), while the state kernels keep falling as $Q$ grows. `chunk_cb` is small at every $Q$: its work is done once per group, and this shape has one group against 80 heads. The forward pass as a whole gets faster over this range of $Q$, which is why the benchmarks use $Q = 256$. Each column times one kernel alone, so the columns add up only roughly to `forward_ms`, which also runs `chunk_cumsum`. (On a CPU the interpreter's times only show which kernels ran.)

# %% [markdown]
# Against mamba_ssm's `mamba_chunk_scan_combined` at the benchmark shapes, `benchmarks/bench_ssd.py` times both in one run (forward, forward + backward, peak memory, achieved TFLOP/s and the floor). When its JSON is present beside the book, it is shown here:

# %% tags=["nbval-ignore-output"]
import json
import pathlib

results = pathlib.Path("data/ssd_bench.json")  # python benchmarks/bench_ssd.py --json book/data/ssd_bench.json
if results.is_file():
    data = json.loads(results.read_text())
    print(f"device: {data['device']}")
    print_table(data["rows"])
    for shape, stages in data["stages"].items():
        print(f"\nwhere the time goes, {shape}:")
        print_table(stages)
else:
    print("no stored benchmark run (python benchmarks/bench_ssd.py --json book/data/ssd_bench.json); a small timing:")
    c = chunk_sizes[-1]
    ms = median_ms(lambda: fwd(c))
    b, l, h, p, n = (size[k] for k in ("batch", "length", "heads", "headdim", "dstate"))
    flop = b * (l // c) * h * (4 * c * p * n + c * c * p) + b * (l // c) * c * c * n
    print(f"{runtime.device_name()}: forward {ms:.3f} ms, {tflops(flop, ms):.2f} TFLOP/s "
          f"(measured matmul rate {matmul_tflops():.0f} TFLOP/s)")

# %% [markdown]
# In the stored benchmark (H200, bfloat16) ours is faster than mamba_ssm at both shapes, forward and forward + backward (the `speedup` column, 1.15× to 1.53×, the least at the first shape's forward pass), with less peak memory forward at both shapes (267 against 276 MiB, 450 against 465 MiB) and 16–19 % less forward + backward, and its floor is 15–17 % of its measured time (the `pct_floor` column: the time its FLOPs would take at the measured matmul rate, or its bytes at the measured copy bandwidth if that is longer; see {term}`memory floor`, a measured reference, not a hard bound). mamba_ssm's kernels are tuned by Triton's autotuner, whose picks change from one tuning to the next, and with them its time: in the stored run its forward + backward at the first shape took 5.10, 4.70 and 3.92 ms after three tunings, in the run before it 3.45, 3.30 and 3.07 ms, and in the one before that 5.34, 4.28 and 5.29 ms. The benchmark tunes the peer three times for each pass and its rows show the fastest time the peer was seen to take (`peer_tunings` in the JSON lists them all). So the first shape's forward + backward ratio is best read as a range, 1.2× (the run before this one, with ours at 2.55 ms) to 1.65× (the one before that, with ours at 2.60 ms); the stored run's is 1.53×, its forward ratio 1.15×. The stored run shared its two-GPU host for its first 87 s of 257: `benchmarks/bench_linear_scan.py` ran on the other GPU meanwhile. It times the kernels with the fix to $CB$'s offsets described at the end of this paragraph, as this page's own timings do, and the two agree at the first shape to within about 3 %: the forward pass takes 0.603 ms at $Q = 256$ in the table above (stored: 0.598), `chunk_scan` 0.389 ms (stored: 0.383), and the backward pass 2.02 ms (stored: 1.97). Set against the stored mamba_ssm times, 0.690 and 3.92 ms, they give 1.14× forward and 1.49× forward + backward, close to the stored run's 1.15× and 1.53×; times from different runs compare only roughly, so the stored run, which times both in one process, is the number to quote (with the range above for the first shape's forward + backward). In the stage tables `chunk_scan` and the backward's $dx$ and $dB\,dC$ kernels take most of the time. The forward pass keeps the final states only when they are asked for (`return_final_states`); mamba_ssm computes them at every call, 10 MiB at the first shape. What is alive at the forward's peak, while `chunk_scan` writes its output, is otherwise the same in both, tensor for tensor (the output, the states entering each chunk, the sums themselves: our high plane, mamba_ssm's one plane, the steps), apart from $CB$ and two of this chapter's own choices. mamba_ssm keeps $CB$ as whole $Q \times Q$ blocks; ours keeps only the squares its kernels read (section 2), 10 of 16 at $Q = 256$: 10 against 16 MiB at the first shape, 40 against 64 MiB at the second. The two choices are the low plane of the sums (5 MiB at the first shape, 8 MiB at the second), which keeps every weight to float32 rounding, and the one flag byte per row of the non-finite check (1.25 and 2 MiB). `benchmarks/ssd_memory_ledger.py` lists those tensors for both passes on a CPU, with the launches stubbed. Its peaks for ours are 266.25 and 450 MiB; the stored GPU run measured 267.25 and 450 MiB, against mamba_ssm's 276 and 465 MiB. The ledger counts tensor bytes, and PyTorch's caching allocator can give a tensor a free block larger than it asked for, which may be the extra 1 MiB at the first shape (not traced to a tensor). Before $CB$ kept only its squares, the ledger and the GPU both had 272.25 and 474 MiB: 2 % over mamba_ssm's peak at the second shape. Keeping the squares made the forward pass faster too and, in one comparison, the backward pass slower (`book/data/packed_cb_ab.json`, an H200). In A/B rounds, each version in its own process and tuned, the forward pass took 0.575 ms against 0.607, the backward pass 1.747 ms against 1.699 (without $D$), and forward and backward with $D$ and $z$ through autograd 2.814 ms against 2.767, slower in every round; profiled kernel by kernel there with the same configurations, `chunk_scan` took 349 µs against 382 and the backward's $dx$ kernel 524 µs against 476, whose transposed tiles now come from squares of 64 rows instead of rows of the whole chunk. That $dx$ was slower because of its registers, found a session later: without $D$, as in the backward rounds and the profiles, the compiler gave the squares' $dx$ kernel 143 registers per thread against 96 for $CB$ whole, so three blocks fit on an SM instead of four (ncu: 525 against 484 µs). With $D$ both take 128, which would explain why the stored runs' stage tables, which pass $D$ (two separate runs on different hosts), show little: $dx$ took 0.742 against 0.736 ms, and the whole backward pass 1.96 against 1.97 ms (squares against $CB$ whole, both before the fix). The cause was the form of the offsets, not the squares: built as the tile's corner plus fresh `tl.arange`s they took 143 registers, and even a formula with no squares in it (the corner's row times 64 plus its column), written that way, took 145; built from the position tensors the loop already holds, as `cb_offsets` now does, they take 96. Profiled again without $D$, the $dx$ kernel took 478 µs against 524 before the fix, and the backward pass 1.84 ms against 1.87. That forward and backward with $D$ and $z$ was slower (2.814 against 2.767 ms) is not explained by this, since with $D$ the registers did not change; the fix has no tuned A/B yet. The stored run above is of the fixed code; its stage tables, with $D$, are within 1 % of the run before the fix ($dx$ 0.749 against 0.742 ms, the whole backward pass 1.97 against 1.96 ms at the first shape). On the GPU the fixed kernels passed `tests/test_ssd.py` with the tuned configurations (133 passed, 4 skipped) and compute-sanitizer's memcheck, which reports invalid memory accesses, with each kernel's first listed configuration instead of the tuned one (0 errors; chunks of 32, 128 and 256, odd lengths, packed sequences).

# %% [markdown]
# ## What we have, and what comes next
#
# Mamba-2's SSM is a multiplication by a semiseparable matrix. Cutting it into chunks turns most of the work into matmuls (the diagonal blocks, the chunk states, the state-to-output products), leaving a short sequential carry of $L/Q$ steps. Five forward kernels, and four backward ones beside the forward's chunk-state and state-passing kernels run again on gradients, implement it, each checked against a float64 reference; the gradient of the decays is $C \cdot dC - B \cdot dB$ reverse-summed, which the kernels compute as sums over the pairs and rows that straddle each step, so that nothing large cancels.
#
# [Chapter 6](06_bidirectional.ipynb) adds a second semiseparable matrix that runs backwards in time: the bidirectional ({term}`quasiseparable`) SSMs of Hydra {cite}`hwang2024hydra` and Bi-Mamba2 {cite}`repo_bimamba2`, both directions computed on one grid of chunks by one fused pipeline.
#
# **Exercises.** Exercises 1 and 2 have no cell: each is a test in `tests/test_ssd.py`, which you can run or compare with your own answer. Exercise 3 has a stub below with a checker.
#
# 1. Show that packing two sequences into one row with `seq_idx` gives exactly the outputs of two separate calls (`test_packed_sequences_equal_separate_runs`).
# 2. Show that the chunk size does not change the result: `ssd_chunk_scan(..., chunk_size=16)` and `chunk_size=32` agree to float32 rounding, and both agree with `ssd_recurrent_ref` (`test_chunk_size_does_not_change_the_result`).
# 3. *A chunk state by a matmul.* Write `chunk_states(x, B, dt, dA_cumsum)`, what each chunk adds to the state, $S_c = \sum_{s \in c} e^{\ell_{\text{last}} - \ell_s}\, \Delta_s\, x_s B_s^\top = X_c^\top \operatorname{diag}(w)\, B_c$, as a Triton kernel with one `tl.dot` per (batch, chunk, head). Inputs, contiguous float32: `x` (batch, L, heads, P); `B` (batch, L, heads, N), one group per head; `dt` and `dA_cumsum` (batch, heads, chunks, Q), `dt` as `chunk_cumsum` returns it (zero past $L$) and `dA_cumsum` the natural-log sums $\ell$ in float32 (not the two float32 planes in log2 units that `chunk_cumsum` stores; `natural_sums` turns those into $\ell$). Output (batch, chunks, heads, P, N). $P$, $N$ and $Q$ are powers of two, at least 16 (`tl.arange` takes powers of two and `tl.dot` tiles of at least $16 \times 16$, as the primer says), so each can be a block size as it is; $L$ need not be a multiple of $Q$: mask the last chunk's loads.
#
# Replace the `raise` in the stub and run the cell; the checker (`mamba_annotated.exercises`) compares your function with the chunk states of `ssd_chunked_ref` (float64) on fresh random inputs. Its bound, $2 \cdot 10^{-3}$, allows the {term}`TF32` inputs that `tl.dot` uses for float32 tiles on a GPU.

# %%
import triton  # the exercises write their own kernels
import triton.language as tl

from mamba_annotated.exercises import check as check_exercise


def chunk_states(x, B, dt, dA_cumsum):
    raise NotImplementedError  # your code here


attempted = check_exercise("5.3", chunk_states)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
@triton.jit
def chunk_states_kernel(x_ptr, b_ptr, dt_ptr, a_ptr, s_ptr, length, heads, chunks,
                        Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)  # one program per (batch, chunk, head)
    head = pid % heads
    chunk = (pid // heads) % chunks
    batch = pid // (heads * chunks)
    s = chunk * Q + tl.arange(0, Q)  # positions of the chunk
    inside = s < length
    rows = (batch * length + s) * heads + head  # rows of (batch, L, heads, ...)
    x = tl.load(x_ptr + rows[:, None] * P + tl.arange(0, P)[None, :], mask=inside[:, None], other=0.0)
    B = tl.load(b_ptr + rows[:, None] * N + tl.arange(0, N)[None, :], mask=inside[:, None], other=0.0)
    steps = ((batch * heads + head) * chunks + chunk) * Q + tl.arange(0, Q)
    dt = tl.load(dt_ptr + steps)
    a = tl.load(a_ptr + steps)
    a_last = tl.load(a_ptr + ((batch * heads + head) * chunks + chunk) * Q + Q - 1)
    weight = tl.exp(a_last - a) * dt  # (Q,): decay to the chunk's end times the step
    states = tl.dot(tl.trans(x * weight[:, None]), B)  # (P, Q) @ (Q, N), on the tensor cores
    out = (pid * P + tl.arange(0, P))[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(s_ptr + out, states)


def chunk_states(x, B, dt, dA_cumsum):
    batch, length, heads, P = x.shape
    N, (chunks, Q) = B.shape[-1], dt.shape[-2:]
    states = torch.empty(batch, chunks, heads, P, N, dtype=torch.float32, device=x.device)
    chunk_states_kernel[(batch * chunks * heads,)](x, B, dt, dA_cumsum, states, length, heads, chunks, Q=Q, P=P, N=N)
    return states


assert check_exercise("5.3", chunk_states)
