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
# # Putting it together: blocks, training and decoding
#
# In this chapter you will learn:
#
# - how a Mamba-2 block wraps chapter 5's `ssd_chunk_scan`: one projection, a short causal convolution, the scan, a gated norm, and a projection back, built here line by line and checked against float64;
# - how a model generates text one token at a time, and why a state-space model's decoding cache stays the same size while attention's grows with every token;
# - how a Transformer, Mamba-1, Mamba-2 and a hybrid of the same size compare when trained on a recall task and on the bytes of Python source code: what each learns, how fast each trains, and how much memory each needs.
#
# Every mixer in this chapter (the layer that mixes positions: attention or an SSM) runs the book's kernels: the selective scan of [section 4.9](04_selective_scan.ipynb), the SSD chunk scan of [chapter 5](05_ssd.ipynb) and the attention of [chapter 7](07_attention.ipynb). The blocks are the package's `mamba_annotated.modules`. They copy the interface of {term}`mamba_ssm`, the Mamba authors' PyTorch package {cite}`repo_mamba`, and of its `Mamba` and `Mamba2` modules {cite}`gu2023mamba,dao2024transformers`: the same constructor arguments and parameter names, so a checkpoint saved from mamba_ssm loads into them.
#
# ```{admonition} Notation (chapter 5's, with letters for the heads and groups)
# | symbol | meaning |
# |---|---|
# | $u_t \in \mathbb{R}^{d}$ | the block's input at position $t$ ($d$: `d_model`) |
# | $x_t$, $z_t$ | the SSM's input and the gate, each $H \cdot P$ channels ($H$ heads of headdim $P$; $G$ groups of heads share a $B$ and a $C$) |
# | $\Delta_t$, $A$, $B_t$, $C_t$, $D$ | step, decay rate, input and readout maps ($N$: dstate), skip |
# | $h_t \in \mathbb{R}^{P \times N}$ | the state of one head after position $t$ |
# | $L$ | sequence length |
# ```

# %%
import json
import math
import pathlib

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from mamba_annotated import runtime
from mamba_annotated.bench import print_table
from mamba_annotated.exercises import check as check_exercise
from mamba_annotated.figures import MIXER_COLORS, show_fragment
from mamba_annotated.modules import InferenceParams, LMHeadModel, Mamba2
from mamba_annotated.ssd import ssd_chunk_scan
from mamba_annotated.ssd.reference import ssd_quadratic_ref
from mamba_annotated.ssd.step import ssd_state_update_kernel
from mamba_annotated.tasks import bytes_to_text, mqar, sample_windows, stdlib_corpus, text_to_bytes
from mamba_annotated.testing import check, randn, seed_everything, tolerance
from mamba_annotated.train import (KINDS, byte_lm_eval, decode_benchmark, fit_config, model_config, mqar_accuracy,
                                   train)

seed_everything(0)
device = runtime.DEVICE
GPU = device.type == "cuda"

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## A Mamba-2 block, piece by piece
#
# A block maps a sequence $u$ of shape (batch, $L$, $d$) to one of the same shape. Mamba-2's does it in five steps {cite}`dao2024transformers`:
#
# 1. **One projection.** A single linear layer makes, for every position, the gate $z_t$ and the SSM's input $x_t$, $H \cdot P = 2d$ numbers each (the block works at twice the model's width: mamba_ssm's `expand = 2`), the maps $B_t$ and $C_t$ ($N$ numbers each), and one raw step per head. One matrix multiply instead of five. Here all heads share one $B$ and one $C$; a model may instead split the heads into $G$ groups with a $B$ and a $C$ each, as in [chapter 5](05_ssd.ipynb), much as {term}`grouped-query attention` shares keys and values.
# 2. **A short causal convolution.** Each channel of $(x, B, C)$ is combined with its own values at the three previous positions (a depthwise convolution of width 4: channels do not mix; padded on the left so position $t$ sees only $t-3, \dots, t$), then passed through SiLU. This gives the SSM a little local context before the long-range recurrence.
# 3. **The scan.** `ssd_chunk_scan` runs the SSM of chapter 5 with $A = -e^{A_{\log}}$, where the module learns $A_{\log}$ so that $A$ stays negative whatever training does to it (every decay is then below 1), the step $\Delta_t = \operatorname{softplus}(\mathrm{raw}_t + \mathrm{bias})$ with a learned bias per head (`dt_bias`), and the skip $D$.
# 4. **A gated norm.** The output is multiplied by $\operatorname{silu}(z_t)$ and then normalised by its root mean square (RMSNorm) with a learned scale.
# 5. **A projection back** to $d$ channels.
#
# The function below writes these steps out for the parameters of a `Mamba2` module. Its `scan` argument is the only moving part: chapter 5's kernel, or the float64 reference.

# %%
def mamba2_block(block, u, scan):
    """The forward pass of ``block`` (a Mamba2 module, one group, the default options) written out,
    with ``scan(x, dt, A, B, C, D, dt_bias)`` as the SSM."""
    heads, headdim, dstate, width = block.nheads, block.headdim, block.d_state, block.d_conv
    inner = heads * headdim
    # 1. one projection: [z, x, B, C, raw dt]
    z, xBC, dt = torch.split(block.in_proj(u), [inner, inner + 2 * dstate, heads], dim=-1)
    # 2. causal depthwise conv over time: pad width-1 zeros on the left, one filter per channel
    xBC = F.conv1d(F.pad(xBC.transpose(1, 2), (width - 1, 0)), block.conv1d.weight, block.conv1d.bias,
                   groups=xBC.shape[-1])
    x, B, C = torch.split(F.silu(xBC.transpose(1, 2)), [inner, dstate, dstate], dim=-1)
    # 3. the SSM, per head; A = -exp(A_log) < 0 makes every decay exp(dt A) < 1
    A = -torch.exp(block.A_log.to(u.dtype))
    y = scan(x.unflatten(-1, (heads, headdim)), dt, A, B[:, :, None, :], C[:, :, None, :], block.D, block.dt_bias)
    # 4. gate, then RMS norm over the channels
    y = y.flatten(-2).to(u.dtype) * F.silu(z)
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + block.norm.eps) * block.norm.weight
    # 5. back to d_model
    return block.out_proj(y)


