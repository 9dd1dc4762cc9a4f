"""Each op called exactly as the upstream call sites call it, positional and keyword.

The call sites are mamba_ssm 2.3.2.post1's ``Mamba2.forward`` (the path without the fused
split-conv kernel: ``mamba_chunk_scan_combined`` on ``torch.split`` views of one projection),
``Mamba.forward`` (``selective_scan_fn`` on views of ``in_proj`` and ``x_proj`` outputs), code written
for ``flash_attn_func`` (every default written out, and positional), and accelerated-scan's
``scan(gates, tokens)``. Each is checked against the float64 references, forward and gradients;
on a GPU where mamba_ssm's Triton kernels import, against the peer too. Then every op as a
``torch.library`` op: ``opcheck``, ``torch.compile(fullgraph=True)`` of a model using all four
against eager, and (GPU) CUDA-graph capture of forward and backward.
"""
import inspect
import math
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from mamba_annotated import (attention, attention_varlen, attention_with_kvcache, bidirectional_chunk_scan,
                             linear_scan, rmsnorm_fn, selective_scan, selective_state_update, sequential_scan,
                             ssd_chunk_scan, ssd_state_update)
from mamba_annotated.attention.reference import attention_ref
from mamba_annotated.runtime import DEVICE
from mamba_annotated.scan.api import linear_scan_op, selective_scan_op, sequential_scan_op
from mamba_annotated.scan.reference import linear_scan_ref, selective_scan_ref
from mamba_annotated.ssd.reference import ssd_quadratic_ref
from mamba_annotated.testing import (assert_close, assert_gradients_close, randn, reading_back_fails, rel_error,
                                     tolerance, uniform)

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
TOL = tolerance(torch.float32)
SUM_TOL = 10 * TOL  # gradients that are sums over every position (dA, dD, d dt_bias)


def mamba_ssm_module(submodule):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from peers import mamba_ssm_module as load
    return load(submodule)


# --- Mamba2.forward: mamba_chunk_scan_combined on split views -------------------------------------

HEADS, HEADDIM, GROUPS, DSTATE, CHUNK = 4, 16, 2, 8, 16
D_SSM = HEADS * HEADDIM
WIDTH = D_SSM + D_SSM + 2 * GROUPS * DSTATE + HEADS   # z, xBC, dt: in_proj's output without the MLP part


def mamba2_leaves(batch, length):
    return dict(zxbcdt=randn(batch, length, WIDTH).requires_grad_(),
                A_log=torch.log(uniform(HEADS, low=1.0, high=4.0)).requires_grad_(),
                D=randn(HEADS).requires_grad_(),
                dt_bias=randn(HEADS, scale=0.5).requires_grad_())


def mamba2_call(scan, seq_idx=None, cu_seqlens=None, return_final_states=False, return_varlen_states=False):
    """Mamba2.forward's call, with the depthwise conv replaced by its activation (the views are the point)."""
    def run(zxbcdt, A_log, D, dt_bias):
        z, xBC, dt = torch.split(zxbcdt, [D_SSM, D_SSM + 2 * GROUPS * DSTATE, HEADS], dim=-1)
        xBC = F.silu(xBC)
        x, B, C = torch.split(xBC, [D_SSM, GROUPS * DSTATE, GROUPS * DSTATE], dim=-1)
        A = -torch.exp(A_log.float())
        return scan(
            x.unflatten(-1, (HEADS, HEADDIM)),
            dt,
            A,
            B.unflatten(-1, (GROUPS, DSTATE)),
            C.unflatten(-1, (GROUPS, DSTATE)),
            chunk_size=CHUNK,
            D=D,
            z=z.unflatten(-1, (HEADS, HEADDIM)),
            dt_bias=dt_bias,
            dt_softplus=True,
            seq_idx=seq_idx,
            cu_seqlens=cu_seqlens,
            return_final_states=return_final_states,
            return_varlen_states=return_varlen_states,
        )
    return run


def ssd_reference(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                  cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
                  return_varlen_states=False):
    """mamba_chunk_scan_combined's signature over the float64 quadratic reference (no varlen states)."""
    assert not return_varlen_states
    return ssd_quadratic_ref(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                             initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
                             return_final_states=return_final_states)


