"""Decoding: the two state-update kernels against float64 references; every causal block's
token-by-token step equal to its chunked forward pass (from an empty cache, and after a chunked
prefill, packed sequences included); the bidirectional blocks refuse to step; the language model's
generate (greedy equals the argmax of the full forward pass; sampling is reproducible and stays in
the top k)."""
import ast
import importlib.util
import inspect
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

import mamba_annotated.modules.lm as lm_module
from mamba_annotated.modules import MHA, BiMamba2, Hydra, InferenceParams, LMConfig, LMHeadModel, Mamba, Mamba2
from mamba_annotated.modules.lm import sample
from mamba_annotated.runtime import DEVICE
from mamba_annotated.scan.reference import discretize
from mamba_annotated.scan.selective_step import selective_state_update
from mamba_annotated.ssd.reference import ssd_recurrent_ref
from mamba_annotated.ssd.step import ssd_state_update
from mamba_annotated.testing import assert_close, every_other, randn, tolerance, uniform

TOL = tolerance(torch.float32)
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
OPTIONS = [dict(dt_bias=True, dt_softplus=True, D=True, z=True), dict(dt_bias=False, dt_softplus=False, D=False, z=False),
           dict(dt_bias=True, dt_softplus=False, D=True, z=False), dict(dt_bias=False, dt_softplus=True, D=False, z=True)]
OPTION_IDS = ["all", "none", "bias-D", "softplus-z"]


def strided(shape, dtype=torch.float32):
    """A random tensor of ``shape`` that is a view with a gap after every row (as torch.split makes)."""
    wide = randn(*shape[:-1], shape[-1] + 3, dtype=dtype)
    return wide[..., 1:shape[-1] + 1]


# --- the SSD step (Mamba-2) ------------------------------------------------------------------------------

def ssd_step_inputs(batch=3, heads=4, headdim=12, groups=2, dstate=5, dtype=torch.float32, D_per_channel=False,
                    dt_bias=True, dt_softplus=True, D=True, z=True):
    return dict(
        state=randn(batch, headdim, heads, dstate).transpose(1, 2).to(dtype),  # any strides: a transposed view
        x=strided((batch, heads, headdim), dtype),
        dt=uniform(batch, heads, low=-1.0, high=1.0) if dt_softplus else uniform(batch, heads, low=0.05, high=0.8),
        A=-uniform(heads, low=0.5, high=2.0),
        B=strided((batch, groups, dstate), dtype), C=randn(batch, groups, dstate, dtype=dtype),
        D=(randn(heads, headdim) if D_per_channel else randn(heads)) if D else None,
        z=randn(batch, heads, headdim, dtype=dtype) if z else None,
        dt_bias=randn(heads, scale=0.5) if dt_bias else None, dt_softplus=dt_softplus)


def ssd_step_ref(inputs, dt_limit=(0.0, math.inf)):
    """One position of the float64 recurrence from the given state: (y, the new state)."""
    one = (lambda t: t[:, None] if t is not None else None)
    y, state = ssd_recurrent_ref(one(inputs["x"]), one(inputs["dt"]), inputs["A"], one(inputs["B"]), one(inputs["C"]),
                                 D=inputs["D"], z=one(inputs["z"]), dt_bias=inputs["dt_bias"],
                                 initial_states=inputs["state"].double(), dt_softplus=inputs["dt_softplus"],
                                 dt_limit=dt_limit, return_final_states=True)
    return y[:, 0], state


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("D_per_channel", [False, True])
def test_ssd_step_against_float64(options, D_per_channel):
    inputs = ssd_step_inputs(D_per_channel=D_per_channel, **options)
    y_ref, state_ref = ssd_step_ref(inputs)
    state = inputs["state"]
    y = ssd_state_update(**inputs)
    assert y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype
    assert_close(y, y_ref, TOL, "y")
    assert_close(state, state_ref, TOL, "state (in place)")


def test_ssd_step_clamps_to_dt_limit_and_one_group_per_head():
    inputs = ssd_step_inputs(groups=4, dt_softplus=False)
    inputs["dt"] = uniform(3, 4, low=-0.5, high=2.0)   # below and above the limits
    y_ref, state_ref = ssd_step_ref(inputs, dt_limit=(0.1, 1.0))
    y = ssd_state_update(**inputs, dt_limit=(0.1, 1.0))
    assert_close(y, y_ref, TOL, "y")
    assert_close(inputs["state"], state_ref, TOL, "state")


