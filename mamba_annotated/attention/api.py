"""Public attention function: flash_attn's ``flash_attn_func``, its input checks, and the op
registered with torch.library (:mod:`..library`) around chapter 7's kernels."""
import math
import numbers
from collections.abc import Sequence
from typing import Optional

import torch

from ..library import NAMESPACE, define_op, last_dim_contiguous
from ..validation import check_tensor
from .backward import attention_backward
from .forward import attention_forward
from .probabilities import marked_probabilities

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def check_attention_inputs(q, k, v, packed=False):
    """q (batch, seqlen_q, heads, d); k, v (batch, seqlen_k, kv_heads, d); kv_heads divides heads.
    Any size may be 0 but the head dim. ``packed``: flash_attn's varlen layout, q (total_q, heads,
    d), k, v (total_k, kv_heads, d)."""
    ndim = 3 if packed else 4
    check_tensor("q", q, ndim=ndim)
    check_tensor("k", k, ndim=ndim)
    check_tensor("v", v, ndim=ndim)
    heads, head_dim = q.shape[-2], q.shape[-1]
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")
    if k.shape[-1] != head_dim or (not packed and k.shape[0] != q.shape[0]):
        expected = "(total_k, kv_heads" if packed else f"(batch={q.shape[0]}, seqlen_k, kv_heads"
        raise ValueError(f"k must have shape {expected}, head_dim={head_dim}) to match q {tuple(q.shape)}; "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}; got {tuple(v.shape)}")
    kv_heads = k.shape[-2]
    divides = heads % kv_heads == 0 if kv_heads else heads == 0  # no kv head: no query head either
    if not divides:
        raise ValueError(f"the kv_heads of k and v ({kv_heads}) must divide the heads of q ({heads})")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (last dimension of q, k, v) must be between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM}; got {head_dim}")


def check_real(name, value):
    # type() first: an isinstance against the numbers ABC costs a microsecond on every call
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")


def resolve_window(causal, window_size, seqlen_k) -> tuple[int, int]:
    """(left, right), -1 for an unbounded side, after flash_attn's reading of ``window_size``: a
    side that is negative or at least seqlen_k is unbounded, and causal sets right = 0. So (-1, -1)
    is full attention, (-1, 0) causal attention, anything else local (sliding-window) attention."""
    if isinstance(causal, torch.Tensor) or not isinstance(causal, (bool, numbers.Integral)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if type(window_size) is tuple and tuple(map(type, window_size)) == (int, int) and window_size == (-1, -1):
        return (-1, 0) if causal else (-1, -1)  # the default, decided without the ABC checks below (a microsecond each)
    if (isinstance(window_size, (str, torch.Tensor)) or not isinstance(window_size, Sequence)
            or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    left, right = (-1 if w < 0 or w >= seqlen_k else int(w) for w in window_size)
    return left, 0 if causal else right


def check_softcap(softcap) -> float:
    """softcap as a float; flash_attn reads any softcap <= 0 as off, returned as 0.0."""
    check_real("softcap", softcap)
    return float(softcap) if softcap > 0 else 0.0


def check_alibi_slopes(alibi_slopes, q, batch=None):
    """ALiBi slopes: float32, (heads,) or (batch, heads), on q's device; constants, as in flash_attn,
    which returns no gradient for them (a slope that requires one is refused rather than left
    without it). ``batch`` defaults to q's first size (packed sequences pass theirs)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a tensor or None; got {type(alibi_slopes).__name__}")
    batch, heads = q.shape[0] if batch is None else batch, q.shape[-2]
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, as in flash_attn; got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on the device of q ({q.device}); got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = ({batch}, {heads}); "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("alibi_slopes: no gradient with respect to the slopes (flash_attn has none "
                                  "either); pass alibi_slopes.detach() for fixed slopes")


def check_dropout(dropout_p) -> float:
    check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return float(dropout_p)


def checked_options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, window_reach,
                    batch=None) -> tuple[float, int, int, float, float]:
    """The options flash_attn_func and flash_attn_varlen_func share, checked and resolved:
    (softmax_scale, window_left, window_right, softcap, dropout_p). ``window_reach``: the key count
    a window side is read against (:func:`resolve_window`); ``batch``: for the ALiBi slopes' shape."""
    dropout_p = check_dropout(dropout_p)
    softcap = check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, q, batch)
    if softmax_scale is not None:
        check_real("softmax_scale", softmax_scale)
    window_left, window_right = resolve_window(causal, window_size, window_reach)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return scale, window_left, window_right, softcap, dropout_p


def draw_dropout_seed(dropout_p: float, device: torch.device) -> Optional[torch.Tensor]:
    """The seed of one call's dropout mask, drawn from PyTorch's generator of q's device (so
    ``torch.manual_seed`` reproduces the mask) as a one-element tensor that the kernels read:
    no synchronisation with the GPU, a fresh value on every call even inside a compiled graph or
    a CUDA graph replay, where a Python number would be frozen. None without dropout."""
    if dropout_p == 0.0:
        return None
    return torch.randint(2 ** 62, (1,), dtype=torch.int64, device=device)


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window_left: int,
                      window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                      dropout_seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), both contiguous. With no query or no key there is nothing to launch: out is 0
    and a row that sees no key has lse = +inf, as in flash_attn."""
    if q.numel() == 0 or k.numel() == 0:
        batch, seqlen_q, heads, _ = q.shape
        lse = torch.full((batch, heads, seqlen_q), math.inf, dtype=torch.float32, device=q.device)
        return q.new_zeros(q.shape), lse
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    return attention_forward(q, k, v, softmax_scale=softmax_scale, window=(window_left, window_right),
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)


def fake_attention_outputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                           dropout_seed):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def attention_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], dropout_p: float, dropout_seed: Optional[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in the inputs' dtype. With no query or no key the gradients are 0
    (out does not depend on q when no key is seen) and nothing is launched."""
    if q.numel() == 0 or k.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    q, k, v, dout = (last_dim_contiguous(t) for t in (q, k, v, dout))
    return attention_backward(q, k, v, out, lse, dout, softmax_scale=softmax_scale, window=(window_left, window_right),
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)


