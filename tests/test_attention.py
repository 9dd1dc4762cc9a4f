"""Chapter 7's attention against float64: output, log-sum-exp, the three gradients, flash_attn's
interface, bad inputs.

The bound is the rule of :mod:`mamba_annotated.testing`: the kernel's relative error against the
float64 reference is at most twice the error of the same attention computed naively by PyTorch in
the input dtype (plus a tiny floor, for cases where PyTorch happens to be exact).
"""
import inspect
import math

import pytest
import torch
import triton
import triton.language as tl

from mamba_annotated.attention import api, attention
from mamba_annotated.attention.api import attention_op
from mamba_annotated.attention.reference import (attention_logits, attention_ref, causal_mask, geometric_alibi_slopes,
                                                 naive_attention, window_mask)
from mamba_annotated.attention.scores import tanh
from mamba_annotated.attention.teaching import attention_variant
from mamba_annotated.runtime import DEVICE
from mamba_annotated.testing import (FLOAT_DTYPES, assert_close, assert_within_same_computation, gradients, randn,
                                     rel_error)

ON_GPU = DEVICE.type == "cuda"

# (seqlen_q, seqlen_k, head_dim): lengths that are not multiples of a block, one query, one key,
# more queries than keys (causal rows that see nothing), head dims that are not powers of two.
if ON_GPU:
    SHAPES = [(1, 1, 64), (113, 203, 80), (1023, 203, 96), (4097, 4097, 128)]
else:
    SHAPES = [(1, 1, 16), (17, 17, 24), (113, 113, 16), (47, 113, 40), (113, 47, 16)]


def make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype):
    q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype)
    v = randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype)
    return q, k, v


DROPOUT_SEED = 20261123


def seeded_attention(q, k, v, *args, **kwargs):
    """attention after torch.manual_seed(DROPOUT_SEED): every call draws the same dropout mask."""
    torch.manual_seed(DROPOUT_SEED)
    return attention(q, k, v, *args, **kwargs)


def check_all(q, k, v, causal, softmax_scale=None, backward="split", factor=2.0, **features):
    """Output, lse and dq, dk, dv of the kernel against float64, bounded by PyTorch in q's dtype.
    ``features``: window_size, softcap, alibi_slopes, dropout_p (production schedule only). With
    dropout, the references apply the mask the kernel marks in S_dmask, whose probabilities are
    checked too; every call of the kernel is seeded alike, so forward and backward draw that mask.
    ``factor``: the bound, a multiple of PyTorch's error (the chapter's rule is 2)."""
    dtype = q.dtype
    reference_features = dict(features)
    if "window_size" in features:  # the reference takes the window as flash_attn resolves it
        reference_features["window"] = api.resolve_window(causal, reference_features.pop("window_size"), k.shape[1])
    if features.get("dropout_p", 0.0) > 0:
        out, lse, s_dmask = seeded_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                             return_attn_probs=True, **features)
        logit_features = {name: value for name, value in reference_features.items() if name != "dropout_p"}
        ref_probs = torch.softmax(attention_logits(q.double(), k.double(), causal, softmax_scale,
                                                   **logit_features), -1).nan_to_num(0.0)
        same_probs = torch.softmax(attention_logits(q, k, causal, softmax_scale, **logit_features), -1).nan_to_num(0.0)
        assert s_dmask.shape == ref_probs.shape and s_dmask.dtype == dtype
        assert_within_same_computation("S_dmask", s_dmask.abs(), same_probs, ref_probs, dtype, factor)
        reference_features["dropout_mask"] = s_dmask >= 0
    else:
        out, lse = attention(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True, **features)
    ref_out, ref_lse = attention_ref(q, k, v, causal, softmax_scale, **reference_features)
    same_out, same_lse = naive_attention(q, k, v, causal, softmax_scale, **reference_features)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_within_same_computation("out", out, same_out, ref_out, dtype, factor)
    assert_within_same_computation("lse", lse, same_lse, ref_lse, dtype, factor)

    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    if features:
        ours = gradients(lambda q, k, v: seeded_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                          **features), inputs, grad_out)
    else:
        ours = gradients(lambda q, k, v: attention_variant(q, k, v, causal, softmax_scale, backward=backward),
                         inputs, grad_out)
    same = gradients(lambda q, k, v: naive_attention(q, k, v, causal, softmax_scale, **reference_features)[0],
                     inputs, grad_out)
    ref64 = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    ref = gradients(lambda q, k, v: attention_ref(q, k, v, causal, softmax_scale, **reference_features)[0],
                    ref64, grad_out)
    for name in ("q", "k", "v"):
        assert ours[name].dtype == dtype
        assert_within_same_computation(f"grad {name}", ours[name], same[name], ref[name], dtype, factor)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", SHAPES)
