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
# # Packing two floats into one word
#
# In this chapter you will learn:
#
# - why early Triton kernels bit-packed the pair $(a, b)$ into a single integer to scan it, and how: bitcast, shift, bitwise OR (`|`);
# - how to write a {term}`combine` that unpacks, composes and repacks, and why the float32 version agrees bit for bit with the tuple scan while the 16-bit version does not;
# - whether packing still pays on today's Triton: what it does to the number of {term}`shuffles <shuffle>`, and its speed measured on the GPU against the tuple scan.
#
# It builds on [chapter 2](02_associative_scan.ipynb): the combine $(a_1, b_1)\bullet(a_2, b_2) = (a_1 a_2,\, a_2 b_1 + b_2)$ (earlier pair on the left) and the one-{term}`block` tuple scan `tuple_scan_forward`.
#
# ```{admonition} Notation (as in chapter 2)
# | symbol | meaning |
# |---|---|
# | $t$, $L$ | time step, sequence length |
# | $a_t$, $b_t$ | decay and input of step $t$, the pair the scan combines |
# | $h_t$ | the state after step $t$ |
# | $w$ | a packed word: the bits of $a$ in its high half, those of $b$ in its low half |
# ```

# %%
import matplotlib.pyplot as plt
import torch

from mamba_annotated import runtime
from mamba_annotated.bench import gbps, median_ms, memory_floor_ms, print_table
from mamba_annotated.figures import COLORS, show_source
from mamba_annotated.scan.associative import tuple_scan_forward
from mamba_annotated.scan.packed import combine_words, pack_pair, packed_scan_forward, packed_scan_kernel, unpack_pair
from mamba_annotated.scan.reference import linear_scan_ref
from mamba_annotated.testing import check, randn, rel_error, seed_everything, tolerance, uniform

seed_everything(0)

# %% tags=["nbval-ignore-output"]
runtime.describe()

# %% [markdown]
# ## Why pack at all
#
# Until early 2024, `tl.associative_scan` took a single tensor: the combine function received two scalars and returned one ([triton#2657](https://github.com/triton-lang/triton/issues/2657); tuples arrived with [triton#2947](https://github.com/triton-lang/triton/pull/2947)). Our element is a *pair*. The workaround: an element is just 64 bits of information, so store it in one 64-bit integer,
#
# $$
# w = \underbrace{\text{bits}(a)}_{\text{high 32}} \;\|\; \underbrace{\text{bits}(b)}_{\text{low 32}},
# $$
#
# where $\|$ is concatenation, the 32 bits of $a$ followed by the 32 bits of $b$ (in code, a shift and a bitwise OR). Scan the integers, and let the combine reinterpret the bits: unpack both words into floats, compose the maps, pack the result. Nothing is converted numerically on the way in or out; `x.to(tl.uint32, bitcast=True)` relabels the 32 bits of a float as an integer. For 16-bit inputs two values fit in one 32-bit word the same way.

# %%
def draw_word(ax, y, label, fields):
    x = 0
    for name, bits, color in fields:
        ax.add_patch(plt.Rectangle((x, y), bits, 0.8, color=color, alpha=0.35, ec="black"))
        ax.text(x + bits / 2, y + 0.4, name, ha="center", va="center")
        x += bits
    ax.text(-1, y + 0.4, label, ha="right", va="center")


fig, ax = plt.subplots(figsize=(10, 2.2))
draw_word(ax, 1, "float32 pair -> uint64", [("a: sign | exponent 8 | mantissa 23", 32, COLORS["decay"]),
                                            ("b: sign | exponent 8 | mantissa 23", 32, COLORS["x"])])
draw_word(ax, 0, "bfloat16 pair -> uint32", [("a: 16 bits", 16, COLORS["decay"]), ("b: 16 bits", 16, COLORS["x"])])
ax.set(xlim=(-22, 65), ylim=(-0.2, 2), xticks=[0, 16, 32, 48, 64], yticks=[])
ax.set_xlabel("bit position (from the most significant)")
for side in ("left", "right", "top"):
    ax.spines[side].set_visible(False)
plt.tight_layout()
plt.show()

