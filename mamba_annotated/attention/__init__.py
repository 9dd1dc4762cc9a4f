"""Chapter 7: memory-efficient attention (FlashAttention-2 style), forward and backward."""
from .api import attention

__all__ = ["attention"]