def test_forward_lse_and_gradients(seqlen_q, seqlen_k, head_dim, causal, dtype):
    heads, kv_heads = (4, 2) if ON_GPU else (2, 1)  # grouped-query attention
    check_all(*make_qkv(2 if ON_GPU else 1, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim", [16, 256])
def test_smallest_and_largest_head_dims(head_dim, dtype):
    seqlen_q, seqlen_k = (203, 1023) if ON_GPU else (17, 29)
    check_all(*make_qkv(1, seqlen_q, seqlen_k, 2, 1, head_dim, dtype), causal=True)


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (3, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_groupings(heads, kv_heads, causal):
    n = 257 if ON_GPU else 33
    check_all(*make_qkv(2 if ON_GPU else 1, n, n + 7, heads, kv_heads, 32, torch.bfloat16), causal)


@pytest.mark.parametrize("backward, causal, dtype", [
    ("fused", False, torch.float32), ("fused", True, torch.bfloat16),
    ("atomic", False, torch.bfloat16), ("atomic", True, torch.float32)])
def test_teaching_backward_kernels(backward, causal, dtype):
    seqlen_q, seqlen_k = (1023, 777) if ON_GPU else (45, 33)
    check_all(*make_qkv(1, seqlen_q, seqlen_k, 4, 2, 48, dtype), causal, backward=backward)


@pytest.mark.parametrize("softmax_scale, causal, dtype", [
    (2.0, False, torch.float32), (0.0, False, torch.float32), (0.0, True, torch.bfloat16),
    (-0.7, False, torch.bfloat16), (-0.7, True, torch.float32)])
def test_softmax_scale_zero_and_negative_included(softmax_scale, causal, dtype):
    """The forward pass took the row maximum of the raw scores and scaled it afterwards: with a
    scale of 0, -inf * 0 made every output NaN; with a negative one the maximum became a minimum."""
    n = 300 if ON_GPU else 29
    check_all(*make_qkv(1, n + 5 * causal, n, 2, 1, 32, dtype), causal, softmax_scale=softmax_scale)



# --- local attention, soft-capping, ALiBi ------------------------------------------------------------

def alibi(*shape):
    """Slopes as in ALiBi's geometric series, shuffled so that heads differ in order too."""
    n = math.prod(shape)
    return geometric_alibi_slopes(n, DEVICE)[torch.randperm(n, device=DEVICE)].reshape(shape)


# (seqlen_q, seqlen_k): square, more keys than queries, more queries than keys (rows that see nothing)
WINDOW_SHAPES = [(257, 257), (203, 1023), (1023, 203)] if ON_GPU else [(45, 45), (29, 77), (77, 29)]


@pytest.mark.parametrize("window_size, causal", [
    ((5, 3), False), ((9, -1), False), ((-1, 6), False), ((0, 0), False), ((7, 2), True), ((40, 40), False)])
@pytest.mark.parametrize("seqlen_q, seqlen_k", WINDOW_SHAPES)
def test_sliding_window(window_size, causal, seqlen_q, seqlen_k):
    """Windows narrower and wider than a block, one side bounded, the diagonal alone, with causal."""
    check_all(*make_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, torch.float32), causal, window_size=window_size)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_window_in_every_dtype(dtype, causal):
    n = 1000 if ON_GPU else 61
    check_all(*make_qkv(2, n, n + 3, 4, 2, 40, dtype), causal, window_size=(n // 7, n // 11))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("softcap, softmax_scale", [(1.5, None), (30.0, 2.0), (4.0, -0.5)])
def test_softcap(softcap, softmax_scale, dtype):
    """A small cap saturates tanh (its derivative near 0 in the backward pass); a large one barely
    bends the scores; a negative scale goes through tanh as well."""
    n = 300 if ON_GPU else 37
    check_all(*make_qkv(1, n, n + 8, 2, 2, 32, dtype), False, softmax_scale=softmax_scale, softcap=softcap)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("softcap, causal", [(30.0, False), (50.0, True)])
def test_softcap_saturated(softcap, causal, dtype):
    """Caps of the size models use (Gemma 2: 50) on scores of that size, so that tanh saturates:
    on a GPU, 16-bit inputs go through the hardware's approximate tanh, whose error moves a
    saturated logit by up to softcap * 2^-11.

    In float32 the bound is 3 x PyTorch's error, not 2. The kernels take exponentials base 2, so a
    logit of about 50 is held as about 72 (50 log2 e), where float32's spacing is 1.4 times as
    coarse in natural units, and the backward pass rounds there twice (the rebuilt logit and the
    row's lse in base 2) where PyTorch rounds once, at 50. On the CPU the ratio of the errors was
    below 1.2 for most of 64 draws and 1.84 at worst; one draw in a CI run reached 2.11 (grad k).
    Rebuilding P from fma(tanh, cap2, -lse2) would remove one of the two roundings (not done)."""
    n = 300 if ON_GPU else 37
    q, k, v = make_qkv(1, n, n + 5, 4, 2, 32, dtype)
    q = (q.float() * 2.0 * softcap).to(dtype)  # scores of about 2 softcap: tanh(2) = 0.96
    check_all(q, k, v, causal, factor=3.0 if dtype == torch.float32 else 2.0, softcap=softcap)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(per_batch, causal, dtype):
    batch, heads = 2, 4
    n = 400 if ON_GPU else 41
    slopes = alibi(batch, heads) if per_batch else alibi(heads)
    check_all(*make_qkv(batch, n - 9, n, heads, 2, 32, dtype), causal, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seqlen_q, seqlen_k", WINDOW_SHAPES)
def test_every_feature_together(seqlen_q, seqlen_k, dtype):
    """Causal + window + softcap + ALiBi + grouped-query heads + odd lengths + a head dim that is
    not a power of two."""
    check_all(*make_qkv(2, seqlen_q, seqlen_k, 6, 2, 24, dtype), True, softcap=6.0, window_size=(13, 5),
              alibi_slopes=alibi(2, 6))


# --- dropout -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout(causal, dtype):
    """Output, lse and gradients against float64 with the mask the kernel marks in S_dmask."""
    n = 300 if ON_GPU else 37
    check_all(*make_qkv(2, n, n + 11, 4, 2, 40, dtype), causal, dropout_p=0.17)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seqlen_q, seqlen_k", WINDOW_SHAPES)
def test_dropout_with_every_other_feature(seqlen_q, seqlen_k, dtype):
    check_all(*make_qkv(2, seqlen_q, seqlen_k, 6, 2, 24, dtype), True, softcap=6.0, window_size=(13, 5),
              alibi_slopes=alibi(2, 6), dropout_p=0.4)


def marked_probabilities(dropout_p, causal=False, seqlen_q=None, seqlen_k=None, window_size=(-1, -1)):
    n = 256 if ON_GPU else 64
    q, k, v = make_qkv(2, seqlen_q or n, seqlen_k or n, 4, 2, 16, torch.float32)
    return attention(q, k, v, dropout_p, causal=causal, window_size=window_size, return_attn_probs=True)[2]


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_dropout_keeps_each_probability_with_probability_one_minus_p(dropout_p):
    """The fraction kept is 1 - p within 5 standard deviations, overall and in every (batch, head);
    masks of different heads, batch rows and query rows are not copies of one another (they agree
    on about p^2 + (1 - p)^2 of the pairs, as independent draws do)."""
    keep = marked_probabilities(dropout_p) >= 0
    count = keep[0, 0].numel()
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / count)
    kept = keep.double().mean(dim=(-1, -2))
    assert ((kept - (1 - dropout_p)).abs() < 5 * sigma).all(), kept
    agree = dropout_p ** 2 + (1 - dropout_p) ** 2
    sigma_agree = math.sqrt(agree * (1 - agree) / count)
    for a, b in ((keep[0, 0], keep[0, 1]), (keep[0, 0], keep[1, 0]), (keep[0, 0, :-1], keep[0, 0, 1:])):
        assert abs((a == b).double().mean().item() - agree) < 5 * sigma_agree


def test_dropout_marks_zero_outside_the_window_and_rows_sum_to_one():
    s_dmask = marked_probabilities(0.3, seqlen_q=77, seqlen_k=50, window_size=(9, 4)).double()
    hidden = ~window_mask(77, 50, (9, 4), DEVICE)
    assert (s_dmask[..., hidden] == 0).all()
    sums = s_dmask.abs().sum(-1)
    sees_a_key = (~hidden).any(-1)  # the first rows of a window off the keys see none
    assert_close(sums[..., sees_a_key], torch.ones_like(sums[..., sees_a_key]), 1e-5)
    assert (sums[..., ~sees_a_key] == 0).all()


def test_dropout_is_reproduced_by_the_seed_and_fresh_at_every_call():
    """torch.manual_seed fixes the mask (outputs and gradients bitwise equal); the next call draws a
    new one."""
    n = 512 if ON_GPU else 40
    q, k, v = make_qkv(1, n, n, 2, 1, 16, torch.bfloat16)
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    runs = [gradients(lambda q, k, v: seeded_attention(q, k, v, dropout_p=0.2, causal=True), inputs, grad_out)
            for _ in range(2)]
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), f"grad {name} changed with the same seed"
    torch.manual_seed(DROPOUT_SEED)
    first, second = (attention(q.detach(), k.detach(), v.detach(), 0.2, causal=True) for _ in range(2))
    assert not torch.equal(first, second)
    assert torch.equal(first, seeded_attention(q.detach(), k.detach(), v.detach(), dropout_p=0.2, causal=True))


@pytest.mark.parametrize("shape", [dict(seqlen_q=0), dict(seqlen_k=0)])
def test_dropout_on_empty_inputs(shape):
    sizes = dict(batch=1, seqlen_q=5, seqlen_k=7, heads=2, kv_heads=1, head_dim=16) | shape
    q, k, v = make_qkv(*sizes.values(), torch.float32)
    out, lse, s_dmask = attention(q, k, v, 0.5, return_attn_probs=True)
    assert out.shape == q.shape and (out == 0).all()
    assert s_dmask.shape == (1, 2, sizes["seqlen_q"], sizes["seqlen_k"])


def test_window_skips_key_blocks_it_does_not_cover():
    """Skipped, not masked: keys far outside every row's window hold NaN, which a masked-out but
    loaded block would still carry into out (0 * NaN) and into the gradients."""
    seqlen_q, seqlen_k, window = (128, 4096, (64, 64)) if ON_GPU else (16, 256, (8, 8))
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, torch.float32)
    # the lowest key any row sees is seqlen_k - seqlen_q - window[0]; every key over a block below it is poisoned
    poisoned = seqlen_k - seqlen_q - window[0] - (128 if ON_GPU else 32)
    k[:, :poisoned], v[:, :poisoned] = math.nan, math.nan
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, window_size=window, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    sl = slice(poisoned, None)
    ref_out, ref_lse = attention_ref(q, k[:, sl], v[:, sl], window=window)  # the same distances
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
    assert torch.isfinite(dq).all() and torch.isfinite(dk[:, sl]).all() and torch.isfinite(dv[:, sl]).all()
    assert not dk[:, :poisoned].nan_to_num(1.0).any() and not dv[:, :poisoned].nan_to_num(1.0).any()


@pytest.mark.parametrize("window, value", [((-1, 0), math.nan), ((3, 0), math.inf), ((4, 2), math.nan)])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(window, value):
    """A NaN or inf in v at key t: the rows whose window holds t become NaN; every other row keeps
    its bits. In the masked blocks p = 0 for the hidden keys, but 0 x NaN = NaN in p @ v, which
    poisoned the earlier rows of the diagonal block (found on the H100 by the reliability step)."""
    t, length = 10, 19 if not ON_GPU else 200
    q, k, v = make_qkv(1, length, length, 2, 1, 32, torch.float16)
    clean = attention(q, k, v, window_size=window)
    v = v.clone()
    v[:, t] = value
    out = attention(q, k, v, window_size=window)
    seen = window_mask(length, length, window)[:, t]
    assert (~torch.isfinite(out[:, seen])).all(-1).all(), "a row that sees the value should be NaN"
    assert torch.equal(out[:, ~seen], clean[:, ~seen]), "a row that does not see the value changed"


def test_rows_outside_every_key_see_nothing():
    """A window that leaves a row no key (here the keys end before the window of the last rows
    begins) gives that row out = 0, lse = +inf and zero gradients, as causal rows that see nothing."""
    q, k, v = make_qkv(1, 40, 10, 2, 1, 16, torch.float32)
    q.requires_grad_()
    out, lse = attention(q, k, v, window_size=(3, 2), return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, window=(3, 2))
    blind = ref_lse.isinf()
    assert blind.any() and not blind.all()
    assert torch.equal(lse.isinf(), blind) and not out.transpose(1, 2)[blind].any()
    assert_close(out, ref_out, 1e-5)
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
    assert torch.isfinite(dq).all() and not dq.transpose(1, 2)[blind].any()


def test_alibi_with_causal_differs_from_flash_attn_only_in_lse_by_a_row_constant():
    """flash_attn's kernel adds slope * j when causal (no left window): the same out, an lse larger
    by slope * (i + seqlen_k - seqlen_q). Checked through the reference with that bias."""
    q, k, v = make_qkv(1, 23, 31, 2, 2, 16, torch.float64)
    slopes = alibi(2).double()
    out, lse = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / 4.0
    j = torch.arange(31, dtype=torch.float64, device=q.device)
    scores = (scores + slopes[:, None, None] * j).masked_fill(~causal_mask(23, 31, q.device), -math.inf)
    flash_lse = torch.logsumexp(scores, -1)
    flash_out = (torch.softmax(scores, -1) @ v.transpose(1, 2)).transpose(1, 2)
    assert_close(out, flash_out, 1e-12)
    i = torch.arange(23, dtype=torch.float64, device=q.device)
    assert_close(flash_lse - lse, (slopes[:, None] * (i + 31 - 23)).expand_as(lse), 1e-12)
    ours_out, ours_lse = attention(q.float(), k.float(), v.float(), causal=True, alibi_slopes=slopes.float(),
                                   return_lse=True)
    assert_close(ours_lse, lse, 1e-5)


@triton.jit
def tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tanh(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_tanh_is_accurate_to_float32_rounding():
    """The softcap's tanh: a few float32 ulps against float64 from 1e-30 to saturation, both signs."""
    magnitudes = torch.cat([torch.logspace(-30, 1.5, 400, dtype=torch.float64), torch.tensor([0.5, 0.4999, 0.5001])])
    x = torch.cat([magnitudes, -magnitudes, torch.zeros(1, dtype=torch.float64)]).float().to(DEVICE)
    y = torch.empty_like(x)
    tanh_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    exact = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((y.double() - exact).abs() <= 3 * ulp).all()

# --- flash_attn_func's interface -------------------------------------------------------------------

def test_signature_is_flash_attn_func():
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    expected = [("q", inspect.Parameter.empty, positional), ("k", inspect.Parameter.empty, positional),
                ("v", inspect.Parameter.empty, positional), ("dropout_p", 0.0, positional),
                ("softmax_scale", None, positional), ("causal", False, positional),
                ("window_size", (-1, -1), positional), ("softcap", 0.0, positional),
                ("alibi_slopes", None, positional), ("deterministic", False, positional),
                ("return_attn_probs", False, positional), ("return_lse", False, inspect.Parameter.KEYWORD_ONLY)]
    got = [(p.name, p.default, p.kind) for p in inspect.signature(attention).parameters.values()]
    assert got == expected


def test_positional_arguments_follow_flash_attn_func():
    """The fourth positional argument is dropout_p, the sixth causal: an earlier signature
    (q, k, v, causal, softmax_scale, return_lse) read 0.1 as causal=True and (0.0, None, True) as
    return_lse=True without the mask."""
    q, k, v = make_qkv(1, 19, 23, 2, 1, 16, torch.float32)
    assert torch.equal(seeded_attention(q, k, v, dropout_p=0.1), seeded_attention(q, k, v, 0.1))
    assert not torch.equal(seeded_attention(q, k, v, 0.1), attention(q, k, v))
    out = attention(q, k, v, 0.0, None, True)
    assert isinstance(out, torch.Tensor)
    assert_close(out, attention_ref(q, k, v, causal=True)[0], 1e-5)
    assert_close(attention(q, k, v, 0.0, 0.3), attention_ref(q, k, v, softmax_scale=0.3)[0], 1e-5)


def test_arguments_at_what_flash_attn_reads_as_default_are_accepted():
    """flash_attn reads a window side that is negative or at least seqlen_k as unbounded,
    (-1, 0) as causal, and softcap <= 0 as off; deterministic changes nothing here."""
    q, k, v = make_qkv(1, 9, 11, 2, 1, 16, torch.float32)
    full, causal = attention(q, k, v), attention(q, k, v, causal=True)
    for kwargs in (dict(window_size=[-1, -1]), dict(window_size=(11, 50)), dict(window_size=(-5, -2)),
                   dict(softcap=0.0), dict(softcap=-1.0), dict(deterministic=True), dict(dropout_p=0),
                   dict(alibi_slopes=None)):
        assert torch.equal(attention(q, k, v, **kwargs), full), kwargs
    for kwargs in (dict(window_size=(-1, 0)), dict(window_size=(20, 0)), dict(causal=True, window_size=(11, 3))):
        assert torch.equal(attention(q, k, v, **kwargs), causal), kwargs


def test_return_attn_probs_returns_out_lse_and_flash_attns_empty_s_dmask():
    """flash_attn fills S_dmask only when dropout_p > 0; with dropout_p = 0 it returns an empty
    tensor of shape (0,) in q's dtype, and so does this function."""
    q, k, v = make_qkv(1, 9, 11, 2, 1, 16, torch.bfloat16)
    out, lse, s_dmask = attention(q, k, v, return_attn_probs=True)
    out2, lse2 = attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and lse.shape == (1, 2, 9)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype and s_dmask.device == q.device
    assert len(attention(q, k, v, return_attn_probs=True, return_lse=True)) == 3


def test_return_lse_false_returns_only_the_output():
    q, k, v = make_qkv(1, 9, 9, 2, 1, 16, torch.float32)
    out = attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 9)


def test_rows_that_see_no_key_have_lse_plus_inf_and_zero_gradients():
    """flash_attn's convention (and ours, which used -inf before): lse = +inf, so P = exp(S - lse) = 0."""
    q, k, v = make_qkv(1, 29, 11, 2, 1, 16, torch.float32)
    q.requires_grad_()
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    hidden = 29 - 11  # the first seqlen_q - seqlen_k queries see no key
    assert torch.all(lse[..., :hidden] == math.inf) and torch.isfinite(lse[..., hidden:]).all()
    assert torch.equal(lse.isinf(), attention_ref(q, k, v, causal=True)[1].isinf())
    assert not out[:, :hidden].any()
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
    assert not dq[:, :hidden].any() and torch.isfinite(dq).all()


def test_large_negative_scores_leave_the_gradients_finite():
    """Keys past the end of the last block load as zeros; where every real score of a row is very
    negative, such a key's P = exp(0 - lse) overflows, and the dQ kernel multiplied it by the zero
    key: inf * 0 = NaN in dq."""
    q, k, v = make_qkv(1, 8, 21, 1, 1, 16, torch.float32)
    k = 1.0 + 0.1 * k
    q = q - 30.0  # every score about -120 after the 1/4 scale, so lse < -89 and exp(-lse) overflows
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    ours = gradients(lambda q, k, v: attention(q, k, v), inputs, grad_out)
    ref = gradients(lambda q, k, v: attention_ref(q, k, v)[0],
                    {name: t.detach().double().requires_grad_() for name, t in inputs.items()}, grad_out)
    # The point is that the gradients are finite. Their accuracy is bounded by the scores' size:
    # P = exp2(S log2(e) - lse2) with |S log2(e)| ~ 170 carries 170 x float32's rounding (1e-5) in
    # every entry, and dS = P (dP - delta) cancels on top (1.2e-4 for grad k for one draw, against
    # 1e-7 at ordinary scores, where test_forward_lse_and_gradients holds the kernel to 2 x PyTorch's error)
    for name in ("q", "k", "v"):
        assert_close(ours[name], ref[name], 1e-3, f"grad {name}")


@pytest.mark.parametrize("shape", [dict(batch=0), dict(seqlen_q=0), dict(seqlen_k=0), dict(heads=0, kv_heads=0),
                                   dict(heads=0)])
def test_empty_inputs_give_empty_outputs_without_a_launch(shape, monkeypatch):
    """As flash_attn: empty in, empty out; with no key, out = 0 and lse = +inf. Gradients are 0."""
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty input")

    monkeypatch.setattr(api, "attention_forward", no_launch)
    monkeypatch.setattr(api, "attention_backward", no_launch)
    sizes = dict(batch=2, seqlen_q=5, seqlen_k=7, heads=2, kv_heads=1) | shape
    q, k, v = (t.requires_grad_() for t in make_qkv(*sizes.values(), 16, torch.bfloat16))
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (sizes["batch"], sizes["heads"], sizes["seqlen_q"]) and torch.all(lse == math.inf)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t, g in zip((q, k, v), grads):
        assert g.shape == t.shape and g.dtype == t.dtype and not g.any()


def assert_view_gradients(make_leaf, views, causal, dtype):
    """Gradients through attention(*views(leaf)) for a leaf in ``dtype`` against the same views of
    a float64 leaf, with the rule's bound; ``views`` may give q, k, v strided, sliced or expanded."""
    leaf = make_leaf(dtype).requires_grad_()
    leaf64 = leaf.detach().double().requires_grad_()
    q, k, v = views(leaf)
    out = attention(q, k, v, causal=causal)
    grad_out = torch.randn(out.shape, dtype=torch.float64, device=out.device).to(dtype)
    (ours,) = torch.autograd.grad(out, leaf, grad_out.transpose(1, 2).contiguous().transpose(1, 2))
    (ref,) = torch.autograd.grad(attention_ref(*views(leaf64), causal=causal)[0], leaf64, grad_out.double())
    same_leaf = leaf.detach().requires_grad_()
    (same,) = torch.autograd.grad(naive_attention(*views(same_leaf), causal=causal)[0], same_leaf, grad_out)
    assert_within_same_computation("grad of the leaf", ours, same, ref, dtype)


NONCONTIGUOUS = {
    # (batch, heads, seqlen, d) storage seen as (batch, seqlen, heads, d): last stride 1, others permuted
    "transposed": (lambda dtype: randn(3, 1, 4, 19, 32, dtype=dtype),
                   lambda t: (t[0].transpose(1, 2), t[1, :, :2].transpose(1, 2), t[2, :, 2:].transpose(1, 2))),
    # a QKV projection's output (batch, N, 3, heads, d), unbound: strided views of one tensor
    "packed qkv": (lambda dtype: randn(2, 23, 3, 2, 32, dtype=dtype), lambda t: t.unbind(2)),
    # one key/value head expanded to the four query heads (stride 0), and a last stride of 2
    "expanded kv, strided q": (lambda dtype: randn(1, 17, 6, 64, dtype=dtype),
                               lambda t: (t[:, :, :4, ::2], t[:, :, 4:5, 32:].expand(-1, -1, 4, -1),
                                          t[:, :, 5:6, 32:].expand(-1, -1, 4, -1))),
}


@pytest.mark.parametrize("layout, causal", [("transposed", True), ("packed qkv", False),
                                            ("expanded kv, strided q", True)])
def test_gradients_of_noncontiguous_views(layout, causal):
    make_leaf, views = NONCONTIGUOUS[layout]
    q, k, v = views(make_leaf(torch.float16))
    assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    assert_view_gradients(make_leaf, views, causal, torch.float16)


@pytest.mark.parametrize("layout, causal, dtype", [("expanded kv, strided q", False, torch.float32),
                                                   ("transposed", True, torch.bfloat16),
                                                   ("packed qkv", False, torch.bfloat16),
                                                   ("transposed", False, torch.float16),
                                                   ("packed qkv", True, torch.float16),
                                                   ("expanded kv, strided q", False, torch.float16)])
def test_noncontiguous_views_forward_and_gradients_in_every_dtype(layout, causal, dtype):
    """test_gradients_of_noncontiguous_views runs float16 and judges the gradients only: here the
    out of the same views too, in every dtype (in float16 with the other causal flag), by the rule."""
    make_leaf, views = NONCONTIGUOUS[layout]
    q, k, v = views(make_leaf(dtype))
    assert_within_same_computation("out", attention(q, k, v, causal=causal), naive_attention(q, k, v, causal)[0],
                                   attention_ref(q, k, v, causal)[0], dtype)
    assert_view_gradients(make_leaf, views, causal, dtype)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_slopes_as_views(per_batch):
    """ALiBi slopes that are views: (heads,) a strided slice, (batch, heads) a transposed (heads,
    batch) tensor. Out, lse and the three gradients against float64 by the rule."""
    batch, heads = 2, 4
    slopes = alibi(heads, batch).t() if per_batch else alibi(2 * heads)[::2]
    assert not slopes.is_contiguous()
    check_all(*make_qkv(batch, 23, 30, heads, 2, 32, torch.float32), True, alibi_slopes=slopes)


def test_default_backward_is_deterministic():
    n = 2048 if ON_GPU else 40
    q, k, v = make_qkv(2 if ON_GPU else 1, n, n, 4 if ON_GPU else 2, 1, 64 if ON_GPU else 16, torch.bfloat16)
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    first = gradients(lambda q, k, v: attention(q, k, v, causal=True), inputs, grad_out)
    second = gradients(lambda q, k, v: attention(q, k, v, causal=True, deterministic=True), inputs, grad_out)
    for name in first:
        assert torch.equal(first[name], second[name]), f"grad {name} changed between two runs"


def test_float32_dots_are_exact_unless_tf32_is_allowed():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.float32)
    ref, _ = attention_ref(q, k, v)
    assert rel_error(attention(q, k, v), ref) < 1e-5
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        err = rel_error(attention(q, k, v), ref)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert err < (5e-3 if ON_GPU else 1e-5)  # TF32 keeps 10 mantissa bits; the interpreter is exact anyway


# --- torch.library registration and torch.compile ---------------------------------------------------

@pytest.mark.parametrize("seqlen_q, seqlen_k, heads, kv_heads, window, softcap, with_alibi, dropout_p", [
    (5, 7, 2, 2, (-1, -1), 0.0, False, 0.0), (7, 5, 4, 2, (-1, 0), 0.0, False, 0.0),
    (9, 12, 2, 1, (3, 2), 5.0, True, 0.0), (9, 12, 2, 1, (-1, 0), 0.0, False, 0.3)])
def test_opcheck(seqlen_q, seqlen_k, heads, kv_heads, window, softcap, with_alibi, dropout_p):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, seqlen_q, seqlen_k, heads, kv_heads, 16, torch.float32))
    options = (0.25, *window, softcap, alibi(heads) if with_alibi else None, dropout_p,
               api.draw_dropout_seed(dropout_p, q.device))
    torch.library.opcheck(attention_op.op, (q, k, v, *options))
    out, lse = attention_op(q, k, v, *options)
    torch.library.opcheck(attention_op.backward_op, (q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                     torch.randn_like(out), *options))
    if dropout_p:
        torch.library.opcheck(api.attention_probabilities, (q.detach(), k.detach(), lse, *options[:-2], *options[-2:]))