# %% [markdown]
# Two layouts, one idea: a float32 pair fills a 64-bit word, a 16-bit pair a 32-bit word, and in both the decay sits in the high half.

# %% [markdown]
# ## Pack, unpack, and the combine between them
#
# Packing widens each field's bits to the word type and shifts $a$ into the high half; unpacking shifts back and lets the narrowing cast drop the high bits. The `FLOAT`, `HALF` and `WORD` types and the field width `BITS` are compile-time constants (`FLOAT` is the float type of one field, float32, bfloat16 or float16; `HALF` is not float16: it is the unsigned integer type of one field, `uint32` for a float32 pair and `uint16` for a 16-bit one; `WORD` is `uint64` or `uint32`, `BITS` 32 or 16), so one pair of helpers serves both layouts.
#
# Two kinds of cast do the work, and they differ. `x.to(HALF, bitcast=True)` is a *bitcast*: it relabels the bits of a float as an integer of the same width, changing none of them. `.to(WORD)` from an unsigned `HALF` widens with zeros on top, and `.to(HALF)` from a `WORD` is a *narrowing cast*: it keeps the low `BITS` bits and drops the rest, again without arithmetic. Two conversions change a value rather than relabel its bits: `a.to(FLOAT)` and `b.to(FLOAT)` at the start of `pack_pair` round float32 to 16 bits in the 16-bit layout (and do nothing in the float32 one), and the final `.to(tl.float32)` in `unpack_pair` widens a 16-bit float to float32, exactly. Only the first can lose information.
#
# A worked word shows why the widening must fill with zeros. Take $a = 0.5$ and $b = -1.0$, whose float32 bits are `0x3F000000` and `0xBF800000`. Shifted and joined, $w$ = `0x3F000000BF800000`, and both halves come back unchanged. Had $b$'s bits been widened as a *signed* integer, its sign bit would have been copied into the whole top half (`0xFFFFFFFFBF800000`), and the `|` would have overwritten $a$ with all ones, a NaN. Bitcasting to an unsigned `HALF` before widening prevents that.

# %%
show_source(pack_pair)

# %%
show_source(unpack_pair)

# %% [markdown]
# The combine unpacks both words into float32, applies the same `first_order_combine` as chapter 2, and packs the result. `tl.associative_scan` hands the combine only its two operands, so each float type (float32, bfloat16, float16) gets a two-line wrapper that fixes the types (see `mamba_annotated/scan/packed.py`).

# %%
show_source(combine_words)

# %% [markdown]
# The kernel: load, pack, scan the words, unpack the state. Like chapter 2's, one {term}`program` holds one row in one {term}`block`.

# %%
show_source(packed_scan_kernel)

# %% [markdown]
# ## Float32 words: bit for bit the tuple scan
#
# For float32 every value survives the round trip exactly (the bits are only relabelled), and the combine does the same float32 multiplies and adds as the tuple scan, in the same tree. So the results should not merely be close: they should be *identical*.

# %%
rows, length = runtime.size(gpu=(4 * 1536, 2000), cpu=(3, 100))
a = uniform(rows, length, low=0.6, high=1.0)
b = randn(rows, length)
h_packed = packed_scan_forward(a, b)

# %%
check("packed float32 vs float64", h_packed, linear_scan_ref(a, b), tolerance(torch.float32))
assert torch.equal(h_packed, tuple_scan_forward(a, b))
print("packed float32 == tuple scan, bit for bit: True")

# %% [markdown]
# ## 16-bit words: the scan now accumulates in 16 bits
#
# For bfloat16 the pair fits in 32 bits, but the packed element has room for 16-bit values only: every combine must *round* its float32 result back to bfloat16 before repacking. The tuple scan of chapter 2 loads 16-bit inputs too, but its running values stay float32 and are rounded once, on output. The packed scan rounds at every combine, so its state carries the rounding errors of all the combines that built it.
#
# A yardstick for the packed scan is the same kind of arithmetic done in plain PyTorch: compose in float32, round the state to 16 bits after every step. It is not the same arithmetic, so the bits differ: the loop rounds $h$ once per step, in time order, where the packed scan rounds both halves of every combine in its tree, including the running product of the decays, which the loop never forms. The check below therefore asks for an error of the same size, not the same error: at most twice the loop's, plus $10^{-3}$.
#
# (One {term}`interpreter` fact: Triton's CPU interpreter keeps bfloat16 as raw bits and, left alone, *truncates* float32 to bfloat16, where a GPU rounds to nearest even. `mamba_annotated` makes the interpreter round as the GPU does (`mamba_annotated/interpreter_rounding.py`), so one yardstick serves both.)