def flat(result):
    """One tensor of everything an op returned (so one upstream gradient reaches all of it)."""
    return torch.cat([t.flatten() for t in result]) if isinstance(result, tuple) else result


@pytest.mark.parametrize("return_final_states", [False, True])
def test_mamba2_call_site(return_final_states):
    leaves = mamba2_leaves(2, 37)
    ours = mamba2_call(ssd_chunk_scan, return_final_states=return_final_states)
    ref = mamba2_call(ssd_reference, return_final_states=return_final_states)
    out = ours(**leaves)
    assert isinstance(out, tuple) == return_final_states
    assert_close(flat(out), flat(ref(**leaves)), TOL, "y (and final state)")
    errors = assert_gradients_close(lambda **a: flat(ours(**a)), lambda **a: flat(ref(**a)), leaves, SUM_TOL)
    # the gradients of A_log, D and dt_bias are sums over every position of terms of both signs
    # (tests/test_ssd.py's grad_tol says why their float32 bound is wider); zxbcdt's is not
    assert errors["zxbcdt"] < TOL, errors


def test_mamba2_call_site_with_packed_sequences_and_varlen_states():
    """Inference with cu_seqlens (batch 1): y, the last state and every sequence's final state."""
    lengths = [9, 20, 1, 13]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE),
                                      torch.tensor(lengths, device=DEVICE)).to(torch.int32)[None]
    leaves = mamba2_leaves(1, sum(lengths))
    y, last_state, varlen_states = mamba2_call(ssd_chunk_scan, seq_idx, cu_seqlens, True, True)(**leaves)
    y_ref, last_ref = mamba2_call(ssd_reference, seq_idx, None, True)(**leaves)
    assert_close(y, y_ref, TOL, "y")
    assert_close(last_state, last_ref, TOL, "final state")
    assert varlen_states.shape == (len(lengths), HEADS, HEADDIM, DSTATE)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        one = {k: (v[:, start:end] if k == "zxbcdt" else v) for k, v in leaves.items()}
        _, final_ref = mamba2_call(ssd_reference, return_final_states=True)(**one)
        assert_close(varlen_states[i], final_ref[0], TOL, f"final state of sequence {i}")


# --- Mamba.forward: selective_scan_fn on views of the projections --------------------------------

def test_mamba_call_site():
    batch, length, d_inner, dstate, dt_rank = 2, 29, 8, 4, 2
    leaves = dict(xz=randn(batch, 2 * d_inner, length).requires_grad_(),
                  x_dbl=randn(batch * length, dt_rank + 2 * dstate).requires_grad_(),
                  dt_weight=randn(d_inner, dt_rank).requires_grad_(),
                  dt_bias=randn(d_inner, scale=0.5).requires_grad_(),
                  A_log=torch.log(uniform(d_inner, dstate, low=1.0, high=4.0)).requires_grad_(),
                  D=randn(d_inner).requires_grad_())

    def call(scan):
        def run(xz, x_dbl, dt_weight, dt_bias, A_log, D):
            x, z = xz.chunk(2, dim=1)
            dt, B, C = torch.split(x_dbl, [dt_rank, dstate, dstate], dim=-1)
            dt = (dt_weight @ dt.t()).unflatten(1, (batch, length)).transpose(0, 1)   # "d (b l) -> b d l"
            B = B.unflatten(0, (batch, length)).transpose(1, 2).contiguous()         # "(b l) n -> b n l"
            C = C.unflatten(0, (batch, length)).transpose(1, 2).contiguous()
            A = -torch.exp(A_log.float())
            return scan(x, dt, A, B, C, D.float(), z=z, delta_bias=dt_bias.float(), delta_softplus=True,
                        return_last_state=True)
        return run

    ours, ref = call(selective_scan), call(selective_scan_ref)
    assert_close(flat(ours(**leaves)), flat(ref(**leaves)), TOL, "y and last state")
    assert_gradients_close(lambda **a: flat(ours(**a)), lambda **a: flat(ref(**a)), leaves, TOL)


