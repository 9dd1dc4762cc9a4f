"""attention_with_kvcache (flash_attn's flash_attn_with_kvcache) against float64: the output, the
log-sum-exp and the cache after the append, over drawn combinations of every option; the split-KV
merge; rows that see no key; non-finite keys and values; the interface, bad inputs and
out-of-range indices; torch.library, torch.compile and CUDA graphs.

The bound is chapter 7's rule (:mod:`mamba_annotated.testing`): the kernel's relative error
against the float64 reference is at most twice that of the same attention computed naively by
PyTorch in the input dtype, on the same (rotated, rounded) queries and keys. The cache after the
append is checked element by element: exactly, except where rotary embeddings rotate a new key,
which may differ from the float64 rotation by one unit of its dtype (float32 arithmetic, rounded
once, against float64 rounded once).
"""
import collections
import inspect
import math
import random

import pytest
import torch

from mamba_annotated import attention_with_kvcache
from mamba_annotated.attention import kvcache, split_kv
from mamba_annotated.attention.api import resolve_window
from mamba_annotated.attention.index_checks import index_flags
from mamba_annotated.attention.kvcache import attention_with_kvcache_op
from mamba_annotated.attention.reference import (attention_ref, geometric_alibi_slopes, kvcache_reference,
                                                 kvcache_sequences, naive_attention)
from mamba_annotated.runtime import DEVICE
from mamba_annotated.testing import (FLOAT_DTYPES, assert_close, assert_refused_in_a_child_process,
                                     assert_within_same_computation, every_other, randn)

ON_GPU = DEVICE.type == "cuda"
INT32 = dict(dtype=torch.int32, device=DEVICE)


def ints(values):
    return torch.tensor(values, **INT32)


