"""A small language model on the blocks: embedding, pre-norm residual blocks (any mixer per layer,
an optional gated MLP), a final RMS norm and a tied LM head, with a chunked prefill and
token-by-token decoding (:meth:`LMHeadModel.generate`).

The module names follow mamba_ssm's ``MambaLMHeadModel`` (backbone.embedding, backbone.layers.i.norm,
.mixer, .norm2, .mlp, backbone.norm_f, lm_head), so a mamba_ssm checkpoint with ``rms_norm=True``
whose layers are Mamba, Mamba2 and MHA loads into the model of the same configuration.
"""
import copy
import math
import time
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hydra import BiMamba2, Hydra
from .layers import InferenceParams, RMSNorm
from .mamba import Mamba
from .mamba2 import Mamba2
from .mha import MHA

MIXERS = {"mamba": Mamba, "mamba2": Mamba2, "attn": MHA, "hydra": Hydra, "bimamba2": BiMamba2}
DEFAULT_MIXER_CFG = {"attn": {"causal": True}}  # a language model's attention sees the past only

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])
GenerationOutput = namedtuple("GenerationOutput", ["sequences", "scores"])


@dataclass
class LMConfig:
    """The model's shape. ``layer_types`` names each layer's mixer, in order: "mamba" (Mamba-1),
    "mamba2", "attn" (:class:`.mha.MHA`), or the bidirectional "hydra" and "bimamba2" (an encoder:
    no decoding). ``mixer_cfg`` holds each type's keyword arguments, e.g.
    ``{"mamba2": {"d_state": 64, "headdim": 32}, "attn": {"num_heads": 8, "rotary_emb_dim": 32}}``
    ("attn" needs num_heads; its causal defaults to True). ``d_intermediate`` > 0 adds a gated MLP
    of that hidden size after each mixer. The vocabulary is padded to a multiple of
    ``pad_vocab_size_multiple``, as mamba_ssm pads it."""

    d_model: int = 256
    vocab_size: int = 50277
    layer_types: list = field(default_factory=lambda: ["mamba2"] * 4)
    d_intermediate: int = 0
    mixer_cfg: dict = field(default_factory=dict)
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.pad_vocab_size_multiple) * self.pad_vocab_size_multiple


class GatedMLP(nn.Module):
    """fc2(a * silu(g)), [a, g] = fc1(x): mamba_ssm's ``GatedMLP`` (hidden size rounded up to a
    multiple of ``multiple_of``; fc1 and fc2 without bias)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, multiple_of=128, device=None,
                 dtype=None):
        super().__init__()
        hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden = math.ceil(hidden / multiple_of) * multiple_of
        self.fc1 = nn.Linear(in_features, 2 * hidden, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, out_features if out_features is not None else in_features, bias=False,
                             device=device, dtype=dtype)

    def forward(self, x):
        a, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(a * F.silu(gate))


class Block(nn.Module):
    """residual += x; x = mixer(norm(residual)) (then the same with the MLP): mamba_ssm's ``Block``,
    which returns (x, residual) so the next block adds and normalises in one place."""

    def __init__(self, dim, mixer, mlp, norm_epsilon, residual_in_fp32, device=None, dtype=None):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.norm = RMSNorm(dim, eps=norm_epsilon, device=device, dtype=dtype)
        self.mixer = mixer
        if mlp is not None:
            self.norm2 = RMSNorm(dim, eps=norm_epsilon, device=device, dtype=dtype)
        self.mlp = mlp

    def add_and_norm(self, hidden_states, residual, norm):
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = norm(residual.to(dtype=norm.weight.dtype))
        return hidden_states, residual.float() if self.residual_in_fp32 else residual

    def forward(self, hidden_states, residual=None, inference_params=None, **mixer_kwargs):
        hidden_states, residual = self.add_and_norm(hidden_states, residual, self.norm)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        if self.mlp is not None:
            hidden_states, residual = self.add_and_norm(hidden_states, residual, self.norm2)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)


def init_weights(module, n_layer, initializer_range=0.02, n_residuals_per_layer=1):
    """GPT-2's initialisation as mamba_ssm applies it: Linear biases zero (but dt_proj's, marked
    _no_reinit), embeddings N(0, initializer_range), and the projections that write into the
    residual stream (out_proj, fc2) Kaiming-uniform scaled by 1/sqrt(residuals per layer * n_layer)."""
    if isinstance(module, nn.Linear) and module.bias is not None and not getattr(module.bias, "_no_reinit", False):
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    for name, p in module.named_parameters():
        if name in ("out_proj.weight", "fc2.weight"):
            nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            with torch.no_grad():
                p /= math.sqrt(n_residuals_per_layer * n_layer)


def make_mixer(kind, d_model, layer_idx, mixer_cfg, factory_kwargs):
    if kind not in MIXERS:
        raise ValueError(f"layer_types: unknown mixer {kind!r}; expected one of {sorted(MIXERS)}")
    kwargs = {**DEFAULT_MIXER_CFG.get(kind, {}), **copy.deepcopy(mixer_cfg.get(kind, {}))}
    return MIXERS[kind](d_model, layer_idx=layer_idx, **kwargs, **factory_kwargs)


class MixerModel(nn.Module):
    """Embedding, the blocks, the final norm: hidden states (batch, L, d_model) from token ids."""

    def __init__(self, config: LMConfig, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        unknown = set(config.mixer_cfg) - set(MIXERS)
        if unknown:
            raise ValueError(f"mixer_cfg: unknown mixer(s) {sorted(unknown)}; expected keys among {sorted(MIXERS)}")
        self.residual_in_fp32 = config.residual_in_fp32
        self.embedding = nn.Embedding(config.padded_vocab_size(), config.d_model, **factory_kwargs)
        self.layers = nn.ModuleList([
            Block(config.d_model, make_mixer(kind, config.d_model, i, config.mixer_cfg, factory_kwargs),
                  GatedMLP(config.d_model, hidden_features=config.d_intermediate, **factory_kwargs)
                  if config.d_intermediate > 0 else None,
                  config.norm_epsilon, config.residual_in_fp32, **factory_kwargs)
            for i, kind in enumerate(config.layer_types)])
        self.norm_f = RMSNorm(config.d_model, eps=config.norm_epsilon, **factory_kwargs)
        residuals = 2 if config.d_intermediate > 0 else 1
        self.apply(lambda m: init_weights(m, config.n_layer, n_residuals_per_layer=residuals))

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, inference_params=None, **mixer_kwargs):
        hidden_states, residual = self.embedding(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params, **mixer_kwargs)
        residual = hidden_states + residual if residual is not None else hidden_states
        return self.norm_f(residual.to(dtype=self.norm_f.weight.dtype))


def sample(logits, top_k=1, top_p=0.0, *, temperature=1.0, generator=None):
    """The next token of each row of logits (batch, vocab): greedy (argmax) when top_k == 1; else
    drawn from softmax(logits / temperature) restricted to the top_k logits (top_k = 0: all of
    them) and then to the smallest set whose probability reaches top_p (top_p = 0: no limit), as
    mamba_ssm's ``sample``. Its ``min_p`` (the fourth positional argument there) is not
    implemented: ``temperature`` is keyword-only here, so a positional ``min_p`` fails loudly."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1]; got {top_p}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive (top_k=1 is greedy decoding); got {temperature}")
    if top_k > 0:
        logits, indices = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
    else:
        indices = None
    logits = logits.float() / temperature
    if 0.0 < top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1)
        # drop the least likely tokens while the mass of what is dropped stays within 1 - top_p
        drop_sorted = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    choice = torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)
    return indices.gather(-1, choice[:, None]).squeeze(-1) if indices is not None else choice


