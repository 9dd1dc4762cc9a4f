"""The small pieces every block shares: RMS norms (modules around the gated-norm kernel of
:mod:`mamba_annotated.gated_norm`), and in plain PyTorch depthwise convolutions along time (causal,
centred, and their decoding step), rotary embeddings, and the decoding cache record.

The norms are a kernel rather than torch ops because, written with torch ops, their float32
intermediates cost a Mamba-2 model about a third of its eager training step time and a third of its
peak memory (README, "Using the kernels"). The rest are a few lines the reader can check
against their formulas.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.rotary import rotate
from ..gated_norm import rmsnorm_fn


@dataclass
class InferenceParams:
    """The decoding cache and position, as mamba_ssm's ``InferenceParams`` (same fields): the
    blocks keep their states in ``key_value_memory_dict[layer_idx]``; ``seqlen_offset`` is the
    number of positions already seen (0 during the prefill). ``lengths_per_sample`` (per-row
    lengths) is not implemented by the attention block, which raises if it is set."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


class CachedStates:
    """For blocks whose decoding state is the (conv_state, ssm_state) pair of their
    ``allocate_inference_cache``, kept in ``inference_params`` under their ``layer_idx``."""

    def get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        """This layer's (conv_state, ssm_state) in ``inference_params``, allocated on first use."""
        if self.layer_idx is None:
            raise ValueError("decoding with inference_params needs the block's layer_idx (pass layer_idx=...)")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, inference_params.max_seqlen)
        conv_state, ssm_state = cache[self.layer_idx]
        if initialize_states:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state


class RMSNorm(nn.Module):
    """RMS normalization (no bias), float32 inside: mamba_ssm's ``RMSNorm`` (its state_dict holds
    ``weight`` only), run by the gated-norm kernel without a gate."""

    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x):
        return rmsnorm_fn(x, self.weight, None, eps=self.eps)


class RMSNormGated(nn.Module):
    """mamba_ssm's gated ``RMSNorm`` (ops/triton/layernorm_gated.py), same arguments and
    state_dict (``weight``), run by the gated-norm kernel (:func:`mamba_annotated.gated_norm.rmsnorm_fn`):
    norm(x) * silu(z) if ``norm_before_gate`` else norm(x * silu(z)); the RMS over groups of
    ``group_size`` channels (None: one group)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"group_size ({group_size}) must divide hidden_size ({hidden_size})")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, None, z, self.eps, self.group_size, self.norm_before_gate)


def conv_state_of(x, width):
    """The last ``width`` inputs of x (batch, channels, L), zero-padded on the left when L < width:
    the cache a causal conv steps from (mamba_ssm keeps ``width`` of them)."""
    return F.pad(x, (width - x.shape[-1], 0))


def causal_conv1d_step(x, conv_state, weight, bias):
    """One position of the causal conv: shifts x (batch, channels) into conv_state (batch, channels,
    width), in place, and returns sum_k weight_k state_k + bias (no activation), as mamba_ssm's
    step without causal_conv1d."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = (conv_state * weight[:, 0]).sum(-1)
    return out + bias if bias is not None else out


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoFormer) on the first ``dim`` channels of each head, as
    flash_attn's ``RotaryEmbedding`` (no xPos scaling): channel pairs (i, i + dim/2) (or (2i, 2i+1)
    when ``interleaved``) rotate by position * base^(-2i/dim). The angles and the rotation are
    computed in float32 and the result rounded to the input's dtype. ``inv_freq`` is a
    non-persistent buffer, as flash_attn's: it is not in the state_dict."""

    def __init__(self, dim, base=10000.0, interleaved=False, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary_emb_dim must be even; got {dim}")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x, seqlen_offset):
        """x (batch, L, heads, head_dim) at positions seqlen_offset ... seqlen_offset + L - 1."""
        positions = torch.arange(seqlen_offset, seqlen_offset + x.shape[1], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.to(x.device))  # (L, dim / 2): the tables for these positions
        rows = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return rotate(x, angles.cos(), angles.sin(), rows, self.interleaved)

    def forward(self, q, k, seqlen_offset=0):
        return self.rotate(q, seqlen_offset), self.rotate(k, seqlen_offset)
