"""attention_varlen (flash_attn's flash_attn_varlen_func) against float64: out, lse and the three
gradients of packed sequences of unequal lengths (queries and keys of different counts, sequences
of no query or no key, rows past the last sequence), with every option of ``attention``; dropout
through the mask S_dmask marks; the same bits as ``attention`` on sequences of equal lengths;
flash_attn's interface and return conventions, bad inputs and offsets, torch.library and
torch.compile.

The bound is chapter 7's rule (:mod:`mamba_annotated.testing`): the kernel's relative error
against the float64 reference (each sequence through ``attention_ref`` on its own,
:func:`varlen_reference`) is at most twice the error of the same attention computed naively by
PyTorch in the input dtype. In the interpreter the sizes are small (the kernels' tiles are 32 x 16
there, so a sequence of 37 queries or 40 keys spans several); on a GPU the parametrization widens.
"""
import inspect
import math

import pytest
import torch

from mamba_annotated import attention, attention_varlen
from mamba_annotated.attention import varlen
from mamba_annotated.attention.api import resolve_window
from mamba_annotated.attention.reference import (attention_logits, geometric_alibi_slopes, naive_attention,
                                                 varlen_reference)
from mamba_annotated.attention.varlen import attention_varlen_op, attention_varlen_probabilities
from mamba_annotated.runtime import DEVICE
from mamba_annotated.testing import (FLOAT_DTYPES, assert_refused_on_the_device, assert_within_same_computation,
                                     gradients, randn)

ON_GPU = DEVICE.type == "cuda"
DROPOUT_SEED = 20261201

# (query lengths, key lengths) of the sequences: unequal within a sequence, one without queries,
# one without keys, some over a tile of the interpreter's (32 queries, 16 keys)
if ON_GPU:
    LENGTHS = [([1, 513, 0, 77, 1200, 64], [300, 129, 5, 77, 0, 1500]), ([128, 128], [128, 128])]
else:
    LENGTHS = [([37, 0, 5, 13], [21, 6, 40, 0])]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def make_packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, unowned=(2, 3)):
    """Packed q, k, v of these sequences, ``unowned`` rows past the last one in q and in k, v; with
    cu_seqlens and the longest lengths: the arguments of attention_varlen after q, k, v."""
    q = randn(sum(lengths_q) + unowned[0], heads, head_dim, dtype=dtype)
    k = randn(sum(lengths_k) + unowned[1], kv_heads, head_dim, dtype=dtype)
    v = randn(sum(lengths_k) + unowned[1], kv_heads, head_dim, dtype=dtype)
    return q, k, v, offsets(lengths_q), offsets(lengths_k), max(lengths_q, default=0), max(lengths_k, default=0)


def alibi(*shape):
    """ALiBi's geometric slopes, shuffled so that heads differ in order too."""
    n = math.prod(shape)
    return geometric_alibi_slopes(n, DEVICE)[torch.randperm(n, device=DEVICE)].reshape(shape)


def seeded_varlen(*args, **kwargs):
    """attention_varlen after torch.manual_seed(DROPOUT_SEED): every call draws the same dropout mask."""
    torch.manual_seed(DROPOUT_SEED)
    return attention_varlen(*args, **kwargs)


