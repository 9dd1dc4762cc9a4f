"""Block sizes of the SSD kernels: autotuned on a GPU, one small fixed choice in the interpreter.

Triton's interpreter cannot autotune over several configurations (and timing there means
nothing), so it gets ``cpu_config``: 16-wide blocks, the smallest that ``tl.dot`` accepts on a
GPU. Configurations whose row or column blocks exceed the chunk are dropped before tuning.
``MAMBA_ANNOTATED_AUTOTUNE=0`` keeps only the first GPU configuration and the 16-wide one (quick
test runs: tuning compiles every configuration for every new problem shape).
The tuner's trial runs write the real output buffers, so a result must not depend on which
configurations ran before: partial results use a layout that every configuration writes in full
(the SSD kernels have no atomic accumulators; one would have to go in ``reset_to_zero``), and
tests/test_ssd.py tunes in the interpreter too.
"""
import os

import triton

from ..runtime import INTERPRETED

CHUNK_BLOCKS = ("BLOCK_M", "BLOCK_K")


def fits_chunk(configs, named_args, **kwargs):
    chunk = {**named_args, **kwargs}["CHUNK"]
    kept = [c for c in configs if all(c.kwargs.get(k, 0) <= chunk for k in CHUNK_BLOCKS)]
    if kept:
        return kept
    smallest = {k: (min(v, chunk) if k in CHUNK_BLOCKS else v) for k, v in configs[0].kwargs.items()}
    return [triton.Config(smallest, num_warps=4)]


def autotune(gpu_configs, cpu_config, key, reset_to_zero=None):
    """triton.autotune over ``gpu_configs`` (on a GPU) or ``[cpu_config]`` (interpreter)."""
    if INTERPRETED:
        configs = [cpu_config]
    elif os.environ.get("MAMBA_ANNOTATED_AUTOTUNE", "1") == "0":
        # two, not one: triton.autotune only prunes (to fit the chunk) when it has a choice
        configs = [gpu_configs[0], cpu_config]
    else:
        configs = gpu_configs
    return triton.autotune(configs=configs, key=key,
                           reset_to_zero=reset_to_zero, prune_configs_by={"early_config_prune": fits_chunk})


def config(num_warps=4, num_stages=3, **blocks):
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)
