"""mamba_annotated: the Triton kernels behind Mamba, Mamba-2, bidirectional SSMs and
memory-efficient attention, each derived in a chapter of the Annotated Mamba book.

Importing the package first decides where kernels run (:mod:`mamba_annotated.runtime`): with no
CUDA device it turns on Triton's interpreter, which must happen before any kernel is defined.
"""
from . import runtime  # noqa: F401  (first: sets TRITON_INTERPRET before kernels are defined)
from .attention import attention, attention_varlen, attention_with_kvcache
from .bidirectional import bidirectional_chunk_scan
from .gated_norm import rmsnorm_fn
from .scan import linear_scan, selective_scan, sequential_scan
from .scan.selective_step import selective_state_update
from .ssd import ssd_chunk_scan
from .ssd.step import ssd_state_update
from .modules import BiMamba2, Hydra, InferenceParams, LMConfig, LMHeadModel, MHA, Mamba, Mamba2

__all__ = ["sequential_scan", "linear_scan", "selective_scan", "ssd_chunk_scan", "bidirectional_chunk_scan",
           "attention", "attention_varlen", "attention_with_kvcache", "rmsnorm_fn", "selective_state_update",
           "ssd_state_update", "Mamba", "Mamba2", "Hydra", "BiMamba2", "MHA", "InferenceParams", "LMConfig",
           "LMHeadModel"]
__version__ = "0.1.0"