COMPILED_FEATURES = {"causal": dict(causal=True),
                     "window, softcap, alibi": dict(window_size=(3, 2), softcap=5.0, alibi_slopes="alibi"),
                     "dropout": dict(dropout_p=0.3, causal=True)}


@pytest.mark.parametrize("features", COMPILED_FEATURES)
def test_torch_compile_fullgraph_matches_eager(features):
    """The compiled graph gives the eager bits; with dropout, for the same seed, and the compiled
    graph draws a fresh mask at every call (the seed is not frozen into it)."""
    q, k, v = make_qkv(1, 9, 13, 2, 1, 16, torch.float32)
    kwargs = {name: alibi(2) if value == "alibi" else value for name, value in COMPILED_FEATURES[features].items()}

    def loss(q, k, v):
        out, lse, s_dmask = attention(q, k, v, return_attn_probs=True, **kwargs)
        return (out * out).sum() + lse.sum() + s_dmask.abs().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, loss):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(DROPOUT_SEED)
        value = fn(*leaves)
        results.append((value, *torch.autograd.grad(value, leaves)))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    if "dropout_p" in kwargs:
        assert compiled(q, k, v) != compiled(q, k, v)


# --- the chapter's exercises -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="large sizes need compiled kernels")
def test_long_sequence_bfloat16():
    q, k, v = make_qkv(1, 16384, 16384, 2, 1, 128, torch.bfloat16)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q[:, -256:], k, v, causal=True)  # the last 256 queries, bottom-right aligned
    same_out, same_lse = naive_attention(q[:, -256:], k, v, causal=True)
    assert_within_same_computation("out", out[:, -256:], same_out, ref_out, torch.bfloat16)
    assert_within_same_computation("lse", lse[..., -256:], same_lse, ref_lse, torch.bfloat16)


