"""flash_attn's ``flash_attn_varlen_func``: attention over a batch of sequences of different
lengths, packed one after another without padding, forward and backward, by chapter 7's kernels.

Sequence b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and its keys and values
rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v; it attends to its own keys only, exactly as
``attention`` would on that sequence alone (its diagonal bottom-right aligned with its own lengths).
Padding a batch to its longest sequence would spend the kernels' work, and memory, on the padding;
packed, every query row computed is a real one. The same forward, backward and probabilities
kernels run with ``VARLEN`` set (:mod:`.packed`): each program reads its sequence's rows from
cu_seqlens, on the device, so the host learns nothing of the lengths but the maxima it is given,
and nothing waits for the GPU.

``attention_varlen_op`` registers the computation with torch.library (:func:`..library.define_op`)
so that ``torch.compile(fullgraph=True)`` traces a call; ``attention_varlen`` is the public
function, flash_attn's signature, which checks its arguments and calls the op.
"""
import math
import operator
from typing import Optional

import torch

from ..library import NAMESPACE, define_op, last_dim_contiguous, traced_or_captured
from ..validation import check_same_device, check_tensor
from .api import check_attention_inputs, checked_options, draw_dropout_seed
from .backward import attention_backward
from .forward import attention_forward
from .packed import check_packing
from .probabilities import marked_probabilities


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q):
    """int32, one-dimensional, batch + 1 >= 1 entries, the same count for q and k, on q's device."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1)
        check_same_device(name, t, "q", q)
    if not cu_seqlens_q.shape[0]:
        raise ValueError("cu_seqlens_q must hold batch + 1 >= 1 offsets (0 first); got shape (0,)")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have the shape of cu_seqlens_q, (batch + 1,) = "
                         f"{tuple(cu_seqlens_q.shape)}; got {tuple(cu_seqlens_k.shape)}")


def check_max_seqlen(name, value) -> int:
    """A non-negative Python integer. A tensor is refused: reading it would wait for the GPU."""
    if isinstance(value, (bool, torch.Tensor)):
        raise TypeError(f"{name} must be an int (a host number: a tensor would be read, waiting for the "
                        f"device); got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value


def nothing_to_launch(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> bool:
    """No query row or no key in any sequence (or no sequence): every output row is a row that sees
    no key."""
    return q.numel() == 0 or k.numel() == 0 or cu_seqlens_q.shape[0] == 1 or not (max_seqlen_q and max_seqlen_k)


def varlen_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                   dropout_p: float, dropout_seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (total_q, heads, d) contiguous, lse (heads, total_q) float32. cu_seqlens are
    checked against the lengths on the device first (:func:`.packed.check_packing`), unless traced
    or captured. With nothing to launch, out is 0 and lse +inf."""
    if not traced_or_captured():
        check_packing(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if nothing_to_launch(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32, device=q.device)
        return q.new_zeros(q.shape), lse
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    return attention_forward(q, k, v, softmax_scale=softmax_scale, window=(window_left, window_right),
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             dropout_seed=dropout_seed, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def fake_varlen_outputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                        window_right, softcap, alibi_slopes, dropout_p, dropout_seed):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def varlen_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                     alibi_slopes: Optional[torch.Tensor], dropout_p: float, dropout_seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in the inputs' dtype; 0 with nothing to launch (out depends on no
    input then)."""
    if nothing_to_launch(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    q, k, v, dout = (last_dim_contiguous(t) for t in (q, k, v, dout))
    return attention_backward(q, k, v, out, lse, dout, softmax_scale=softmax_scale, window=(window_left, window_right),
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                              dropout_seed=dropout_seed, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def fake_varlen_gradients(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def save_varlen(ctx, inputs, output):  # torch.library passes ``output`` by keyword
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
     alibi_slopes, dropout_p, dropout_seed) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
    ctx.options = max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p


def varlen_grads(ctx, run_backward, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p = ctx.options
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = run_backward(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed)
    return dq, dk, dv, *(None,) * 11


attention_varlen_op = define_op("attention_varlen", varlen_outputs, fake_varlen_outputs, varlen_gradients,
                                fake_varlen_gradients, save_varlen, varlen_grads)


@torch.library.custom_op(f"{NAMESPACE}::attention_varlen_probabilities", mutates_args=())
def attention_varlen_probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                   softmax_scale: float, window_left: int, window_right: int, softcap: float,
                                   alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                                   dropout_seed: torch.Tensor) -> torch.Tensor:
    """S_dmask of packed sequences (:mod:`.probabilities`), an op of its own so that torch.compile
    can trace a call that asks for it."""
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    return marked_probabilities(q, k, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                dropout_seed, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


@attention_varlen_probabilities.register_fake
def fake_attention_varlen_probabilities(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                        dropout_seed):
    return q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False):
    """Attention over packed sequences of different lengths (chapter 7): flash_attn's
    ``flash_attn_varlen_func`` (2.8), same arguments in the same order, same defaults and returns.

    q (total_q, heads, head_dim); k, v (total_k, kv_heads, head_dim), kv_heads dividing heads
    (grouped-query attention, as in ``attention``). ``cu_seqlens_q``, ``cu_seqlens_k``: int32
    (batch + 1,) on q's device, the offsets of the sequences: sequence b is rows
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and
    v, its own lengths L_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b] and L_k likewise (either may be
    0, and L_q != L_k). ``max_seqlen_q``, ``max_seqlen_k``: Python ints, at least every L_q and
    L_k (the kernels' grids are laid out over them; they are never read from the device, which
    would wait for it). float16, bfloat16 or float32; 16 <= head_dim <= 256, any (flash_attn asks
    for multiples of 8); any strides (a last stride other than 1 is copied, as in ``attention``).

    Every other argument as ``attention``'s, applied to each sequence on its own: query i and key
    j of sequence b are i + L_k - L_q - j apart (the diagonal bottom-right aligned with that
    sequence's own lengths), which ``causal``, ``window_size`` (read against max_seqlen_k, as
    flash_attn reads it), ``softcap`` and ``alibi_slopes`` ((heads,) or (batch, heads), batch =
    len(cu_seqlens_q) - 1) use as ``attention`` does; ``softmax_scale`` None is 1 / sqrt(head_dim).
    ``dropout_p > 0`` drops each probability as ``attention`` does, the mask regenerated in the
    backward pass from the seed, its counter the pair's index in (batch, heads, max_seqlen_q,
    max_seqlen_k): sequences of equal lengths get the mask, and the bits, of ``attention`` on the
    batch they form. ``deterministic`` changes nothing: the backward pass is always deterministic.
    ``block_table`` (paged keys and values) is not implemented: anything but None raises
    NotImplementedError.

    Returns out (total_q, heads, head_dim) in q's dtype. With ``return_attn_probs=True``, (out,
    lse, S_dmask) as flash_attn: lse (heads, total_q) float32, flash_attn's packed layout, the
    natural-log sum of exp(logits) of each query row; S_dmask, filled only when dropout_p > 0 (an
    empty tensor of shape (0,) otherwise), (batch, heads, max_seqlen_q, max_seqlen_k) in q's dtype:
    sequence b's probabilities in S_dmask[b, :, :L_q, :L_k], negated where dropout zeroed them, 0
    everywhere else (flash_attn pads the last two sizes to multiples of 128 and scales by a running
    maximum; this one is exact and normalised). Keyword-only extra: ``return_lse=True`` returns
    (out, lse) (ignored with return_attn_probs, whose tuple holds lse already). lse is not
    differentiable; out is differentiable in q, k and v.

    Rows no sequence owns, [cu_seqlens_q[-1], total_q) of q and [cu_seqlens_k[-1], total_k) of k,
    v (flash_attn leaves the outputs there unspecified): out 0 and lse +inf there, and their
    gradients 0. A query row that sees no key (a sequence without keys, causal rows before the
    diagonal, a window off the keys) gets out 0 and lse +inf, as in ``attention``.

    cu_seqlens are checked on the device without waiting for it (``torch._assert_async``: on a GPU
    a failure is a device-side assert with the message; on the CPU it raises at once): each starts
    at 0, never decreases and ends at most at total_q (total_k), and no sequence is longer than
    max_seqlen_q (max_seqlen_k). The check is skipped while torch.compile traces or a CUDA graph
    captures; the kernels then still read and write nothing outside q, k, v and the outputs, but a
    sequence longer than the maxima gets wrong results: out, lse and dq of its query rows past
    max_seqlen_q, and dk, dv of its keys past max_seqlen_k, are not written.
    """
    if block_table is not None:
        raise NotImplementedError("block_table: paged keys and values are not implemented for attention_varlen "
                                  "(attention_with_kvcache takes a block_table); pass block_table=None")
    check_attention_inputs(q, k, v, packed=True)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale, window_left, window_right, softcap, dropout_p = checked_options(
        q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, max_seqlen_k,
        batch=cu_seqlens_q.shape[0] - 1)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # the kernels index them densely
    dropout_seed = draw_dropout_seed(dropout_p, q.device)
    out, lse = attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                   window_right, softcap, alibi_slopes, dropout_p, dropout_seed)
    if return_attn_probs:
        if dropout_seed is None:
            return out, lse, q.new_empty(0)
        return out, lse, attention_varlen_probabilities(q.detach(), k.detach(), lse, cu_seqlens_q, cu_seqlens_k,
                                                        max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
                                                        softcap, alibi_slopes, dropout_p, dropout_seed)
    return (out, lse) if return_lse else out
