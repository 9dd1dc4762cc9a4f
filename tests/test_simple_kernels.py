"""The teaching kernels of chapters 5 and 7 (``ssd/simple.py``, ``attention/simple.py``) against the
float64 references, forward and gradients, at interpreter sizes on fresh random inputs."""
import pytest
import torch

from mamba_annotated.attention.reference import attention_ref, naive_attention
from mamba_annotated.attention.simple import attention_backward_simple, attention_forward_simple
from mamba_annotated.ssd.reference import ssd_chunked_ref, ssd_quadratic_ref
from mamba_annotated.ssd.simple import chunk_scan_dx_simple, chunk_scan_simple, chunk_state_simple
from mamba_annotated.testing import (assert_close, assert_within_same_computation, gradients, randn, tolerance,
                                     uniform)


def ssd_inputs(batch=2, chunks=3, Q=16, heads=2, P=16, N=16):
    """Contiguous float32 inputs, one group; dt > 0 and used as is (no bias, softplus or clamp)."""
    length = chunks * Q
    inputs = dict(x=randn(batch, length, heads, P), dt=uniform(batch, length, heads, low=0.02, high=0.6),
                  A=-uniform(heads, low=0.5, high=2.0), B=randn(batch, length, 1, N), C=randn(batch, length, 1, N),
                  initial_states=randn(batch, heads, P, N))
    chunked = lambda t: t.reshape(batch, chunks, Q, heads).permute(0, 3, 1, 2).contiguous()  # (b, h, chunks, Q)
    dt = chunked(inputs["dt"])
    l = chunked((inputs["dt"] * inputs["A"]).reshape(batch, chunks, Q, heads).cumsum(2).reshape(batch, length, heads))
    return inputs, dt, l


@pytest.mark.parametrize("Q,P,N", [(16, 16, 16), (32, 16, 32)])
def test_chunk_state_simple(Q, P, N):
    inputs, dt, l = ssd_inputs(Q=Q, P=P, N=N)
    _, steps = ssd_chunked_ref(**{k: v.double() for k, v in inputs.items()}, chunk_size=Q, return_intermediates=True)
    assert_close(chunk_state_simple(inputs["x"], inputs["B"], dt, l), steps["states"], tolerance(torch.float32))


@pytest.mark.parametrize("Q,P,N", [(16, 16, 16), (32, 32, 16)])
def test_chunk_scan_simple(Q, P, N):
    inputs, dt, l = ssd_inputs(Q=Q, P=P, N=N)
    as64 = {k: v.double() for k, v in inputs.items()}
    _, steps = ssd_chunked_ref(**as64, chunk_size=Q, return_intermediates=True)
    y = chunk_scan_simple(inputs["x"], inputs["B"], inputs["C"], steps["states_in"].float().contiguous(), dt, l)
    assert_close(y, ssd_quadratic_ref(**as64), tolerance(torch.float32))


def diagonal_blocks_ref(x, dt, A, B, C, Q):
    """The diagonal blocks' part of y: the quadratic reference on each chunk alone, float64."""
    batch, length, heads, P = x.shape
    alone = lambda t: t.reshape(batch * (length // Q), Q, *t.shape[2:])
    y = ssd_quadratic_ref(alone(x), alone(dt), A, alone(B), alone(C))
    return y.reshape(x.shape)


@pytest.mark.parametrize("Q,P,N", [(16, 16, 16), (32, 16, 32)])
def test_chunk_scan_dx_simple(Q, P, N):
    inputs, dt, l = ssd_inputs(Q=Q, P=P, N=N)
    x = inputs["x"].double().requires_grad_()
    dy = randn(*x.shape)
    y = diagonal_blocks_ref(x, inputs["dt"], inputs["A"], inputs["B"], inputs["C"], Q)
    (dx_ref,) = torch.autograd.grad(y, x, dy.double())
    assert_close(chunk_scan_dx_simple(dy, inputs["B"], inputs["C"], dt, l), dx_ref, tolerance(torch.float32))


def attention_inputs(batch=2, length=48, heads=2, d=16):
    return tuple(randn(batch, length, heads, d) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length,d", [(16, 16), (48, 32)])
def test_attention_forward_simple(causal, length, d):
    q, k, v = attention_inputs(length=length, d=d)
    out, lse = attention_forward_simple(q, k, v, causal)
    out_ref, lse_ref = attention_ref(q, k, v, causal)
    out_same, lse_same = naive_attention(q, k, v, causal)
    assert_within_same_computation("out", out, out_same, out_ref, torch.float32)
    assert_within_same_computation("lse", lse, lse_same, lse_ref, torch.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length,d", [(16, 16), (48, 32)])
def test_attention_backward_simple(causal, length, d):
    q, k, v = attention_inputs(length=length, d=d)
    out, lse = attention_forward_simple(q, k, v, causal)
    dout = randn(*q.shape)
    ours = dict(zip("qkv", attention_backward_simple(q, k, v, out, lse, dout, causal)))
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_())
    same = gradients(lambda q, k, v: naive_attention(q, k, v, causal)[0], inputs, dout.double())
    ref = gradients(lambda q, k, v: attention_ref(q, k, v, causal)[0],
                    {key: t.detach().double().requires_grad_() for key, t in inputs.items()}, dout.double())
    for key in "qkv":
        assert_within_same_computation(f"d{key}", ours[key], same[key], ref[key], torch.float32)


def test_simple_kernels_refuse_ragged_lengths():
    q, k, v = attention_inputs(length=20)
    with pytest.raises(ValueError, match="multiple"):
        attention_forward_simple(q, k, v)