def padded_probabilities(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, **features):
    """(batch, heads, max_seqlen_q, max_seqlen_k): each sequence's softmax(logits) in its corner,
    0 elsewhere (the layout of S_dmask), in q's dtype."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    probs = torch.zeros(len(bounds_q) - 1, q.shape[1], max_seqlen_q, max_seqlen_k, dtype=q.dtype, device=q.device)
    for b in range(len(bounds_q) - 1):
        slopes = features.get("alibi_slopes")
        sequence = dict(features, alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[b])
        logits = attention_logits(q[None, bounds_q[b]:bounds_q[b + 1]], k[None, bounds_k[b]:bounds_k[b + 1]], causal,
                                  **sequence)
        probs[b, :, :logits.shape[2], :logits.shape[3]] = torch.softmax(logits, -1).nan_to_num(0.0)[0]
    return probs


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale=None,
                 **features):
    """out, lse and dq, dk, dv against float64 by the rule, rows past the last sequence included.
    ``features``: window_size, softcap, alibi_slopes, dropout_p; with dropout the references apply
    the mask the kernel marks in S_dmask, whose probabilities are checked too (every call seeded
    alike, so the forward and backward passes draw that mask). Returns (out, lse)."""
    dtype, packing = q.dtype, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    reference_features = dict(features)
    reference_features["window"] = resolve_window(causal, reference_features.pop("window_size", (-1, -1)),
                                                  max_seqlen_k)
    if features.get("dropout_p", 0.0) > 0:
        out, lse, s_dmask = seeded_varlen(q, k, v, *packing, softmax_scale=softmax_scale, causal=causal,
                                          return_attn_probs=True, **features)
        logit_features = {name: value for name, value in reference_features.items() if name != "dropout_p"}
        ref_probs, same_probs = (padded_probabilities(t, k_, *packing, causal, softmax_scale=softmax_scale,
                                                      **logit_features) for t, k_ in ((q.double(), k.double()), (q, k)))
        assert s_dmask.shape == ref_probs.shape and s_dmask.dtype == dtype
        assert_within_same_computation("S_dmask", s_dmask.abs(), same_probs, ref_probs, dtype)
        reference_features["dropout_mask"] = s_dmask >= 0
    else:
        out, lse = attention_varlen(q, k, v, *packing, softmax_scale=softmax_scale, causal=causal, return_lse=True,
                                    **features)
    arguments = (cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    ref_out, ref_lse = varlen_reference(q, k, v, *arguments, **reference_features)
    same_out, same_lse = varlen_reference(q, k, v, *arguments, **reference_features, attend=naive_attention)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert_within_same_computation("out", out, same_out, ref_out, dtype)
    assert_within_same_computation("lse", lse, same_lse, ref_lse, dtype)

    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    ours = gradients(lambda q, k, v: seeded_varlen(q, k, v, *packing, softmax_scale=softmax_scale, causal=causal,
                                                   **features), inputs, grad_out)
    same = gradients(lambda q, k, v: varlen_reference(q, k, v, *arguments, **reference_features,
                                                      attend=naive_attention)[0], inputs, grad_out)
    ref = gradients(lambda q, k, v: varlen_reference(q, k, v, *arguments, **reference_features)[0],
                    {name: t.detach().double().requires_grad_() for name, t in inputs.items()}, grad_out)
    for name in ("q", "k", "v"):
        assert ours[name].dtype == dtype
        assert_within_same_computation(f"grad {name}", ours[name], same[name], ref[name], dtype)
    return out, lse


DTYPES_CAUSAL = ([(dtype, causal) for dtype in FLOAT_DTYPES for causal in (False, True)] if ON_GPU else
                 [(torch.float32, False), (torch.float32, True), (torch.float16, True), (torch.bfloat16, True)])


@pytest.mark.parametrize("lengths_q, lengths_k", LENGTHS)
@pytest.mark.parametrize("dtype, causal", DTYPES_CAUSAL)
def test_forward_lse_and_gradients(lengths_q, lengths_k, dtype, causal):
    """Unequal lengths, grouped-query heads, a head dim that is not a power of two, rows no
    sequence owns: each sequence is attention on its own, its causal diagonal aligned with its own
    lengths."""
    heads, kv_heads, head_dim = (8, 2, 80) if ON_GPU else (2, 1, 24)
    check_varlen(*make_packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES if ON_GPU else (torch.bfloat16,))
def test_every_feature_together(dtype):
    """Causal + window + softcap + ALiBi per (sequence, head) + grouped-query heads + a scale."""
    lengths_q, lengths_k = LENGTHS[0]
    heads, kv_heads, head_dim = (6, 2, 40) if ON_GPU else (4, 2, 24)
    check_varlen(*make_packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype), True, softmax_scale=0.3,
                 softcap=5.0, window_size=(13, 5), alibi_slopes=alibi(len(lengths_q), heads))


@pytest.mark.parametrize("window_size", [(4, 1), (-1, 3), (9, -1)] if ON_GPU else [(4, 1)])
def test_sliding_window(window_size):
    """A window narrower than a tile, its offset per sequence (L_k - L_q), ALiBi slopes per head."""
    lengths_q, lengths_k = LENGTHS[0]
    check_varlen(*make_packed(lengths_q, lengths_k, 2, 2, 16, torch.float32), False, window_size=window_size,
                 alibi_slopes=alibi(2))


@pytest.mark.parametrize("dtype, features", [
    (torch.float32, dict(causal=True, softcap=6.0, window_size=(13, 5), alibi_slopes="batch, heads"))]
    + ([(torch.bfloat16, dict(causal=True)), (torch.float16, dict(causal=False))] if ON_GPU else []))
def test_dropout(dtype, features):
    """Output, lse and gradients against float64 with the mask the kernel marks in S_dmask, whose
    counter is the pair's place in (batch, heads, max_seqlen_q, max_seqlen_k): the forward,
    backward and probabilities kernels must agree on it sequence by sequence."""
    lengths_q, lengths_k = LENGTHS[0]
    heads, kv_heads = (4, 2) if ON_GPU else (2, 1)
    packed = make_packed(lengths_q, lengths_k, heads, kv_heads, 24, dtype)
    features = dict(features, dropout_p=0.3)
    if features.get("alibi_slopes") == "batch, heads":
        features["alibi_slopes"] = alibi(len(lengths_q), heads)
    check_varlen(*packed, **features)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_sequences_of_equal_lengths_give_attentions_bits(dropout_p):
    """Sequences of one length each are a batch: out, lse (in its packed layout), the gradients and,
    with dropout, S_dmask are the bits ``attention`` gives on the (batch, seqlen, heads, d) view,
    with causal, window, softcap and ALiBi (per batch row) together."""
    batch, seqlen_q, seqlen_k, heads, kv_heads = (3, 300, 257, 4, 2) if ON_GPU else (2, 19, 23, 2, 1)
    q, k, v = (randn(batch, n, h, 32, dtype=torch.bfloat16)
               for n, h in ((seqlen_q, heads), (seqlen_k, kv_heads), (seqlen_k, kv_heads)))
    options = dict(dropout_p=dropout_p, causal=True, window_size=(11, 2), softcap=5.0,
                   alibi_slopes=alibi(batch, heads), return_attn_probs=True)
    dense_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(DROPOUT_SEED)
    dense_out, dense_lse, dense_probs = attention(*dense_leaves, **options)
    grad_out = torch.randn_like(dense_out)
    dense_grads = torch.autograd.grad(dense_out, dense_leaves, grad_out)
    packed_leaves = [t.flatten(0, 1).clone().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = (torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * n for n in (seqlen_q, seqlen_k))
    out, lse, probs = seeded_varlen(*packed_leaves, cu_q, cu_k, seqlen_q, seqlen_k, **options)
    grads = torch.autograd.grad(out, packed_leaves, grad_out.flatten(0, 1))
    assert torch.equal(out, dense_out.flatten(0, 1))
    assert torch.equal(lse, dense_lse.transpose(0, 1).flatten(1, 2))  # (batch, heads, seqlen) -> (heads, total)
    assert torch.equal(probs, dense_probs)
    for name, got, want in zip("qkv", grads, dense_grads):
        assert torch.equal(got, want.flatten(0, 1)), f"grad {name}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_noncontiguous_inputs(dtype):
    """q a head-major view, k and v the two halves of one (total_k, kv_heads, 2 d) projection,
    strided in their last dim (copied, as in ``attention``): out, lse, and the gradients of the
    leaves through those views, against float64 through the same views."""
    lengths_q, lengths_k = LENGTHS[0]
    packing = (offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k))
    leaves = dict(q_leaf=randn(2, sum(lengths_q) + 1, 32, dtype=dtype),
                  kv_leaf=randn(sum(lengths_k), 1, 64, dtype=dtype))

    def views(q_leaf, kv_leaf):
        return q_leaf.transpose(0, 1), kv_leaf[..., 0::2], kv_leaf[..., 1::2]

    q, k, v = views(**leaves)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()) and k.stride(-1) == 2
    ours = lambda **t: attention_varlen(*views(**t), *packing, causal=True)  # noqa: E731
    same = lambda **t: varlen_reference(*views(**t), *packing[:2], True, attend=naive_attention)[0]  # noqa: E731
    ref = lambda **t: varlen_reference(*views(**t), *packing[:2], True)[0]  # noqa: E731
    out, lse = attention_varlen(q, k, v, *packing, causal=True, return_lse=True)
    ref_out, ref_lse = varlen_reference(q, k, v, *packing[:2], True)
    same_out, same_lse = varlen_reference(q, k, v, *packing[:2], True, attend=naive_attention)
    assert_within_same_computation("out", out, same_out, ref_out, dtype)
    assert_within_same_computation("lse", lse, same_lse, ref_lse, dtype)
    leaves = {name: t.requires_grad_() for name, t in leaves.items()}
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=DEVICE)
    got, want_same = gradients(ours, leaves, grad_out), gradients(same, leaves, grad_out)
    want = gradients(ref, {name: t.detach().double().requires_grad_() for name, t in leaves.items()}, grad_out)
    for name in leaves:
        assert_within_same_computation(f"grad {name}", got[name], want_same[name], want[name], dtype)


def test_offsets_and_slopes_as_views():
    """cu_seqlens_q and cu_seqlens_k the two columns of one (batch + 1, 2) int32 tensor (stride 2:
    read densely, they would be each other's neighbours), the ALiBi slopes (batch, heads) a
    transposed (heads, batch) tensor: out, lse and the gradients against float64 by the rule."""
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed(lengths_q, lengths_k, 2, 1, 16, torch.float32)
    offsets_qk = torch.stack([cu_q, cu_k], dim=1)
    cu_q, cu_k = offsets_qk[:, 0], offsets_qk[:, 1]
    slopes = alibi(2, len(lengths_q)).t()
    assert not (cu_q.is_contiguous() or cu_k.is_contiguous() or slopes.is_contiguous())
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, alibi_slopes=slopes)


def test_rows_that_see_no_key_and_rows_of_no_sequence():
    """A sequence without keys, causal rows before a diagonal past the keys, and rows past the last
    sequence: out 0, lse +inf, every gradient there 0 (checked on NaN-poisoned outputs)."""
    lengths_q, lengths_k = [4, 6, 3], [0, 2, 5]
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed(lengths_q, lengths_k, 2, 1, 16, torch.float32, unowned=(3, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    blind = torch.zeros(q.shape[0], dtype=torch.bool, device=DEVICE)
    blind[:4] = True       # no key
    blind[4:8] = True      # 6 queries, 2 keys: the first four see none
    blind[13:] = True      # past the last sequence
    assert torch.equal(torch.isinf(lse), blind[None].expand_as(lse)) and (lse[:, blind] > 0).all()
    assert not out[blind].any() and torch.isfinite(out).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not dq[blind].any() and torch.isfinite(dq).all()
    assert not dk[7:].any() and not dv[7:].any() and dk[:7].any() and dv[:7].any()


# --- flash_attn_varlen_func's interface -----------------------------------------------------------

def test_signature_is_flash_attn_varlen_func():
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    required = [(name, inspect.Parameter.empty, positional) for name in
                ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    expected = required + [("dropout_p", 0.0, positional), ("softmax_scale", None, positional),
                           ("causal", False, positional), ("window_size", (-1, -1), positional),
                           ("softcap", 0.0, positional), ("alibi_slopes", None, positional),
                           ("deterministic", False, positional), ("return_attn_probs", False, positional),
                           ("block_table", None, positional), ("return_lse", False, inspect.Parameter.KEYWORD_ONLY)]
    assert [(p.name, p.default, p.kind) for p in inspect.signature(attention_varlen).parameters.values()] == expected


def test_return_conventions():
    """out alone; (out, lse) with return_lse; (out, lse, S_dmask) with return_attn_probs, S_dmask an
    empty (0,) tensor in q's dtype without dropout and (batch, heads, max_seqlen_q, max_seqlen_k)
    with it, 0 outside each sequence's corner; positional arguments in flash_attn's order (the
    eighth is dropout_p, the tenth causal)."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed([3, 7], [5, 2], 2, 1, 16, torch.bfloat16, unowned=(1, 0))
    packing = (cu_q, cu_k, max_q, max_k)
    out = attention_varlen(q, k, v, *packing)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    out2, lse = attention_varlen(q, k, v, *packing, return_lse=True)
    out3, lse3, s_dmask = attention_varlen(q, k, v, *packing, return_attn_probs=True, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(out, out3) and torch.equal(lse, lse3)
    assert lse.shape == (2, 11) and lse.dtype == torch.float32 and torch.isinf(lse[:, 10]).all()
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype and s_dmask.device == q.device
    assert torch.equal(attention_varlen(q, k, v, *packing, 0.0, None, True),
                       attention_varlen(q, k, v, *packing, causal=True))
    assert not torch.equal(attention_varlen(q, k, v, *packing, 0.0, None, True), out)
    dropped = seeded_varlen(q, k, v, *packing, 0.5, return_attn_probs=True)
    assert torch.equal(dropped[0], seeded_varlen(q, k, v, *packing, dropout_p=0.5))
    probs = dropped[2]
    assert probs.shape == (2, 2, 7, 5) and probs.dtype == q.dtype
    assert not probs[0, :, 3:].any() and not probs[1, :, :, 2:].any()  # outside (3, 5) and (7, 2)
    assert (probs < 0).any() and (probs > 0).any()


def test_empty_inputs_give_empty_outputs_without_attention_launches(monkeypatch):
    """As flash_attn's: no query, no key, no sequence or no head: out 0 (rows that see no key or
    belong to no sequence), lse +inf, gradients 0, and no attention kernel runs."""
    def no_launch(*args, **kwargs):
        raise AssertionError("an attention kernel was launched for an empty input")

    monkeypatch.setattr(varlen, "attention_forward", no_launch)
    monkeypatch.setattr(varlen, "attention_backward", no_launch)
    cases = [([0, 0], [3, 4], (0, 0)), ([2, 3], [0, 0], (1, 0)), ([], [], (4, 2)), ([0], [0], (2, 3))]
    for lengths_q, lengths_k, unowned in cases:
        for heads in (2, 0):
            q, k, v, *packing = make_packed(lengths_q, lengths_k, heads, heads // 2, 16, torch.float16, unowned)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out, lse = attention_varlen(q, k, v, *packing, causal=True, return_lse=True)
            assert out.shape == q.shape and not out.any() and lse.shape == (heads, q.shape[0])
            assert torch.all(lse == math.inf)
            for t, g in zip((q, k, v), torch.autograd.grad(out, (q, k, v), torch.randn_like(out))):
                assert g.shape == t.shape and g.dtype == t.dtype and not g.any()


def bad_inputs():
    """(build, error, message): build(case) returns the changed arguments of a good call."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return [
        (lambda c: dict(q=c["q"].numpy(force=True)), TypeError, "q must be a torch.Tensor"),
        (lambda c: dict(q=c["q"].double()), TypeError, "q must have dtype"),
        (lambda c: dict(k=c["k"].half()), TypeError, "k must have the dtype of q"),
        (lambda c: dict(q=c["q"][None]), ValueError, "q must have 3 dimensions"),
        (lambda c: dict(v=c["v"][None]), ValueError, "v must have 3 dimensions"),
        (lambda c: dict(k=c["k"][..., :16], v=c["v"][..., :16]), ValueError,
         r"k must have shape \(total_k, kv_heads, head_dim=32\)"),
        (lambda c: dict(v=c["v"][:5]), ValueError, "v must have the shape of k"),
        (lambda c: dict(q=c["q"][:, :3]), ValueError, "kv_heads of k and v .2. must divide"),
        (lambda c: dict(q=c["q"][..., :8], k=c["k"][..., :8], v=c["v"][..., :8]), ValueError,
         "head_dim .* between 16 and 256"),
        (lambda c: dict(cu_seqlens_q=c["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q must have dtype int32"),
        (lambda c: dict(cu_seqlens_k=c["cu_seqlens_k"].float()), TypeError, "cu_seqlens_k must have dtype int32"),
        (lambda c: dict(cu_seqlens_q=[0, 3, 9]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (lambda c: dict(cu_seqlens_q=c["cu_seqlens_q"][None]), ValueError, "cu_seqlens_q must have 1 dimensions"),
        (lambda c: dict(cu_seqlens_q=torch.zeros(0, **i32), cu_seqlens_k=torch.zeros(0, **i32)), ValueError,
         "cu_seqlens_q must hold batch \\+ 1 >= 1 offsets"),
        (lambda c: dict(cu_seqlens_k=c["cu_seqlens_k"][:2]), ValueError,
         r"cu_seqlens_k must have the shape of cu_seqlens_q, \(batch \+ 1,\) = \(3,\); got \(2,\)"),
        (lambda c: dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q must be an int"),
        (lambda c: dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int"),
        (lambda c: dict(max_seqlen_q=torch.tensor(6)), TypeError, "max_seqlen_q must be an int .*a tensor"),
        (lambda c: dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0; got -1"),
        (lambda c: dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        (lambda c: dict(softmax_scale=math.nan), ValueError, "softmax_scale must be finite"),
        (lambda c: dict(causal=None), TypeError, "causal must be a bool"),
        (lambda c: dict(window_size=(3,)), TypeError, "window_size must be a pair of ints"),
        (lambda c: dict(softcap="5"), TypeError, "softcap must be a real number"),
        (lambda c: dict(alibi_slopes=torch.ones(3, 4, device=DEVICE)), ValueError,
         r"alibi_slopes must have shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\); got \(3, 4\)"),
        (lambda c: dict(alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)), TypeError,
         "alibi_slopes must be float32"),
        (lambda c: dict(block_table=torch.zeros(2, 1, **i32)), NotImplementedError, "block_table"),
    ]


@pytest.mark.parametrize("build, error, message", bad_inputs())
def test_bad_inputs_raise_clear_errors(build, error, message, no_launch):
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed([3, 6], [5, 4], 4, 2, 32, torch.float32, unowned=(0, 0))
    call = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    with pytest.raises(error, match=message):
        attention_varlen(**(call | build(call)))


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_offsets_on_another_device_are_refused():
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed([3, 6], [5, 4], 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q is on cpu"):
        attention_varlen(q, k, v, cu_q.cpu(), cu_k, max_q, max_k)


# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) against q of 9 rows, k of 9
BAD_OFFSETS = [
    ([1, 3, 9], [0, 5, 9], 6, 5, r"cu_seqlens_q must start at 0, never decrease and end at most at total_q = 9"),
    ([0, 5, 3], [0, 5, 9], 6, 5, "cu_seqlens_q must start at 0, never decrease"),
    ([0, 3, 10], [0, 5, 9], 7, 5, r"cu_seqlens_q .* end at most at total_q = 9"),
    ([0, 3, 9], [0, 5, 9], 5, 5, r"no sequence may be longer than max_seqlen_q = 5"),
    ([0, 3, 9], [0, 5, 12], 6, 7, r"cu_seqlens_k .* end at most at total_k = 9"),
    ([0, 3, 9], [0, 5, 9], 6, 4, r"no sequence may be longer than max_seqlen_k = 4"),
    ([0, 3, 9], [0, -2147483648, 9], 6, 5, "cu_seqlens_k must start at 0, never decrease"),
]


@pytest.mark.parametrize("cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, message", BAD_OFFSETS)
def test_offsets_are_checked_on_the_device(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, message):
    """Offsets that do not start at 0, decrease, run past the packed rows, or hold a sequence longer
    than max_seqlen are refused before any attention kernel runs (on a GPU by a device-side assert,
    without waiting for the device: in a process of its own, since the assert leaves the CUDA
    context unusable)."""
    q, k, v = (randn(9, heads, 16) for heads in (2, 1, 1))
    assert_refused_on_the_device("attention_varlen", message, q, k, v, offsets_of(cu_seqlens_q),
                                 offsets_of(cu_seqlens_k), max_seqlen_q, max_seqlen_k)


def offsets_of(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_unchecked_offsets_keep_the_kernels_inside_the_tensors(monkeypatch):
    """While traced or captured the offsets go unchecked: a sequence longer than max_seqlen_q, one
    whose keys run past total_k, and a last offset past total_q must not move a program outside q,
    k, v or the outputs (sequence_rows clamps them). The sequences the offsets describe correctly
    keep their results."""
    monkeypatch.setattr(varlen, "traced_or_captured", lambda: True)
    q, k, v = (randn(n, heads, 16) for n, heads in ((40, 2), (30, 1), (30, 1)))
    cu_q, cu_k = offsets_of([0, 5, 39, 70]), offsets_of([0, 6, 20, 50])
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 33, 14, causal=True, return_lse=True)
    ref_out, ref_lse = varlen_reference(q[:5], k[:6], v[:6], cu_q[:2], cu_k[:2], causal=True)
    assert_within_same_computation("out of the good sequence", out[:5], naive_varlen(q, k, v)[0], ref_out,
                                   torch.float32)
    assert torch.isfinite(out[5:38]).all()  # the long sequence's first 33 rows: written, not attention's


def naive_varlen(q, k, v):
    return varlen_reference(q[:5], k[:6], v[:6], offsets_of([0, 5]), offsets_of([0, 6]), causal=True,
                            attend=naive_attention)


# --- torch.library registration and torch.compile ------------------------------------------------

@pytest.mark.parametrize("window, softcap, with_alibi, dropout_p",
                         [((3, 2), 5.0, True, 0.3)] + ([((-1, 0), 0.0, False, 0.0)] if ON_GPU else []))
def test_opcheck(window, softcap, with_alibi, dropout_p):
    q, k, v, cu_q, cu_k, max_q, max_k = make_packed([5, 9], [7, 4], 1, 1, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = (0.25, *window, softcap, alibi(2, 1) if with_alibi else None, dropout_p,
               varlen.draw_dropout_seed(dropout_p, q.device))
    packing = (cu_q, cu_k, max_q, max_k)
    torch.library.opcheck(attention_varlen_op.op, (q, k, v, *packing, *options))
    out, lse = attention_varlen_op(q, k, v, *packing, *options)
    torch.library.opcheck(attention_varlen_op.backward_op, (q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                            torch.randn_like(out), *packing, *options))
    if dropout_p:
        torch.library.opcheck(attention_varlen_probabilities, (q.detach(), k.detach(), lse, *packing, *options))


def test_torch_compile_fullgraph_matches_eager():
    """Traced without a graph break, forward and backward, S_dmask too: the compiled graph gives
    eager's bits for the same seed and draws a fresh mask at every call."""
    torch._dynamo.reset()
    q, k, v, *packing = make_packed([5, 0, 9], [7, 3, 4], 2, 1, 16, torch.float32)
    options = dict(dropout_p=0.3, causal=True, window_size=(4, 1), softcap=5.0, alibi_slopes=alibi(2))

    def loss(q, k, v, cu_seqlens_q, cu_seqlens_k):
        out, lse, s_dmask = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *packing[2:],
                                             return_attn_probs=True, **options)
        return (out * out).sum() + lse.nan_to_num(posinf=0.0).sum() + s_dmask.abs().sum()

    # aot_eager, as tests/test_attention.py: inductor draws the dropout seed from a generator of its own
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, loss):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(DROPOUT_SEED)
        value = fn(*leaves, *packing[:2])
        results.append((value, *torch.autograd.grad(value, leaves)))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert compiled(q, k, v, *packing[:2]) != compiled(q, k, v, *packing[:2])


# --- on the GPU: the sizes and options users run --------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled kernels at the tiles users run")
@pytest.mark.parametrize("head_dim", [16, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_head_dims_and_dtypes_on_the_gpu(head_dim, dtype):
    lengths_q, lengths_k = [1, 700, 0, 129, 64], [300, 700, 9, 128, 0]
    check_varlen(*make_packed(lengths_q, lengths_k, 4, 2, head_dim, dtype), True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled kernels at the tiles users run")
def test_many_short_sequences_and_a_long_one_on_the_gpu():
    """A training batch's shape: 64 short sequences and one of 8192 tokens, bfloat16, causal."""
    lengths = [int(n) for n in torch.randint(1, 300, (64,))] + [8192]
    check_varlen(*make_packed(lengths, lengths, 8, 2, 128, torch.bfloat16, unowned=(0, 0)), True)