def test_ssd_step_16_bit_state():
    inputs = ssd_step_inputs(dtype=torch.bfloat16)
    y_ref, state_ref = ssd_step_ref(inputs)
    y = ssd_state_update(**inputs)
    assert y.dtype == torch.bfloat16 and inputs["state"].dtype == torch.bfloat16
    assert_close(y, y_ref, tolerance(torch.bfloat16), "y")
    assert_close(inputs["state"], state_ref, tolerance(torch.bfloat16), "state")


def test_ssd_step_float16_state():
    """test_ssd_step_16_bit_state in float16, with D per channel."""
    inputs = ssd_step_inputs(dtype=torch.float16, D_per_channel=True)
    y_ref, state_ref = ssd_step_ref(inputs)
    y = ssd_state_update(**inputs)
    assert y.dtype == torch.float16 and inputs["state"].dtype == torch.float16
    assert_close(y, y_ref, tolerance(torch.float16), "y")
    assert_close(inputs["state"], state_ref, tolerance(torch.float16), "state")


def test_ssd_step_bad_inputs():
    inputs = ssd_step_inputs()
    with pytest.raises(ValueError, match="B must have shape"):
        ssd_state_update(**{**inputs, "B": randn(3, 3, 5), "C": randn(3, 3, 5)})
    with pytest.raises(ValueError, match="dt must have shape"):
        ssd_state_update(**{**inputs, "dt": randn(3, 4, 12)})
    with pytest.raises(ValueError, match="dt_limit"):
        ssd_state_update(**inputs, dt_limit=(1.0, 0.5))


# --- the selective step (Mamba-1) -------------------------------------------------------------------------

def selective_step_inputs(batch=3, dim=10, dstate=6, groups=None, heads=None, dt_bias=True, dt_softplus=True, D=True,
                          z=True, dtype=torch.float32, state_dtype=None):
    """mamba_ssm's layouts: 3-d (batch, dim, dstate), or 4-d with ``heads``; B, C with ``groups``.
    x, dt, B, C, z in ``dtype``, the state in ``state_dtype`` (default ``dtype``); A, D, dt_bias
    float32, as a model keeps them."""
    lead = (heads,) if heads else ()
    bc = (batch, groups, dstate) if groups else (batch, dstate)
    return dict(
        state=randn(batch, *lead, dstate, dim, dtype=state_dtype or dtype).transpose(-1, -2),
        x=strided((batch, *lead, dim), dtype),
        dt=(uniform(batch, *lead, dim, low=-1.0, high=1.0, dtype=dtype) if dt_softplus
            else uniform(batch, *lead, dim, low=0.05, high=0.8, dtype=dtype)),
        A=-uniform(*lead, dim, dstate, low=0.2, high=2.0),
        B=strided(bc, dtype), C=randn(*bc, dtype=dtype),
        D=randn(*lead, dim) if D else None, z=randn(batch, *lead, dim, dtype=dtype) if z else None,
        dt_bias=randn(*lead, dim, scale=0.5) if dt_bias else None, dt_softplus=dt_softplus)


