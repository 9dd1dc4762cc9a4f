"""Chapter 5: Mamba-2's state-space duality (SSD), computed chunk by chunk in Triton."""
from .api import ssd_chunk_scan

__all__ = ["ssd_chunk_scan"]