# %% tags=["nbval-ignore-output"]
def sixteen_bit_loop(a, b):
    h, states = torch.zeros_like(a[..., 0]), []
    for t in range(a.shape[-1]):
        h = (a[..., t].float() * h.float() + b[..., t].float()).to(a.dtype)
        states.append(h)
    return torch.stack(states, dim=-1)


for dtype in (torch.bfloat16, torch.float16):
    a16, b16 = a.to(dtype), b.to(dtype)
    ref = linear_scan_ref(a16, b16)
    packed_error = rel_error(packed_scan_forward(a16, b16), ref)
    loop_error = rel_error(sixteen_bit_loop(a16, b16), ref)
    tuple_error = rel_error(tuple_scan_forward(a16, b16), ref)
    name = str(dtype).removeprefix("torch.")
    assert packed_error <= 2 * loop_error + 1e-3, (name, packed_error, loop_error)
    print(f"{name}: packed rel err {packed_error:.1e} <= 2 x {loop_error:.1e} (16-bit accumulation in PyTorch) + 1e-3")
    assert tuple_error < packed_error, (name, tuple_error, packed_error)
    print(f"{name}: tuple scan (float32 accumulation) rel err {tuple_error:.1e} < packed {packed_error:.1e}")

# %% [markdown]
# The packed errors printed above are about 1.2 times the loop's for both types (for float16 the $10^{-3}$ allowance is most of the bound, so that line is a loose check), and about twice the tuple scan's, whose only error is the one rounding of its output.
#
# The gap against the length (bfloat16 inputs, float64 reference). The decays are now in $(0.9, 1)$, closer to one than the $(0.6, 1)$ of the check above, so more past roundings survive in each state: the packed error here is about $5.5 \cdot 10^{-3}$, against $3.4 \cdot 10^{-3}$ above, while the tuple scan's, one rounding of its output, does not depend on the decays:

# %% tags=["nbval-ignore-output"]
lengths = runtime.size(gpu=[2**k for k in range(4, 15, 2)], cpu=[16, 64, 256])
errors = {"tuple scan (float32 accumulation)": [], "packed 16-bit words": []}
for length_case in lengths:
    a_l = uniform(8, length_case, low=0.9, high=1.0, dtype=torch.bfloat16)
    b_l = randn(8, length_case, dtype=torch.bfloat16)
    ref = linear_scan_ref(a_l, b_l)
    errors["tuple scan (float32 accumulation)"].append(rel_error(tuple_scan_forward(a_l, b_l), ref))
    errors["packed 16-bit words"].append(rel_error(packed_scan_forward(a_l, b_l), ref))
fig, ax = plt.subplots(figsize=(6.4, 3.8))
for (name, errs), color in zip(errors.items(), [COLORS["y"], COLORS["decay"]]):
    ax.loglog(lengths, errs, "o-", color=color, label=name)
ax.set(xlabel="sequence length L", ylabel="relative error vs float64", title="bfloat16 inputs")
ax.grid(alpha=0.3)
ax.legend(fontsize="small")
plt.tight_layout()
plt.show()
print_table([dict(L=n, tuple_scan=t, packed=p) for n, t, p in zip(lengths, *errors.values())])

# %% [markdown]
# The verdict: the packed scan's error is about three times the tuple scan's from $L = 64$ on (twice at $L = 16$); the tuple scan's stays at the one rounding of its output, about $1.7 \cdot 10^{-3}$. The packed error stops growing after $L = 64$: with decays of about 0.95 on average, an old rounding error fades like an old input, by a factor $e$ every 20 steps or so, so only the roundings of the last few dozen steps count.

