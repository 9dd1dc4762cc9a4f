"""Chapter 7's attention against float64: output, log-sum-exp, the three gradients, bad inputs.

The bound is FlashAttention's rule: the kernel's relative error against the float64 reference is
at most twice the error of the same attention computed naively by PyTorch in the input dtype
(plus a tiny floor, for cases where PyTorch happens to be exact).
"""
import math

import pytest
import torch

from mamba_annotated.attention import attention, attention_variant
from mamba_annotated.attention.reference import assert_flash_rule, attention_ref, naive_attention
from mamba_annotated.runtime import DEVICE
from mamba_annotated.testing import FLOAT_DTYPES, assert_close, gradients, randn, rel_error

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


def check_all(q, k, v, causal, softmax_scale=None, backward="split"):
    """Output, lse and dq, dk, dv of the kernel against float64, bounded by PyTorch in q's dtype."""
    dtype = q.dtype
    out, lse = attention_variant(q, k, v, causal, softmax_scale, return_lse=True, backward=backward)
    ref_out, ref_lse = attention_ref(q, k, v, causal, softmax_scale)
    same_out, same_lse = naive_attention(q, k, v, causal, softmax_scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_flash_rule("out", out, same_out, ref_out, dtype)
    assert_flash_rule("lse", lse, same_lse, ref_lse, dtype)

    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    ours = gradients(lambda q, k, v: attention_variant(q, k, v, causal, softmax_scale, backward=backward),
                     inputs, grad_out)
    same = gradients(lambda q, k, v: naive_attention(q, k, v, causal, softmax_scale), inputs, grad_out)
    ref64 = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    ref = gradients(lambda q, k, v: attention_ref(q, k, v, causal, softmax_scale), ref64, grad_out)
    for name in ("q", "k", "v"):
        assert ours[name].dtype == dtype
        assert_flash_rule(f"grad {name}", ours[name], same[name], ref[name], dtype)


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


@pytest.mark.parametrize("backward", ["fused", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_backward_kernels(backward, causal, dtype):
    seqlen_q, seqlen_k = (1023, 777) if ON_GPU else (45, 33)
    check_all(*make_qkv(1, seqlen_q, seqlen_k, 4, 2, 48, dtype), causal, backward=backward)


def test_softmax_scale_and_noncontiguous_inputs():
    n = 300 if ON_GPU else 40
    qkv = randn(2, n, 3, 2, 32, dtype=torch.float16)  # packed q, k, v: strided views, as in a QKV projection
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_all(q, k, v, causal=True, softmax_scale=0.3)
    check_all(*make_qkv(1, n, n, 2, 2, 32, torch.float32), causal=False, softmax_scale=2.0)


def test_return_lse_false_returns_only_the_output():
    q, k, v = make_qkv(1, 9, 9, 2, 1, 16, torch.float32)
    out = attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 9)


def test_default_backward_is_deterministic():
    n = 2048 if ON_GPU else 40
    q, k, v = make_qkv(2, n, n, 4, 1, 64 if ON_GPU else 16, torch.bfloat16)
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    first = gradients(lambda q, k, v: attention(q, k, v, causal=True), inputs, grad_out)
    second = gradients(lambda q, k, v: attention(q, k, v, causal=True), inputs, grad_out)
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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="large sizes need compiled kernels")
def test_long_sequence_bfloat16():
    q, k, v = make_qkv(1, 16384, 16384, 2, 1, 128, torch.bfloat16)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q[:, -256:], k, v, causal=True)  # the last 256 queries, bottom-right aligned
    same_out, same_lse = naive_attention(q[:, -256:], k, v, causal=True)
    assert_flash_rule("out", out[:, -256:], same_out, ref_out, torch.bfloat16)
    assert_flash_rule("lse", lse[..., -256:], same_lse, ref_lse, torch.bfloat16)


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
    (lambda q, k, v: dict(q=q[..., :8], k=k[..., :8], v=v[..., :8]), ValueError, "head_dim .* between 16 and 256"),
    (lambda q, k, v: dict(q=q.repeat(1, 1, 1, 9), k=k.repeat(1, 1, 1, 9), v=v.repeat(1, 1, 1, 9)),
     ValueError, "head_dim .* between 16 and 256; got 288"),
    (lambda q, k, v: dict(q=q[:, :0], k=k, v=v), ValueError, "q must not be empty"),
    (lambda q, k, v: dict(q=q, k=k[:, :0], v=v[:, :0]), ValueError, "k must not be empty"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    (lambda q, k, v: dict(q=q, k=k, v=v, softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
]


@pytest.mark.parametrize("build, error, message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(build, error, message):
    q, k, v = make_qkv(2, 10, 12, 4, 2, 32, torch.float32)
    with pytest.raises(error, match=message):
        attention(**build(q, k, v))


def test_unknown_backward_method_is_refused():
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