# --- flash_attn_func -----------------------------------------------------------------------------

def test_flash_attn_func_call_with_every_default_written_out():
    q, k, v = (randn(2, 19, 4, 32) for _ in range(3))
    out = attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False)
    assert isinstance(out, torch.Tensor)
    assert_close(out, attention_ref(q, k, v)[0], TOL, "out")


def test_flash_attn_func_positional_order():
    """flash_attn_func(q, k, v, dropout_p, softmax_scale, causal): the sixth argument is causal."""
    q, k, v = (randn(1, 13, 2, 16) for _ in range(3))
    assert_close(attention(q, k, v, 0.0, None, True), attention_ref(q, k, v, causal=True)[0], TOL, "causal")
    assert_close(attention(q, k, v, 0.0, 0.3), attention_ref(q, k, v, softmax_scale=0.3)[0], TOL, "scale")
    torch.manual_seed(0)
    dropped = attention(q, k, v, 0.1)
    torch.manual_seed(0)
    assert torch.equal(dropped, attention(q, k, v, dropout_p=0.1))  # the fourth argument is dropout_p


def test_packed_qkv_unbound_as_attention_modules_do():
    qkv = randn(2, 17, 3, 4, 32).requires_grad_()
    leaves = dict(qkv=qkv)
    ours = lambda qkv: attention(*qkv.unbind(dim=2), causal=True)  # noqa: E731
    ref = lambda qkv: attention_ref(*qkv.unbind(dim=2), causal=True)[0]  # noqa: E731
    assert_close(ours(qkv), ref(qkv), TOL, "out")
    assert_gradients_close(ours, ref, leaves, TOL)


# --- accelerated-scan's scan(gates, tokens) ------------------------------------------------------

def test_accelerated_scan_call():
    gates, tokens = uniform(2, 8, 45, low=0.6, high=1.0), randn(2, 8, 45)
    assert_close(linear_scan(gates, tokens), linear_scan_ref(gates, tokens), TOL, "h")


# --- torch.library: opcheck, torch.compile, CUDA graphs -----------------------------------------

def test_opcheck_scans():
    a, b, h0 = uniform(3, 21, low=0.6, high=1.0), randn(3, 21), randn(3)
    for op in (linear_scan_op, sequential_scan_op):
        # without a gradient, then with one (each tuple built as its turn comes: requires_grad_ in
        # the second would otherwise mark the first's tensors before it runs)
        torch.library.opcheck(op.op, (a, b, h0, False))
        torch.library.opcheck(op.op, (a.detach().requires_grad_(), b.detach().requires_grad_(), None, True))
    u, delta = randn(1, 4, 19).requires_grad_(), uniform(1, 4, 19, low=0.1, high=0.5).requires_grad_()
    A, B, C = -uniform(4, 3, low=0.5, high=1.5).requires_grad_(), randn(1, 3, 19).requires_grad_(), randn(1, 3, 19)
    torch.library.opcheck(selective_scan_op.op, (u, delta, A, B, C, randn(4), None, None, True, True))
    torch.library.opcheck(selective_scan_op.op, (u, delta, A, B, C, None, randn(1, 4, 19), randn(4), False, True))


def transposed(*shape):
    """A random tensor of ``shape`` whose last two dims are swapped in memory (not contiguous)."""
    return randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def split_view(*shape):
    """A random tensor of ``shape`` that is a slice of a wider last dim (mamba_ssm's in_proj split)."""
    return randn(*shape[:-1], shape[-1] + 3)[..., 2:-1]