def fake_attention_gradients(q, k, v, out, lse, dout, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                             dropout_p, dropout_seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def save_attention(ctx, inputs, output):  # torch.library passes ``output`` by keyword
    q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed)
    ctx.options = softmax_scale, window_left, window_right, softcap, dropout_p


def attention_grads(ctx, run_backward, grad_out, _grad_lse):
    q, k, v, out, lse, alibi_slopes, dropout_seed = ctx.saved_tensors
    softmax_scale, window_left, window_right, softcap, dropout_p = ctx.options
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = run_backward(q, k, v, out, lse, grad_out, softmax_scale, window_left, window_right, softcap,
                              alibi_slopes, dropout_p, dropout_seed)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_op = define_op("attention", attention_outputs, fake_attention_outputs, attention_gradients,
                         fake_attention_gradients, save_attention, attention_grads)


@torch.library.custom_op(f"{NAMESPACE}::attention_probabilities", mutates_args=())
def attention_probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                            window_left: int, window_right: int, softcap: float,
                            alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                            dropout_seed: torch.Tensor) -> torch.Tensor:
    """flash_attn's S_dmask (:mod:`.probabilities`), an op of its own so that torch.compile can
    trace a call that asks for it."""
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    return marked_probabilities(q, k, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                dropout_p, dropout_seed)


@attention_probabilities.register_fake
def fake_attention_probabilities(q, k, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                 dropout_p, dropout_seed):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty((batch, heads, seqlen_q, k.shape[1]))


def attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False):
    """softmax(softmax_scale * q k^T) v without materialising the scores (chapter 7): flash_attn's
    ``flash_attn_func``, same arguments in the same order, same defaults and returns.

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim) with kv_heads
    dividing heads (grouped-query attention: query head h uses key/value head h // (heads // kv_heads)).
    float16, bfloat16 or float32 (float32 dots are exact IEEE unless
    ``torch.set_float32_matmul_precision("high")`` allows TF32); 16 <= head_dim <= 256, any; any
    strides. Any other size may be 0: empty inputs give empty outputs, and with seqlen_k = 0 out
    is 0 and lse = +inf.

    ``softmax_scale``: any finite number, 0 and negative included; None means 1 / sqrt(head_dim).
    Query i and key j are ``distance = i + seqlen_k - seqlen_q - j`` apart (the diagonal aligned to
    the bottom-right corner, as flash-attn >= 2.1). ``causal=True`` lets query i see key j iff
    distance >= 0. ``window_size = (left, right)`` (local, sliding-window attention) lets it see
    key j iff -right <= distance <= left; it is read as flash_attn reads it: a side that is
    negative or at least seqlen_k is unbounded, and causal sets right = 0, so (-1, -1) is full
    attention and (-1, 0) causal. Key blocks outside every row's window are skipped, so the cost
    grows with the window, not with seqlen_k. A query that sees no key gets a zero output and
    lse = +inf, flash_attn's convention.
    ``softcap > 0`` caps the logits: softcap * tanh(softmax_scale * q.k / softcap) (softcap <= 0 is
    off, as in flash_attn). ``alibi_slopes`` (float32, (heads,) or (batch, heads)) adds
    -slope * |distance| to the logits, after the cap. flash_attn's CUDA kernel, when causal and
    without a left window, adds slope * j instead: a per-row constant away from this, so out and
    the gradients are the same, but its lse is larger by slope * (i + seqlen_k - seqlen_q). Here
    the bias is the same formula in every mode and near 0 on the diagonal, where float32 rounds
    finest. The slopes get no gradient (nor in flash_attn); slopes that require one are refused.
    ``dropout_p > 0`` zeroes each probability with probability dropout_p and scales the rest by
    1 / (1 - dropout_p), in every call (as flash_attn: pass ``dropout_p=p if self.training else
    0.0``). The mask comes from a counter-based generator (Philox) seeded by a draw from PyTorch's
    generator of q's device, so ``torch.manual_seed`` reproduces it; the backward pass draws it
    again from the same seed rather than storing it. The mask differs from flash_attn's (another
    generator), its distribution does not. ``deterministic`` is accepted and changes nothing: the
    backward pass is always deterministic (every gradient element has one writer; no atomics), so
    two runs give bitwise equal gradients, with dropout too.

    Returns out like q. With ``return_attn_probs=True``, (out, lse, S_dmask) as flash_attn:
    lse (batch, heads, seqlen_q) float32, the natural-log sum of exp(logits) per query row (before
    dropout), and S_dmask, filled only when dropout_p > 0 (an empty tensor of shape (0,) in q's
    dtype otherwise, as flash_attn's): the probabilities (batch, heads, seqlen_q, seqlen_k) in q's
    dtype, negated where dropout zeroed them, 0 outside the window, so that ``S_dmask >= 0`` is
    the keep mask and ``S_dmask.abs()`` the probabilities. flash_attn pads its last two sizes to
    multiples of 128 and stores probabilities scaled by a running maximum; this S_dmask is exactly
    (seqlen_q, seqlen_k), normalised (rows sum to 1), so ``S_dmask[:, :, :seqlen_q, :seqlen_k]``
    reads both. It is for tests: it writes N x N numbers. Keyword-only extra:
    ``return_lse=True`` returns (out, lse) (ignored when return_attn_probs is set, whose tuple
    holds lse already). lse is not differentiable. Differentiable in q, k and v.
    """
    check_attention_inputs(q, k, v)
    scale, window_left, window_right, softcap, dropout_p = checked_options(
        q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, k.shape[1])
    dropout_seed = draw_dropout_seed(dropout_p, q.device)
    out, lse = attention_op(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed)
    if return_attn_probs:
        if dropout_seed is None:
            return out, lse, q.new_empty(0)
        return out, lse, attention_probabilities(q.detach(), k.detach(), lse, scale, window_left, window_right,
                                                 softcap, alibi_slopes, dropout_p, dropout_seed)
    return (out, lse) if return_lse else out
