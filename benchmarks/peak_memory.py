"""Peak GPU memory of one call, the way every benchmark's ``peak_MB`` column measures it."""
import gc

import torch


def peak_mib(fn) -> float:
    """Peak memory of one call of ``fn()``, in MiB above what was allocated before it (GPU only).

    The garbage collector runs first: a tensor that is unreachable but not yet freed (held by a
    reference cycle) counts in the baseline, and if the collector freed it during the call the peak
    would come out low by its size. (One bench_bidirectional run recorded a peak far below what a
    clean process measured for the same call; the cause was not found, and this one is ruled out.)"""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
