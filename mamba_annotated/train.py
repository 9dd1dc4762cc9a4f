"""Training and evaluating small language models on the package's blocks, to compare mixers.

* :func:`model_config` and :func:`fit_config`: a Transformer (our attention with a gated MLP),
  Mamba-1, Mamba-2 and a hybrid (Mamba-2 with a few attention layers) as :class:`LMConfig`, and
  the shape (d_model, n_layer) of each kind that comes closest to a target parameter count, so
  models of equal size are compared.
* :func:`train`: AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on a
  GPU (float32 on CPU), optionally ``torch.compile``; returns a metrics record (a plain dict that
  ``json.dumps`` takes, for ``book/data/``).
* :func:`mqar_accuracy`, :func:`byte_lm_eval`: accuracy at the query positions of the recall task;
  validation loss and bits per byte of a byte-level model.
* :func:`decode_benchmark`: tokens/s of the prefill (the chunked kernels over the prompt) against
  the decoding steps (one token at a time through the recurrent step or the KV cache).
"""
import contextlib
import dataclasses
import math
import statistics
import time

import torch
import torch.nn.functional as F

from .modules import LMConfig, LMHeadModel
from .runtime import DEVICE
from .tasks import IGNORE_INDEX

KINDS = ("transformer", "mamba", "mamba2", "hybrid")

# d_model per layer of the usual shapes, which fit_config prefers among shapes of the same size:
# GPT-2 small is 768 wide and 12 deep; a Mamba stack has no MLP, so twice the layers at the same
# width (Mamba-130M: 768 wide, 24 deep).
PREFERRED_WIDTH_PER_LAYER = {"transformer": 64, "mamba": 32, "mamba2": 32, "hybrid": 32}


def hybrid_attention_layers(n_layer, attn_every=4):
    """The attention layers of a hybrid of n_layer: one per ``attn_every`` layers (at least one),
    spread evenly, none first (the first layer sees the embeddings only)."""
    n_attn = max(1, round(n_layer / attn_every))
    return [int((j + 0.5) * n_layer / n_attn) for j in range(n_attn)]