def merge_attention(out1, lse1, out2, lse2):
    """The chapter's exercise, solved: attention over keys K1 + K2 from attention over K1 and over K2.

    Each part is normalised by its own sum exp(lse_i); the whole sum is exp(lse1) + exp(lse2), so
    lse = logaddexp(lse1, lse2) and out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2.
    """
    lse = torch.logaddexp(lse1, lse2)
    weight1 = torch.exp(lse1 - lse).transpose(1, 2)[..., None]  # (batch, seqlen_q, heads, 1)
    weight2 = torch.exp(lse2 - lse).transpose(1, 2)[..., None]
    return weight1 * out1.float() + weight2 * out2.float(), lse


def test_exercise_merge_attention_over_two_halves_of_the_keys():
    q, k, v = make_qkv(2, 37, 70, 4, 2, 32, torch.float32)
    out1, lse1 = attention(q, k[:, :30], v[:, :30], return_lse=True)
    out2, lse2 = attention(q, k[:, 30:], v[:, 30:], return_lse=True)
    out, lse = merge_attention(out1, lse1, out2, lse2)
    ref_out, ref_lse = attention_ref(q, k, v)
    assert rel_error(out, ref_out) < 1e-5
    assert rel_error(lse, ref_lse) < 1e-5


def test_exercise_decoding_query_sees_every_key():
    q, k, v = make_qkv(1, 25, 61, 4, 2, 32, torch.float32)
    last = q[:, -1:]
    assert_close(attention(last, k, v, causal=True), attention(last, k, v), 1e-6)