def non_contiguous_op_args():
    """(op, arguments of its forward custom op) for every public op, inputs as strided views."""
    from mamba_annotated.attention.api import attention_op
    from mamba_annotated.attention.varlen import attention_varlen_op
    from mamba_annotated.bidirectional.api import bidirectional_chunk_scan_op
    from mamba_annotated.conv1d import depthwise_conv_op
    from mamba_annotated.gated_norm import gated_rms_norm_op
    from mamba_annotated.ssd.api import ssd_chunk_scan_op

    def grad(*tensors):
        return [t.requires_grad_() for t in tensors]

    a, b = grad(transposed(3, 21).abs().clamp(0.5, 0.99), transposed(3, 21))
    u, delta, B = grad(transposed(1, 4, 19), transposed(1, 4, 19).abs() * 0.3 + 0.1, transposed(1, 3, 19))
    A, C = grad(-uniform(4, 3, low=0.5, high=1.5), randn(1, 3, 19))
    x, dt = grad(split_view(1, 17, 2, 16), transposed(1, 17, 2) * 0.5)
    A_ssd, B_ssd, C_ssd = grad(-uniform(2, low=0.5, high=1.5), split_view(1, 17, 1, 16), split_view(1, 17, 1, 16))
    qkv = randn(1, 13, 3, 2, 16)
    q, k, v = grad(*(qkv[:, :, i] for i in range(3)))
    packed_qkv = randn(15, 3, 2, 16)  # three sequences packed, one row past the last
    packed_q, packed_k, packed_v = grad(*packed_qkv.unbind(1))
    cu_seqlens = torch.tensor([0, 6, 6, 14], dtype=torch.int32, device=DEVICE)
    return [
        ("linear_scan", linear_scan_op, (a, b, None, False)),
        ("sequential_scan", sequential_scan_op, (a, b, None, True)),
        ("selective_scan", selective_scan_op, (u, delta, A, B, C, randn(4), transposed(1, 4, 19), None, True, True)),
        ("ssd_chunk_scan", ssd_chunk_scan_op, (x, dt, A_ssd, B_ssd, C_ssd, 16, None, split_view(1, 17, 2, 16), None,
                                               None, None, None, True, 0.0, math.inf, None, True)),
        ("bidirectional_chunk_scan", bidirectional_chunk_scan_op,
         (x, dt, A_ssd, B_ssd, C_ssd, 16, None, None, None, None, True, 0.0, math.inf, False, None, None, None)),
        ("attention", attention_op, (q, k, v, 0.25, -1, 0, 0.0, None, 0.0, None)),
        ("attention_varlen", attention_varlen_op,
         (packed_q, packed_k, packed_v, cu_seqlens, cu_seqlens, 8, 8, 0.25, -1, 0, 0.0, None, 0.0, None)),
        ("gated_rms_norm", gated_rms_norm_op,
         (*grad(split_view(1, 17, 24)), *grad(randn(24), randn(24), split_view(1, 17, 24)), 1e-5, 12, False)),
        # the blocks' conv input: a slice of the in_proj output, transposed; a transposed weight
        ("depthwise_conv1d", depthwise_conv_op,
         (*grad(split_view(2, 17, 24).transpose(1, 2), randn(4, 24).t(), randn(24)),
          torch.tensor([[0] * 9 + [1] * 8, [0] * 17], dtype=torch.int32, device=DEVICE), 3, True)),
    ]


class RecordDispatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op (an OpOverload, aten's or ours) dispatched while active, with its arguments, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def args_of(self, op):
        return [args for func, args in self.calls if func is op]

    def names(self):
        return [func.__name__ for func, _ in self.calls]


@pytest.mark.parametrize("name, op, args", non_contiguous_op_args(), ids=lambda v: v if isinstance(v, str) else "")
def test_fake_functions_match_strided_inputs(name, op, args):
    """Each fake (meta) function gives the shapes, dtypes and strides its real function returns,
    forward and backward, when the inputs are strided views (a transposed u or dt, a slice of an
    in_proj output, q/k/v from one packed tensor). torch.compile checks the real outputs against
    the fake ones and stops on a mismatch: the selective scan's fakes copied a transposed input's
    strides while the kernels return contiguous tensors, which broke torch.compile of Mamba-1."""
    torch.library.opcheck(op.op, args)
    outputs = op.op(*args)
    loss = sum(t.float().square().sum() for t in outputs if t.is_floating_point() and t.requires_grad)
    backward_op = getattr(torch.ops.mamba_annotated, f"{name}_backward").default
    with RecordDispatch() as recorder:
        loss.backward()
    calls = recorder.args_of(backward_op)
    assert len(calls) == 1, f"{name}_backward ran {len(calls)} times"
    # the saved inputs still require grad; the backward op itself is not differentiated
    torch.library.opcheck(op.backward_op, [t.detach() if isinstance(t, torch.Tensor) else t for t in calls[0]])


def all_four_ops(scan_a, scan_b, u, delta, A, B, C, x, dt, A_ssd, B_ssd, C_ssd, q, k, v):
    """A small model's worth of calls: every public op, forward, summed into one loss."""
    h = linear_scan(torch.sigmoid(scan_a), scan_b, reverse=True)
    y1 = selective_scan(u, delta, A, B, C, delta_softplus=True)
    y2 = ssd_chunk_scan(x, dt, A_ssd, B_ssd, C_ssd, 16, dt_softplus=True)
    y3 = attention(q, k, v, causal=True)
    return h.square().sum() + y1.square().sum() + y2.square().sum() + y3.square().sum()


def all_four_inputs():
    return dict(scan_a=randn(2, 3, 25), scan_b=randn(2, 3, 25),
                u=randn(1, 4, 17), delta=randn(1, 4, 17, scale=0.5), A=-uniform(4, 3, low=0.5, high=1.5),
                B=randn(1, 3, 17), C=randn(1, 3, 17),
                x=randn(1, 21, 2, 16), dt=randn(1, 21, 2, scale=0.5), A_ssd=-uniform(2, low=0.5, high=1.5),
                B_ssd=randn(1, 21, 1, 16), C_ssd=randn(1, 21, 1, 16),
                q=randn(1, 11, 2, 16), k=randn(1, 11, 2, 16), v=randn(1, 11, 2, 16))


def loss_and_gradients(fn, inputs):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    loss = fn(**leaves)
    return loss, torch.autograd.grad(loss, list(leaves.values()))


def test_torch_compile_fullgraph_matches_eager():
    """The custom ops trace with no graph break (fullgraph=True) and run the same kernels."""
    torch._dynamo.reset()
    inputs = all_four_inputs()
    backend = "inductor" if DEVICE.type == "cuda" else "aot_eager"
    compiled = torch.compile(all_four_ops, fullgraph=True, backend=backend)
    loss, grads = loss_and_gradients(compiled, inputs)
    eager_loss, eager_grads = loss_and_gradients(all_four_ops, inputs)
    assert_close(loss, eager_loss, TOL, "loss")
    for name, got, want in zip(inputs, grads, eager_grads):
        assert_close(got, want, TOL, f"grad {name}")


def test_forward_without_autograd_gives_the_same_bits():
    """With nothing to differentiate (no_grad, or no input requiring a gradient) an op skips its
    autograd.Function (library.define_op) and runs the same forward: the same result, bit for bit."""
    inputs = all_four_inputs()
    with_grad, _ = loss_and_gradients(all_four_ops, inputs)
    with torch.no_grad():
        without_grad = all_four_ops(**inputs)
    plain = all_four_ops(**inputs)  # grad mode on, no input requires a gradient
    assert torch.equal(with_grad.detach(), without_grad) and torch.equal(without_grad, plain)
    assert without_grad.grad_fn is None and plain.grad_fn is None


def packed_lengths_attention(q, k, v):
    cu_seqlens = torch.tensor([0, 4, 11], dtype=torch.int32, device=q.device)
    return attention_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, 7, 7, causal=True)


