"""The nn.Module blocks (mamba_annotated.modules): constructors and state_dicts as mamba_ssm's, every
block's forward pass and every parameter's gradient against a float64 plain-PyTorch computation of
the same block, what is not implemented; on a GPU with mamba_ssm, its Mamba2 and Mamba with their
weights copied into ours."""
import inspect
import itertools
import math
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from mamba_annotated.attention.reference import attention_ref
from mamba_annotated.bidirectional.reference import bidirectional_ref
from mamba_annotated.gated_norm import rmsnorm_ref
from mamba_annotated.modules import MHA, BiMamba2, Hydra, InferenceParams, Mamba, Mamba2
from mamba_annotated.runtime import DEVICE
from mamba_annotated.scan.reference import selective_scan_ref
from mamba_annotated.ssd.reference import ssd_quadratic_ref
from mamba_annotated.testing import (assert_close, assert_within_same_computation, reading_back_fails, rel_error,
                                     tolerance)

TOL = tolerance(torch.float32)
SUM_TOL = 10 * TOL  # parameter gradients are sums over every position of terms of both signs
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")


# --- float64 references of the blocks, from the modules' parameters --------------------------------

def float64_parameters(module):
    """A float64 leaf copy of every parameter, by name (the reference differentiates these)."""
    return {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}


def linear(x, P, name):
    bias = P.get(f"{name}.bias")
    return F.linear(x, P[f"{name}.weight"], bias)


def conv_ref(x, weight, bias, left, seq_idx=None):
    """out_t = sum_k weight_k x_{t - left + k} + bias, x (batch, L, channels), zero outside the
    sequence and outside the packed sequence of t; one shifted copy per tap."""
    batch, length, _ = x.shape
    t = torch.arange(length, device=x.device)
    out = torch.zeros_like(x)
    for k in range(weight.shape[-1]):
        source = t - left + k
        valid = ((source >= 0) & (source < length))[None].expand(batch, length)
        source = source.clamp(0, length - 1)
        if seq_idx is not None:
            valid = valid & (seq_idx[:, source] == seq_idx)
        out = out + weight[:, 0, k] * x[:, source] * valid[..., None]
    return out + bias if bias is not None else out