# --- bad inputs ----------------------------------------------------------------------------------------

BAD_INPUTS = [
    (lambda q, k, v: dict(q=q.numpy(force=True), k=k, v=v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: dict(q=q.double(), k=k, v=v), TypeError, "q must have dtype"),
    (lambda q, k, v: dict(q=q, k=k.half(), v=v), TypeError, "k must have the dtype of q"),
    (lambda q, k, v: dict(q=q, k=k, v=v.int()), TypeError, "v must have dtype"),
    (lambda q, k, v: dict(q=q[0], k=k, v=v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: dict(q=q, k=k[..., :16], v=v[..., :16]), ValueError, "k must have shape"),
    (lambda q, k, v: dict(q=q, k=k[:1], v=v[:1]), ValueError, "k must have shape"),
    (lambda q, k, v: dict(q=q, k=k, v=v[:, :5]), ValueError, "v must have the shape of k"),
    (lambda q, k, v: dict(q=q[:, :, :3], k=k, v=v), ValueError, "kv_heads of k and v .2. must divide"),
    (lambda q, k, v: dict(q=q, k=k[:, :, :0], v=v[:, :, :0]), ValueError, "kv_heads of k and v .0. must divide"),
    (lambda q, k, v: dict(q=q[..., :8], k=k[..., :8], v=v[..., :8]), ValueError, "head_dim .* between 16 and 256"),
    (lambda q, k, v: dict(q=q.repeat(1, 1, 1, 9), k=k.repeat(1, 1, 1, 9), v=v.repeat(1, 1, 1, 9)),
     ValueError, "head_dim .* between 16 and 256; got 288"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
    (lambda q, k, v: dict(q=q, k=k, v=v, dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda q, k, v: dict(q=q, k=k, v=v, dropout_p=None), TypeError, "dropout_p must be a real number"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softcap="1"), TypeError, "softcap must be a real number"),
    (lambda q, k, v: dict(q=q, k=k, v=v, causal=0.0), TypeError, "causal must be a bool"),
    (lambda q, k, v: dict(q=q, k=k, v=v, window_size=-1), TypeError, "window_size must be a pair of ints"),
    (lambda q, k, v: dict(q=q, k=k, v=v, window_size=(-1, -1, -1)), TypeError, "window_size must be a pair"),
    (lambda q, k, v: dict(q=q, k=k, v=v, window_size=(-1.0, -1)), TypeError, "window_size must be a pair"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softcap=math.nan), ValueError, "softcap must be finite"),
    (lambda q, k, v: dict(q=q, k=k, v=v, alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a tensor"),
    (lambda q, k, v: dict(q=q, k=k, v=v, alibi_slopes=torch.ones(4, dtype=torch.float16, device=q.device)),
     TypeError, "alibi_slopes must be float32"),
    (lambda q, k, v: dict(q=q, k=k, v=v, alibi_slopes=torch.ones(2, device=q.device)), ValueError,
     r"alibi_slopes must have shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\); got \(2,\)"),
    (lambda q, k, v: dict(q=q, k=k, v=v, alibi_slopes=torch.ones(4, 2, device=q.device)), ValueError,
     "alibi_slopes must have shape"),
    (lambda q, k, v: dict(q=q, k=k, v=v, alibi_slopes=torch.ones(4, device=q.device, requires_grad=True)),
     NotImplementedError, "alibi_slopes: no gradient"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(build, error, message):
    q, k, v = make_qkv(2, 10, 12, 4, 2, 32, torch.float32)
    with pytest.raises(error, match=message):
        attention(**build(q, k, v))


def test_unknown_backward_schedule_is_refused():
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="backward must be one of"):
        attention_variant(q, k, v, backward="fast")


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_wrong_device_is_refused():
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="q is on cpu"):
        attention(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(ValueError, match="k is on cpu"):
        attention(q, k.cpu(), v)
