"""Allocation of kernel outputs, with an optional poison fill for tests.

Every launcher allocates what its kernel writes through :func:`empty`. Normally that is
``torch.empty``; inside :func:`mamba_annotated.testing.poisoned_outputs` the tensor is filled
with NaN first, so an element the kernel forgets to write shows up as NaN in the comparison
instead of passing by luck with whatever the allocator left there.
"""
import torch

_poison = False


def set_poison(enabled: bool) -> bool:
    """Turn the NaN fill on or off; returns the previous setting."""
    global _poison
    previous, _poison = _poison, enabled
    return previous


def empty(shape, dtype, device) -> torch.Tensor:
    # sizes passed one by one: PyTorch parses a tuple (and a torch.Size more so) microseconds slower,
    # and a model allocates outputs at every launch
    out = torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)
    if _poison:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out
