"""Calls between jitted functions in the interpreter patch triton.language once per launch
(mamba_annotated.interpreter_calls), compute what Triton's own patching computes, and leave the
language as it was after the launch."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from mamba_annotated import interpreter_calls, ssd_chunk_scan
from mamba_annotated.runtime import INTERPRETED
from mamba_annotated.testing import randn

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the patch is for Triton's interpreter only")


@triton.jit
def scaled_tile(ptr, offsets, scale):
    return tl.load(ptr + offsets) * scale


@triton.jit
def twice_scaled_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = scaled_tile(x_ptr, offsets, 2.0) + scaled_tile(x_ptr, offsets, 3.0)  # two calls per program
    tl.store(out_ptr + offsets, total)


def run_twice_scaled(programs=4, block=8):
    x = torch.arange(programs * block, dtype=torch.float32)
    out = torch.empty_like(x)
    twice_scaled_kernel[(programs,)](x, out, BLOCK=block)
    return x, out


def counting_triton_patching(monkeypatch):
    calls, patch = [], interpreter_calls.triton_patch_lang

    def counted(fn):
        calls.append(fn.__name__)
        return patch(fn)
    monkeypatch.setattr(interpreter_calls, "triton_patch_lang", counted)
    return calls


def test_the_package_installs_it():
    assert interpreter._patch_lang.__name__ == "patch_lang_once"
    assert interpreter.GridExecutor.__call__.__name__ == "launch"
    assert interpreter._patch_lang.triton_original is not interpreter._patch_lang


def test_a_launch_patches_once_and_its_calls_reuse_it(monkeypatch):
    calls = counting_triton_patching(monkeypatch)
    x, out = run_twice_scaled()
    assert torch.equal(out, 5 * x)
    assert calls == ["twice_scaled_kernel"]  # 8 helper calls in 4 programs patched nothing more
    run_twice_scaled()
    assert calls == ["twice_scaled_kernel"] * 2  # the next launch patches afresh


def test_without_it_every_call_patches_and_gives_the_same_bits(monkeypatch):
    ours = run_twice_scaled(programs=3)[1]
    calls = []
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or interpreter_calls.triton_patch_lang(fn))
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter_calls.triton_launch)
    assert torch.equal(run_twice_scaled(programs=3)[1], ours)
    assert len(calls) == 1 + 2 * 3  # what the patch saves: Triton's own patching at every call


@triton.jit
def failing_tile(ptr, offsets):
    tl.static_assert(offsets.shape[0] == 1024, "a helper that refuses every tile here")
    return tl.load(ptr + offsets)


@triton.jit
def failing_helper_kernel(x_ptr, BLOCK: tl.constexpr):
    failing_tile(x_ptr, tl.arange(0, BLOCK))


def language_attributes():
    """Every attribute of the modules and classes a launch patches, by identity."""
    return {(owner.__name__, name): id(value) for owner in (tl, tl.math, tl.tensor, tl.dtype)
            for name, value in vars(owner).items()}


def test_the_language_is_restored_after_a_launch_and_after_a_failing_one():
    before = language_attributes()
    run_twice_scaled()
    assert language_attributes() == before and interpreter_calls.patched_in_launch() is None
    with pytest.raises(Exception, match="refuses every tile"):
        failing_helper_kernel[(2,)](torch.zeros(8), BLOCK=8)
    assert language_attributes() == before and interpreter_calls.patched_in_launch() is None


@triton.jit
def row_sums_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.load(x_ptr + row * BLOCK + tl.arange(0, BLOCK))
    # tl.sum and tl.zeros live in triton.language's own modules, whose globals hold
    # triton.language.core, a module the launch of a kernel that imports triton.language leaves alone
    total = tl.sum(tile, axis=0) + tl.sum(tl.zeros((BLOCK,), tl.float32) + 1.0, axis=0)
    tl.store(out_ptr + row, total)


def test_a_call_into_a_module_the_launch_did_not_patch_patches_it_once(monkeypatch):
    calls = counting_triton_patching(monkeypatch)
    x = torch.arange(4 * 8, dtype=torch.float32)
    out = torch.empty(4)
    row_sums_kernel[(4,)](x, out, BLOCK=8)
    assert torch.equal(out, x.view(4, 8).sum(1) + 8)
    assert len(calls) == 2, calls  # the kernel's modules, then core at the first of 12 calls


def test_a_reloaded_module_still_calls_tritons_own_functions():
    """After importlib.reload (an edited module in a notebook), the patch keeps Triton's functions,
    not its own, which would call themselves."""
    import importlib
    original = interpreter_calls.triton_patch_lang
    reloaded = importlib.reload(interpreter_calls)
    reloaded.install()
    assert reloaded.triton_patch_lang is original
    assert torch.equal(run_twice_scaled()[1], 5 * torch.arange(32, dtype=torch.float32))


def test_language_modules_are_those_the_interpreter_patches():
    assert interpreter_calls.language_modules(scaled_tile.fn) == {tl}
    assert interpreter_calls.language_modules(run_twice_scaled) == {tl}


def test_a_package_kernel_with_its_helpers_gives_the_same_bits(monkeypatch):
    """SSD's forward and backward, which call helpers in every program, with and without the patch."""
    x, dt, B, C = randn(1, 37, 2, 16), randn(1, 37, 2), randn(1, 37, 1, 8), randn(1, 37, 1, 8)
    A = -torch.rand(2) - 0.5

    def forward_and_grads():
        inputs = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
        y = ssd_chunk_scan(*inputs, chunk_size=16)
        y.backward(torch.ones_like(y))
        return [y.detach(), *(t.grad for t in inputs)]
    ours = forward_and_grads()
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter_calls.triton_patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter_calls.triton_launch)
    for a, b in zip(ours, forward_and_grads()):
        assert torch.equal(a, b)
