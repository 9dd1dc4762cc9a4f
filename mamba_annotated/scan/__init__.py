"""Chapters 1-4: the first-order linear recurrence and Mamba-1's selective scan."""
from .api import linear_scan, selective_scan, sequential_scan

__all__ = ["sequential_scan", "linear_scan", "selective_scan"]