def kernel_scan(x, dt, A, B, C, D, dt_bias):
    return ssd_chunk_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)


def float64_scan(x, dt, A, B, C, D, dt_bias):
    return ssd_quadratic_ref(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)


# %% [markdown]
# The same parameters run three ways: the module's own `forward`, the function above with chapter 5's kernel, and the function above in float64 with the quadratic reference of chapter 5 (the SSM as one $L \times L$ matrix per head). A length that is not a multiple of the chunk (301 against chunks of 64 on a GPU) checks the last chunk, which is cut short.

# %%
CHUNK = runtime.size(64, 16)
block = Mamba2(d_model=runtime.size(256, 32), d_state=runtime.size(64, 16), headdim=runtime.size(64, 16),
               chunk_size=CHUNK, device=device)
u = randn(2, runtime.size(301, 37), block.d_model)
with torch.no_grad():
    by_module = block(u)
    by_hand = mamba2_block(block, u, kernel_scan)
    in_float64 = mamba2_block(block.double(), u.double(), float64_scan)
block.float()
check("the block written out = Mamba2.forward", by_hand, by_module, tolerance(torch.float32))
check("Mamba2.forward against float64", by_module, in_float64, tolerance(torch.float32))

# %% [markdown]
# The block written out agrees with the module, and both agree with float64 to float32's precision. Two of the five steps are plain PyTorch in the function above: the convolution (step 2) and the gated norm (step 4). The module replaces both with Triton kernels.
#
# The convolution and its SiLU become Triton kernels, one forward and two backward (`mamba_annotated/conv1d.py`), just as mamba_ssm's module calls the CUDA kernel of its optional `causal-conv1d` package when that is installed. `F.conv1d` wants the channels first, while the projection lays $(x, B, C)$ out as (batch, $L$, channels): written as above, the activations are copied into the transposed, padded layout on the way in, the SiLU is a kernel of its own, and the backward pass adds copies and a SiLU of its own. The kernel reads the projection's output through its strides, writes its result in the projection's layout, and sums in float32 with a single rounding at the end.
#
# Reading through strides has a trap. A row of the projection holds $2HP + 2N + H$ numbers (with one group of $B$ and $C$): 3,352 in the model of the benchmark at the end of this chapter, a multiple of 8 but not of 16. Triton compiles a kernel for each class of its integer arguments, and the class records only whether 16 divides a value (and whether it is 1). Knowing no more of the row stride, the compiler cannot prove that a row of bfloat16 numbers starts at a multiple of 8 elements (16 bytes, the widest load), and it reads each element with a load of its own. The convolution and norm kernels are therefore told, as a `constexpr`, the largest power of two up to 16 that divides the strides they read through (`known_multiple` in `mamba_annotated/triton_ops.py`). Compiled for an H100 (`scripts/compile_offline.py in_projection`), the forward convolution kernel's 128 single-element loads per thread become 16 loads of 16 bytes; what that buys in time is in the note below.
#
# The gated norm becomes two Triton kernels, one for the forward pass and one for the backward (`mamba_annotated/gated_norm.py`: the same formula, with the arguments of mamba_ssm's `rmsnorm_fn`). Written as torch ops, the norm launches several elementwise kernels, and autograd keeps their float32 results for the backward pass (copies of $y$, each twice the size of a bfloat16 $y$); the kernel reads $y$ and $z$ once and keeps, besides its inputs, one number per position and group, the inverse root mean square. The training section below quotes the memory this saves, from an earlier run of this chapter.
#
# *A note on the hints' speed.* Timed by the GPU itself (PyTorch's profiler, kernel times only, so the host and the gaps between launches are left out) on the benchmark model's shapes, 8 × 2048 positions in bfloat16, with the hints on and off in turn over six rounds (`benchmarks/bench_alignment_hints.py`, `book/data/alignment_hints_ab.json`, one H200): the forward convolution kernel took 67 µs with the hints against 107 µs without (1.60× faster), the first backward kernel 227 against 333 µs (1.47×), and the second backward kernel, which reads only a buffer of the kernels' own, 70 µs either way, as it should. The norm's kernels gained less, 48 against 56 µs forward (1.17×) and 100 against 111 µs backward (1.10×) (why less, we have not measured). Each kernel's six rounds lay within 1 % of one another.
#
# `Mamba2` adds what a real model needs around these lines, each in the package and tested against mamba_ssm's module: an optional MLP part in the projection, several groups of $B$ and $C$, a $D$ per channel, packed sequences (`seq_idx`, `cu_seqlens`), a limit on $\Delta$, and the decoding cache of the next section.

# %% [markdown]
# ## Decoding: one token at a time
#
# A language model generates text by predicting one token, appending it, and predicting the next. Running the whole block again over the growing sequence would cost $O(L)$ per token for the SSM and $O(L^2)$ for attention. Both keep a cache instead, and with it a step costs $O(1)$ for the SSM, whose state does not grow with $L$, and $O(L)$ for attention, one query against $L$ cached keys:
#
# - **An SSM keeps its state.** After a prompt of $T$ tokens, the state $h_T$ of each head summarises everything seen; each later position $t > T$ needs only $h_{t} = e^{\Delta_t A} h_{t-1} + \Delta_t\, x_t B_t^\top$ and $y_t = h_t C_t + D x_t$: a decay, a rank-one update and a product with $C_t$, the recurrence of [chapter 1](01_sequential_scan.ipynb) at a single position. The convolution keeps a window of its last inputs, as wide as its kernel (4).
# - **Attention keeps every key and value** (the {term}`KV cache`): the new query attends to all of them, so the cache and the work per token grow with the position.
#
# The prompt itself still goes through the chunked kernels (the {term}`prefill`): they are fast on many positions at once and leave the state behind. The package's step kernel for Mamba-2, `ssd_state_update`, launches one {term}`program` per batch row, head and block of rows of the head's $P \times N$ state: a program owns some of the $P$ rows and all $N$ columns. Each program first computes the head's step $\Delta_t$ and decay $e^{\Delta_t A}$ (two scalars, with the formula chapter 5's `chunk_cumsum` applies at each position), then does the work of these lines:

