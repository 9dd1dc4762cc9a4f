"""Chapter 6: bidirectional SSMs as quasiseparable matrices, both directions in one fused pipeline."""
from .api import bidirectional_chunk_scan

__all__ = ["bidirectional_chunk_scan"]
