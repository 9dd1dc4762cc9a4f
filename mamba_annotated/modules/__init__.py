"""nn.Module blocks on the package's kernels, and a small language model that stacks them.

* :class:`Mamba2` and :class:`Mamba`: mamba_ssm's modules (same constructors and state_dicts);
* :class:`Hydra` and :class:`BiMamba2`: bidirectional Mamba-2 mixers (encoders: no decoding);
* :class:`MHA`: attention with rotary embeddings, GQA and a KV cache;
* :class:`LMHeadModel` (:class:`LMConfig` picks the mixer of each layer) with ``generate``.

Decoding follows mamba_ssm: pass an :class:`InferenceParams`; its ``seqlen_offset`` is 0 for the
prefill (the chunked kernels, which leave every layer's state) and the position of the token
afterwards (each block's ``step``: :func:`~mamba_annotated.ssd.step.ssd_state_update`,
:func:`~mamba_annotated.scan.selective_step.selective_state_update`, the KV cache).
"""
from .hydra import BiMamba2, Hydra
from .layers import InferenceParams, RMSNorm, RMSNormGated, RotaryEmbedding
from .lm import Block, GatedMLP, LMConfig, LMHeadModel, MixerModel, sample
from .mamba import Mamba
from .mamba2 import Mamba2
from .mha import MHA

__all__ = ["Mamba", "Mamba2", "Hydra", "BiMamba2", "MHA", "RMSNorm", "RMSNormGated", "RotaryEmbedding",
           "InferenceParams", "LMConfig", "MixerModel", "LMHeadModel", "Block", "GatedMLP", "sample"]