# %% [markdown]
# ## Does packing still pay?
#
# Packing was a necessity; was it also faster? The hardware's exchange between threads, the {term}`warp` {term}`shuffle` (`shfl.sync`), moves 32 bits per thread. The tuple scan keeps $a$ and $b$ as float32 {term}`registers`, even for 16-bit inputs, and so needs two shuffles per exchange. A 64-bit word also needs two, so a float32 pair saves nothing by packing. A 16-bit pair in one 32-bit word needs one, half the tuple scan's, but pays integer shifts and casts and two roundings on every combine. Both scans read and write the same bytes. We time both on identical inputs in the same run (`8 × 1536` rows, one block per row).

# %% tags=["nbval-ignore-output"]
rows = runtime.size(gpu=8 * 1536, cpu=4)
timing_rows = []
for dtype in (torch.float32, torch.bfloat16):
    for length_case in runtime.size(gpu=[1024, 4096, 16384], cpu=[64]):
        a_t = uniform(rows, length_case, low=0.6, high=1.0, dtype=dtype)
        b_t = randn(rows, length_case, dtype=dtype)
        nbytes = 3 * a_t.numel() * a_t.element_size()
        for name, fn in [("tuple", tuple_scan_forward), ("packed", packed_scan_forward)]:
            ms = median_ms(lambda: fn(a_t, b_t))
            timing_rows.append(dict(dtype=str(dtype).removeprefix("torch."), L=length_case, scan=name, ms=ms,
                                    GBps=gbps(nbytes, ms), pct_of_floor=100 * memory_floor_ms(nbytes) / ms))
print(f"device: {runtime.device_name()}")
print_table(timing_rows)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, dtype in zip(axes, ("float32", "bfloat16")):
    for name, color in [("tuple", COLORS["y"]), ("packed", COLORS["decay"])]:
        points = [(r["L"], r["ms"]) for r in timing_rows if r["scan"] == name and r["dtype"] == dtype]
        ax.loglog(*zip(*points), "o-", base=2, color=color, label=name)
    ax.set(title=f"{dtype}, {rows} rows", xlabel="sequence length L", ylabel="median time (ms)")
    ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# The verdict: in float32 the two scans take the same time to within about 2%: the same bytes, the same shuffles, and the packed scan's shifts cost nothing visible. In bfloat16 they are level at $L = 1024$ (both at about 72% of the {term}`memory floor`, the time their bytes take at the measured copy bandwidth); from $L = 4096$ on the packed scan is slower, at about 65% of the floor against the tuple scan's 94% at $L = 4096$ and 85% at $L = 16384$: the shuffles it saves do not pay for its integer work and its two roundings per combine. That work most likely weighs more here than in float32 because a bfloat16 element brings half the bytes, so the same arithmetic per element has half the memory time to hide behind. In the stored H200 benchmark (`book/data/linear_scan_bench.json`) the float32 scans are within 2% of each other and the packed bfloat16 scan is 29–46% slower at $L \ge 4096$; the table above gives this GPU's numbers. Packing no longer pays.