def selective_step_ref(inputs):
    """Through the channels of the heads * dim flattened: discretize (chapter 4's reference) for
    one step, then h = A_bar h + Bu_bar, y = C.h + D x, y * silu(z). Returns (y, state), float64."""
    state = inputs["state"]
    batch, dstate = state.shape[0], state.shape[-1]
    flat = (lambda t: t.double().reshape(batch, -1) if t is not None else None)
    channels = flat(inputs["x"]).shape[1]
    B, C = (t.double().reshape(batch, -1, dstate) for t in (inputs["B"], inputs["C"]))
    B, C = (t.repeat_interleave(channels // t.shape[1], dim=1) for t in (B, C))  # (batch, channels, dstate)
    bias = inputs["dt_bias"].double().reshape(-1) if inputs["dt_bias"] is not None else None
    A_bar, Bu_bar = discretize(flat(inputs["dt"])[..., None], inputs["A"].double().reshape(-1, dstate),
                               B[..., None], flat(inputs["x"])[..., None], bias, inputs["dt_softplus"])
    h = A_bar[..., 0] * state.double().reshape(batch, channels, dstate) + Bu_bar[..., 0]
    y = (h * C).sum(-1)
    if inputs["D"] is not None:
        y = y + inputs["D"].double().reshape(-1) * flat(inputs["x"])
    if inputs["z"] is not None:
        y = y * F.silu(flat(inputs["z"]))
    return y.reshape(inputs["x"].shape), h.reshape(state.shape)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("layout", [dict(), dict(groups=2), dict(heads=3, groups=3)], ids=["3d", "3d-groups", "4d"])
def test_selective_step_against_float64(options, layout):
    inputs = selective_step_inputs(**layout, **options)
    y_ref, state_ref = selective_step_ref(inputs)
    y = selective_state_update(**inputs)
    assert y.shape == inputs["x"].shape
    assert_close(y, y_ref, TOL, "y")
    assert_close(inputs["state"], state_ref, TOL, "state (in place)")


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_selective_step_reads_D_and_dt_bias_through_their_strides(layout):
    """The kernel indexes D and dt_bias by channel, densely, and views of them used to reach it as
    they were: a strided one was read at the wrong elements, an expanded one (stride 0) past the end
    of its storage. Found by the reliability sweep's decoding-step cases (scripts/reliability)."""
    inputs = selective_step_inputs()  # the 3-d layout: D and dt_bias (dim,)
    for name in ("D", "dt_bias"):
        dim = inputs[name].shape[0]
        inputs[name] = randn(2 * dim)[::2] if layout == "strided" else randn(1).expand(dim)
    y_ref, state_ref = selective_step_ref(inputs)
    y = selective_state_update(**inputs)
    assert_close(y, y_ref, TOL, "y")
    assert_close(inputs["state"], state_ref, TOL, "state (in place)")


def as_view(t):
    """The values of ``t`` in a view that is not contiguous: its dimensions reversed in memory, or, for
    a vector, every other element of a tensor holding NaN in between (a dense read meets a NaN)."""
    if t.dim() == 1:
        return every_other(t, torch.full_like(t, math.nan))
    dims = list(range(t.dim()))[::-1]
    return t.permute(dims).contiguous().permute(dims)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float16, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("layout", [dict(), dict(heads=3, groups=3)], ids=["3d", "4d"])
def test_selective_step_16_bit(dtype, state_dtype, layout):
    """x, dt, B, C, z in 16 bits, the state in 16 bits or float32: y rounded once from the float32
    update, the state rounded once into its dtype, both against float64."""
    inputs = selective_step_inputs(**layout, dtype=dtype, state_dtype=state_dtype)
    y_ref, state_ref = selective_step_ref(inputs)
    y = selective_state_update(**inputs)
    assert y.shape == inputs["x"].shape and y.dtype == dtype
    assert inputs["state"].dtype == (state_dtype or dtype)
    assert_close(y, y_ref, tolerance(dtype), "y")
    assert_close(inputs["state"], state_ref, tolerance(state_dtype or dtype), "state (in place)")


@pytest.mark.parametrize("step, layout", [("ssd", dict()), ("ssd", dict(D_per_channel=True)),
                                          ("selective", dict(heads=3, groups=3))],
                         ids=["ssd, D per head", "ssd, D per channel", "selective, 4-d"])
def test_step_every_argument_a_view(step, layout):
    """dt, A, C, z, D and dt_bias, which the float64 tests of each step pass contiguous, as views
    (:func:`as_view`: transposed matrices, vectors with NaN between their elements); the state, x
    and B are views there already."""
    make, reference, update = ((ssd_step_inputs, ssd_step_ref, ssd_state_update) if step == "ssd"
                               else (selective_step_inputs, selective_step_ref, selective_state_update))
    inputs = make(**layout)
    for name in ("dt", "A", "C", "z", "D", "dt_bias"):
        inputs[name] = as_view(inputs[name])
        assert not inputs[name].is_contiguous(), name
    y_ref, state_ref = reference(inputs)
    y = update(**inputs)
    assert_close(y, y_ref, TOL, "y")
    assert_close(inputs["state"], state_ref, TOL, "state (in place)")


@pytest.mark.parametrize("step", ["ssd", "selective"])
def test_steps_on_an_empty_batch(step, no_launch):
    """A batch of no sequence: an empty y like x, and nothing launched."""
    inputs = ssd_step_inputs(batch=0) if step == "ssd" else selective_step_inputs(batch=0, heads=3, groups=3)
    y = (ssd_state_update if step == "ssd" else selective_state_update)(**inputs)
    assert y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype


def test_selective_step_unimplemented_and_bad_inputs():
    inputs = selective_step_inputs()
    with pytest.raises(NotImplementedError, match="state_batch_indices"):
        selective_state_update(**inputs, state_batch_indices=torch.arange(3))
    with pytest.raises(ValueError, match="groups"):
        selective_state_update(**{**inputs, "B": randn(3, 3, 6), "C": randn(3, 3, 6)})


# --- each causal block: step by step equals the chunked forward pass ------------------------------------------

BLOCKS = {
    "mamba2": lambda: Mamba2(32, d_state=8, headdim=16, ngroups=2, chunk_size=16, layer_idx=0),
    "mamba2-no-norm-mlp": lambda: Mamba2(32, d_state=8, headdim=16, d_ssm=32, D_has_hdim=True, rmsnorm=False,
                                         bias=True, dt_limit=(0.02, 0.05), chunk_size=16, layer_idx=0),
    "mamba": lambda: Mamba(16, d_state=8, layer_idx=0),
    "mha-gqa-rotary": lambda: MHA(32, 2, num_heads_kv=1, causal=True, rotary_emb_dim=8, layer_idx=0),
    "mha-conv-mlp": lambda: MHA(32, 2, causal=True, d_conv=4, mlp_dim=64, rotary_emb_dim=16,
                                rotary_emb_interleaved=True, layer_idx=0),
}


def block_and_input(name, batch=2, length=11):
    block = BLOCKS[name]().to(DEVICE)
    d_model = 16 if name == "mamba" else 32
    return block, randn(batch, length, d_model)


def step(block, u_t, cache, position):
    if isinstance(block, MHA):
        return block.step(u_t, *cache, position)[0]
    return block.step(u_t, *cache)[0]


@pytest.mark.parametrize("name", BLOCKS)
@torch.no_grad()
def test_step_by_step_equals_forward(name):
    block, u = block_and_input(name)
    cache = block.allocate_inference_cache(u.shape[0], u.shape[1])
    decoded = torch.cat([step(block, u[:, t:t + 1], cache, t) for t in range(u.shape[1])], dim=1)
    assert_close(decoded, block(u), TOL, f"{name}: steps from an empty cache")


def prefill_then_steps(block, u, prefill):
    """forward with InferenceParams: a chunked prefill of ``prefill`` tokens fills the cache, then one
    token per call. Returns (the outputs along the sequence, the InferenceParams)."""
    params = InferenceParams(max_seqlen=u.shape[1], max_batch_size=u.shape[0])
    outs = [block(u[:, :prefill], inference_params=params)]
    for t in range(prefill, u.shape[1]):
        params.seqlen_offset = t
        outs.append(block(u[:, t:t + 1], inference_params=params))
    return torch.cat(outs, dim=1), params


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("prefill", [1, 6])
@torch.no_grad()
def test_prefill_then_steps_equals_forward(name, prefill):
    block, u = block_and_input(name)
    decoded, _ = prefill_then_steps(block, u, prefill)
    assert_close(decoded, block(u), TOL, f"{name}: prefill of {prefill}, then steps")


@torch.no_grad()
def test_attention_decoding_under_bf16_autocast():
    """Under autocast the residual stream stays float32 while q, k, v come out of the projection in
    bfloat16: the cache must hold (or be read in) q's dtype. Generating with a Transformer in a
    bf16-autocast training script failed with "k must have the dtype of q" before."""
    block, u = block_and_input("mha-gqa-rotary")
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        decoded, params = prefill_then_steps(block, u, 4)
        whole = block(u)
    assert params.key_value_memory_dict[0][0].dtype == torch.bfloat16
    assert_close(decoded, whole, tolerance(torch.bfloat16), "prefill + steps under bf16 autocast")
    by_hand = block.allocate_inference_cache(u.shape[0], u.shape[1], dtype=torch.float32)  # a float32 cache
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        decoded = torch.cat([step(block, u[:, t:t + 1], by_hand, t) for t in range(u.shape[1])], dim=1)
    assert_close(decoded, whole, tolerance(torch.bfloat16), "steps from a float32 cache under bf16 autocast")


@pytest.mark.parametrize("name", [name for name in BLOCKS if not name.startswith("mha")])
@torch.no_grad()
def test_ssm_decoding_under_bf16_autocast(name):
    """Under autocast the projections come out in bfloat16 while a step's state and SSM output stay
    float32: the gated norm then takes a float32 y with a bfloat16 z. Generating with a Mamba-2
    model under autocast failed with "z must have the dtype of x" before."""
    block, u = block_and_input(name)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        decoded, _ = prefill_then_steps(block, u, 4)
        whole = block(u)
    assert_close(decoded, whole, tolerance(torch.bfloat16), f"{name}: prefill + steps under bf16 autocast")


@torch.no_grad()
def test_mamba2_packed_prefill_then_steps():
    """A prefill of two packed sequences (batch 1, cu_seqlens and seq_idx) leaves each one's conv
    and SSM states (causal_conv1d_varlen_states and return_varlen_states in mamba_ssm); decoding
    both as a batch of 2 continues each as the forward pass of that sequence alone."""
    block = BLOCKS["mamba2"]().to(DEVICE)
    lengths, extra = [3, 8], 4
    seqs = [randn(1, n + extra, 32) for n in lengths]
    packed = torch.cat([s[:, :n] for s, n in zip(seqs, lengths)], dim=1)
    cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor([[0] * lengths[0] + [1] * lengths[1]], dtype=torch.int32, device=DEVICE)
    params = InferenceParams(max_seqlen=max(lengths) + extra, max_batch_size=2)
    prefill = block(packed, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=params)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        full = block(s)
        assert_close(prefill[:, cu_seqlens[i]:cu_seqlens[i + 1]], full[:, :n], TOL, f"prefill of sequence {i}")
    params.seqlen_offset = 1  # any position > 0: a step
    for j in range(extra):
        u_t = torch.cat([s[:, n + j:n + j + 1] for s, n in zip(seqs, lengths)], dim=0)
        out = block(u_t, inference_params=params)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            assert_close(out[i:i + 1], block(s[:, :n + j + 1])[:, -1:], TOL, f"sequence {i}, step {j}")


@pytest.mark.parametrize("cls", [Hydra, BiMamba2])
def test_bidirectional_blocks_have_no_step(cls):
    block = cls(32, d_state=8, headdim=16, chunk_size=16, layer_idx=0).to(DEVICE)
    with pytest.raises(NotImplementedError, match="non-causal"):
        block.step(randn(1, 1, 32), None, None)
    with pytest.raises(NotImplementedError, match="non-causal"):
        block.allocate_inference_cache(1, 8)
    with pytest.raises(NotImplementedError, match="inference_params"):
        block(randn(1, 4, 32), inference_params=InferenceParams(max_seqlen=8, max_batch_size=1))


def test_step_takes_one_token():
    block, u = block_and_input("mamba2")
    with pytest.raises(ValueError, match="one token"):
        block.step(u[:, :2], *block.allocate_inference_cache(2, 4))


# --- the language model ------------------------------------------------------------------------------------

def hybrid_lm():
    config = LMConfig(d_model=32, vocab_size=37, layer_types=["mamba2", "attn", "mamba"], d_intermediate=48,
                      mixer_cfg={"mamba2": dict(d_state=8, headdim=16, chunk_size=16),
                                 "attn": dict(num_heads=2, num_heads_kv=1, rotary_emb_dim=8),
                                 "mamba": dict(d_state=4)})
    return LMHeadModel(config).to(DEVICE).eval()


def test_lm_state_dict_names_as_mamba_ssm():
    keys = set(hybrid_lm().state_dict())
    for key in ("backbone.embedding.weight", "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.A_log",
                "backbone.layers.1.mixer.in_proj.weight", "backbone.layers.2.mixer.dt_proj.bias",
                "backbone.layers.0.norm2.weight", "backbone.layers.0.mlp.fc1.weight", "backbone.norm_f.weight",
                "lm_head.weight"):
        assert key in keys, key
    lm = hybrid_lm()
    assert lm.lm_head.weight is lm.backbone.embedding.weight  # tied
    assert lm.backbone.embedding.weight.shape == (40, 32)     # 37 padded to a multiple of 8


def test_generate_greedy_is_deterministic_and_equals_the_forward_argmax():
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (2, 5), device=DEVICE)
    first = lm.generate(prompt, max_length=12)
    assert first.shape == (2, 12) and torch.equal(first[:, :5], prompt)
    assert torch.equal(lm.generate(prompt, max_length=12), first)
    with torch.no_grad():
        logits = lm(first).logits[:, 4:-1, :37]   # teacher forcing over the generated sequence
    assert torch.equal(logits.argmax(-1), first[:, 5:])


def test_generate_sampling_is_reproducible_and_stays_in_the_top_k():
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (2, 4), device=DEVICE)

    def draw():
        return lm.generate(prompt, max_length=10, top_k=3, temperature=0.8,
                           generator=torch.Generator(device=DEVICE).manual_seed(7))
    tokens = draw()
    assert torch.equal(draw(), tokens)
    with torch.no_grad():
        logits = lm(tokens).logits[:, 3:-1, :37]
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens[:, 4:, None]).any(-1).all()