# %%
show_fragment(ssd_state_update_kernel, "state_ptrs = (state_ptr", "    if HAS_D:")

# %% [markdown]
# How to read it: `state_ptrs` is a {term}`tile` of addresses, one per entry of this program's rows of the state (rows `p` of the head dim, columns `n` of the state dim); `tl.load` brings those entries into {term}`registers` and `tl.store` writes them back. `b64`, `h` and `g` are the program's batch row (as a 64-bit integer, so that addresses cannot overflow), its head, and the head's group of $B$ and $C$; the `stride_*` arguments let each tensor have any memory layout, and the masks switch off the entries past $P$ and past $N$, because a tile's sides are rounded up to powers of two. The line `state = decay * state + ...` is $h_t = e^{\Delta_t A} h_{t-1} + \Delta_t\, x_t B_t^\top$, and `y = tl.sum(state * C[None, :], axis=1)` is $h_t C_t$; $D x_t$ and the gate are applied after the fragment.
#
# The state tile is loaded once, decayed and updated in registers, stored back, and read out against $C$: the step moves the state twice (in and out) and does a few multiply-adds per number, so on its own it is {term}`memory-bound`. In this chapter, though, the bytes are not what takes the time. A layer's cache in the Mamba-2 models trained below (width 320, 10 heads) is 172 KiB per sequence (a 160 KiB state and the convolution's 12 KiB window; the figure below), which an H200 reads and writes in a few microseconds even at batch 64, while the decoding table at the end of the chapter measures about 1 ms per Mamba-2 layer and step, at batch 1 and at batch 64 alike. That time is mostly the host's: the host is the CPU, which runs the model's Python and issues every kernel launch, and a layer's step is some fifteen separate PyTorch and Triton calls (projection, split, convolution step, state update, norm, residual), each costing the CPU far longer than the GPU needs to run it.
#
# Does decoding give the model the same function as the chunked forward pass? The check below runs each kind of model of this chapter two ways on the same tokens: the chunked forward pass over all of them at once, and a prefill of the first part followed by single-token steps. `InferenceParams` is the cache that travels through the model: each layer keeps its state (or its keys and values) in it under the layer's index, and `seqlen_offset` counts the positions already seen. A call at offset 0 is the prefill; a call with one token at a positive offset is a decoding step. The models are tiny versions of the four kinds trained later in the chapter (`KINDS`: a Transformer, Mamba-1, Mamba-2 and a hybrid): 2 layers of width 256, a vocabulary of 256, and in the hybrid one attention layer in two.

# %%
def logits_step_by_step(model, tokens, prefill):
    """The model's logits at every position: the chunked kernels over tokens[:, :prefill], then one
    decoding step per remaining token, each reading and updating the cache."""
    params = InferenceParams(max_seqlen=tokens.shape[1], max_batch_size=tokens.shape[0])
    logits = [model(tokens[:, :prefill], inference_params=params).logits]
    params.seqlen_offset = prefill
    for t in range(prefill, tokens.shape[1]):
        logits.append(model(tokens[:, t:t + 1], inference_params=params).logits)
        params.seqlen_offset += 1
    return torch.cat(logits, dim=1)