@pytest.mark.parametrize("name, call, inputs", [
    ("attention (lse)", lambda q, k, v: attention(q, k, v, causal=True), dict(q=(1, 11, 2, 16), k=(1, 11, 2, 16),
                                                                            v=(1, 11, 2, 16))),
    ("attention_varlen (lse)", packed_lengths_attention, dict(q=(1, 11, 2, 16), k=(1, 11, 2, 16), v=(1, 11, 2, 16))),
    ("selective_scan (last state, chunk states)", lambda u, delta, B, C: selective_scan(
        u, delta, -torch.ones(4, 3, device=u.device), B, C, delta_softplus=True), dict(u=(1, 4, 17), delta=(1, 4, 17),
                                                                                      B=(1, 3, 17), C=(1, 3, 17))),
    ("ssd_chunk_scan (saved intermediates)", lambda x, dt, B, C: ssd_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, dt_softplus=True), dict(x=(1, 21, 2, 16), dt=(1, 21, 2),
                                                                                  B=(1, 21, 1, 16), C=(1, 21, 1, 16))),
    ("ssd_chunk_scan (final states asked for, not used)", lambda x, dt, B, C: ssd_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, dt_softplus=True, return_final_states=True)[0],
     dict(x=(1, 21, 2, 16), dt=(1, 21, 2), B=(1, 21, 1, 16), C=(1, 21, 1, 16))),
    ("bidirectional_chunk_scan (saved intermediates)", lambda x, dt, B, C: bidirectional_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, dt_softplus=True), dict(x=(1, 21, 2, 16), dt=(1, 21, 2),
                                                                                  B=(1, 21, 1, 16), C=(1, 21, 1, 16))),
    ("rmsnorm_fn (rstd)", lambda x, w: rmsnorm_fn(x, w, None), dict(x=(3, 16), w=(16,))),
])
def test_backward_fills_no_zeros_for_outputs_no_loss_reached(name, call, inputs):
    """An op's outputs beside the one a loss uses (lse, the last state, saved intermediates) get no
    gradient. autograd hands a Python Function zeros in their place unless told not to, an
    allocation and a fill launch at every backward pass (the size of the chunk states for the
    selective scan), which library.define_op turns off for every op: the backward dispatches no
    zeros. A first backward pass runs unrecorded: on a GPU the first call of an autotuned kernel
    times its configurations, clearing the L2 cache between timings with a ``zero_``."""
    leaves = {key: randn(*shape).requires_grad_() for key, shape in inputs.items()}
    out = call(**leaves)
    torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out), retain_graph=True)
    with RecordDispatch() as recorder:
        torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))
    filled = [op for op in recorder.names() if op.split(".")[0] in ("zeros", "zeros_like", "zero_")]
    assert not filled, f"{name}: the backward filled {filled}"