def test_generate_stops_at_eos_and_returns_scores():
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (1, 3), device=DEVICE)
    greedy = lm.generate(prompt, max_length=9)
    eos = int(greedy[0, 4])
    out = lm.generate(prompt, max_length=9, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, greedy[:, :5 if eos not in greedy[0, 3:4].tolist() else 4])
    assert len(out.scores) == out.sequences.shape[1] - 3 and out.scores[0].shape == (1, 37)


def test_generate_scores_are_the_logits_of_each_step():
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (2, 3), device=DEVICE)
    out = lm.generate(prompt, max_length=7, return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == out.sequences.shape[1] - 3 == 4
    with torch.no_grad():
        for i, score in enumerate(out.scores):
            want = lm(out.sequences[:, :3 + i]).logits[:, -1, :37]
            assert score.shape == (2, 37)
            assert_close(score, want, TOL, f"score of step {i}")
            assert torch.equal(score.argmax(-1), out.sequences[:, 3 + i])


def test_generate_stops_once_every_row_has_produced_eos(monkeypatch):
    """Row 0 produces eos at the first step, row 1 at the second: generation stops there."""
    script = iter([[5, 7], [9, 5], [1, 1], [2, 2], [3, 3], [4, 4]])
    monkeypatch.setattr(lm_module, "sample", lambda logits, **_: torch.tensor(next(script), device=DEVICE))
    out = hybrid_lm().generate(torch.randint(0, 37, (2, 3), device=DEVICE), max_length=9, eos_token_id=5)
    assert out[:, 3:].tolist() == [[5, 9], [7, 5]]


def ssm_lm():
    config = LMConfig(d_model=32, vocab_size=37, layer_types=["mamba2", "mamba", "mamba2"], d_intermediate=48,
                      mixer_cfg={"mamba2": dict(d_state=8, headdim=16, chunk_size=16), "mamba": dict(d_state=4)})
    return LMHeadModel(config).to(DEVICE).eval()


MAMBA_SSM_POSITIONAL = ["input_ids", "max_length", "top_k", "top_p", "min_p", "temperature", "return_dict_in_generate",
                        "output_scores"]


def test_generate_takes_mamba_ssm_positional_order():
    """mamba_ssm's MambaLMHeadModel.generate(input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0,
    temperature=1.0, return_dict_in_generate=False, output_scores=False, **decode's keywords): a
    positional call means the same here (min_p before temperature)."""
    parameters = list(inspect.signature(LMHeadModel.generate).parameters.values())[1:]
    positional = [p for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == MAMBA_SSM_POSITIONAL
    assert [p.default for p in positional[2:]] == [1, 0.0, 0.0, 1.0, False, False]
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (2, 3), device=DEVICE)

    def seeded():
        return torch.Generator(device=DEVICE).manual_seed(3)
    by_position = lm.generate(prompt, 9, 3, 0.0, 0.0, 0.5, True, True, generator=seeded())
    by_name = lm.generate(prompt, max_length=9, top_k=3, temperature=0.5, return_dict_in_generate=True,
                          output_scores=True, generator=seeded())
    assert torch.equal(by_position.sequences, by_name.sequences)
    assert all(torch.equal(a, b) for a, b in zip(by_position.scores, by_name.scores))


def mamba_ssm_generation_source():
    """mamba_ssm's utils/generation.py where mamba_ssm is installed, read, not imported: importing it
    needs transformers (and the package's CUDA extensions), which the GPU box may lack."""
    spec = importlib.util.find_spec("mamba_ssm")
    path = pathlib.Path(spec.origin).parent / "utils" / "generation.py" if spec and spec.origin else None
    if path is None or not path.exists():
        pytest.skip("mamba_ssm is not installed")
    return ast.parse(path.read_text())


def function_parameters(tree, name, in_class=None):
    """{parameter: default source or None} of a function (a method of ``in_class``) in ``tree``."""
    scope = tree.body
    if in_class:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == in_class).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    positional = node.args.args
    defaults = [None] * (len(positional) - len(node.args.defaults)) + [ast.unparse(d) for d in node.args.defaults]
    return dict(zip((a.arg for a in positional), defaults))


