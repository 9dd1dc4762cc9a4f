"""Rotary position embeddings (RoFormer) from given cos/sin tables, at given positions: what
:func:`.kvcache.attention_with_kvcache` applies to the new keys and to the queries, as flash_attn's
``flash_attn_with_kvcache`` does inside its kernel.

The first ``rotary_dim`` channels of each head are rotated in pairs, each pair by its own angle,
the pair's row of the tables at the token's position; the other channels pass unchanged. The pairs
are (2c, 2c + 1) when ``interleaved`` (GPT-J's layout, flash_attn's default here) and
(c, c + rotary_dim / 2) otherwise (GPT-NeoX's), for c < rotary_dim / 2:

    x'_a = x_a cos - x_b sin,    x'_b = x_b cos + x_a sin.

The arithmetic is float32 whatever the dtypes, and the result is rounded once to x's dtype: the
keys are stored in the cache rounded, and the queries enter the attention rounded, as flash_attn's
kernel rounds them (it rotates in registers and writes the input dtype to shared memory).
"""
import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x (batch, L, heads, d) rotated, in x's dtype (a new tensor).

    ``cos``, ``sin`` (seqlen_ro, rotary_dim / 2): the tables, any float dtype, rotary_dim <= d;
    ``positions`` (batch, L) integer: the row of the tables for each token (broadcast over the
    heads), every one below seqlen_ro (not checked here: :mod:`.kvcache` checks its calls)."""
    half = cos.shape[1]
    angle_cos = cos.float()[positions][:, :, None]  # (batch, L, 1, rotary_dim / 2)
    angle_sin = sin.float()[positions][:, :, None]
    rot = x[..., :2 * half].float()
    if interleaved:
        x_a, x_b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x_a * angle_cos - x_b * angle_sin, x_b * angle_cos + x_a * angle_sin], dim=-1)
        rotated = rotated.flatten(-2)
    else:
        x_a, x_b = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x_a * angle_cos - x_b * angle_sin, x_b * angle_cos + x_a * angle_sin], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)