def packed_ids(x):
    """seq_idx for two sequences packed in each row of x (batch, L, ...): L // 3 positions, then the rest."""
    return (torch.arange(x.shape[1], device=x.device) >= x.shape[1] // 3).int().expand(x.shape[0], -1).contiguous()


# every public op, called as in a model (the chunk scans with packed sequences, whose index values
# they check): (name, call, shapes of its float inputs, differentiable, its index tensors' values)
NO_READ_BACK_CALLS = [
    ("attention", lambda q, k, v: attention(q, k, v, causal=True),
     dict(q=(1, 11, 2, 16), k=(1, 11, 2, 16), v=(1, 11, 2, 16)), True, {}),
    ("attention_varlen", lambda q, k, v, cu_seqlens: attention_varlen(
        q[0], k[0], v[0], cu_seqlens, cu_seqlens, 7, 7, causal=True),
     dict(q=(1, 11, 2, 16), k=(1, 11, 2, 16), v=(1, 11, 2, 16)), True, dict(cu_seqlens=[0, 4, 11])),
    ("attention_with_kvcache, paged", lambda q, k_cache, v_cache, k, v, cache_seqlens, block_table:
        attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                               causal=True),
     dict(q=(2, 1, 4, 16), k_cache=(4, 16, 2, 16), v_cache=(4, 16, 2, 16), k=(2, 1, 2, 16), v=(2, 1, 2, 16)), False,
     dict(cache_seqlens=[5, 9], block_table=[[0, 1], [2, 3]])),
    ("linear_scan", lambda a, b: linear_scan(a.sigmoid(), b), dict(a=(3, 50), b=(3, 50)), True, {}),
    ("sequential_scan", lambda a, b: sequential_scan(a.sigmoid(), b), dict(a=(3, 50), b=(3, 50)), True, {}),
    ("selective_scan", lambda u, delta, B, C: selective_scan(
        u, delta, -torch.ones(4, 3, device=u.device), B, C, delta_softplus=True),
     dict(u=(1, 4, 17), delta=(1, 4, 17), B=(1, 3, 17), C=(1, 3, 17)), True, {}),
    ("selective_state_update", lambda state, x, dt, B, C: selective_state_update(
        state, x, dt, -torch.ones(8, 4, device=x.device), B, C, dt_softplus=True),
     dict(state=(2, 8, 4), x=(2, 8), dt=(2, 8), B=(2, 4), C=(2, 4)), False, {}),
    ("ssd_chunk_scan, packed", lambda x, dt, B, C: ssd_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, seq_idx=packed_ids(x), dt_softplus=True),
     dict(x=(1, 21, 2, 16), dt=(1, 21, 2), B=(1, 21, 1, 16), C=(1, 21, 1, 16)), True, {}),
    ("ssd_chunk_scan, varlen states", lambda x, dt, B, C, cu_seqlens: ssd_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, cu_seqlens=cu_seqlens, dt_softplus=True,
        return_varlen_states=True)[1],
     dict(x=(1, 21, 2, 16), dt=(1, 21, 2), B=(1, 21, 1, 16), C=(1, 21, 1, 16)), False, dict(cu_seqlens=[0, 8, 21])),
    ("ssd_state_update", lambda state, x, dt, B, C: ssd_state_update(
        state, x, dt, -torch.ones(4, device=x.device), B, C, dt_softplus=True),
     dict(state=(2, 4, 16, 8), x=(2, 4, 16), dt=(2, 4), B=(2, 1, 8), C=(2, 1, 8)), False, {}),
    ("bidirectional_chunk_scan, packed", lambda x, dt, B, C, cu_seqlens: bidirectional_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, dt_softplus=True, cu_seqlens=cu_seqlens),
     dict(x=(1, 21, 2, 16), dt=(1, 21, 2), B=(1, 21, 1, 16), C=(1, 21, 1, 16)), True, dict(cu_seqlens=[0, 8, 21])),
    ("bidirectional_chunk_scan, seq_idx", lambda x, dt, B, C: bidirectional_chunk_scan(
        x, dt, -torch.ones(2, device=x.device), B, C, 16, seq_idx=packed_ids(x), dt_softplus=True),
     dict(x=(2, 21, 2, 16), dt=(2, 21, 2), B=(2, 21, 1, 16), C=(2, 21, 1, 16)), True, {}),
    ("rmsnorm_fn", lambda x, w, z: rmsnorm_fn(x, w, None, z=z), dict(x=(3, 16), w=(16,), z=(3, 16)), True, {}),
]


@pytest.mark.parametrize("name, call, inputs, differentiable, indices", NO_READ_BACK_CALLS,
                         ids=[case[0] for case in NO_READ_BACK_CALLS])
def test_no_op_reads_a_value_back_to_the_host(name, call, inputs, differentiable, indices):
    """No public op waits for the GPU: a read of a tensor's value back to the host would stop the
    host from queueing kernels ahead of the GPU at every call (every layer of a model), and breaks
    CUDA-graph capture. Checks of index values run on the device (validation.refuse_unless). The
    index tensors are made before: a copy from the host is a wait of its own."""
    leaves = {key: randn(*shape).requires_grad_(differentiable) for key, shape in inputs.items()}
    index = {key: torch.tensor(values, dtype=torch.int32, device=DEVICE) for key, values in indices.items()}

    def step():
        out = call(**leaves, **index)
        if differentiable:
            torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))

    step()  # compiles and, on a GPU, tunes the kernels first
    with reading_back_fails():
        step()