def test_generate_positional_order_is_mamba_ssm_s():
    """Against the installed mamba_ssm's own source: its generate's positional parameters and
    defaults are ours, and every keyword its decode takes is a parameter of ours."""
    tree = mamba_ssm_generation_source()
    theirs = function_parameters(tree, "generate", in_class="GenerationMixin")
    ours = inspect.signature(LMHeadModel.generate).parameters
    assert list(theirs)[1:] == MAMBA_SSM_POSITIONAL
    for name, default in list(theirs.items())[3:]:
        assert ours[name].default == ast.literal_eval(default), name
    for name in function_parameters(tree, "decode"):
        if name not in ("input_ids", "model"):
            assert name in ours, name


@pytest.mark.parametrize("name, value", [("min_p", 0.05), ("repetition_penalty", 1.2),
                                         ("teacher_outputs", "tokens"), ("streamer", object())])
def test_generate_refuses_by_name_what_it_does_not_implement(name, value):
    prompt = torch.randint(0, 37, (1, 3), device=DEVICE)
    if value == "tokens":
        value = torch.randint(0, 37, (1, 6), device=DEVICE)
    with pytest.raises(NotImplementedError, match=name):  # top_k=0: the one case where mamba_ssm reads min_p
        hybrid_lm().generate(prompt, max_length=6, top_k=0, **{name: value})


