"""Chapter 7: memory-efficient attention (FlashAttention-2 style), forward and backward, over dense
or packed sequences of different lengths (flash_attn's ``flash_attn_varlen_func``), and attention
over a KV cache for decoding (flash_attn's ``flash_attn_with_kvcache``)."""
from .api import attention
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "attention_with_kvcache"]