class LMHeadModel(nn.Module):
    """The language model: :class:`MixerModel` and an LM head tied to the embedding (when
    ``config.tie_embeddings``). ``forward`` returns ``CausalLMOutput(logits)`` as mamba_ssm's
    ``MambaLMHeadModel``; :meth:`generate` decodes."""

    def __init__(self, config: LMConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.backbone = MixerModel(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size(), bias=False, device=device, dtype=dtype)
        # mamba_ssm's MambaLMHeadModel initialises a second time here, over the whole model and with
        # one residual per layer: that pass, not the backbone's, sets the weights (and the random
        # draws), so it is repeated to give the same model from the same seed
        self.apply(lambda m: init_weights(m, config.n_layer))
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.backbone.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0, **mixer_kwargs):
        """input_ids (batch, L) -> logits (batch, L, padded vocab), or the last ``num_last_tokens``
        positions only. ``position_ids`` is accepted for the generation loop's sake and unused (the
        blocks take positions from inference_params), as in mamba_ssm."""
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))

    @torch.inference_mode()
    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, *, eos_token_id=None, cg=False,
                 vocab_size=None, enable_timing=False, repetition_penalty=1.0, teacher_outputs=None, streamer=None,
                 generator: Optional[torch.Generator] = None):
        """Continue each row of input_ids (batch, L) up to ``max_length`` tokens in all: the prompt
        goes through the chunked kernels once (the prefill, which leaves every layer's state or KV
        cache), then each new token through the blocks' decoding steps. mamba_ssm's
        ``MambaLMHeadModel.generate``, same positional order and defaults; the keywords it passes
        on to its ``decode`` are keywords here. Greedy with top_k=1 (the default); sampling
        otherwise (:func:`sample`; ``generator``, an extra, makes it reproducible). Returns the
        sequences (batch, L + new tokens), or ``GenerationOutput(sequences, scores)`` with
        ``return_dict_in_generate`` (scores: the logits of each step when ``output_scores``, else None).

        ``cg=True`` captures one decoding step in a CUDA graph after the prefill and replays it
        for every further token, as mamba_ssm does: at batch 1 a step is mostly the host's Python
        and launch code, which a replay skips (it runs the recorded kernels from one call). CUDA
        only, on the current device, and only for models whose layers are all Mamba or Mamba-2
        blocks (an attention layer's cache position is a host integer here, which a graph would
        freeze). The replay runs the eager step's kernels, so it gives the same tokens. Each call
        captures afresh (mamba_ssm keeps its graph on the model), which costs about three eager
        steps: two warm-up steps, whose state updates are undone from a copy of the states, and the
        capture.

        Where this differs from mamba_ssm: the logits are cut to the configuration's vocabulary
        (``vocab_size``, when given, cuts them there instead), so no padding id is ever drawn,
        where mamba_ssm samples over the padded vocabulary unless given ``vocab_size``; and
        generation stops once every row has produced ``eos_token_id`` at some step (mamba_ssm stops
        only when all rows produce it at the same step). Not implemented, and refused by name:
        ``min_p`` > 0 with ``top_k`` <= 0 (the only case in which mamba_ssm's ``sample`` reads it),
        ``repetition_penalty`` != 1, ``teacher_outputs``, ``streamer``."""
        unsupported = {"min_p": min_p > 0 and top_k <= 0, "repetition_penalty": repetition_penalty != 1.0,
                       "teacher_outputs": teacher_outputs is not None, "streamer": streamer is not None}
        for name, given in unsupported.items():
            if given:
                raise NotImplementedError(f"generate: {name} is not implemented")
        batch, prompt_length = input_ids.shape
        if not 0 < prompt_length < max_length:
            raise ValueError(f"max_length ({max_length}) must exceed the prompt's length ({prompt_length}), "
                             f"which must be at least 1")
        if cg:
            self.check_graph_decoding(input_ids.device)
        vocab = self.config.vocab_size if vocab_size is None else vocab_size

        def now():  # for enable_timing: the time once the device has done what was queued
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            return time.perf_counter()

        start = now() if enable_timing else None
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch)
        tokens, scores, sequences = input_ids, [], [input_ids]
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        replay = None  # the captured step, with cg=True, from the second step on
        while True:
            if replay is None:
                logits = self(tokens, inference_params=params, num_last_tokens=1).logits[:, -1, :vocab]
            else:
                logits = replay(tokens)
            params.seqlen_offset += tokens.shape[1]
            if output_scores:
                scores.append(logits.clone())
            tokens = sample(logits, top_k=top_k, top_p=top_p, temperature=temperature, generator=generator)[:, None]
            sequences.append(tokens)
            if params.seqlen_offset + 1 >= max_length:
                break
            if eos_token_id is not None:  # reading done back waits for the step: only when it can stop early
                done |= tokens[:, 0] == eos_token_id
                if bool(done.all()):
                    break
            if cg and replay is None:
                replay = self.capture_decoding_step(tokens, params, vocab)
        sequences = torch.cat(sequences, dim=1)
        if enable_timing:  # mamba_ssm's line
            print(f"Prompt processing + decoding time: {1e3 * (now() - start):.0f}ms")
        if not return_dict_in_generate:
            return sequences
        return GenerationOutput(sequences=sequences, scores=tuple(scores) if output_scores else None)

    def check_graph_decoding(self, device):
        """Refuse ``cg=True`` where a captured step could not be replayed."""
        if device.type != "cuda":
            raise NotImplementedError(f"generate: cg=True needs CUDA tensors; input_ids are on {device}")
        if device.index is not None and device.index != torch.cuda.current_device():
            # the graph and its stream would be the current device's, while the step's kernels run on
            # the inputs' device: nothing would be captured
            raise NotImplementedError(f"generate: cg=True needs the inputs' GPU to be the current device "
                                      f"({device}; current cuda:{torch.cuda.current_device()}): torch.cuda.set_device")
        others = sorted(set(self.config.layer_types) - {"mamba", "mamba2"})
        if others:
            raise NotImplementedError(f"generate: cg=True decodes models of Mamba and Mamba-2 layers only; this one "
                                      f"has {others} layers (an attention layer's cache position is a host integer)")

    def capture_decoding_step(self, tokens, params, vocab):
        """One decoding step captured in a CUDA graph, after the prefill: returns ``replay(tokens)
        -> logits`` (batch, vocab), a view that the next replay overwrites. The first launches of
        a kernel compile it and allocate, which a capture cannot hold, so two warm-up steps run
        first, on a side stream (as torch.cuda.graph asks), from the prefill's states; the states
        they advance are then put back. Capturing records the step without running it."""
        static_tokens = tokens.clone()
        states = [t for entry in params.key_value_memory_dict.values() for t in entry]  # (conv, ssm) per layer
        before = [t.clone() for t in states]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self(static_tokens, inference_params=params, num_last_tokens=1)
        torch.cuda.current_stream().wait_stream(side)
        for state, saved in zip(states, before):
            state.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self(static_tokens, inference_params=params, num_last_tokens=1).logits[:, -1, :vocab]

        def replay(new_tokens):
            static_tokens.copy_(new_tokens)
            graph.replay()
            return logits
        return replay