def test_generate_takes_min_p_where_mamba_ssm_ignores_it():
    """mamba_ssm's sample reads min_p only with top_k = 0: greedy and top-k calls with a min_p run
    as without it."""
    lm = hybrid_lm()
    prompt = torch.randint(0, 37, (2, 3), device=DEVICE)
    assert torch.equal(lm.generate(prompt, 8, 1, 0.0, 0.05), lm.generate(prompt, 8))
    drawn = [lm.generate(prompt, 8, 4, 0.0, min_p, generator=torch.Generator(device=DEVICE).manual_seed(5))
             for min_p in (0.0, 0.3)]
    assert torch.equal(*drawn)


def test_generate_vocab_size_and_timing(capsys):
    """vocab_size cuts the logits (scores and draws) there; enable_timing prints mamba_ssm's line."""
    lm = hybrid_lm()
    prompt = torch.randint(0, 30, (2, 3), device=DEVICE)
    out = lm.generate(prompt, max_length=7, return_dict_in_generate=True, output_scores=True, vocab_size=30,
                      enable_timing=True)
    assert [s.shape for s in out.scores] == [(2, 30)] * 4
    assert (out.sequences[:, 3:] < 30).all()
    assert "Prompt processing + decoding time:" in capsys.readouterr().out


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's refusal")
def test_generate_cg_needs_cuda():
    with pytest.raises(NotImplementedError, match="cg=True needs CUDA"):
        ssm_lm().generate(torch.randint(0, 37, (1, 3)), max_length=6, cg=True)