def layer_types(kind, n_layer, attn_every=4):
    """Each layer's mixer (:class:`LMConfig`'s ``layer_types``) in a model of one kind."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}; got {kind!r}")
    if kind == "hybrid":
        attn = set(hybrid_attention_layers(n_layer, attn_every))
        return ["attn" if i in attn else "mamba2" for i in range(n_layer)]
    return [{"transformer": "attn", "mamba": "mamba", "mamba2": "mamba2"}[kind]] * n_layer


def model_config(kind, d_model, n_layer, vocab_size, *, head_dim=64, d_state=64, chunk_size=256, attn_every=4):
    """The :class:`LMConfig` of a model of one kind.

    * "transformer": attention (``d_model // head_dim`` heads, rotary embeddings on the whole
      head) and a gated MLP of hidden size 8/3 d_model after it, as Transformer++ (4 d^2 + 8 d^2
      weights per layer);
    * "mamba": Mamba-1 blocks at mamba_ssm's defaults (d_state 16, expand 2), no MLP;
    * "mamba2": Mamba-2 blocks (``d_state``, heads of ``head_dim``, expand 2), no MLP;
    * "hybrid": the Mamba-2 stack with one layer in ``attn_every`` replaced by attention, no MLP.

    ``chunk_size`` is Mamba-2's chunk (the speed of the kernels, not the model)."""
    if d_model % head_dim:
        raise ValueError(f"d_model ({d_model}) must be a multiple of head_dim ({head_dim})")
    attn = {"num_heads": d_model // head_dim, "rotary_emb_dim": head_dim}
    mamba2 = {"d_state": d_state, "headdim": head_dim, "chunk_size": chunk_size}
    return LMConfig(d_model=d_model, vocab_size=vocab_size, layer_types=layer_types(kind, n_layer, attn_every),
                    d_intermediate=round(8 * d_model / 3) if kind == "transformer" else 0,
                    mixer_cfg={"attn": attn, "mamba2": mamba2})


def param_count(config):
    """Parameters of the model a config builds (the tied embedding and LM head counted once).
    Built on the meta device: no memory, no kernels."""
    return sum(p.numel() for p in LMHeadModel(config, device="meta").parameters())


def fit_config(kind, target_params, vocab_size, *, d_model=None, shape_slack=2.0, width_multiple=None,
               max_layers=96, **config_kwargs):
    """The config of ``kind`` whose parameter count is closest to ``target_params``, and that count.

    With ``d_model`` given only the depth is chosen (every kind at the same width: the
    comparison changes the mixer only). Otherwise widths run over multiples of
    ``width_multiple`` (default: the head size), and the closest count is taken among the shapes
    whose width per layer is within a factor ``shape_slack`` of the usual one of the kind
    (:data:`PREFERRED_WIDTH_PER_LAYER`), so no model is absurdly deep or shallow; when no shape
    is in that band (tiny targets), among all. Equal counts come first, the usual shape second:
    a layer is a few percent of a 10-30 M model, and a fixed shape would miss the target by that.
    ``config_kwargs`` go to :func:`model_config`; a hybrid has at least two layers.

    The count of a shape is the count without layers plus one layer of each type it holds, each
    measured once per width by building it (:func:`param_count`), so no formula can drift from
    the modules."""
    step = width_multiple or config_kwargs.get("head_dim", 64)
    widths = [d_model] if d_model is not None else range(step, 64 * step + 1, step)
    min_layers = 2 if kind == "hybrid" else 1
    candidates = []  # (outside the shape band, relative error, d_model, n_layer)
    for width in widths:
        empty = model_config(kind, width, 0, vocab_size, **config_kwargs)
        base = param_count(empty)
        per_type = {t: param_count(dataclasses.replace(empty, layer_types=[t])) - base
                    for t in set(layer_types(kind, max_layers))}
        if candidates and base + min_layers * min(per_type.values()) > target_params:
            break  # this width and every wider one overshoots already
        for n_layer in range(min_layers, max_layers + 1):
            count = base + sum(per_type[t] for t in layer_types(kind, n_layer))
            off_shape = abs(math.log(width / n_layer / PREFERRED_WIDTH_PER_LAYER[kind])) > math.log(shape_slack)
            candidates.append((off_shape, abs(count - target_params) / target_params, width, n_layer))
            if count > target_params:
                break  # deeper only grows
    _, _, width, n_layer = min(candidates)
    config = model_config(kind, width, n_layer, vocab_size, **config_kwargs)
    return config, param_count(config)


def lr_factor(step, warmup_steps, total_steps, min_ratio=0.1):
    """The learning rate's multiplier at ``step`` (0-based) of ``total_steps``: a linear warm-up
    from 1/warmup_steps to 1 (at step warmup_steps - 1), then a cosine down to ``min_ratio`` (at
    the last step)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step + 1 - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model, lr, weight_decay, betas):
    """AdamW with weight decay on the matrices (and conv kernels) only: not on biases, norms, or the
    SSM parameters mamba_ssm marks ``_no_weight_decay`` (A_log, D, dt_bias), which set decay
    rates and step sizes rather than mix features."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused AdamW is one kernel for all parameters on a GPU; the CPU takes the default loop
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=DEVICE.type == "cuda")


def autocast():
    """bf16 autocast on a GPU (the weights stay float32); nothing on CPU, where the interpreter
    runs float32."""
    if DEVICE.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(logits, targets, vocab_size):
    """Mean cross-entropy (nats) over the scored positions (targets != -100). The logits'
    vocabulary padding is cut off, and the softmax runs in float32 whatever the autocast dtype."""
    logits = logits[..., :vocab_size].float()
    return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def synchronize():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def train(model, next_batch, steps, *, lr=1e-3, warmup_steps=None, min_lr_ratio=0.1, weight_decay=0.1,
          betas=(0.9, 0.95), grad_clip=1.0, compiled=False, untimed_steps=2):
    """Train ``model`` (an :class:`LMHeadModel`) for ``steps`` steps on ``next_batch(step)``, which
    returns ``(inputs, targets)`` int64 (batch, L), targets -100 where not scored.

    Warm-up defaults to 10% of the steps. With ``compiled`` the model runs under
    ``torch.compile(fullgraph=True)``: a graph break is an error, not a silent slowdown.

    Returns a dict for JSON: ``loss``, ``lr`` and ``grad_norm`` per step (the norm before
    clipping), ``tokens_per_step``, ``tokens_per_s`` (over the steps after the first
    ``untimed_steps``, which pay for compilation and autotuning; ``next_batch``'s own time counts,
    so keep the data on the device), ``wall_s`` (all steps), ``peak_memory_bytes`` (CUDA; None on
    CPU), ``params``, ``device``, ``autocast`` and ``compiled``. Per-step values stay on the device
    until the end, so logging does not stall the GPU every step."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    vocab_size = model.config.vocab_size
    warmup_steps = max(1, steps // 10) if warmup_steps is None else warmup_steps
    untimed_steps = min(untimed_steps, steps - 1)
    optimizer = make_optimizer(model, lr, weight_decay, betas)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, steps, min_lr_ratio))
    forward = torch.compile(model, fullgraph=True) if compiled else model
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    losses, grad_norms, lrs, tokens_per_step = [], [], [], 0
    start = timed_start = time.perf_counter()
    for step in range(steps):
        if step == untimed_steps:
            synchronize()
            timed_start = time.perf_counter()
        inputs, targets = (t.to(DEVICE, non_blocking=True) for t in next_batch(step))
        with autocast():
            loss = lm_loss(forward(inputs).logits, targets, vocab_size)
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.detach())
        tokens_per_step = inputs.numel()
    synchronize()
    end = time.perf_counter()
    return {
        "loss": torch.stack(losses).tolist(),
        "lr": lrs,
        "grad_norm": torch.stack(grad_norms).tolist(),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * (steps - untimed_steps) / (end - timed_start),
        "wall_s": end - start,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else None,
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(DEVICE),
        "autocast": "bfloat16" if DEVICE.type == "cuda" else None,
        "compiled": bool(compiled),
    }


@torch.inference_mode()
def mqar_accuracy(model, inputs, targets, *, batch_size=256):
    """The fraction of query positions (targets != -100) where the model's most likely token is
    the target; the argmax runs over the task's vocabulary only (not the padding)."""
    vocab_size = model.config.vocab_size
    correct = scored = 0
    model.eval()
    for i in range(0, inputs.shape[0], batch_size):
        x, y = inputs[i:i + batch_size].to(DEVICE), targets[i:i + batch_size].to(DEVICE)
        with autocast():
            predicted = model(x).logits[..., :vocab_size].argmax(dim=-1)
        mask = y != IGNORE_INDEX
        correct += int((predicted[mask] == y[mask]).sum())
        scored += int(mask.sum())
    return correct / scored