# %% [markdown]
# ## What we have, and what comes next
#
# Packing turns a pair scan into a single-tensor scan with nothing but bitcasts and shifts. For float32 it gives bit for bit the tuple scan's result: the same arithmetic, and the same two shuffles per exchange, so it gains nothing. For 16-bit inputs, packing a pair into one 32-bit word halves the shuffles but keeps the scan's state in 16 bits, less accurate than the tuple scan's float32 state, and it is slower anyway; packing the pair as two float32 halves of a 64-bit word (as the float32 path does) keeps float32 accuracy, but then needs two shuffles, like the tuple scan. The tuple scan stays our building block.
#
# Both one-block kernels stop at `MAX_LENGTH` = 65536 steps, the package's cap: one program holds the whole row, and 65536 pairs are already 131072 32-bit values, twice the register file of an H100's or H200's {term}`SM`, so such a block {term}`spills <spill>` to local memory. Chapter 4 chains blocks with {term}`carries <carry>` to scan any length.
#
# **Exercises** (answers to 1 and 2 in the dropdown below them; 3 and 4 have checkers):
#
# 1. The float32 packed scan agrees with the tuple scan bit for bit, because both do the same float32 operations in the same tree (`test_float32_words_match_the_tuple_scan_bit_for_bit` checks it). Name a change to one of the two kernels that would keep both within the float32 bound but end the bit-for-bit agreement, and say why it would.
# 2. The check in the section on 16-bit words printed the packed scan's error for bfloat16 and for float16 inputs. Which is smaller, by about what factor, and why? What does float16 give up in exchange, and where in a packed scan could that show?
# 3. *Two float16 in one word.* Write `pack_halves(high, low)`: for two float16 tensors of one shape, an int32 tensor whose words hold the 16 bits of `high` in their top half and those of `low` in their bottom half, as a Triton kernel. (Widening a negative 16-bit integer copies its sign bit into the top half: reinterpret as `tl.uint16` first.)
# 4. *And back.* Write `unpack_halves(words)` returning `(high, low)`, float16, equal to the packed numbers bit for bit: zeros of both signs, infinities and NaN included. (On `int32`, `>>` is an arithmetic shift: `word >> 16` fills the top half with copies of the sign bit. That does no harm here, because `.to(tl.int16)` keeps only the low 16 bits, which you then bitcast to float16.)
#
# Exercises 3 and 4 use `int32` words, a type PyTorch can shift and compare, where the chapter uses `uint32`: the bits are the same, and only `>>` differs (on `uint32` it fills with zeros).
#
# ```{admonition} Answers to exercises 3.1 and 3.2 (click to show)
# :class: dropdown
# 3.1. Any change to the bracketing or to the rounding. Launching one kernel with another number of warps (or another block size) changes how `tl.associative_scan` groups the combines: how many elements each thread folds alone and where the shuffle rounds split the row. Float32 addition and multiplication round, so different groupings differ in the last bits, while both stay as accurate. Computing $a_2 b_1 + b_2$ with `tl.fma` in one combine and as a separate multiply and add in the other (one rounding against two, where the compiler does not fuse them itself) does the same.
#
# 3.2. Float16's error is about eight times smaller. Float16 stores 10 mantissa bits, bfloat16 7, so their unit roundoffs are $2^{-11} \approx 4.9 \cdot 10^{-4}$ and $2^{-8} \approx 3.9 \cdot 10^{-3}$, a factor of 8, and both the packed scan's errors (many roundings) and the tuple scan's (one rounding of the output) scale with it. In exchange float16 has 5 exponent bits where bfloat16 has float32's 8: its largest finite value is 65504 and its smallest normal one $6.1 \cdot 10^{-5}$. In the packed scan a state beyond 65504 becomes infinite, and the running product of the decays, in the high half of each word, loses precision in the subnormals and reaches zero after a long enough run of decays (harmless by then: it multiplies a state whose contribution has faded just as far).
# ```
#
# Replace the `raise` in each stub and run the cell; the checkers (`mamba_annotated.exercises`) compare the bits with those PyTorch's integer operations give, on fresh random numbers and every special value.

# %%
import triton  # the exercises write their own kernels
import triton.language as tl

from mamba_annotated.exercises import check as check_exercise


def pack_halves(high, low):
    raise NotImplementedError  # your code here


def unpack_halves(words):
    raise NotImplementedError  # your code here


attempted = [check_exercise(number, answer) for number, answer in (("3.3", pack_halves), ("3.4", unpack_halves))]

# %% [markdown]
# The solutions (click to show), run through the same checkers:

# %% tags=["hide-input"]
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
    tl.store(low_ptr + i, word.to(tl.int16).to(tl.float16, bitcast=True), mask=i < n)  # keeps the low bits


def unpack_halves(words):
    high = torch.empty(words.shape, dtype=torch.float16, device=words.device)
    low = torch.empty_like(high)
    unpack_kernel[(triton.cdiv(words.numel(), 128),)](words, high, low, words.numel(), BLOCK=128)
    return high, low


for number, answer in (("3.3", pack_halves), ("3.4", unpack_halves)):
    assert check_exercise(number, answer)