@gpu_only
def test_generate_cg_refuses_attention_layers():
    with pytest.raises(NotImplementedError, match="attn"):
        hybrid_lm().generate(torch.randint(0, 37, (1, 3), device=DEVICE), max_length=6, cg=True)


def counted_replays(monkeypatch):
    """A list that gets one entry per CUDA-graph replay from now on."""
    replays, replay = [], torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(graph), replay(graph))[1])
    return replays


@gpu_only
@pytest.mark.parametrize("case", ["float32", "bfloat16", "autocast", "sampled", "eos"])
def test_generate_cg_replays_the_eager_steps(monkeypatch, case):
    """A captured step replays the eager step's kernels: the same logits, bit for bit, so the same
    tokens (greedy; sampled from the same seed; in bfloat16 weights or under bfloat16 autocast, as
    bench_models decodes; stopped at eos). Every step after the prefill's is a replay: a capture
    that recorded nothing would replay stale logits. And the states that the warm-up steps
    advanced were put back, or the first replayed token would differ."""
    lm = ssm_lm().to(torch.bfloat16 if case == "bfloat16" else torch.float32)
    prompt = torch.randint(0, 37, (1 if case == "eos" else 3, 5), device=DEVICE)

    def run(cg, eos_token_id=None):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case == "autocast"):
            return lm.generate(prompt, 17, 5 if case == "sampled" else 1, return_dict_in_generate=True,
                               output_scores=True, cg=cg, eos_token_id=eos_token_id,
                               generator=torch.Generator(device=DEVICE).manual_seed(11))
    eos = None
    if case == "eos":  # a token the eager run produces late, so that both runs stop there
        eos = int(run(False).sequences[0, 12])
    eager = run(False, eos)
    replays = counted_replays(monkeypatch)
    replayed = run(True, eos)
    assert torch.equal(replayed.sequences, eager.sequences)
    assert len(replayed.scores) == len(eager.scores) == eager.sequences.shape[1] - 5
    assert all(torch.equal(a, b) for a, b in zip(replayed.scores, eager.scores))
    assert len(replays) == len(eager.scores) - 1 and len(set(map(id, replays))) <= 1