def make_case(batch=2, seqlen_q=1, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, capacity=37,
              layout="contiguous", page_size=5, seqlens=None, leftpad=None, new=0, rotary_dim=0, rotary_dtype=None,
              **options):
    """Inputs of one call as a dict of attention_with_kvcache's keyword arguments (q, k_cache,
    v_cache, ...), the caches random everywhere. ``layout``: "contiguous", "indexed" (a cache of
    batch + 2 rows, cache_batch_idx a random choice of them) or "paged" (pages of ``page_size``
    shuffled over a pool of more pages than the batch needs). ``seqlens``: cache_seqlens, a list
    (made an int32 tensor), an int, or None; ``leftpad`` a list or None; ``new`` the keys appended;
    ``rotary_dim`` > 0 gives rotary tables of capacity + seqlen_q rows in ``rotary_dtype``
    (default q's). Other ``options`` are passed on."""
    case = dict(q=randn(batch, seqlen_q, heads, head_dim, dtype=dtype))
    if layout == "paged":
        pages = -(-capacity // page_size)
        pool = batch * pages + 3
        cache_shape = (pool, page_size, kv_heads, head_dim)
        case["block_table"] = torch.randperm(pool, device=DEVICE)[:batch * pages].view(batch, pages).to(torch.int32)
        capacity = pages * page_size
    else:
        rows = batch + 2 if layout == "indexed" else batch
        cache_shape = (rows, capacity, kv_heads, head_dim)
        if layout == "indexed":
            case["cache_batch_idx"] = torch.randperm(rows, device=DEVICE)[:batch].to(torch.int32)
    case["k_cache"], case["v_cache"] = randn(*cache_shape, dtype=dtype), randn(*cache_shape, dtype=dtype)
    if new:
        case["k"], case["v"] = (randn(batch, new, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    if seqlens is not None:
        case["cache_seqlens"] = ints(seqlens) if isinstance(seqlens, list) else seqlens
    if leftpad is not None:
        case["cache_leftpad"] = ints(leftpad)
    if rotary_dim:
        angles = torch.rand(capacity + seqlen_q, rotary_dim // 2, device=DEVICE, dtype=torch.float64) * 2 * math.pi
        case["rotary_cos"], case["rotary_sin"] = (f(angles).to(rotary_dtype or dtype) for f in (torch.cos, torch.sin))
    return case | options


def capacity_of(case):
    if "block_table" in case:
        return case["block_table"].shape[1] * case["k_cache"].shape[1]
    return case["k_cache"].shape[1]


def reference_arguments(case):
    """The case's arguments for kvcache_reference: the window as flash_attn resolves it."""
    args = {name: value for name, value in case.items() if name not in ("window_size", "num_splits")}
    args["window"] = resolve_window(case.get("causal", False), case.get("window_size", (-1, -1)), capacity_of(case))
    return args


def rotated_key_slack(case):
    """Per cache element, how far a rotated new key may lie from the float64 rotation: one unit of
    the dtype relative to |x_a| + |x_b| of its channel pair (the two terms' sizes, since |cos|, |sin|
    <= 1), placed where the append writes; 0 elsewhere (exact)."""
    zeros = torch.zeros(case["k_cache"].shape, dtype=torch.float64, device=DEVICE)
    if "rotary_cos" not in case:
        return zeros
    half = case["rotary_cos"].shape[1]
    pairs = case["k"][..., :2 * half].double().abs()
    if case.get("rotary_interleaved", True):
        sizes = (pairs[..., 0::2] + pairs[..., 1::2]).repeat_interleave(2, dim=-1)
    else:
        sizes = (pairs[..., :half] + pairs[..., half:]).repeat(1, 1, 1, 2)
    sizes = torch.cat([sizes, torch.zeros_like(case["k"][..., 2 * half:], dtype=torch.float64)], dim=-1)
    placed = {name: case.get(name) for name in ("cache_seqlens", "cache_batch_idx", "block_table")}
    slack = kvcache_sequences(case["q"], zeros, zeros, sizes, sizes, **placed)[3]
    return slack * torch.finfo(case["q"].dtype).eps


def check_case(case, factor=2.0):
    """Run the op on copies of the caches; out and lse against float64 by the rule, the caches after
    the append element by element. Returns (out, lse)."""
    dtype = case["q"].dtype
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out, lse = attention_with_kvcache(**(case | dict(k_cache=k_cache, v_cache=v_cache)), return_softmax_lse=True)
    ref_out, ref_lse, ref_k_cache, ref_v_cache = kvcache_reference(**reference_arguments(case))
    same_out, same_lse, _, _ = kvcache_reference(**reference_arguments(case), attend=naive_attention)
    batch, seqlen_q, heads, _ = case["q"].shape
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32
    assert not out.requires_grad and not lse.requires_grad
    if out.numel():  # (no relative error of nothing)
        assert_within_same_computation("out", out, same_out, ref_out, dtype, factor)
        assert_within_same_computation("lse", lse, same_lse, ref_lse, dtype, factor)
    assert torch.equal(v_cache, ref_v_cache), "v_cache after the append"
    slack = rotated_key_slack(case)
    off = (k_cache.double() - ref_k_cache.double()).abs()
    assert (off <= slack).all(), f"k_cache after the append: {int((off > slack).sum())} elements off"
    return out, lse


# --- drawn combinations of every option -----------------------------------------------------------

CASES = 18
HEAD_DIMS = (16, 24, 32, 40, 64, 72, 128, 256, 48)  # with 16..256 and non-powers of two


def draw(index):
    """Case ``index`` of CASES: dtype and layout cycle (every pair twice), the rest drawn from a
    seed of its own. Plain data (kwargs of make_case), so a failure names its case."""
    rng = random.Random(1000 + index)
    dtype = FLOAT_DTYPES[index % 3]
    layout = ("contiguous", "indexed", "paged")[index // 3 % 3]
    seqlen_q = 1 if index % 2 == 0 else rng.choice([2, 3, 5, 9])
    heads, kv_heads = rng.choice([(2, 2), (4, 1), (6, 3), (4, 2), (3, 1), (8, 2)])
    head_dim = HEAD_DIMS[index % len(HEAD_DIMS)]
    capacity = rng.choice([29, 37, 53, 61])
    page_size = rng.choice([1, 3, 5, 7, 16])
    if layout == "paged":
        capacity = -(-capacity // page_size) * page_size
    batch = rng.choice([1, 2, 3])
    new = rng.choice([0, 0, 1, 3, seqlen_q])
    seqlens = [rng.choice([0, rng.randint(0, capacity - new), capacity - new]) for _ in range(batch)]
    case = dict(batch=batch, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                capacity=capacity, layout=layout, page_size=page_size, new=new,
                seqlens=seqlens if rng.random() < 0.8 else seqlens[0],  # an int: every sequence alike
                causal=rng.random() < 0.5,
                window_size=rng.choice([(-1, -1), (-1, -1), (rng.randint(0, 20), rng.randint(0, 4)),
                                        (rng.randint(0, 12), -1), (-1, rng.randint(0, 2))]),
                softcap=rng.choice([0.0, 0.0, 5.0, 30.0]), num_splits=rng.choice([0, 1, 2, 3, 5]))
    if new == 0 and rng.random() < 0.15:
        case["seqlens"] = None  # the whole cache
    if case["seqlens"] is not None and rng.random() < 0.4:
        ends = case["seqlens"] if isinstance(case["seqlens"], list) else [case["seqlens"]] * batch
        case["leftpad"] = [rng.randint(0, end) for end in ends]
    if new and rng.random() < 0.6:
        case["rotary_dim"] = 2 * rng.randint(1, head_dim // 2)
        case["rotary_interleaved"] = rng.random() < 0.5
        case["rotary_dtype"] = rng.choice([None, torch.float32])
    alibi = rng.choice([None, None, "heads", "batch, heads"])
    if alibi:
        case["alibi"] = alibi
    if rng.random() < 0.2:
        case["softmax_scale"] = rng.choice([0.3, -0.5, 0.0])
    return case


def build(drawn):
    drawn = dict(drawn)
    alibi = drawn.pop("alibi", None)
    case = make_case(**drawn)
    if alibi:
        shape = (drawn["heads"],) if alibi == "heads" else (drawn["batch"], drawn["heads"])
        case["alibi_slopes"] = geometric_alibi_slopes(math.prod(shape), DEVICE)[
            torch.randperm(math.prod(shape), device=DEVICE)].reshape(shape)
    return case


@pytest.mark.parametrize("index", range(CASES))
def test_drawn_combinations(index):
    check_case(build(draw(index)))


def test_the_draws_cover_every_option():
    """Every option the op has is drawn in some case (and its plain value in another)."""
    draws = [draw(i) for i in range(CASES)]
    seen = lambda key, value=True: any(value(d.get(key)) if callable(value) else d.get(key) == value  # noqa: E731
                                       for d in draws)
    for layout in ("contiguous", "indexed", "paged"):
        assert seen("layout", layout)
    for dtype in FLOAT_DTYPES:
        assert seen("dtype", dtype)
    assert seen("layout", "paged") and any(d["layout"] == "paged" and d["page_size"] in (1, 3, 5, 7) for d in draws)
    assert seen("leftpad", lambda v: v is not None) and seen("leftpad", lambda v: v is None)
    assert seen("new", 0) and seen("new", lambda v: v and v > 1)
    assert seen("rotary_interleaved", True) and seen("rotary_interleaved", False)
    assert any(d.get("rotary_dim", 0) and d["rotary_dim"] < d["head_dim"] for d in draws)
    assert seen("causal", True) and seen("causal", False)
    assert seen("window_size", lambda w: w is not None and w[0] >= 0)
    assert seen("softcap", lambda c: c and c > 0)
    assert seen("softmax_scale", 0.0) and seen("softmax_scale", 0.3)  # a negative scale: its own test below
    assert any(d.get("rotary_dtype") == torch.float32 and d["dtype"] != torch.float32 for d in draws)
    assert seen("alibi", "heads") and seen("alibi", "batch, heads")
    assert any(d["kv_heads"] == 1 < d["heads"] for d in draws) and any(1 < d["kv_heads"] < d["heads"] for d in draws)
    assert seen("seqlen_q", 1) and seen("seqlen_q", lambda n: n > 1)
    assert {24, 72, 16, 256} <= {d["head_dim"] for d in draws}
    assert any(isinstance(d["seqlens"], list) and 0 in d["seqlens"] for d in draws)
    assert seen("seqlens", lambda s: isinstance(s, int)) and seen("seqlens", None)
    assert {0, 1} <= {d["num_splits"] for d in draws} and seen("num_splits", lambda n: n > 1)


# --- the options one at a time, where a draw could miss an edge ----------------------------------

@pytest.mark.parametrize("layout, page_size", [("contiguous", 0), ("indexed", 0), ("paged", 1), ("paged", 7)])
def test_append_with_leftpad_and_rotary(layout, page_size):
    """New keys land at cache_seqlens (absolute, leftpad included), rotated there; the attention
    reads [leftpad, cache_seqlens + new); the queries rotate at cache_seqlens + i when causal."""
    case = make_case(batch=3, seqlen_q=3, heads=4, kv_heads=2, capacity=29, layout=layout, page_size=page_size,
                     seqlens=[0, 11, 26], leftpad=[0, 4, 9], new=3, rotary_dim=20, rotary_interleaved=False,
                     causal=True, num_splits=3)
    check_case(case)


@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))])
def test_queries_rotate_per_row_only_when_causal_or_local(causal, window_size):
    """flash_attn rotates the queries at cache_seqlens + i when causal or local, else all at
    cache_seqlens: several queries and two new keys make the difference show."""
    case = make_case(batch=2, seqlen_q=4, heads=2, kv_heads=1, capacity=33, seqlens=[5, 20], new=2, rotary_dim=32,
                     rotary_interleaved=True, causal=causal, window_size=window_size)
    check_case(case)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_decoding_step_with_grouped_heads_and_every_split_count(dtype):
    """One query per head (8 heads packed 4 to a kv head), a cache several key blocks long: every
    split count gives the reference's result, and they agree with one another."""
    case = make_case(batch=2, seqlen_q=1, heads=8, kv_heads=2, head_dim=64, dtype=dtype, capacity=97,
                     seqlens=[96, 45], new=1, causal=True)
    results = [check_case(case | dict(num_splits=n)) for n in (1, 2, 3, 7, 128)]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for out, lse in results[1:]:
        assert_close(out, results[0][0], tol, "out with splits against one split")
        assert_close(lse, results[0][1], 1e-6, "lse with splits against one split")


def test_rows_that_see_no_key():
    """Sequences of no key (cache_seqlens 0, nothing appended), rows before a causal diagonal past
    the keys, rows whose window holds no key: out = 0, lse = +inf, with and without splits."""
    case = make_case(batch=3, seqlen_q=6, heads=2, kv_heads=1, capacity=40, seqlens=[0, 3, 30], leftpad=[0, 1, 0],
                     causal=True)
    for n in (1, 4):
        out, lse = check_case(case | dict(num_splits=n))
        assert torch.all(lse[0] == math.inf) and not out[0].any()
        assert torch.all(lse[1, :, :4] == math.inf) and not out[1, :4].any()  # 2 keys, 6 queries
        assert torch.isfinite(lse[2]).all()
    # a window that ends before the sequence starts: keys [27, 30), window (1, 0) of five queries
    windowed = make_case(batch=1, seqlen_q=5, heads=2, kv_heads=1, capacity=40, seqlens=[30], leftpad=[27],
                         window_size=(1, 0), num_splits=2)
    out, lse = check_case(windowed)
    assert torch.all(lse[0, :, :2] == math.inf) and not out[0, :2].any() and torch.isfinite(lse[0, :, 2:]).all()


@pytest.mark.parametrize("causal, num_splits", [(False, 1), (True, 3)])
def test_stale_and_nan_positions_outside_the_sequences_are_never_read(causal, num_splits):
    """Every cache position outside [cache_leftpad, cache_seqlens + new) holds NaN, in every
    layout: the outputs are those of the clean cache. A key loaded past either end and then masked
    would still bring its NaN value in (0 x NaN in the product; without a window, nothing drops it)."""
    for layout in ("contiguous", "indexed", "paged"):
        case = make_case(batch=2, seqlen_q=2, heads=4, kv_heads=2, capacity=37, layout=layout, page_size=3,
                         seqlens=[9, 30], leftpad=[2, 0], new=2, causal=causal, num_splits=num_splits)
        clean = attention_with_kvcache(**(case | dict(k_cache=case["k_cache"].clone(),
                                                      v_cache=case["v_cache"].clone())), return_softmax_lse=True)
        starts = case["cache_leftpad"].tolist()
        ends = (case["cache_seqlens"] + 2).tolist()
        poisoned = {name: case[name].clone() for name in ("k_cache", "v_cache")}
        reads = kvcache_positions_mask(case, starts, ends)
        for t in poisoned.values():
            t[~reads] = math.nan
        got = attention_with_kvcache(**(case | poisoned), return_softmax_lse=True)
        assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1]), layout


def kvcache_positions_mask(case, starts, ends):
    """(cache rows or pages, positions) bool: True where a sequence's positions [start, end) lie."""
    mask = torch.zeros(case["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    page_size = case["k_cache"].shape[1]
    for b, (start, end) in enumerate(zip(starts, ends)):
        for p in range(start, end):
            if "block_table" in case:
                mask[int(case["block_table"][b, p // page_size]), p % page_size] = True
            else:
                row = int(case["cache_batch_idx"][b]) if "cache_batch_idx" in case else b
                mask[row, p] = True
    return mask


@pytest.mark.parametrize("name, value, window, num_splits", [
    ("k", math.nan, (-1, -1), 3), ("v", math.nan, (-1, 0), 3), ("v", math.inf, (3, 0), 4), ("k", math.inf, (4, 1), 1),
    ("v", math.nan, (2, 2), 1)])
def test_a_non_finite_key_or_value_reaches_exactly_the_rows_that_see_it(name, value, window, num_splits):
    """A NaN or inf at one position of a sequence: the rows whose window holds it are non-finite,
    in the merged output of several splits too (a split that went NaN must not be outweighed or
    dropped by the merge); every other row keeps its bits; the other sequence is untouched."""
    seqlen_q, end, t = 7, 30, 25
    case = make_case(batch=2, seqlen_q=seqlen_q, heads=4, kv_heads=2, capacity=40, seqlens=[end, end],
                     window_size=window, num_splits=num_splits)
    clean_out, clean_lse = attention_with_kvcache(**case, return_softmax_lse=True)
    poisoned = case[f"{name}_cache"].clone()
    poisoned[0, t] = value
    out, lse = attention_with_kvcache(**(case | {f"{name}_cache": poisoned}), return_softmax_lse=True)
    distance = torch.arange(seqlen_q, device=DEVICE) + end - seqlen_q - t
    left, right = window
    sees = (distance >= -right if right >= 0 else True) & (distance <= left if left >= 0 else True)
    sees = torch.as_tensor(sees, device=DEVICE).expand(seqlen_q)
    assert sees.any() and (not sees.all() or window == (-1, -1))
    assert (~torch.isfinite(out[0, sees])).all(), "a row that sees the value should be non-finite in full"
    assert torch.equal(out[0, ~sees], clean_out[0, ~sees]), "a row that does not see the value changed"
    assert torch.equal(out[1], clean_out[1]) and torch.equal(lse[1], clean_lse[1])
    if name == "v":  # lse depends on the keys alone
        assert torch.equal(lse, clean_lse)
    else:
        assert torch.isnan(lse[0].transpose(0, 1)[sees]).all()


def test_exercise_merge_two_partial_attentions_by_their_lses():
    """What the merge kernel does, by hand: attention over positions [0, t) (cache_seqlens = t) and
    over [t, end) (cache_leftpad = t) combine into attention over [0, end) by their log-sum-exps."""
    end, t = 50, 21
    case = make_case(batch=2, seqlen_q=3, heads=4, kv_heads=2, capacity=end)
    first = attention_with_kvcache(**case, cache_seqlens=t, return_softmax_lse=True)
    second = attention_with_kvcache(**case, cache_seqlens=end, cache_leftpad=ints([t, t]), return_softmax_lse=True)
    lse = torch.logaddexp(first[1], second[1])
    weights = [torch.exp(part[1] - lse).transpose(1, 2)[..., None] for part in (first, second)]
    out = weights[0] * first[0].double() + weights[1] * second[0].double()
    whole = attention_with_kvcache(**case, return_softmax_lse=True)
    ref_out, ref_lse = attention_ref(case["q"], case["k_cache"], case["v_cache"])
    assert_close(out, ref_out, 1e-5, "merged out")
    assert_close(lse, ref_lse, 1e-5, "merged lse")
    assert_close(whole[0], ref_out, 1e-5, "out over the whole cache")


def test_noncontiguous_inputs():
    """q a transposed view, the new k and v strided, the caches two views of one (batch, capacity,
    2, kv_heads, d) tensor (the layout of the MHA module's cache): the append writes through them."""
    batch, capacity, kv_heads, heads, head_dim, new = 2, 31, 2, 4, 32, 3
    kv_cache = randn(batch, capacity, 2, kv_heads, head_dim, dtype=torch.bfloat16)
    q = randn(batch, heads, 5, head_dim, dtype=torch.bfloat16).transpose(1, 2)
    kv = randn(batch, new, kv_heads, 2 * head_dim, dtype=torch.bfloat16)
    case = dict(q=q, k_cache=kv_cache[:, :, 0], v_cache=kv_cache[:, :, 1], k=kv[..., ::2], v=kv[..., 1::2],
                cache_seqlens=ints([7, 20]), causal=True, num_splits=2)
    assert not any(case[n].is_contiguous() for n in ("q", "k_cache", "v_cache", "k", "v"))
    expected = check_case(case)  # on copies of the caches
    out = attention_with_kvcache(**case)
    assert torch.equal(out, expected[0])
    _, _, k_after, v_after = kvcache_reference(**reference_arguments(case))
    assert torch.equal(kv_cache[:, :, 0], k_after) and torch.equal(kv_cache[:, :, 1], v_after)


@pytest.mark.parametrize("name, neighbours", [("cache_seqlens", "flipped"), ("cache_leftpad", "flipped"),
                                              ("cache_batch_idx", "padding")])
def test_noncontiguous_index_tensors(name, neighbours):
    """cache_seqlens, cache_leftpad and cache_batch_idx as strided views: a column of a (batch, 2)
    int32 tensor (a per-sequence record), its other column holding other valid values ("flipped":
    the same values reversed, so a misread still passes the range checks and only the output can
    show it) or -1 padding (a misread is refused as out of range). Before the public call copied
    them, the kernels read the neighbours: a wrong output (relative error 0.2-0.5) or a refusal."""
    case = make_case(batch=3, seqlen_q=2, heads=4, kv_heads=2, capacity=37, layout="indexed", seqlens=[9, 30, 17],
                     leftpad=[2, 0, 5], causal=True, num_splits=2)
    index = case[name]
    other = index.flip(0) if neighbours == "flipped" else torch.full_like(index, -1)
    case[name] = every_other(index, other)
    check_case(case)

def test_noncontiguous_rotary_tables_block_table_and_slopes():
    """The tensors test_noncontiguous_inputs passes contiguous, as views: the rotary tables the two
    halves of one (seqlen_ro, rotary_dim / 2, 2) tensor (last stride 2), the block table
    column-major, the ALiBi slopes (batch, heads) a transposed (heads, batch) tensor. Out, lse and
    the caches after the append against float64."""
    case = make_case(batch=2, seqlen_q=3, heads=4, kv_heads=2, capacity=29, layout="paged", page_size=5,
                     seqlens=[4, 17], new=2, rotary_dim=16, rotary_interleaved=False, causal=True, num_splits=2)
    tables = torch.stack([case["rotary_cos"], case["rotary_sin"]], dim=-1)
    case["rotary_cos"], case["rotary_sin"] = tables[..., 0], tables[..., 1]
    case["block_table"] = case["block_table"].t().contiguous().t()
    case["alibi_slopes"] = geometric_alibi_slopes(8, DEVICE)[torch.randperm(8, device=DEVICE)].reshape(4, 2).t()
    assert not any(case[n].is_contiguous() for n in ("rotary_cos", "rotary_sin", "block_table", "alibi_slopes"))
    check_case(case)


def test_empty_inputs():
    """No query: nothing to attend, but the new keys are still appended; a cache of no position."""
    case = make_case(batch=2, seqlen_q=0, capacity=9, seqlens=[1, 4], new=2)
    check_case(case)
    case = make_case(batch=2, seqlen_q=3, capacity=0, seqlens=0)
    out, lse = check_case(case)
    assert not out.any() and torch.all(lse == math.inf)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_no_sequence_and_no_head(layout):
    """A batch of no sequence (with keys to append, in a cache of rows or pages) and sequences of no
    head: empty outputs of the right shapes and the caches untouched (checked by hand: the reference
    takes neither)."""
    for sizes, lse_shape in ((dict(batch=0, seqlens=[]), (0, 4, 1)), (dict(heads=0, kv_heads=0, seqlens=[3, 4]),
                                                                     (2, 0, 1))):
        case = make_case(layout=layout, page_size=4, new=1, **sizes)
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        out, lse = attention_with_kvcache(**case, return_softmax_lse=True)
        assert out.shape == case["q"].shape and lse.shape == lse_shape
        assert torch.equal(case["k_cache"], k_cache) and torch.equal(case["v_cache"], v_cache)


REMEMBERED_CALL_VARIANTS = [
    # each differs from the checked call only where Python's == cannot see it, or in a value
    (dict(causal=1.0), TypeError, "causal must be a bool"),                      # 1.0 == True
    (dict(window_size=(-1.0, -1)), TypeError, "window_size must be a pair of ints"),  # == (-1, -1)
    (dict(num_splits=True), TypeError, "num_splits must be an int"),             # True == 1
    (dict(return_softmax_lse=1.0), TypeError, "return_softmax_lse must be a bool"),
    (dict(cache_seqlens=20), ValueError, r"cache_seqlens \(20\) \+ seqlen_new \(2\) must be between 0"),
]


@pytest.mark.parametrize("changed, error, message", REMEMBERED_CALL_VARIANTS)
def test_a_remembered_call_does_not_let_a_different_one_through(changed, error, message):
    """The public call keeps the checks' verdict for a kind of call (kvcache.call_key): a call that
    differs in what the checks read is checked again, however equal Python finds its arguments."""
    case = make_case(batch=2, capacity=21, seqlens=3, new=2, causal=True, num_splits=1)
    attention_with_kvcache(**case, return_softmax_lse=True)
    with pytest.raises(error, match=message):
        attention_with_kvcache(**(case | dict(return_softmax_lse=True) | changed))


def test_a_remembered_call_does_not_let_other_strides_or_grad_mode_through():
    """Strides are part of a call's kind (an expanded cache cannot take the append), and ALiBi
    slopes that require a gradient are refused under grad mode after a call under no_grad."""
    case = make_case(batch=2, capacity=21, seqlens=[3, 5], new=2)
    check_case(case)
    attention_with_kvcache(**case)  # the same kind of call as the next one but for k_cache's strides
    expanded = case | dict(k_cache=case["k_cache"][:1].expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="k_cache is written in place .* cannot be an expanded view"):
        attention_with_kvcache(**expanded)
    slopes = geometric_alibi_slopes(case["q"].shape[2], device=DEVICE).requires_grad_()
    with torch.no_grad():
        attention_with_kvcache(**make_case(batch=2, capacity=21, seqlens=[3, 5]), alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="alibi_slopes: no gradient"):
        attention_with_kvcache(**make_case(batch=2, capacity=21, seqlens=[3, 5]), alibi_slopes=slopes)


def test_an_unhashable_argument_is_checked_at_every_call():
    case = make_case(batch=2, capacity=21, seqlens=[3, 5], causal=True)
    check_case(case | dict(window_size=[4, 0]))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        attention_with_kvcache(**(case | dict(window_size=[4.0, 0])))


def test_remembered_plans_give_the_same_bits_and_stay_bounded(monkeypatch):
    """Outputs with every plan remembered equal those planned afresh, bit for bit; past
    MAX_REMEMBERED kinds of call the dictionaries start afresh rather than grow."""
    monkeypatch.setattr(split_kv, "MAX_REMEMBERED", 3)
    memos = (kvcache.CHECKED_CALLS, kvcache.PLANS, split_kv.LAUNCH_PLANS)
    for memo in memos:
        memo.clear()
    cases = [make_case(batch=2, capacity=capacity, seqlens=[3, 5], window_size=(4, 0), num_splits=2)
             for capacity in (9, 21, 33, 45, 57)]
    remembered = []
    for case in cases:  # five kinds of call: each dictionary fills to three, starts afresh, fills again
        attention_with_kvcache(**case, return_softmax_lse=True)
        remembered.append(attention_with_kvcache(**case, return_softmax_lse=True))
        assert all(0 < len(memo) <= 3 for memo in memos)
    assert all(len(memo) == 2 for memo in memos)  # 3 kinds, then afresh: kinds 4 and 5
    for case, again in zip(cases, remembered):
        for memo in memos:
            memo.clear()
        fresh = attention_with_kvcache(**case, return_softmax_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(again, fresh))


def test_an_int_cache_seqlens_is_checked_at_every_call_without_a_key_per_value():
    """A decoding loop that passes its position as an int makes one kind of call, not one per
    step, and a position past the cache is still refused."""
    kvcache.CHECKED_CALLS.clear()
    case = make_case(batch=2, capacity=21, new=1)
    for position in (3, 4, 5):
        attention_with_kvcache(**case, cache_seqlens=position)
    assert len(kvcache.CHECKED_CALLS) == 1
    with pytest.raises(ValueError, match=r"cache_seqlens \(21\) \+ seqlen_new \(1\) must be between 0"):
        attention_with_kvcache(**case, cache_seqlens=21)


def test_a_window_given_as_a_tuple_subclass_is_keyed_by_its_elements_types():
    """A namedtuple window (1, 0) equals (True, 0) and (1.0, 0) in Python: after the first is
    remembered, the other two are still refused."""
    Window = collections.namedtuple("Window", "left right")
    case = make_case(batch=2, capacity=21, seqlens=[3, 5])
    attention_with_kvcache(**case, window_size=Window(1, 0))
    for window in (Window(True, 0), Window(1.0, 0)):
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            attention_with_kvcache(**case, window_size=window)


def test_launch_plan_follows_the_float32_matmul_precision():
    """The float32 dot precision is read at every call, not remembered with the plan."""
    q, k_cache = randn(1, 1, 4, 32), randn(1, 16, 2, 32)
    previous = torch.get_float32_matmul_precision()
    try:
        precisions = []
        for setting in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(setting)
            plan = split_kv.launch_plan(q, k_cache, layout="contiguous", leftpad=False, alibi=False,
                                        softmax_scale=0.1, window=(-1, -1), softcap=0.0, num_splits=1, config=None)
            precisions.append(plan.constants["PRECISION"])
    finally:
        torch.set_float32_matmul_precision(previous)
    assert precisions == ["ieee", "tf32", "ieee"]


def test_outputs_never_require_a_gradient():
    """flash_attn's function has no backward pass: neither has this one (outputs without grad_fn)."""
    case = make_case(seqlens=[3, 9], new=1)
    q = case["q"].requires_grad_()
    out = attention_with_kvcache(**case)
    assert not out.requires_grad and out.grad_fn is None and q.grad is None


# --- the interface ------------------------------------------------------------------------------------

def test_signature_is_flash_attn_with_kvcache():
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    expected = [("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty),
                ("v_cache", inspect.Parameter.empty), ("k", None), ("v", None), ("rotary_cos", None),
                ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
                ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
                ("return_softmax_lse", False)]
    got = [(p.name, p.default) for p in inspect.signature(attention_with_kvcache).parameters.values()]
    assert got == expected
    assert all(p.kind == positional for p in inspect.signature(attention_with_kvcache).parameters.values())


def test_positional_call_and_return_conventions():
    """flash_attn's positional order (k, v, rotary_cos, rotary_sin, cache_seqlens ...); out alone
    unless return_softmax_lse."""
    case = make_case(seqlens=[4, 8], new=1)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out = attention_with_kvcache(case["q"], k_cache, v_cache, case["k"], case["v"], None, None,
                                 case["cache_seqlens"])
    assert isinstance(out, torch.Tensor)
    out2, lse = attention_with_kvcache(**case, return_softmax_lse=True)
    assert torch.equal(out, out2) and lse.shape == (2, 4, 1)


BAD_INPUTS = [
    (lambda c: dict(q=c["q"].numpy(force=True)), TypeError, "q must be a torch.Tensor"),
    (lambda c: dict(q=c["q"].double()), TypeError, "q must have dtype"),
    (lambda c: dict(k_cache=c["k_cache"].half()), TypeError, "k_cache must have the dtype of q"),
    (lambda c: dict(v_cache=c["v_cache"][0]), ValueError, "v_cache must have 4 dimensions"),
    (lambda c: dict(v_cache=c["v_cache"][:, :5]), ValueError, "v_cache must have the shape of k_cache"),
    (lambda c: dict(k_cache=c["k_cache"][..., :16], v_cache=c["v_cache"][..., :16]), ValueError,
     "k_cache must have shape .* head_dim=32"),
    (lambda c: dict(q=c["q"][:, :, :3]), ValueError, "kv_heads of k_cache and v_cache .2. must divide"),
    (lambda c: dict(k_cache=c["k_cache"][:1], v_cache=c["v_cache"][:1]), ValueError,
     "k_cache must have a row for each of the 2 sequences of q"),
    (lambda c: dict(q=c["q"][..., :8], k_cache=c["k_cache"][..., :8], v_cache=c["v_cache"][..., :8]), ValueError,
     "head_dim .* between 16 and 256"),
    (lambda c: dict(k=c["k"], v=None), ValueError, "k and v must be given together; got k alone"),
    (lambda c: dict(k=c["k"].half(), v=c["v"]), TypeError, "k must have the dtype of q"),
    (lambda c: dict(k=c["k"][:, :, :1], v=c["v"][:, :, :1]), ValueError, r"k must have shape \(batch=2, seqlen_new"),
    (lambda c: dict(k=c["k"], v=c["v"][:, :1]), ValueError, "v must have the shape of k"),
    (lambda c: dict(k=c["k"], v=c["v"], cache_seqlens=None), ValueError, "cache_seqlens must be given with k and v"),
    (lambda c: dict(cache_seqlens=c["cache_seqlens"].long()), TypeError, "cache_seqlens must have dtype int32"),
    (lambda c: dict(cache_seqlens=c["cache_seqlens"][:1]), ValueError, r"cache_seqlens must have shape \(2,\)"),
    (lambda c: dict(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int or an int32 tensor"),
    (lambda c: dict(cache_seqlens=-1), ValueError, r"cache_seqlens \(-1\) \+ seqlen_new \(0\) must be between 0"),
    (lambda c: dict(k=c["k"], v=c["v"], cache_seqlens=20), ValueError,
     r"cache_seqlens \(20\) \+ seqlen_new \(2\) must be between 0 and the cache's capacity \(21\)"),
    (lambda c: dict(cache_batch_idx=c["cache_seqlens"].long()), TypeError, "cache_batch_idx must have dtype int32"),
    (lambda c: dict(cache_leftpad=ints([0, 0, 0])), ValueError, "cache_leftpad must have shape"),
    (lambda c: dict(block_table=ints([0, 1])), ValueError, "block_table must have 2 dimensions"),
    (lambda c: dict(block_table=ints([[0, 1]])), ValueError, r"block_table must have shape \(batch=2"),
    (lambda c: dict(block_table=ints([[0], [1]]), cache_batch_idx=ints([0, 1])), ValueError,
     "cache_batch_idx cannot be combined with block_table"),
    (lambda c: dict(block_table=ints([[0], [1]]), k_cache=c["k_cache"][:0], v_cache=c["v_cache"][:0]), ValueError,
     "k_cache holds no page"),
    (lambda c: dict(rotary_cos=c["cos"]), ValueError, "rotary_cos and rotary_sin must be given together"),
    (lambda c: dict(rotary_cos=c["cos"], rotary_sin=c["cos"]), ValueError, "rotary_cos and rotary_sin rotate the new"),
    (lambda c: dict(k=c["k"], v=c["v"], rotary_cos=c["cos"], rotary_sin=c["cos"][:-1]), ValueError,
     "rotary_sin must have the shape of rotary_cos"),
    (lambda c: dict(k=c["k"], v=c["v"], rotary_cos=c["cos"][:, :0], rotary_sin=c["cos"][:, :0]), ValueError,
     r"rotary_cos must have shape \(seqlen_ro, rotary_dim / 2\)"),
    (lambda c: dict(k=c["k"], v=c["v"], rotary_cos=c["cos"].repeat(1, 9), rotary_sin=c["cos"].repeat(1, 9)),
     ValueError, r"2 <= rotary_dim <= head_dim \(32\)"),
    (lambda c: dict(k=c["k"], v=c["v"], rotary_cos=c["cos"][:20], rotary_sin=c["cos"][:20]), ValueError,
     r"seqlen_ro \(20\) must be at least the cache's capacity \(21\)"),
    (lambda c: dict(num_splits=129), ValueError, "num_splits must be between 0 .* and 128"),
    (lambda c: dict(num_splits=-1), ValueError, "num_splits must be between"),
    (lambda c: dict(num_splits=2.0), TypeError, "num_splits must be an int"),
    (lambda c: dict(num_splits=True), TypeError, "num_splits must be an int"),
    (lambda c: dict(softcap="1"), TypeError, "softcap must be a real number"),
    (lambda c: dict(softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
    (lambda c: dict(causal=0.0), TypeError, "causal must be a bool"),
    (lambda c: dict(window_size=(-1.0, -1)), TypeError, "window_size must be a pair of ints"),
    (lambda c: dict(rotary_interleaved=None), TypeError, "rotary_interleaved must be a bool"),
    (lambda c: dict(return_softmax_lse="yes"), TypeError, "return_softmax_lse must be a bool"),
    (lambda c: dict(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, "alibi_slopes must have shape"),
    (lambda c: dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a tensor or None"),
    (lambda c: dict(k=c["k"], v=c["v"], k_cache=c["k_cache"][:1].expand(2, -1, -1, -1)), ValueError,
     "k_cache is written in place .* cannot be an expanded view"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(build, error, message, no_launch):
    case = make_case(batch=2, capacity=21, seqlens=[3, 5], new=2, rotary_dim=4)
    case["cos"] = case.pop("rotary_cos")
    del case["rotary_sin"]
    base = dict(q=case["q"], k_cache=case["k_cache"], v_cache=case["v_cache"], cache_seqlens=case["cache_seqlens"])
    with pytest.raises(error, match=message):
        attention_with_kvcache(**(base | build(case)))


OUT_OF_RANGE = [
    (dict(cache_seqlens=[3, 20]), r"cache_seqlens \+ seqlen_new \(2\) must be between 0 and the cache's capacity"),
    (dict(cache_seqlens=[-1, 3]), r"cache_seqlens \+ seqlen_new \(2\) must be between 0"),
    (dict(cache_leftpad=[4, 0]), "cache_leftpad must be between 0 and cache_seqlens"),
    (dict(cache_batch_idx=[0, 4]), r"cache_batch_idx must index the rows of k_cache \(0 <= index < 4\)"),
    (dict(cache_batch_idx=[-1, 1]), "cache_batch_idx must index"),
    (dict(block_table=[[0, 1, 2], [9, 4, 3]]), r"block_table's entries .* \(0 <= entry < 8\)"),
]


@pytest.mark.parametrize("indices, message", OUT_OF_RANGE)
def test_out_of_range_indices_raise(indices, message):
    """Index tensors that point past the cache are refused (on the GPU asynchronously, with the
    same message), before anything is written."""
    paged = "block_table" in indices
    case = make_case(batch=2, capacity=21, layout="paged" if paged else "indexed" if "cache_batch_idx" in indices
                     else "contiguous", page_size=7, seqlens=[3, 5], new=2)
    if paged:
        case["k_cache"], case["v_cache"] = case["k_cache"][:8], case["v_cache"][:8]
    case |= {name: ints(value) for name, value in indices.items()}
    if ON_GPU:
        assert_refused_in_a_child_process("attention_with_kvcache", message, **case)
        return
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        attention_with_kvcache(**case)
    assert torch.equal(case["k_cache"], k_cache) and torch.equal(case["v_cache"], v_cache), \
        "nothing is written when an index is out of range"


def test_rotary_positions_past_the_table_raise():
    """Queries rotated per row at cache_seqlens + i need seqlen_ro >= cache_seqlens + seqlen_q: the fifth
    index check, refused like the others (nothing written), and the last start that fits accepted."""
    case = make_case(batch=2, seqlen_q=3, capacity=21, seqlens=[3, 19], new=2, rotary_dim=8, causal=True)
    case["rotary_cos"], case["rotary_sin"] = case["rotary_cos"][:21], case["rotary_sin"][:21]
    message = r"rotary_cos and rotary_sin need a row for every query position.*seqlen_ro \(21\)"
    if ON_GPU:
        assert_refused_in_a_child_process("attention_with_kvcache", message, **case)
    else:
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        with pytest.raises(RuntimeError, match=message):
            attention_with_kvcache(**case)
        assert torch.equal(case["k_cache"], k_cache) and torch.equal(case["v_cache"], v_cache)
    check_case(case | dict(cache_seqlens=ints([3, 18])))


def test_index_check_kernel_reads_every_sequence_and_every_page_it_holds():
    """The check kernel walks the batch and the block table in tiles of 64: an index out of range
    in the last sequence of a batch of 70, or in the last page it holds of a 70-page table, fails
    its check and only its check; an entry past the pages a sequence holds is not read."""
    batch, pages, page_size, rows = 70, 70, 3, 500
    seqlens = torch.full((batch,), pages * page_size - 1, **INT32)
    leftpad = torch.zeros(batch, **INT32)
    batch_idx = torch.arange(batch, **INT32)
    table = torch.randint(0, rows, (batch, pages), **INT32)

    def flags(**changed):
        args = dict(cache_seqlens=seqlens, cache_leftpad=leftpad, cache_batch_idx=batch_idx, block_table=table)
        args |= changed
        return index_flags(batch=batch, capacity=pages * page_size, new=1, cache_rows=rows, page_size=page_size,
                           rotary_limit=pages * page_size - 1, **args).tolist()

    def with_entry(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    assert flags() == [1, 1, 1, 1, 1]
    assert flags(cache_seqlens=with_entry(seqlens, -1, pages * page_size)) == [0, 1, 1, 1, 0]
    assert flags(cache_leftpad=with_entry(leftpad, -1, -1)) == [1, 0, 1, 1, 1]
    assert flags(cache_batch_idx=with_entry(batch_idx, -1, rows)) == [1, 1, 0, 1, 1]
    assert flags(block_table=with_entry(table, (batch - 1, pages - 1), rows)) == [1, 1, 1, 0, 1]
    shorter = with_entry(seqlens, -1, 10)  # the last sequence holds positions [0, 11): pages 0-3
    assert flags(cache_seqlens=shorter, block_table=with_entry(table, (batch - 1, 4), -1)) == [1, 1, 1, 1, 1]
    assert flags(cache_seqlens=shorter, block_table=with_entry(table, (batch - 1, 3), -1)) == [1, 1, 1, 0, 1]


def test_block_table_entries_past_a_sequence_are_not_checked():
    """Pages a sequence does not reach may hold anything (a server's -1 padding)."""
    case = make_case(batch=2, capacity=21, layout="paged", page_size=7, seqlens=[3, 8], new=1)
    case["block_table"][0, 1:] = -1
    case["block_table"][1, 2] = 10 ** 6
    check_case(case)


def test_default_splits_fill_the_gpu_only_when_the_batch_does_not(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(split_kv, "sm_count", lambda: 132)
    assert split_kv.default_splits(64, 8, 131072, cuda, block_n=64) == 1       # 512 programs already
    assert split_kv.default_splits(16, 8, 131072, cuda, block_n=64) == 2       # 128: fewer than two per SM
    assert split_kv.default_splits(4, 8, 131072, cuda, block_n=64) == 8        # 256 programs, not 288
    assert split_kv.default_splits(1, 8, 131072, cuda, block_n=64) == 33       # two programs per SM
    assert split_kv.default_splits(1, 1, 131072, cuda, block_n=64) == 128      # capped
    assert split_kv.default_splits(1, 8, 100, cuda, block_n=64) == 1           # two key blocks: no split
    assert split_kv.default_splits(1, 8, 512, cuda, block_n=64) == 4           # at least two blocks each
    assert split_kv.default_splits(1, 8, 131072, torch.device("cpu"), block_n=64) == 1


def test_key_tiles_fit_in_shared_memory():
    """The pipeline's key and value buffers fit in the budget at every head dim and dtype, split or
    not, with the largest key tile that fits (the sizes behind the GPU sweep's seed 723150 and the
    unsplit 128-key tiles)."""
    def buffers(config, head_dim, dtype):
        return ((config["num_stages"] - 1) * config["BLOCK_N"] * 2 * split_kv.block_size(head_dim)
                * torch.finfo(dtype).bits // 8)

    for base in (split_kv.SPLIT_CONFIG, split_kv.UNSPLIT_CONFIG):
        for dtype in FLOAT_DTYPES:
            for head_dim in range(16, 257, 8):
                fitted = split_kv.fit_shared_memory(base, head_dim, dtype)
                assert {k: v for k, v in fitted.items() if k != "BLOCK_N"} == \
                    {k: v for k, v in base.items() if k != "BLOCK_N"}
                assert buffers(fitted, head_dim, dtype) <= split_kv.TILE_BUFFER_BYTES
                assert fitted["BLOCK_N"] == base["BLOCK_N"] or \
                    buffers(dict(fitted, BLOCK_N=2 * fitted["BLOCK_N"]), head_dim, dtype) > split_kv.TILE_BUFFER_BYTES
    assert split_kv.fit_shared_memory(split_kv.SPLIT_CONFIG, 203, torch.float32)["BLOCK_N"] == 32
    assert split_kv.fit_shared_memory(split_kv.SPLIT_CONFIG, 256, torch.bfloat16)["BLOCK_N"] == 64
    assert split_kv.fit_shared_memory(split_kv.UNSPLIT_CONFIG, 128, torch.bfloat16)["BLOCK_N"] == 128
    assert split_kv.fit_shared_memory(split_kv.UNSPLIT_CONFIG, 256, torch.bfloat16)["BLOCK_N"] == 64


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.skipif(not ON_GPU, reason="offsets past 2^31 need caches of billions of elements")
@pytest.mark.parametrize("layout", ["indexed", "paged"])
def test_cache_offsets_past_2_31_elements(layout):
    """A sequence whose keys lie past element 2^31 of its cache (cache row 2 of 2^20 positions, or
    pages from number 2^13 on, of 2^18 elements each): the offsets are formed in int64, the append
    lands there too. About 13 GiB of bfloat16 caches."""
    kv_heads, head_dim, length = 8, 128, 4000
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    if layout == "indexed":
        shape, place = (3, 1 << 20, kv_heads, head_dim), dict(cache_batch_idx=ints([2]))
    else:
        pages = -(-(length + 1) // 256)
        shape, place = ((1 << 13) + pages, 256, kv_heads, head_dim), dict(block_table=ints([[(1 << 13) + i for i in
                                                                                              range(pages)]]))
    k_cache, v_cache = torch.randn(shape, **bf16), torch.randn(shape, **bf16)
    q, k, v = torch.randn(1, 1, 32, head_dim, **bf16), torch.randn(1, 1, kv_heads, head_dim, **bf16), \
        torch.randn(1, 1, kv_heads, head_dim, **bf16)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=ints([length]), num_splits=4,
                                      return_softmax_lse=True, **place)
    if layout == "indexed":
        keys, values = k_cache[2:3, :length + 1], v_cache[2:3, :length + 1]
    else:
        keys, values = (t[(1 << 13):].flatten(0, 1)[None, :length + 1] for t in (k_cache, v_cache))
    assert torch.equal(keys[0, length], k[0, 0]) and torch.equal(values[0, length], v[0, 0])
    ref_out, ref_lse = attention_ref(q, keys, values)
    same_out, same_lse = naive_attention(q, keys, values)
    assert_within_same_computation("out", out, same_out, ref_out, torch.bfloat16)
    assert_within_same_computation("lse", lse, same_lse, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("softmax_scale", [-0.5, 0.0])
def test_softmax_scale_negative_and_zero(softmax_scale):
    """A scale <= 0 takes the kernels' SCALE_FIRST path (the drawn cases never draw a negative one)."""
    check_case(make_case(batch=2, seqlen_q=3, capacity=29, seqlens=[7, 20], new=2, causal=True,
                         softmax_scale=softmax_scale, num_splits=2))


@pytest.mark.parametrize("causal", [False, True])
def test_window_sides_at_or_past_the_capacity_are_unbounded(causal):
    """flash_attn reads a side >= the cache's capacity (33 here) as -1: (33, 40) is full attention, so the
    queries rotate at cache_seqlens (all alike) unless causal. The reference's window is written out,
    not taken from resolve_window (which reference_arguments uses)."""
    case = make_case(batch=2, seqlen_q=4, heads=2, kv_heads=1, capacity=33, seqlens=[5, 20], new=2, rotary_dim=32,
                     causal=causal, window_size=(33, 40))
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out, lse = attention_with_kvcache(**(case | dict(k_cache=k_cache, v_cache=v_cache)), return_softmax_lse=True)
    args = {n: v for n, v in case.items() if n not in ("window_size", "num_splits")}
    window = (-1, 0) if causal else (-1, -1)
    ref_out, ref_lse, _, _ = kvcache_reference(**args, window=window)
    same_out, same_lse, _, _ = kvcache_reference(**args, window=window, attend=naive_attention)
    assert_within_same_computation("out", out, same_out, ref_out, torch.float32)
    assert_within_same_computation("lse", lse, same_lse, ref_lse, torch.float32)


# --- torch.library, torch.compile, CUDA graphs -----------------------------------------------------

def op_arguments(case, window=(-1, -1), rotate_per_row=False, num_splits=2):
    return (case["q"], case["k_cache"], case["v_cache"], case.get("k"), case.get("v"), case.get("rotary_cos"),
            case.get("rotary_sin"), case.get("cache_seqlens"), case.get("cache_batch_idx"), case.get("cache_leftpad"),
            case.get("block_table"), 0.25, *window, 0.0, True, rotate_per_row, case.get("alibi_slopes"), num_splits)


@pytest.mark.parametrize("layout, new, rotary", [("contiguous", 2, True), ("paged", 1, False), ("indexed", 0, False)])
def test_opcheck(layout, new, rotary):
    case = make_case(batch=2, seqlen_q=2, capacity=15, layout=layout, page_size=4, seqlens=[3, 9], new=new,
                     rotary_dim=8 if rotary else 0, leftpad=[1, 2])
    torch.library.opcheck(attention_with_kvcache_op, op_arguments(case, (-1, 0), rotate_per_row=True))


def test_opcheck_strided_q():
    """The fake function's out has the real one's (contiguous) strides when q is a transposed view."""
    case = make_case(batch=2, seqlen_q=3, capacity=15, seqlens=[3, 9], new=1)
    case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not case["q"].is_contiguous()
    torch.library.opcheck(attention_with_kvcache_op, op_arguments(case))


def test_torch_compile_fullgraph_matches_eager():
    """Traced without a graph break; out, lse and the caches after the append equal eager's."""
    torch._dynamo.reset()
    case = make_case(batch=2, seqlen_q=2, capacity=23, layout="paged", page_size=4, seqlens=[3, 12], new=2,
                     rotary_dim=8, causal=True, leftpad=[1, 0], num_splits=3, softcap=5.0)

    def step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, block_table):
        return attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                      cache_leftpad=cache_leftpad, block_table=block_table, causal=True,
                                      softcap=5.0, num_splits=3, return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    names = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_leftpad",
             "block_table")
    results = []
    for fn in (compiled, step):
        args = [case[n].clone() for n in names]
        results.append((*fn(*args), args[1], args[2]))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_cuda_graph_capture_replays_decoding_steps():
    """A decoding step captured once and replayed: each replay appends at the cache_seqlens the
    tensor holds then, as eager calls do."""
    case = make_case(batch=2, seqlen_q=1, heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16, capacity=300,
                     seqlens=[10, 200], new=1, causal=True, num_splits=4)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    seqlens = case["cache_seqlens"].clone()
    static = dict(case, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attention_with_kvcache(**(static | dict(k_cache=k_cache.clone(), v_cache=v_cache.clone())))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_with_kvcache(**static)
    eager_k, eager_v = case["k_cache"].clone(), case["v_cache"].clone()
    for step in range(3):
        k_cache.copy_(eager_k)
        v_cache.copy_(eager_v)
        graph.replay()
        want = attention_with_kvcache(**(static | dict(k_cache=eager_k, v_cache=eager_v)))
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(k_cache, eager_k), f"step {step}"
        seqlens += 1
