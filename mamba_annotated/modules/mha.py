"""The attention block on the package's ``attention`` kernel: multi-head (or grouped-query)
self-attention with rotary embeddings and a KV cache for decoding."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import attention
from ..conv1d import depthwise_conv1d
from .layers import RotaryEmbedding, causal_conv1d_step, conv_state_of


class MHA(nn.Module):
    """mamba_ssm 2.3.2.post1's ``MHA`` (modules/mha.py, the attention layer of its hybrid models):
    the same constructor arguments (order and defaults), parameters and state_dict keys, on
    :func:`~mamba_annotated.attention` (flash_attn's ``flash_attn_func``; GQA without repeating
    k and v).

    in_proj makes q, k, v (num_heads, num_heads_kv, num_heads_kv heads of head_dim) and, with
    ``mlp_dim`` > 0 (rounded up to a multiple of 256 as mamba_ssm), a gated MLP branch whose
    output is concatenated before out_proj; with ``d_conv`` > 0 a causal depthwise conv (no
    activation) runs over q, k, v; rotary embeddings on the first ``rotary_emb_dim`` channels of
    q and k (:class:`.layers.RotaryEmbedding`: flash_attn's, without flash_attn).

    Decoding: with ``inference_params`` the keys and values go into the layer's cache
    (batch, max_seqlen, 2, num_heads_kv, head_dim) at ``seqlen_offset``, and the queries attend to
    the cache up to the new position; ``causal`` aligns the mask to the bottom-right corner (the
    last query sees every key), as flash_attn. So a causal block decodes token by token exactly
    as its forward pass computes the whole sequence. (mamba_ssm's path without flash_attn uses
    torch's top-left aligned ``is_causal`` there, under which a decoded token would see the first
    key only; its flash_attn path agrees with this one.) A non-causal block decodes each new token
    against the past only, which its forward pass on the whole sequence does not.
    With ``d_conv`` > 0 the prefill caches the conv's last d_conv *inputs*, which the step shifts
    its new input into (mamba_ssm caches the conv's outputs there, so its first decoded token
    convolves outputs with inputs). ``inference_params.lengths_per_sample`` (per-row cache
    lengths) is not implemented
    (NotImplementedError). head_dim must be 16 to 256 (the attention kernel's range).
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True,
                 out_proj_bias=True, softmax_scale=None, causal=False, layer_idx=None, d_conv=0, rotary_emb_dim=0,
                 rotary_emb_base=10000.0, rotary_emb_interleaved=False, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim, self.layer_idx, self.d_conv = embed_dim, layer_idx, d_conv
        self.rotary_emb_dim, self.softmax_scale, self.causal = rotary_emb_dim, softmax_scale, causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_heads_kv ({self.num_heads_kv})")
        if head_dim is None and embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.head_dim = head_dim if head_dim is not None else embed_dim // num_heads
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        out_dim = self.head_dim * num_heads
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, interleaved=rotary_emb_interleaved,
                                              device=device)
        self.in_proj = nn.Linear(embed_dim, qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **factory_kwargs)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=d_conv, padding=d_conv - 1, groups=qkv_dim,
                                    **factory_kwargs)
        self.out_proj = nn.Linear(out_dim + self.mlp_dim // 2, embed_dim, bias=out_proj_bias, **factory_kwargs)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """(kv_cache (batch, max_seqlen, 2, num_heads_kv, head_dim), conv_state (batch, qkv_dim, d_conv)
        or None), as mamba_ssm (the KV cache uninitialised: only written positions are read)."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        device = self.out_proj.weight.device
        conv_state = (torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device, dtype=dtype)
                      if self.d_conv > 0 else None)
        kv_cache = torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype, device=device)
        return kv_cache, conv_state

    def project(self, x):
        """in_proj, split into qkv and the MLP branch's output (or None)."""
        qkv = self.in_proj(x)
        if self.mlp_dim == 0:
            return qkv, None
        qkv, x_mlp = qkv.split([qkv.shape[-1] - self.mlp_dim, self.mlp_dim], dim=-1)
        up, gate = x_mlp.chunk(2, dim=-1)
        return qkv, up * F.silu(gate)

    def attend(self, qkv, x_mlp, seqlen_offset, kv_cache):
        """Rotary at the positions from seqlen_offset, attention (over the cache, once the new keys
        and values are written to it, when there is one), out_proj."""
        q, kv = qkv.split([self.num_heads * self.head_dim, self.num_heads_kv * 2 * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k, v = kv.unflatten(-1, (2, self.num_heads_kv, self.head_dim)).unbind(dim=-3)
        if self.rotary_emb_dim > 0:
            q, k = self.rotary_emb(q, k, seqlen_offset=seqlen_offset)
        if kv_cache is not None:
            end = seqlen_offset + q.shape[1]
            if end > kv_cache.shape[1]:
                raise ValueError(f"the KV cache holds {kv_cache.shape[1]} positions (max_seqlen); decoding "
                                 f"position {end - 1} does not fit")
            kv_cache[:, seqlen_offset:end, 0] = k
            kv_cache[:, seqlen_offset:end, 1] = v
            # a cache of another dtype than the projection's (allocated by hand, outside autocast) is
            # read in q's: the kernel takes q, k, v of one dtype
            k, v = kv_cache[:, :end, 0].to(q.dtype), kv_cache[:, :end, 1].to(q.dtype)
        context = attention(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal).flatten(-2)
        if x_mlp is not None:
            context = torch.cat([context, x_mlp], dim=-1)
        return self.out_proj(context)

    def forward(self, x, inference_params=None):
        """x (batch, seqlen, embed_dim) -> same shape. With ``inference_params`` (and layer_idx)
        the block fills its cache (prefill, seqlen_offset 0) or decodes one token by :meth:`step`."""
        if inference_params is None:
            qkv, x_mlp = self.project(x)
            if self.d_conv > 0:
                qkv = depthwise_conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                                       self.d_conv - 1).transpose(1, 2)
            return self.attend(qkv, x_mlp, 0, None)
        if self.layer_idx is None:
            raise ValueError("decoding with inference_params needs the block's layer_idx (pass layer_idx=...)")
        if inference_params.lengths_per_sample is not None:
            raise NotImplementedError("inference_params.lengths_per_sample: per-row cache lengths are not "
                                      "implemented; every row is at seqlen_offset")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            # the cache holds what the projection makes: the autocast dtype under autocast (the residual
            # stream x stays float32 there), else x's
            autocast = torch.is_autocast_enabled(x.device.type)
            dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
            cache[self.layer_idx] = self.allocate_inference_cache(x.shape[0], inference_params.max_seqlen,
                                                                  dtype=dtype)
        kv_cache, conv_state = cache[self.layer_idx]
        rows = slice(inference_params.batch_size_offset, inference_params.batch_size_offset + x.shape[0])
        kv_cache = kv_cache[rows]
        conv_state = conv_state[rows] if conv_state is not None else None
        if inference_params.seqlen_offset > 0:
            out, _, _ = self.step(x, kv_cache, conv_state, inference_params.seqlen_offset)
            return out
        qkv, x_mlp = self.project(x)
        if self.d_conv > 0:
            qkv_t = qkv.transpose(1, 2)
            conv_state.copy_(conv_state_of(qkv_t, self.d_conv))
            qkv = depthwise_conv1d(qkv_t, self.conv1d.weight, self.conv1d.bias, self.d_conv - 1).transpose(1, 2)
        return self.attend(qkv, x_mlp, 0, kv_cache)

    def step(self, hidden_states, kv_cache, conv_state, seqlen_offset):
        """One token at position ``seqlen_offset``: hidden_states (batch, 1, embed_dim); its key and
        value are written into kv_cache (batch, max_seqlen, 2, num_heads_kv, head_dim) and the conv
        state (or None) shifted, in place. Returns (out (batch, 1, embed_dim), kv_cache, conv_state)."""
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time; got hidden_states of shape "
                             f"{tuple(hidden_states.shape)}")
        qkv, x_mlp = self.project(hidden_states)
        if self.d_conv > 0:
            qkv = causal_conv1d_step(qkv.squeeze(1), conv_state, self.conv1d.weight, self.conv1d.bias).unsqueeze(1)
        return self.attend(qkv, x_mlp, seqlen_offset, kv_cache), kv_cache, conv_state