@gpu_only
@pytest.mark.parametrize("new_tokens", [1, 2])
def test_generate_cg_with_one_or_two_new_tokens(monkeypatch, new_tokens):
    """One new token comes from the prefill (no step, no capture); two need one replayed step."""
    lm = ssm_lm()
    prompt = torch.randint(0, 37, (2, 4), device=DEVICE)
    eager = lm.generate(prompt, 4 + new_tokens)
    replays = counted_replays(monkeypatch)
    assert torch.equal(lm.generate(prompt, 4 + new_tokens, cg=True), eager)
    assert len(replays) == new_tokens - 1


def test_generate_cg_needs_the_inputs_gpu_current(monkeypatch):
    """The graph and its stream are the current device's: inputs on another GPU are refused (their
    kernels would run outside the capture, and every replay would return the same stale logits)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(NotImplementedError, match="current device"):
        ssm_lm().check_graph_decoding(torch.device("cuda", 1))
    ssm_lm().check_graph_decoding(torch.device("cuda", 0))  # accepted


def test_sample_top_p_and_temperature():
    """top_p keeps the smallest set of most likely tokens whose mass reaches p, renormalised;
    temperature T samples softmax(logits / T)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().float().to(DEVICE).expand(20000, 4)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for top_p, temperature, want in ((0.7, 1.0, [0.5, 0.3, 0, 0]), (0.9, 1.0, [0.5, 0.3, 0.15, 0]),
                                     (0.4, 1.0, [1.0, 0, 0, 0]), (0.0, 0.5, (probs ** 2).tolist())):
        tokens = sample(logits, top_k=0, top_p=top_p, temperature=temperature, generator=generator)
        freq = torch.bincount(tokens, minlength=4).cpu().double() / tokens.numel()
        want = torch.tensor(want, dtype=torch.float64) / sum(want)
        assert (freq[want == 0] == 0).all(), (top_p, temperature, freq)
        assert (freq - want).abs().max() < 0.02, (top_p, temperature, freq)


def test_encoder_lm_runs_forward_and_refuses_to_generate():
    config = LMConfig(d_model=32, vocab_size=16, layer_types=["hydra", "bimamba2"],
                      mixer_cfg={"hydra": dict(d_state=8, headdim=16, chunk_size=16),
                                 "bimamba2": dict(d_state=8, headdim=16, chunk_size=16)})
    lm = LMHeadModel(config).to(DEVICE)
    ids = torch.randint(0, 16, (2, 6), device=DEVICE)
    assert lm(ids).logits.shape == (2, 6, 16)
    with pytest.raises(NotImplementedError, match="non-causal"):
        lm.generate(ids, max_length=8)