small = dict(head_dim=runtime.size(64, 16), d_state=runtime.size(64, 16), chunk_size=CHUNK)
tokens = torch.randint(0, 256, (runtime.size(2, 1), runtime.size(96, 10)), device=device)
for kind in KINDS:
    model = LMHeadModel(model_config(kind, runtime.size(256, 16), 2, 256, attn_every=2, **small), device=device).eval()
    with torch.no_grad():
        check(f"{kind:>11}: prefill + steps = chunked forward", logits_step_by_step(model, tokens, tokens.shape[1] // 3),
              model(tokens).logits, tolerance(torch.float32))

# %% [markdown]
# Both caches give the same logits as the chunked pass. What they cost differs. The figure counts the cache of one layer of each kind, for one sequence, at the sizes trained later in the chapter: about 10 M parameters, with layers of width 448 for the Transformer and 320 for Mamba-1 and Mamba-2 (`fit_config`, described in the next section, picks them).

# %%
def cache_bytes(length, config):
    """Bytes of one layer's decoding cache for one sequence at ``length`` positions, float32."""
    first_layer = LMHeadModel(config, device="meta").backbone.layers[0]  # every layer of these kinds is alike
    cache = first_layer.allocate_inference_cache(1, length, dtype=torch.float32)
    return sum(t.numel() * 4 for t in cache if isinstance(t, torch.Tensor))


positions = [2 ** k for k in range(6, 15)]
configs = {kind: fit_config(kind, 10e6, 256)[0] for kind in ("transformer", "mamba", "mamba2")}
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for kind, config in configs.items():
    ax.plot(positions, [cache_bytes(n, config) / 2 ** 10 for n in positions], marker="o",
            color=MIXER_COLORS[kind], label=f"{kind} (d_model {config.d_model})")
ax.set(xscale="log", yscale="log", xlabel="position in the sequence", ylabel="cache per layer (KiB)",
       title="Decoding cache of one layer, one sequence")
ax.grid(alpha=0.3)
ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# The attention layer's cache grows by 3.5 KiB per position: a key and a value of 448 numbers each (7 heads of 64), in float32. The two SSM caches do not grow. Mamba-1's holds, for each of its 640 channels (twice d_model), $N = 16$ state numbers and the convolution's window of 4 inputs: 640 · 20 floats, 50 KiB. Mamba-2's holds 10 heads (640 / 64) of $P \times N$ = 64 · 64 numbers, plus a window of 4 for each of the convolution's 768 channels ($x$, $B$ and $C$): 172 KiB. The attention cache overtakes Mamba-1's 50 KiB after about 15 positions and Mamba-2's 172 KiB after about 50, before the figure's first point; at 512 positions it is 1.75 MiB per layer. (The hybrid is left out: its layers are Mamba-2 layers and, one in four, attention layers of its own width.)

# %% [markdown]
# ## Four models of the same size
#
# To compare mixers (the layers that mix positions: attention or an SSM), everything else is held fixed: the same embedding and a tied output head (the output layer reuses the embedding matrix), pre-norm residual blocks with RMSNorm (each layer computes $u + \text{mixer}(\text{RMSNorm}(u))$, and a layer with an MLP adds $\text{MLP}(\text{RMSNorm}(\cdot))$ to that the same way), and about the same number of parameters. `fit_config` picks each kind's width and depth so the count comes closest to a target:
#
# - **transformer**: attention (heads of 64, rotary position embeddings {cite}`su2021roformer`) followed by a gated MLP in every layer, as in Transformer++ (the LLaMA recipe: rotary embeddings, RMSNorm, a SiLU-gated MLP);
# - **mamba**: Mamba-1 blocks, no MLP. A Mamba-1 block has the outline of the Mamba-2 block above, with three differences: the first projection makes only $x$ and $z$ ($2d$ channels each); $\Delta$, $B$ and $C$ come afterwards from the convolved $x$, through a second, small projection (`x_proj`, then `dt_proj` lifts the step to one per channel); and the SSM is section 4.9's selective scan, where each of the $2d$ channels has a state of $N = 16$ numbers and its own $N$ decay rates (one $A$ per channel and state number, where Mamba-2 has one per head), gated by $\operatorname{silu}(z)$ with no norm. A Mamba block has about half the parameters of an attention-plus-MLP layer of the same width, so at the same width a Mamba model needs twice as many layers for the same count; `fit_config` also makes the Mamba models narrower for their depth, as Mamba's own models are (the rule is below the table). Here it gives 15 layers of width 320 against the Transformer's 4 of width 448;
# - **mamba2**: Mamba-2 blocks ($N = 64$, heads of 64), no MLP;
# - **hybrid**: a Mamba-2 stack in which one layer in four is attention (heads of 64 at the stack's width, no MLP). An attention layer without an MLP is smaller than a Mamba-2 layer, so `fit_config` gives the hybrid 16 layers where Mamba-2 has 15: layers 2, 6, 10 and 14 (counted from 0) are attention.
#
# Two tasks:
#
# - **Multi-query associative recall** (MQAR) {cite}`arora2023zoology`. Each sequence starts with key-value pairs, `k1 v1 k2 v2 ...` (distinct keys, distinct values). The rest is random tokens, among which each key appears once more, as a *query*; at each query the model must predict that key's value. Only the queries are scored: the loss and the accuracy count no other position. A model must store the pairs and look them up: attention does so directly, by attending back to the key; a fixed-size state must compress the pairs into its numbers.
# - **Next-byte prediction** on the Python standard library's own source, read from the installed Python and split by file into training and validation text.
#
# On the GPU the models have about 10 M parameters; in Triton's {term}`interpreter` (a machine without a GPU) they are tiny, so the chapter runs there in seconds, and only the shape of the code matters.

# %%
TARGET_PARAMS = runtime.size(10e6, 6e3)
SHAPE = {} if GPU else dict(head_dim=16, d_state=16, chunk_size=16)  # the interpreter's tiny models
MQAR_VOCAB = runtime.size(256, 64)
MQAR_TRAIN_LENGTHS = runtime.size([64, 128, 256], [16])
MQAR_TEST_LENGTHS = runtime.size([64, 128, 256, 512], [16, 32])
MQAR_TOKENS_PER_STEP = runtime.size(16384, 32)
MQAR_STEPS = runtime.size(600, 2)
BYTES_LEN, BYTES_BATCH, BYTES_STEPS = runtime.size(512, 8), runtime.size(32, 2), runtime.size(300, 2)
LEARNING_RATE = 2e-3

rows = []
for kind in KINDS:
    for task, vocab in (("mqar", MQAR_VOCAB), ("bytes", 256)):
        config, count = fit_config(kind, TARGET_PARAMS, vocab, **SHAPE)
        rows.append(dict(task=task, kind=kind, d_model=config.d_model, layers=config.n_layer,
                         mixers=" ".join(dict.fromkeys(config.layer_types)), params_M=count / 1e6))
print_table(rows)

# %% [markdown]
# Within a task the counts differ by a few percent at most: a layer is the unit of change, and `fit_config` takes the closest count among shapes whose ratio d_model / layers (how wide the model is for its depth) is within a factor of 2 of the kind's usual ratio: 64 for the Transformer (GPT-2 small: 768 / 12), 32 for the others (Mamba-130M: 768 / 24). Here that is 448 / 4 = 112 for the Transformer and 320 / 15 ≈ 21 for Mamba and Mamba-2. The closest count lies near the edge of the allowed range for the Transformer, so it comes out wide and shallow; the bytes results below come back to this. Both tasks have a vocabulary of 256, so each kind has the same shape in both.
#
# ### Training on associative recall
#
# Each step draws a batch at one of the training lengths (cycling through them), with $L/16$ key-value pairs per sequence (keys from the lower half of a vocabulary of 256, values from the upper half), the same number of tokens per step at every length. The data are made once, before training, and kept on the device, so the timed loop measures the model. The optimiser and its schedule are in `train`: AdamW (Adam with decoupled weight decay, 0.1 on the weight matrices), a learning rate that rises linearly to $2 \cdot 10^{-3}$ over the first 10 % of the steps (60 of MQAR's 600) and then decays along a cosine to a tenth of that, gradients clipped to norm 1, and bfloat16 autocast on the GPU (matrix products in bfloat16, with float32 kept where precision needs it).

# %%
def mqar_batches(lengths, tokens_per_step, steps, vocab, seed):
    """steps batches (inputs, targets), cycling through ``lengths``, L/16 pairs each, on the device."""
    g = torch.Generator().manual_seed(seed)
    per_length = {}
    for n, length in enumerate(lengths):
        count = len(range(n, steps, len(lengths))) * (tokens_per_step // length)
        inputs, targets = mqar(count, length, max(1, length // 16), vocab, generator=g)
        per_length[length] = (inputs.to(device).unflatten(0, (-1, tokens_per_step // length)),
                              targets.to(device).unflatten(0, (-1, tokens_per_step // length)))
    return lambda step: tuple(t[step // len(lengths)] for t in per_length[lengths[step % len(lengths)]])


def train_and_measure(kind, vocab, next_batch, steps, evaluate):
    """Build ``kind`` at the target size, train it, and add ``evaluate(model)`` to the record."""
    torch.manual_seed(0)
    config, _ = fit_config(kind, TARGET_PARAMS, vocab, **SHAPE)
    model = LMHeadModel(config, device=device)
    record = train(model, next_batch, steps, lr=LEARNING_RATE)
    record.update(evaluate(model), d_model=config.d_model, n_layer=config.n_layer)
    return model, record


mqar_runs = {}
train_batches = mqar_batches(MQAR_TRAIN_LENGTHS, MQAR_TOKENS_PER_STEP, MQAR_STEPS, MQAR_VOCAB, seed=1)
test_generator = torch.Generator().manual_seed(2)
test_sets = {length: mqar(runtime.size(512, 2), length, max(1, length // 16), MQAR_VOCAB, generator=test_generator)
             for length in MQAR_TEST_LENGTHS}
for kind in KINDS:
    _, mqar_runs[kind] = train_and_measure(
        kind, MQAR_VOCAB, train_batches, MQAR_STEPS,
        lambda model: {"accuracy": {length: mqar_accuracy(model, *test_sets[length]) for length in MQAR_TEST_LENGTHS}})

# %% tags=["nbval-ignore-output"]
print_table([dict(kind=kind, **{f"accuracy L={length}": r["accuracy"][length] for length in MQAR_TEST_LENGTHS},
                  final_loss=r["loss"][-1], tokens_per_s=r["tokens_per_s"], seconds=r["wall_s"])
             for kind, r in mqar_runs.items()])

# %%
def smoothed(values, width):
    """A running mean over ``width`` steps (the loss of single batches is noisy)."""
    width = max(1, min(width, len(values)))
    kernel = torch.ones(width, dtype=torch.float64) / width
    return torch.conv1d(torch.tensor(values, dtype=torch.float64)[None, None], kernel[None, None])[0, 0].tolist()


fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
for kind, r in mqar_runs.items():
    left.plot(smoothed(r["loss"], 20), color=MIXER_COLORS[kind], label=kind)
    right.plot(MQAR_TEST_LENGTHS, [r["accuracy"][n] for n in MQAR_TEST_LENGTHS], marker="o", color=MIXER_COLORS[kind],
               label=kind)
right.axvline(max(MQAR_TRAIN_LENGTHS), color="k", ls=":", lw=1, label="longest training length")
left.set(xlabel="step", ylabel="loss (nats, mean of 20 steps)", title="MQAR: training loss")
right.set(xscale="log", xlabel="sequence length L (L/16 pairs)", ylabel="accuracy at the queries",
          title="MQAR: recall by length", ylim=(0, 1.02))
right.set_xticks(MQAR_TEST_LENGTHS, [str(n) for n in MQAR_TEST_LENGTHS])
right.tick_params(axis="x", which="minor", labelbottom=False)  # the log axis labels its minor ticks too, over the lengths
for ax in (left, right):
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# How to read the table and the figure. The `accuracy` columns are the fraction of queries where the model's most likely token is the key's value, on 512 test sequences per length drawn apart from the training data. `final_loss` is the loss of the last batch alone, at $L = 256$, the longest training length, which has the most pairs (16) and so the highest loss; it therefore sits above the curves, which average 20 steps over all three lengths. The curves are thick because consecutive steps cycle through the three lengths, whose losses differ, and a 20-step mean still wobbles with that cycle. `tokens_per_s` is the training speed without the first two steps, which compile and tune the kernels; `seconds` is the wall time of all 600 steps, those two included, so it depends on what Triton's cache already holds (this run came right after an attempt cut off part way, which had left most of the compiled kernels in the cache, and those two steps took about 4.4 s of Mamba-2's 39.1 seconds and 0.1 to 0.3 s of each of the others': `seconds` less the other 598 steps at `tokens_per_s`; the autotuners time their configurations again in each new process). Compare speeds by `tokens_per_s`.
#
# In a run this short (600 steps, about ten million tokens) the models have not yet learned to recall. Compare each accuracy with one over the number of pairs: 1/4, 1/8, 1/16 and 1/32 at the four lengths (0.25, 0.125, 0.0625, 0.031). On this H200 run the Transformer and the hybrid score about that at every length (0.262 and 0.246 at $L = 64$, 0.031 and 0.032 at $L = 512$; both about 10 % above it at $L = 256$). A model scores this when it has learned that the answer is one of the values in the sequence's pairs but not which one: its most likely token is one of those values, right once in as many tries as there are pairs. Its loss shows the same level: a uniform guess among the pairs' values costs ln 4, ln 8 and ln 16 nats (a loss in natural-log units) at the three training lengths, 2.08 on average, and the curves of the Transformer and the hybrid are heading there. So accuracy falls with $L$ because the number of pairs grows, and at $L = 512$, past the longest training length, those two still score about 1/32 (0.031 and 0.032). Mamba-1 has not reached even that step: it stays at a guess among all 128 values (1/128 = 0.008; it scores 0.007 to 0.009 at the four lengths), and its final loss, 4.86, is about ln 128 = 4.85. In this run Mamba-2 has not reached it either: it scores 0.032, 0.020, 0.014 and 0.012 at the four lengths, 1.5 to 4 times a guess among all 128 values but well below a guess among the pairs, and its final loss, 4.82, is just under ln 128. The flat stretch near 4.85 early in the curves is the guess among all 128 values; a model leaves it when it starts to copy values from its pairs: the Transformer within its first 20-step window, the hybrid after about 50 steps, and Mamba-1 not at all (each point of the curves is the mean of the 20 steps from it on). Mamba-2's curve stays on the flat stretch, at 4.87 to 4.90, until about step 280, then falls slowly: below ln 128 from step 317 on, and to 4.70 in its last window, where the Transformer's and the hybrid's end at 2.36 and 2.61. (The bumps in the curves of Mamba-2 and Mamba-1 near steps 60 and 70 are spikes in their losses at steps 70 to 72 and 74 to 77, which raise every 20-step window that holds them; they come just after the 60-step warm-up (the learning rate's linear rise), with the learning rate at its peak. Mamba-2's loss is back on the plateau by step 74, Mamba-1's stays between 4.99 and 5.21 until step 92.)
#
# Runs this short vary more than the kernels do: the stored runs put the Transformer, Mamba-2 and the hybrid between 0.14 and 0.27 at $L = 64$, except Mamba-2 twice, at 0.07 in an earlier run and at 0.03 in this one, where the previous run of this page had it at 0.25; they put Mamba-1 between chance and 0.14, and two runs whose records were not kept had the hybrid at 0.11 and Mamba-2 at 0.08. Which model has left the first plateau by step 600 changes from run to run, so read the table as a snapshot of the start of learning, not as a ranking. MQAR is solved only with far longer training {cite}`arora2023zoology`.

# %% [markdown]
# ### Training on bytes of Python
#
# The second task is ordinary language modelling at the byte level (a vocabulary of 256): random windows of the standard library's source for training, and the first 131,072 bytes of the held-out files (256 windows of 512) for validation. The score is bits per byte: the mean cross-entropy of the next byte in bits (the loss in nats divided by ln 2). Guessing uniformly among the 256 bytes scores 8.

# %%
corpus = stdlib_corpus()
g = torch.Generator().manual_seed(3)
byte_batches = [tuple(t.to(device) for t in sample_windows(corpus.train, BYTES_BATCH, BYTES_LEN, generator=g))
                for _ in range(BYTES_STEPS)]
print(f"training text: {len(corpus.train_files)} files; validation text: {len(corpus.validation_files)} files")

byte_runs, byte_models = {}, {}
for kind in KINDS:
    byte_models[kind], byte_runs[kind] = train_and_measure(
        kind, 256, lambda step: byte_batches[step], BYTES_STEPS,
        lambda model: {"validation": byte_lm_eval(model, corpus.validation, BYTES_LEN, batch_size=runtime.size(16, 2),
                                                max_batches=runtime.size(16, 1))})

# %% tags=["nbval-ignore-output"]
print_table([dict(kind=kind, params_M=r["params"] / 1e6, validation_bits_per_byte=r["validation"]["bits_per_byte"],
                  tokens_per_s=r["tokens_per_s"], peak_GiB=(r["peak_memory_bytes"] or 0) / 2 ** 30, seconds=r["wall_s"])
             for kind, r in byte_runs.items()])

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(12, 3.6))
for kind, r in byte_runs.items():
    left.plot(smoothed([loss / math.log(2) for loss in r["loss"]], 20), color=MIXER_COLORS[kind], label=kind)
kinds = list(byte_runs)
middle.bar(kinds, [byte_runs[k]["tokens_per_s"] / 1e3 for k in kinds], color=[MIXER_COLORS[k] for k in kinds])
right.bar(kinds, [(byte_runs[k]["peak_memory_bytes"] or 0) / 2 ** 30 for k in kinds], color=[MIXER_COLORS[k] for k in kinds])
left.set(xlabel="step", ylabel="bits per byte (mean of 20 steps)", title="Bytes: training loss")
middle.set(ylabel="thousand tokens/s", title=f"training speed (batch {BYTES_BATCH}, L={BYTES_LEN})")
right.set(ylabel="GiB", title="peak memory in training")
left.legend(fontsize="small")
for ax in (left, middle, right):
    ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# On bytes the three models with state-space layers reach 1.16 to 1.19 bits per byte on the validation bytes (the hybrid lowest in this run) and the Transformer 1.53. The Transformer is also the shallowest model (4 layers against 15 or 16), which may explain part of its higher loss; this run does not separate the two. (The left panel of the figure plots the training loss averaged over 20-step windows, each point at the start of its window, while the loss is still falling, so its curves end above the validation scores of the finished models.)
#
# The Transformer is also the fastest to train: 667 thousand tokens per second, 2.5 to 3.1 times the others. Every kernel launch costs the host some microseconds, whatever the kernel does, and a 10 M model at $L = 512$ does so little arithmetic per kernel that these costs, not the GPU's arithmetic, set the time of a step. The Transformer runs 4 wide layers where the others run 15 or 16 narrow ones, so it launches far fewer kernels. Speeds bound this way move from run to run (the note after the next paragraph gives this run's circumstances): the speeds in this chapter are this run's, not the kernels' best.
#
# The state-space stacks need about 1.5 times the Transformer's peak memory (2.8 to 2.9 GiB against 1.9): each of their 15 or 16 layers keeps its activations for the backward pass, where the Transformer has 4 layers. Two of the kernels of this chapter's first section shrink it. Writing the gated norm as a kernel roughly halved the Mamba-2 stacks' peak: in earlier runs of this chapter they needed 5.7 to 6.4 GiB with the norm written as torch ops, as the block above writes it out, and 3.2 to 3.4 GiB with the kernel; the difference is the float32 intermediates those ops keep, where the kernel keeps one number per row and group. Making the convolution a kernel, which keeps only its input and parameters for the backward pass, saved another 0.3 to 0.6 GiB: the last run of this page before that kernel, whose convolution was still torch's `F.conv1d` between transposes with a separate SiLU, needed 3.2 to 3.4 GiB for all three state-space stacks.
#
# *A note on this run.* Stored runs have put the Transformer's training speed between 500 and 1,040 thousand tokens per second (the fourteen records in the history of `book/data/models_training.json`, nine of them on H100s), some of them sharing the host with other chapters' runs on a second GPU or a compilation of CUDA code. This one had its host to itself: a machine with one H200, running one notebook at a time and nothing else. It was nevertheless slower than the previous run of this page, which shared a two-GPU host with the model benchmark and GPU tests: on bytes every kind trained at 12 to 21 % fewer tokens per second (the Transformer at 667 thousand against 773), and on MQAR the Transformer, Mamba-2 and the hybrid at 5 to 15 % fewer, with Mamba-1 at about the same speed. This run does not say why. (The code changed between the two runs too: the convolution's wrapper gained input checks before its launches, the convolution and norm kernels gained the alignment hints of the first section, and SSD's packed path two changes that these models, which pass no `seq_idx`, do not run. Nothing here separates their effect from the host's.)

# %% [markdown]
# ### Generating text
#
# The Mamba-2 model trained on bytes continues a prompt through its recurrent step: the prompt goes through the chunked kernels once, then every new byte is one call of `ssd_state_update` per layer. Sampling keeps the 10 most likely bytes at each step and sharpens their distribution a little (temperature 0.8: the logits are divided by 0.8 before the softmax). Expect the look of Python, not its sense: at 1.18 bits per byte after 300 steps, the model has learned `def`, docstrings, parameter lists and indentation (not always where they belong: this run's sample opens a function, `isoformat(name)`, with a docstring whose English makes no sense, uses `cm` in it without defining it, sets `__slots__`, an attribute of classes, in the function's body, and writes a method, `def __init__(self, args):`, inside that body too), not programs. The sample changes from run to run.

# %% tags=["nbval-ignore-output"]
prompt = text_to_bytes("import os\n\n\ndef ").to(device)
sample = byte_models["mamba2"].generate(prompt, max_length=prompt.shape[1] + runtime.size(300, 20), top_k=10,
                                        temperature=0.8, generator=torch.Generator(device=device).manual_seed(0))
print(bytes_to_text(sample[0]))

# %% [markdown]
# Decoding one token at a time is a different workload from training: every layer runs some fifteen small kernels per token, so at batch 1 the time goes to launching them, not to arithmetic. The table times `generate` on a random prompt of 512 bytes, for each kind at batch 1 and at batch 64: the prefill (the prompt and one new token) against the 63 single-token steps that follow, each timed once after an untimed run. `ratio` is the prefill's tokens per second over the decoding's.

# %% tags=["nbval-ignore-output"]
decode_rows = []
for batch in (1, runtime.size(64, 2)):
    prompt = torch.randint(0, 256, (batch, runtime.size(512, 8)), device=device)
    for kind, model in byte_models.items():
        r = decode_benchmark(model, prompt, runtime.size(64, 3), repeats=1)
        decode_rows.append(dict(kind=kind, batch=batch, prefill_tokens_per_s=r["prefill_tokens_per_s"],
                                decode_tokens_per_s=r["decode_tokens_per_s"],
                                ratio=r["prefill_tokens_per_s"] / r["decode_tokens_per_s"]))
print_table(decode_rows)

# %% [markdown]
# For every kind a decoded token costs several hundred times what a prompt token costs in the prefill (`ratio` 292 to 441). Each step is a full pass through every layer for one position: some fifteen small launches per layer (the count above), whose time is mostly launching them. At batch 1 the four kinds decode 54 to 117 tokens per second in this H200 run. A step takes 8.6 ms for the Transformer (4 layers: about 2.1 ms per layer, with its MLP), 13.5 ms for Mamba-1 and 14.4 ms for Mamba-2 (15 layers: about 0.90 and 0.96 ms per layer). The Transformer, which has the fewest layers, decoded fastest at batch 1, as in every stored run but one (where it came third of four); the hybrid came last.
#
# At batch 64 a step does 64 times the work for the same launches: 3,380 to 7,970 tokens per second, 59 to 68 times batch 1.
#
# The fixed-size state pays off where attention's cache grows large. At 512 tokens the Transformer's cache (7 MiB over its 4 layers, in float32) is already 2.8 times Mamba-2's (2.5 MiB over its 15 layers), and the hybrid's 4 attention layers bring its cache to about the same 7 MiB, but at batch 1 an H200 does not notice the difference: what sets the speed is the host's work for each layer's step. The fixed size counts where the cache fills memory: at batch 64 and 512 tokens the Transformer's cache is 448 MiB, a small part of an H200's 141 GB, which it would fill only at prompts of about 150,000 tokens, while a Mamba-2 layer's cache (its state and its convolution's window) stays 172 KiB per sequence at any length.
#
# A model of Mamba and Mamba-2 layers can skip most of that per-step work of the host. A {term}`CUDA graph` records a sequence of kernel launches once (the *capture*) and replays it later with a single call from the host: the GPU runs the recorded kernels one after another, and no Python runs between them. `generate(..., cg=True)` (`cg` for CUDA graph, mamba_ssm's argument) runs the prefill as the cells above do, by launching each kernel from Python (*eagerly*), then captures one decoding step and replays it for every further token. `tests/test_decoding.py` checks on a GPU that the replayed logits equal the eager ones bit for bit. The stored benchmark times a larger model than this page's: 24 Mamba-2 layers and 129 M parameters on an H200 (`benchmarks/bench_models.py`, `book/data/models_bench.json`; prompts of 512 tokens, 128 new ones, the capture counted in the time). Its batch-1 decoding went from 85 tokens per second eagerly to 556 from the graph, and batch 64 from 5,560 to 25,700: less of a gain, because the GPU's own work grows with the batch while the host's does not: per step (the capture included), 1.8 ms from the graph and 11.8 ms eagerly at batch 1, 2.5 and 11.5 ms at batch 64. This page decodes eagerly: two of its four kinds have attention layers, and `cg=True` refuses them. A graph replays the values its kernels were given at the capture, and an attention layer's step passes its position in the cache (where the new key goes, how many keys to read) as a Python number that grows at every step; an SSM layer's step needs no position, since its state has a fixed size.
#
# *Notes on these measurements.* The per-layer figures above divide a whole step by the layers, so they also carry the embedding, the output head and the sampling, and they are rough. In this run the hybrid's step (18.5 ms for 16 layers, 4 of them attention layers without an MLP) took longer than Mamba-2's step (14.4 ms for 15), which would put each of its attention layers at (18.5 − 12 × 0.96)/4 ≈ 1.7 ms, 0.8 of the Transformer's per-layer figure; the previous run of this page had the hybrid's step longer than Mamba-2's too (10.2 against 7.4 ms). The host's speed, not the layers, moves these figures: they are the host's times, not the GPU's, and they change from run to run. This run had the host to itself and still decoded more slowly than the previous run of this page, which decoded beside the model benchmark's training pass on the host's other GPU (73 to 194 tokens per second at batch 1): the Transformer's batch-1 rate fell by 40 %, Mamba-2's and the hybrid's by 49 and 45 %, while Mamba-1's rose by 1 %, and at batch 64 all four fell by 45 to 49 %. Other stored runs decoded 45 to 278 tokens per second at batch 1 with the same decoding kernels. At batch 64 the rate is more than 64 times batch 1's only for the Transformer, whose batch-64 step took less time than its batch-1 step, 8.0 against 8.6 ms: the host's time per launch moved within the run. The other three kinds took 2 to 8 % longer per step at batch 64 than at batch 1. The graph benchmark's eager steps move with the host as well: its last three stored runs took 10.2 and 10.4 ms per eager step (batch 1 and 64), then 19.4 and 20.1 ms, then 11.8 and 11.5 ms (the present one), while a step from the graph took 1.7 to 2.5 ms in all three. The slow run was the first after the alignment hints of the convolution and norm kernels; a later comparison (a probe, not stored), the hints on and off in turn in one process, decoded at 94 and 86 tokens per second at batch 1 (medians of five rounds), so the hints did not cause it (the README gives the runs).

# %% tags=["nbval-ignore-output"]
if GPU:  # the record of this run, for the README and the closing notes
    record = dict(device=runtime.device_name(), mqar=mqar_runs, bytes=byte_runs, decode=decode_rows,
                  settings=dict(target_params=TARGET_PARAMS, mqar_vocab=MQAR_VOCAB, mqar_train_lengths=MQAR_TRAIN_LENGTHS,
                                mqar_steps=MQAR_STEPS, mqar_tokens_per_step=MQAR_TOKENS_PER_STEP, bytes_len=BYTES_LEN,
                                bytes_batch=BYTES_BATCH, bytes_steps=BYTES_STEPS, learning_rate=LEARNING_RATE))
    pathlib.Path("data/models_training.json").write_text(json.dumps(record, indent=1))

# %% [markdown]
# ## What we have
#
# The book's kernels now do a model's job: the blocks built from them match mamba_ssm's modules parameter for parameter (`tests/test_modules.py` and `tests/test_drop_in.py` check it against mamba_ssm where it is installed), train end to end on the GPU, and generate text through recurrent steps that agree with the chunked forward pass. The last section showed the trade the book has been about, in small: attention keeps every key and value, so its cache grows with every token; a state-space model keeps a fixed-size state, which must choose what to remember, and a few minutes of training are enough to see the models differ on text and on the first step of recall (knowing where the answers come from), not to settle which is best. `benchmarks/bench_models.py` times a Mamba-130M-sized model on these kernels against the same model built from mamba_ssm's `Mamba2` modules.
#
# ## Exercises
#
# **8.1** Write the decoding step of Mamba-2's SSM in PyTorch: given the state `h` (batch, heads, $P$, $N$), the new token's `x` (batch, heads, $P$), its step `dt` (batch, heads, already positive), `A` (heads,), `B`, `C` (batch, groups, $N$) and `D` (heads,), return `(new_h, y)`. Heads are split evenly among the groups: head $i$ uses group $\lfloor i \cdot G / H \rfloor$.

# %%
def ssd_step(h, x, dt, A, B, C, D):
    raise NotImplementedError("your code here")


attempted = check_exercise("8.1", ssd_step)

# %% [markdown]
# The solution (click to show), run through the same checker:

# %% tags=["hide-input"]
def ssd_step(h, x, dt, A, B, C, D):
    heads_per_group = h.shape[1] // B.shape[1]
    B, C = (t.repeat_interleave(heads_per_group, dim=1) for t in (B, C))
    decay = torch.exp(dt * A)[..., None, None]
    new_h = decay * h + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (new_h * C[:, :, None, :]).sum(-1) + D[:, None] * x
    return new_h, y


assert check_exercise("8.1", ssd_step)

# %% [markdown]
# **8.2** Write the decoding step of the causal depthwise convolution: `conv_step(window, x, weight, bias)` takes the last `width` inputs `window` (batch, channels, width), the new input `x` (batch, channels), the filters `weight` (channels, width) and `bias` (channels,), and returns `(new_window, out)` where `out` is the convolution's output at the new position. The checker feeds a whole sequence through your step and compares with `F.conv1d` over the sequence.

# %%
def conv_step(window, x, weight, bias):
    raise NotImplementedError("your code here")


attempted = check_exercise("8.2", conv_step)

# %% [markdown]
# The solution, run through the same checker:

# %% tags=["hide-input"]
def conv_step(window, x, weight, bias):
    new_window = torch.cat([window[..., 1:], x[..., None]], dim=-1)
    return new_window, (new_window * weight).sum(-1) + bias


assert check_exercise("8.2", conv_step)

# %% [markdown]
# **8.3** (open) In the MQAR plot, does accuracy fall faster past the longest training length ($L = 256$) than before it? (Compare each point with 1/(number of pairs) first, and train longer until the models beat it.) Why would a model with rotary position embeddings and one with a fixed-size state fail there for different reasons? Train the mamba2 model with `d_state` 16 and 128 (pass `d_state` to `fit_config`) and compare its recall at $L = 256$.
