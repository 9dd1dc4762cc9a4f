"""Chapter 7: memory-efficient attention (FlashAttention-2 style), forward and backward, and
attention over a KV cache for decoding (flash_attn's ``flash_attn_with_kvcache``)."""
from .api import attention
from .kvcache import attention_with_kvcache

__all__ = ["attention", "attention_with_kvcache"]