@torch.inference_mode()
def byte_lm_eval(model, data, seq_len, *, batch_size=16, max_batches=None):
    """Validation of a byte-level model on a uint8 tensor: consecutive windows of ``seq_len`` from
    the start (the same windows every time), each predicting its next bytes. Returns the mean
    ``loss`` (nats per byte), ``bits_per_byte`` (loss / ln 2) and the number of ``bytes`` scored."""
    windows = (data.numel() - 1) // seq_len
    if max_batches is not None:
        windows = min(windows, max_batches * batch_size)
    if windows < 1:
        raise ValueError(f"data has {data.numel()} bytes; one window of seq_len {seq_len} needs {seq_len + 1}")
    vocab_size = model.config.vocab_size
    total, scored = 0.0, 0
    model.eval()
    for first in range(0, windows, batch_size):
        starts = torch.arange(first, min(first + batch_size, windows)) * seq_len
        chunk = data[starts[:, None] + torch.arange(seq_len + 1)].long().to(DEVICE)
        with autocast():
            logits = model(chunk[:, :-1]).logits
        total += float(lm_loss(logits, chunk[:, 1:], vocab_size)) * chunk[:, 1:].numel()
        scored += chunk[:, 1:].numel()
    loss = total / scored
    return {"loss": loss, "bits_per_byte": loss / math.log(2), "bytes": scored}


def timed(fn, repeats):
    """Median wall time of ``fn()`` over ``repeats`` calls, after one untimed call (compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_benchmark(model, prompt, new_tokens, *, repeats=3, cg=False):
    """Prefill against decoding through :meth:`LMHeadModel.generate` (greedy): ``prompt`` (batch, P)
    int64. The prefill is timed as ``generate`` to P + 1 tokens (the chunked forward pass over
    the prompt and one sampled token); decoding as the extra time of ``generate`` to
    P + new_tokens, which adds new_tokens - 1 steps of one token per row. ``cg``: generate's
    CUDA-graph decoding, whose capture (after the prefill) counts in the decoding time.

    Returns a dict for JSON: ``batch``, ``prompt_len``, ``new_tokens``, ``prefill_s``,
    ``decode_s`` (all the steps), ``prefill_tokens_per_s`` (prompt tokens), ``decode_tokens_per_s``
    (generated tokens, all rows)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (one from the prefill, one step); got {new_tokens}")
    prompt = prompt.to(DEVICE)
    batch, prompt_len = prompt.shape
    model.eval()
    with autocast():
        prefill_s = timed(lambda: model.generate(prompt, max_length=prompt_len + 1), repeats)
        total_s = timed(lambda: model.generate(prompt, max_length=prompt_len + new_tokens, cg=cg), repeats)
    # medians of separate runs: the difference can dip below zero when steps cost next to nothing
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "prefill_s": prefill_s,
            "decode_s": decode_s, "prefill_tokens_per_s": batch * prompt_len / prefill_s,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s}
