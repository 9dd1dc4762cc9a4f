"""Chapter 7: memory-efficient attention (FlashAttention-2 style), forward and backward."""
from .api import attention, attention_variant

__all__ = ["attention", "attention_variant"]