def test_host_cost_benchmark_times_the_python_backward_on_both_threads():
    """benchmarks/bench_host_cost.py's breakdown times an op's autograd.Function.backward inside
    torch.autograd.grad and called directly; it must leave the Function's backward as it found it."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_host_cost import backward_thread_us

    inputs = {name: randn(1, 9, 2, 16).requires_grad_() for name in "qkv"}
    op = lambda i: attention(i["q"], i["k"], i["v"], causal=True)  # noqa: E731
    function = type(op(inputs).grad_fn)._forward_cls
    before = function.backward
    on_engine_thread, on_main_thread = backward_thread_us(op, inputs, calls=2)
    assert on_engine_thread > 0 and on_main_thread > 0
    assert function.backward is before


@gpu_only
def test_cuda_graph_capture_of_forward_and_backward():
    inputs = {k: v.requires_grad_() for k, v in all_four_inputs().items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture (compiles and tunes the kernels)
        for _ in range(2):
            torch.autograd.grad(all_four_ops(**inputs), list(inputs.values()))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = all_four_ops(**inputs)
        grads = torch.autograd.grad(loss, list(inputs.values()))
    graph.replay()
    torch.cuda.synchronize()
    eager_loss, eager_grads = loss_and_gradients(all_four_ops, inputs)
    assert torch.equal(loss, eager_loss)
    for name, got, want in zip(inputs, grads, eager_grads):
        assert torch.equal(got, want), f"grad {name} differs between graph replay and eager"


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_call_site_matches_mamba_ssm(dtype):
    peer = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    if peer is None:
        pytest.skip("mamba_ssm's Triton kernels are not importable")
    leaves = {k: (v.detach().to(dtype) if k == "zxbcdt" else v.detach()).requires_grad_()
              for k, v in mamba2_leaves(2, 300).items()}
    ours = mamba2_call(ssd_chunk_scan, return_final_states=True)
    theirs = mamba2_call(peer.mamba_chunk_scan_combined, return_final_states=True)
    ref = mamba2_call(ssd_reference, return_final_states=True)
    want = flat(ref(**leaves))
    mine, peer_out = flat(ours(**leaves)), flat(theirs(**leaves))
    # as close to float64 as the peer or closer: mamba_ssm multiplies float32 tiles in TF32, so
    # in float32 ours (exact by default) and the peer differ by the peer's rounding (1e-3)
    assert_close(mine, want, tolerance(dtype), "ours against float64")
    assert rel_error(mine, want) <= 2 * rel_error(peer_out, want) + 1e-6


def test_rmsnorm_fn_signature_is_mamba_ssms():
    """mamba_ssm's rmsnorm_fn signature, written out (the comparison with mamba_ssm's own needs it installed)."""
    from mamba_annotated import rmsnorm_fn
    empty = inspect.Parameter.empty
    got = [(p.name, p.default, p.kind) for p in inspect.signature(rmsnorm_fn).parameters.values()]
    assert got == [(name, default, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name, default in
                   [("x", empty), ("weight", empty), ("bias", empty), ("z", None), ("eps", 1e-6),
                    ("group_size", None), ("norm_before_gate", True)]]


@gpu_only
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rmsnorm_fn_matches_mamba_ssm(norm_before_gate):
    """Our gated norm takes mamba_ssm's rmsnorm_fn arguments (names, order, defaults) and is as close
    to float64 as the peer or closer, output and gradients (bfloat16 x and z, float32 weight, as a
    Mamba-2 block under autocast, 8 groups)."""
    from mamba_annotated import rmsnorm_fn
    from mamba_annotated.gated_norm import rmsnorm_ref

    peer = mamba_ssm_module("mamba_ssm.ops.triton.layernorm_gated")
    if peer is None:
        pytest.skip("mamba_ssm's Triton kernels are not importable")
    assert inspect.signature(rmsnorm_fn) == inspect.signature(peer.rmsnorm_fn)
    leaves = dict(x=randn(3, 129, 256, dtype=torch.bfloat16), weight=1 + 0.5 * randn(256),
                  bias=randn(256), z=randn(3, 129, 256, dtype=torch.bfloat16))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    d_out = randn(3, 129, 256, dtype=torch.bfloat16)

    def run(fn, inputs):
        out = fn(inputs["x"], inputs["weight"], inputs["bias"], inputs["z"], 1e-5, 32, norm_before_gate)
        return [out, *torch.autograd.grad(out, list(inputs.values()), d_out.to(out.dtype))]

    f64 = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    want = run(rmsnorm_ref, f64)
    for name, mine, theirs, ref in zip(("out", "dx", "dweight", "dbias", "dz"), run(rmsnorm_fn, leaves),
                                       run(peer.rmsnorm_fn, leaves), want):
        assert rel_error(mine, ref) <= 2 * rel_error(theirs, ref) + 1e-6, name