def mamba2_ref(m, P, u, seq_idx=None):
    """mamba_ssm's Mamba2.forward (its unfused path) in float64, on ssd_quadratic_ref."""
    zxbcdt = linear(u.double(), P, "in_proj")
    gn = m.ngroups * m.d_state
    d_mlp = (zxbcdt.shape[-1] - 2 * m.d_ssm - 2 * gn - m.nheads) // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, m.d_ssm, m.d_ssm + 2 * gn, m.nheads], dim=-1)
    xBC = F.silu(conv_ref(xBC, P["conv1d.weight"], P.get("conv1d.bias"), m.d_conv - 1, seq_idx))
    x, B, C = torch.split(xBC, [m.d_ssm, gn, gn], dim=-1)
    heads, groups = (lambda t: t.unflatten(-1, (m.nheads, m.headdim))), (lambda t: t.unflatten(-1, (m.ngroups, -1)))
    y = ssd_quadratic_ref(heads(x), dt, -torch.exp(P["A_log"]), groups(B), groups(C),
                          D=P["D"].view(m.nheads, m.headdim) if m.D_has_hdim else P["D"],
                          z=None if m.rmsnorm else heads(z), dt_bias=P["dt_bias"], seq_idx=seq_idx, dt_softplus=True,
                          dt_limit=m.dt_limit).flatten(-2)
    if m.rmsnorm:
        y = rmsnorm_ref(y, P["norm.weight"], None, z, 1e-5, m.d_ssm // m.ngroups, m.norm_before_gate)
    if d_mlp:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return linear(y, P, "out_proj")


def mamba_ref(m, P, u):
    """mamba_ssm's Mamba.forward (without the fused path) in float64, on selective_scan_ref."""
    x, z = linear(u.double(), P, "in_proj").chunk(2, dim=-1)
    x = F.silu(conv_ref(x, P["conv1d.weight"], P.get("conv1d.bias"), m.d_conv - 1))
    dt, B, C = torch.split(x @ P["x_proj.weight"].T, [m.dt_rank, m.d_state, m.d_state], dim=-1)
    dt = dt @ P["dt_proj.weight"].T
    y = selective_scan_ref(x.transpose(1, 2), dt.transpose(1, 2), -torch.exp(P["A_log"]), B.transpose(1, 2),
                           C.transpose(1, 2), P["D"], z=z.transpose(1, 2), delta_bias=P["dt_proj.bias"],
                           delta_softplus=True)
    return linear(y.transpose(1, 2), P, "out_proj")


def hydra_ref(m, P, u):
    """goombalab/hydra's Hydra.forward, step by step as written there, in float64: the two
    directions stacked on the batch axis (the reverse one flipped in time), dt softplus'ed first,
    one causal SSD (no D), each output rolled by one step with a zero at its start, the reverse
    half flipped back, the input-dependent skip x * (fc_D(x) + D)."""
    batch = u.shape[0]
    gn, h = m.ngroups * m.d_state, m.nheads
    z, xBC, dt = torch.split(linear(u.double(), P, "in_proj"), [m.d_inner, m.d_inner + 4 * gn, 2 * h], dim=-1)
    dt = torch.cat([dt[..., :h], dt[..., h:].flip(1)], dim=0)
    dt = F.softplus(dt + P["dt_bias"])
    xBC = F.silu(conv_ref(xBC, P["conv1d.weight"], P.get("conv1d.bias"), m.d_conv // 2))
    x_og, BC = torch.split(xBC, [m.d_inner, 4 * gn], dim=-1)
    x = torch.cat([x_og, x_og.flip(1)], dim=0)
    BC = torch.cat([BC[..., :2 * gn], BC[..., 2 * gn:].flip(1)], dim=0)
    B, C = BC.split([gn, gn], dim=-1)
    y = ssd_quadratic_ref(x.unflatten(-1, (h, m.headdim)), dt, -torch.exp(P["A_log"]),
                          B.unflatten(-1, (m.ngroups, -1)), C.unflatten(-1, (m.ngroups, -1)),
                          dt_limit=m.dt_limit).flatten(-2)
    y = torch.roll(y, shifts=1, dims=1)
    y = torch.cat([torch.zeros_like(y[:, :1]), y[:, 1:]], dim=1)
    y = y[:batch] + y[batch:].flip(1)
    skip = (x_og @ P["fc_D.weight"].T + P["D"]).repeat_interleave(m.headdim, dim=-1)
    y = y + x_og * skip
    return linear(rmsnorm_ref(y, P["norm.weight"], None, z, 1e-5), P, "out_proj")


def bidirectional_block_ref(m, P, u, seq_idx=None):
    """Hydra (with seq_idx: packed sequences) or Bi-Mamba2 in float64, on bidirectional_ref; the
    conv as torch's padding="same" for Bi-Mamba2 (as its reference module)."""
    gn, h = m.ngroups * m.d_state, m.nheads
    hydra = isinstance(m, Hydra)
    directions = 2 if hydra else 1
    z, xBC, dt = torch.split(linear(u.double(), P, "in_proj"),
                             [m.d_inner, m.d_inner + 2 * directions * gn, directions * h], dim=-1)
    if hydra:
        xBC = conv_ref(xBC, P["conv1d.weight"], P.get("conv1d.bias"), m.d_conv // 2, seq_idx)
    else:
        assert seq_idx is None
        # torch's padding="same": (width - 1) // 2 zeros before, the rest after
        width = m.d_conv
        padded = F.pad(xBC.transpose(1, 2), ((width - 1) // 2, width - 1 - (width - 1) // 2))
        xBC = F.conv1d(padded, P["conv1d.weight"], P.get("conv1d.bias"), groups=xBC.shape[-1]).transpose(1, 2)
    parts = torch.split(F.silu(xBC), [m.d_inner] + [gn] * 2 * directions, dim=-1)
    x = parts[0].unflatten(-1, (h, m.headdim))
    B, C, *rev = (t.unflatten(-1, (m.ngroups, m.d_state)) for t in parts[1:])
    extra = dict(shift=True, dt_rev=dt[..., h:], B_rev=rev[0], C_rev=rev[1]) if hydra else {}
    y = bidirectional_ref(x, dt[..., :h], -torch.exp(P["A_log"]), B, C, D=P["D"], dt_bias=P["dt_bias"],
                          dt_softplus=True, dt_limit=m.dt_limit, seq_idx=seq_idx, **extra)
    if hydra:
        y = y + x * (parts[0] @ P["fc_D.weight"].T)[..., None]
    return linear(rmsnorm_ref(y.flatten(-2), P["norm.weight"], None, z, 1e-5), P, "out_proj")


def rotary_ref(x, dim, base, interleaved, offset=0):
    """Rotary embedding as complex multiplication: channel pair i (i and i + dim/2, or 2i and
    2i + 1 interleaved) times exp(1j * position * base^(-2i/dim))."""
    rot = x[..., :dim]
    if interleaved:
        re, im = rot[..., 0::2], rot[..., 1::2]
    else:
        re, im = rot.chunk(2, dim=-1)
    positions = torch.arange(offset, offset + x.shape[1], dtype=torch.float64, device=x.device)
    theta = positions[:, None] * base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    turned = torch.complex(re, im) * torch.polar(torch.ones_like(theta), theta)[:, None]
    if interleaved:
        rotated = torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([turned.real, turned.imag], dim=-1)
    return torch.cat([rotated, x[..., dim:]], dim=-1)


def mha_ref(m, P, u, rotary_base=10000.0, interleaved=False):
    qkv = linear(u.double(), P, "in_proj")
    x_mlp = None
    if m.mlp_dim:
        qkv, x_mlp = qkv.split([qkv.shape[-1] - m.mlp_dim, m.mlp_dim], dim=-1)
        up, gate = x_mlp.chunk(2, dim=-1)
        x_mlp = up * F.silu(gate)
    if m.d_conv:
        qkv = conv_ref(qkv, P["conv1d.weight"], P["conv1d.bias"], m.d_conv - 1)
    q, k, v = qkv.split([m.num_heads * m.head_dim, m.num_heads_kv * m.head_dim, m.num_heads_kv * m.head_dim], dim=-1)
    q = q.unflatten(-1, (m.num_heads, m.head_dim))
    k, v = (t.unflatten(-1, (m.num_heads_kv, m.head_dim)) for t in (k, v))
    if m.rotary_emb_dim:
        q, k = (rotary_ref(t, m.rotary_emb_dim, rotary_base, interleaved) for t in (q, k))
    out, _ = attention_ref(q, k, v, causal=m.causal, softmax_scale=m.softmax_scale)
    out = out.flatten(-2)
    if x_mlp is not None:
        out = torch.cat([out, x_mlp], dim=-1)
    return linear(out, P, "out_proj")


def check_block(m, ref, u, grads=True, **kwargs):
    """The block's output against ref(m, float64 parameters, u) and, with ``grads``, the gradients of
    u and of every parameter (a random upstream gradient, never ones)."""
    m = m.to(DEVICE)
    P = float64_parameters(m)
    u = u.to(DEVICE).requires_grad_(grads)
    u64 = u.detach().double().requires_grad_(grads)
    out = m(u, **kwargs)
    want = ref(m, P, u64, **kwargs)
    assert_close(out, want, TOL, f"{type(m).__name__} output")
    if not grads:
        return
    grad_out = torch.randn_like(want)
    out.backward(grad_out.float())
    want.backward(grad_out)
    assert_close(u.grad, u64.grad, TOL, "grad u")
    for name, p in m.named_parameters():
        assert p.grad is not None, f"no gradient reached {name}"
        assert_close(p.grad, P[name].grad, SUM_TOL, f"grad {name}")


# --- constructors and state_dicts: mamba_ssm 2.3.2.post1's, read off its modules --------------------

MAMBA2_SIGNATURE = [
    ("d_model", inspect.Parameter.empty), ("d_state", 128), ("d_conv", 4), ("conv_init", None), ("expand", 2),
    ("headdim", 64), ("d_ssm", None), ("ngroups", 1), ("A_init_range", (1, 16)), ("D_has_hdim", False),
    ("rmsnorm", True), ("norm_before_gate", False), ("dt_min", 0.001), ("dt_max", 0.1), ("dt_init_floor", 1e-4),
    ("dt_limit", (0.0, math.inf)), ("bias", False), ("conv_bias", True), ("chunk_size", 256),
    ("use_mem_eff_path", True), ("layer_idx", None), ("process_group", None), ("sequence_parallel", True),
    ("device", None), ("dtype", None)]
MAMBA_SIGNATURE = [
    ("d_model", inspect.Parameter.empty), ("d_state", 16), ("d_conv", 4), ("expand", 2), ("dt_rank", "auto"),
    ("dt_min", 0.001), ("dt_max", 0.1), ("dt_init", "random"), ("dt_scale", 1.0), ("dt_init_floor", 1e-4),
    ("conv_bias", True), ("bias", False), ("use_fast_path", True), ("layer_idx", None), ("device", None),
    ("dtype", None)]
HYDRA_SIGNATURE = [
    ("d_model", inspect.Parameter.empty), ("d_state", 64), ("d_conv", 7), ("conv_init", None), ("expand", 2),
    ("headdim", 64), ("ngroups", 1), ("dt_min", 0.001), ("dt_max", 0.1), ("dt_init_floor", 1e-4),
    ("dt_limit", (0.0, math.inf)), ("learnable_init_states", False), ("activation", "swish"), ("bias", False),
    ("conv_bias", True), ("chunk_size", 256), ("use_mem_eff_path", False), ("layer_idx", None), ("device", None),
    ("dtype", None)]


@pytest.mark.parametrize("cls, expected", [(Mamba2, MAMBA2_SIGNATURE), (Mamba, MAMBA_SIGNATURE),
                                           (Hydra, HYDRA_SIGNATURE), (BiMamba2, HYDRA_SIGNATURE)])
def test_constructor_arguments_as_the_reference(cls, expected):
    got = [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()][1:]
    assert got == expected


# Mamba2(d_model=32, d_state=8, headdim=16, ngroups=2): d_inner 64, 4 heads,
# in_proj 2*64 + 2*2*8 + 4 = 164 wide, conv over 64 + 2*2*8 = 96 channels
MAMBA2_KEYS = {"dt_bias": (4,), "A_log": (4,), "D": (4,), "in_proj.weight": (164, 32), "conv1d.weight": (96, 1, 4),
               "conv1d.bias": (96,), "norm.weight": (64,), "out_proj.weight": (32, 64)}
# Mamba2(32, d_state=8, headdim=16, d_ssm=32, D_has_hdim=True, rmsnorm=False, bias=True, conv_bias=False):
# 2 heads; in_proj 2*64 + 2*8 + 2 = 146 wide; conv over 32 + 16 = 48 channels; D per channel; no norm
MAMBA2_MLP_KEYS = {"dt_bias": (2,), "A_log": (2,), "D": (32,), "in_proj.weight": (146, 32), "in_proj.bias": (146,),
                   "conv1d.weight": (48, 1, 4), "out_proj.weight": (32, 64), "out_proj.bias": (32,)}
# Mamba(d_model=32, d_state=8): d_inner 64, dt_rank ceil(32 / 16) = 2
MAMBA_KEYS = {"A_log": (64, 8), "D": (64,), "in_proj.weight": (128, 32), "conv1d.weight": (64, 1, 4),
              "conv1d.bias": (64,), "x_proj.weight": (2 + 2 * 8, 64), "dt_proj.weight": (64, 2),
              "dt_proj.bias": (64,), "out_proj.weight": (32, 64)}
# Hydra(32, d_state=8, headdim=16): in_proj 2*64 + 2*(2*8) + 2*4 = 168 wide, conv over 64 + 32 channels
HYDRA_KEYS = {"dt_bias": (4,), "A_log": (4,), "D": (4,), "in_proj.weight": (168, 32), "conv1d.weight": (96, 1, 7),
              "conv1d.bias": (96,), "fc_D.weight": (4, 64), "norm.weight": (64,), "out_proj.weight": (32, 64)}
# MHA(32, 2, num_heads_kv=1, rotary_emb_dim=8): head_dim 16, qkv 16 * (2 + 2) = 64 wide; rotary: no state
MHA_KEYS = {"in_proj.weight": (64, 32), "in_proj.bias": (64,), "out_proj.weight": (32, 32), "out_proj.bias": (32,)}


@pytest.mark.parametrize("make, expected", [
    (lambda: Mamba2(32, d_state=8, headdim=16, ngroups=2), MAMBA2_KEYS),
    (lambda: Mamba2(32, d_state=8, headdim=16, d_ssm=32, D_has_hdim=True, rmsnorm=False, bias=True, conv_bias=False),
     MAMBA2_MLP_KEYS),
    (lambda: Mamba(32, d_state=8), MAMBA_KEYS),
    (lambda: Hydra(32, d_state=8, headdim=16), HYDRA_KEYS),
    (lambda: MHA(32, 2, num_heads_kv=1, rotary_emb_dim=8), MHA_KEYS),
], ids=["mamba2", "mamba2-mlp", "mamba", "hydra", "mha"])
def test_state_dict_keys_and_shapes(make, expected):
    state = make().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    make().load_state_dict(state, strict=True)


def test_initialisation_as_mamba_ssm():
    """A_log: log of U(1, 16) per head (Mamba2), log(n + 1) (Mamba); softplus(dt bias) in [dt_min, dt_max]."""
    m2, m1 = Mamba2(64, d_state=8, headdim=16), Mamba(32, d_state=8)
    assert ((m2.A_log.exp() >= 1) & (m2.A_log.exp() <= 16)).all()
    assert torch.equal(m1.A_log.exp().round(), torch.arange(1.0, 9.0).repeat(64, 1))
    for bias in (m2.dt_bias, m1.dt_proj.bias):
        step = F.softplus(bias.detach())
        assert ((step >= 0.001 * (1 - 1e-5)) & (step <= 0.1 * (1 + 1e-5))).all()
    assert torch.equal(m2.D.detach(), torch.ones(8)) and torch.equal(m1.D.detach(), torch.ones(64))


# --- forward passes and gradients against float64 ---------------------------------------------------

def tokens(batch=2, length=21, d_model=32):
    return torch.randn(batch, length, d_model)


@pytest.mark.parametrize("kwargs", [
    dict(ngroups=2),
    dict(ngroups=2, norm_before_gate=True, dt_limit=(0.02, 0.5)),
    dict(d_ssm=32, D_has_hdim=True, rmsnorm=False, bias=True, conv_bias=False),
], ids=["groups", "norm-before-gate-dt-limit", "mlp-part-no-norm"])
def test_mamba2_against_float64(kwargs):
    check_block(Mamba2(32, d_state=8, headdim=16, chunk_size=16, **kwargs), mamba2_ref, tokens())


def test_mamba2_flattened_input_and_packed_sequences():
    """u as (batch * seqlen, d_model) with seqlen given; seq_idx: no state and no conv window
    crosses a packed sequence's boundary (as causal_conv1d with seq_idx)."""
    m = Mamba2(32, d_state=8, headdim=16, ngroups=2, chunk_size=16).to(DEVICE)
    u = tokens(length=19).to(DEVICE)
    P = float64_parameters(m)
    with torch.no_grad():
        assert_close(m(u.flatten(0, 1), seqlen=19), mamba2_ref(m, P, u).flatten(0, 1), TOL, "flattened")
    seq_idx = torch.tensor([[0] * 5 + [1] * 9 + [2] * 5, [0] * 19], dtype=torch.int32, device=DEVICE)
    check_block(m, mamba2_ref, u, seq_idx=seq_idx)


def test_mamba2_prefill_of_packed_sequences_leaves_each_its_own_states():
    """A prefill of packed sequences (batch 1, seq_idx and cu_seqlens, as mamba_ssm's varlen
    inference) leaves in the cache, for each sequence, the conv and SSM states that a prefill of
    that sequence alone leaves: an empty sequence and ones shorter than the conv window included
    (zero-padded on the left), and the next decoded token agrees. Nothing is read back to the host
    (a pause at every layer of a prefill)."""
    m = Mamba2(32, d_state=8, headdim=16, ngroups=2, chunk_size=16, layer_idx=0).to(DEVICE)
    lengths = [5, 0, 2, 9, 1]
    u = tokens(batch=1, length=sum(lengths)).to(DEVICE)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE), torch.tensor(lengths, device=DEVICE))
    seq_idx = seq_idx.int()[None]
    next_tokens = tokens(batch=len(lengths), length=1).to(DEVICE)
    with torch.no_grad():
        packed = InferenceParams(max_seqlen=32, max_batch_size=len(lengths))
        m(u, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=packed)  # compiles first
        packed = InferenceParams(max_seqlen=32, max_batch_size=len(lengths))
        with reading_back_fails():
            m(u, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=packed)
        conv_states, ssm_states = packed.key_value_memory_dict[0]
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            alone = InferenceParams(max_seqlen=32, max_batch_size=1)
            if end > start:
                m(u[:, start:end], inference_params=alone)
                conv_state, ssm_state = alone.key_value_memory_dict[0]
            else:  # nothing to prefill: the states a new sequence starts from
                conv_state, ssm_state = m.get_states_from_cache(alone, 1, initialize_states=True)
            assert_close(conv_states[i], conv_state[0], TOL, f"conv state of sequence {i}")
            assert_close(ssm_states[i], ssm_state[0], TOL, f"SSM state of sequence {i}")
            alone.seqlen_offset = max(end - start, 1)
            assert_close(m(next_tokens[i:i + 1], inference_params=alone)[0],
                         m.step(next_tokens[i:i + 1], conv_states[i:i + 1].clone(), ssm_states[i:i + 1].clone())[0][0],
                         TOL, f"next token of sequence {i}")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the refusal is a device-side assert, which would end this "
                    "process's CUDA context; tests/test_ssd.py checks it there in a child process")
def test_mamba2_prefill_refuses_offsets_past_the_row_with_the_scans_message():
    """cu_seqlens past L reach ssd_chunk_scan's check of the offsets, not an index error of the conv
    states' gather before it."""
    m = Mamba2(32, d_state=8, headdim=16, ngroups=2, chunk_size=16, layer_idx=0).to(DEVICE)
    u = tokens(batch=1, length=12).to(DEVICE)
    cu_seqlens = torch.tensor([0, 5, 20], dtype=torch.int32, device=DEVICE)
    seq_idx = (torch.arange(12, device=DEVICE) >= 5).int()[None]
    with torch.no_grad(), pytest.raises(RuntimeError, match="cu_seqlens must be nondecreasing offsets"):
        m(u, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=InferenceParams(max_seqlen=32, max_batch_size=2))


def test_mamba_against_float64():
    check_block(Mamba(16, d_state=8), mamba_ref, tokens(length=13, d_model=16))


def test_mamba_dt_rank_biases_and_conv_width():
    check_block(Mamba(32, d_state=4, dt_rank=3, bias=True, conv_bias=False, d_conv=3), mamba_ref, tokens(length=9),
                grads=False)


def test_hydra_against_its_reference_module():
    check_block(Hydra(32, d_state=8, headdim=16, ngroups=2, chunk_size=16), hydra_ref, tokens())


def test_hydra_packed_sequences():
    seq_idx = torch.tensor([[0] * 7 + [1] * 9, [0] * 3 + [4] * 13], dtype=torch.int32, device=DEVICE)
    check_block(Hydra(32, d_state=8, headdim=16, chunk_size=16, d_conv=5), bidirectional_block_ref, tokens(length=16),
                seq_idx=seq_idx)


@pytest.mark.parametrize("d_conv", [4, 7])
def test_bimamba2_against_float64(d_conv):
    check_block(BiMamba2(32, d_state=8, headdim=16, chunk_size=16, d_conv=d_conv), bidirectional_block_ref, tokens())


@pytest.mark.parametrize("kwargs, interleaved", [
    (dict(num_heads_kv=1, causal=True, rotary_emb_dim=8), False),
    (dict(causal=False, rotary_emb_dim=16, rotary_emb_interleaved=True, softmax_scale=0.3), True),
    (dict(num_heads_kv=1, causal=True, d_conv=4, mlp_dim=100, qkv_proj_bias=False), False),
], ids=["gqa-rotary-causal", "interleaved-rotary-full", "conv-mlp"])
def test_mha_against_float64(kwargs, interleaved):
    m = MHA(32, 2, **kwargs)
    check_block(m, lambda m, P, u: mha_ref(m, P, u, interleaved=interleaved), tokens(length=13))


def test_mha_grouped_query_heads_against_float64():
    """Four query heads on two key/value heads: with a single key/value head (the cases above)
    every mapping of query heads to key/value heads gives the same result, so this one tells
    them apart (the float64 reference repeats each key/value head for its consecutive queries)."""
    m = MHA(64, 4, num_heads_kv=2, causal=True, rotary_emb_dim=8)
    check_block(m, lambda m, P, u: mha_ref(m, P, u, interleaved=False), tokens(length=13, d_model=64))


# --- what is not implemented says so ------------------------------------------------------------------

def test_unimplemented_arguments_raise():
    with pytest.raises(NotImplementedError, match="process_group"):
        Mamba2(32, headdim=16, process_group=object())
    with pytest.raises(NotImplementedError, match="dt_init"):
        Mamba(32, dt_init="uniform")
    with pytest.raises(NotImplementedError, match="learnable_init_states"):
        Hydra(32, headdim=16, learnable_init_states=True)
    with pytest.raises(ValueError, match="d_conv"):
        Hydra(32, headdim=16, d_conv=4)
    with pytest.raises(ValueError, match="activation"):
        BiMamba2(32, headdim=16, activation="gelu")
    m = MHA(32, 2, causal=True, layer_idx=0).to(DEVICE)
    params = InferenceParams(max_seqlen=8, max_batch_size=1, lengths_per_sample=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="lengths_per_sample"):
        m(tokens(1, 3).to(DEVICE), inference_params=params)


# --- mamba_ssm itself, on a GPU ---------------------------------------------------------------------------

def mamba_ssm_module(name):
    """A mamba_ssm submodule through benchmarks/peers.py's loader, which imports it without running
    mamba_ssm/__init__.py (that imports the CUDA extension a pure-Python build lacks). Skips the test
    when mamba_ssm or anything the submodule imports is missing (peers.py prints why)."""
    pytest.importorskip("einops")
    benchmarks = str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import peers

    module = peers.mamba_ssm_module(name)
    if module is None:
        pytest.skip(f"{name} does not import")
    return module


PEER_TOL = 1e-2


def compare_with_peer(ours, theirs, ref, u, length):
    """Their weights into ours (strict); out and every gradient within 2x the peer's error against
    float64 (plus the float32 floor), and decoding (a prefill, then steps) the same way."""
    ours.load_state_dict(theirs.state_dict(), strict=True)
    P = float64_parameters(ours)
    u64 = u.detach().double().requires_grad_()
    want = ref(ours, P, u64)
    grad_out = torch.randn_like(want)
    want.backward(grad_out)
    results = {}
    for who, module in (("ours", ours), ("theirs", theirs)):
        x = u.detach().clone().requires_grad_()
        out = module(x)
        out.backward(grad_out.float())
        results[who] = dict(out=out.detach(), u=x.grad, **{n: p.grad for n, p in module.named_parameters()})
    # the peer itself must agree with the float64 block: otherwise a divergence that ours and the
    # reference share would widen the "2x the peer's error" bound below and pass unseen (the bound
    # allows TF32 products in the peer's float32 kernels; a semantic difference is of order 1)
    assert_close(results["theirs"]["out"], want.detach(), PEER_TOL, "mamba_ssm's output against the float64 block")
    for name, ours_value in results["ours"].items():
        expected = want.detach() if name == "out" else u64.grad if name == "u" else P[name].grad
        assert_within_same_computation(name, ours_value, results["theirs"][name], expected, torch.float32)
    # decoding: prefill half, then one token at a time, in both modules, against the full float64 pass
    decoded = {}
    with torch.no_grad():
        for who, module in (("ours", ours), ("theirs", theirs)):
            params = InferenceParams(max_seqlen=length, max_batch_size=u.shape[0])
            outs = [module(u[:, :length // 2], inference_params=params)]
            for t in range(length // 2, length):
                params.seqlen_offset = t
                outs.append(module(u[:, t:t + 1], inference_params=params))
            decoded[who] = torch.cat(outs, dim=1)
    assert_close(decoded["theirs"], want.detach(), PEER_TOL, "mamba_ssm's decoding against the float64 block")
    assert_within_same_computation("decoded", decoded["ours"], decoded["theirs"], want.detach(), torch.float32)


@gpu_only
def test_mamba2_matches_mamba_ssm():
    peer = mamba_ssm_module("mamba_ssm.modules.mamba2")
    kwargs = dict(d_state=16, headdim=16, ngroups=2, chunk_size=32, layer_idx=0, device=DEVICE)
    theirs = peer.Mamba2(64, use_mem_eff_path=False, **kwargs)
    ours = Mamba2(64, **kwargs)
    compare_with_peer(ours, theirs, mamba2_ref, torch.randn(2, 100, 64, device=DEVICE), 100)


@gpu_only
def test_mamba_matches_mamba_ssm():
    peer = mamba_ssm_module("mamba_ssm.modules.mamba_simple")
    kwargs = dict(d_state=16, layer_idx=0, device=DEVICE)
    theirs = peer.Mamba(64, **kwargs)
    ours = Mamba(64, **kwargs)
    compare_with_peer(ours, theirs, mamba_ref, torch.randn(2, 100, 64, device=DEVICE), 100)


def test_reference_sees_a_changed_parameter():
    """The float64 block references read the parameters they are given (a check that could not fail otherwise)."""
    m = Mamba2(32, d_state=8, headdim=16, chunk_size=16).to(DEVICE)
    u = tokens().to(DEVICE)
    P = float64_parameters(m)
    P["D"] = P["D"] + 0.5
    with torch.no_grad():
        assert rel_error(m(u), mamba2_ref(m, P, u)) > 100 * TOL
