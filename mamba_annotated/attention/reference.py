"""Attention written out in plain PyTorch: the N x N score matrix, materialised.

``naive_attention`` is the ground truth of chapter 7 when run in float64, and, run in a 16-bit
dtype, the yardstick of FlashAttention's error rule: a kernel's error against the float64 result
may be at most twice the error of this same computation done in the kernel's dtype.
"""
import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: j <= i + seqlen_k - seqlen_q.

    The diagonal is aligned to the bottom-right corner, as in FlashAttention >= 2.1: the last query
    sees every key. With seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see no key at all.
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def naive_attention(q, k, v, causal=False, softmax_scale=None):
    """softmax(scale * q k^T) v in q's dtype; returns (out, lse) in flash_attn's layout.

    q (batch, seqlen_q, heads, d); k, v (batch, seqlen_k, kv_heads, d) with kv_heads dividing heads.
    out like q; lse (batch, heads, seqlen_q), the natural-log sum of exp(scores) of each query row.
    A row that sees no key gets out = 0 and lse = -inf.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # (batch, heads, seqlen, d): each group of heads // kv_heads query heads shares one key/value head
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    k_ = k_.repeat_interleave(heads // kv_heads, dim=1)
    v_ = v_.repeat_interleave(heads // kv_heads, dim=1)
    scores = scale * (q_ @ k_.transpose(-1, -2))
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: 0/0 -> 0
    out = (probs @ v_).transpose(1, 2)
    return out, lse


def attention_ref(q, k, v, causal=False, softmax_scale=None):
    """The float64 ground truth: naive_attention on float64 copies; returns (out, lse) in float64."""
    out, lse = naive_attention(q.double(), k.double(), v.double(), causal, softmax_scale)
    return out, lse


def flash_rule_error(out, torch_same, ref, floor):
    """FlashAttention's accuracy rule: returns (error, bound), error = rel_error(out, ref) and
    bound = 2 * rel_error(torch_same, ref) + floor, where torch_same is the same attention computed
    naively by PyTorch in the kernel's dtype. -inf (rows that see no key) must sit where ref has it
    and is left out of both errors. When ref is exactly zero (dq of rows that see a single key) no
    relative error exists: the bound is then on the RMS of ``out``."""
    from ..testing import rel_error

    infinite = torch.isinf(ref).cpu()
    if not torch.equal(torch.isinf(out).cpu(), infinite):
        return float("inf"), 0.0
    out, torch_same, ref = (torch.where(infinite, 0.0, t.detach().cpu().double()) for t in (out, torch_same, ref))
    if not ref.any():
        return out.square().mean().sqrt().item(), floor
    return rel_error(out, ref), 2 * rel_error(torch_same, ref) + floor


FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def assert_flash_rule(name, out, torch_same, ref, dtype):
    """Raise AssertionError unless ``out`` passes :func:`flash_rule_error` for inputs of ``dtype``."""
    error, bound = flash_rule_error(out, torch_same, ref, FLOOR[dtype])
    if not error <= bound:
        raise AssertionError(f"{name}: error {error:.3e} above 2 x PyTorch's in {dtype} + floor ({bound:.3e})")


def check_flash_rule(name, out, torch_same, ref, dtype):
    """Notebook form of :func:`assert_flash_rule`: prints one deterministic line, raises on failure."""
    assert_flash_rule(name, out, torch_same, ref, dtype)
    print(f"{name}: error <= 2 x PyTorch's in {str(dtype).removeprefix('torch.')}: True")
