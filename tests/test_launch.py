"""The lean launch path (mamba_annotated/launch.py): its cache key is at least as fine as Triton's
specialization, it binds arguments as Triton does, and on a GPU it launches the very kernel
Triton's own path would, with the same results."""
import types

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import mamba_annotated.launch as launch_module
from mamba_annotated.launch import LeanLaunch, classify
from mamba_annotated.runtime import DEVICE

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="the lean path runs only on a GPU")


def add_kernel(x_ptr, y_ptr, out_ptr, n, stride, SCALE: tl.constexpr, BLOCK: tl.constexpr = 64):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets * stride, mask=inside)
    y = tl.load(y_ptr + offsets * stride, mask=inside)
    tl.store(out_ptr + offsets, x + SCALE * y, mask=inside)


def one(value, constexpr=False):
    return classify([value], [constexpr])[0]


def test_integer_classes_separate_what_triton_specializes_on():
    # == 1, multiple of 16, and the 32/64-bit ranges each change the compiled kernel in Triton
    values = [1, 2, 16, 17, 2 ** 31 - 16, 2 ** 31, 2 ** 63 - 16, 2 ** 63, -16, -1]
    classes = [one(v) for v in values]
    assert classes[0] != classes[1] and classes[2] != classes[3]
    assert classes[4] != classes[5] and classes[6] != classes[7]
    assert one(32) == one(48) == one(2 ** 20) == one(-16)
    assert one(3) == one(5) == one(-1)
    # 64-bit unsigned values fit none of the ranges; their class must still differ from a bool's
    assert one(2 ** 63 + 1) != one(False) and one(2 ** 64 - 15) != one(False) and one(-2 ** 63 - 1) != one(True)


def test_argument_classes():
    t = torch.zeros(8)
    assert one(t) == (torch.float32, True)
    assert one(t[1:]) == (torch.float32, False)        # 4 bytes off: not 16-aligned
    assert one(t[4:]) == (torch.float32, True)
    assert one(t.half())[0] == torch.float16
    assert one(True) is True and one(1) != one(True) and one(None) is None
    assert one(7, constexpr=True) == 7 and one(7, constexpr=True) != one(9, constexpr=True)
    assert one(0.5) == one(2.5)                         # floats are not specialized


def test_binding_follows_the_signature():
    launcher = LeanLaunch(JITFunction(add_kernel))
    x = torch.zeros(4)
    options = dict(stride=1, SCALE=2.0, num_warps=2)
    values, launched, _ = launcher.bind((x, x, x, 4), options)
    assert values == (x, x, x, 4, 1, 2.0, 64)          # BLOCK's default filled in
    assert launched == (x.data_ptr(),) * 3 + (4, 1, 2.0, 64)  # tensors go to the launcher as pointers
    # num_warps, a launch option, last, by name and value
    assert launcher.class_key(values, options) == classify(values, launcher.constexpr) + ("num_warps", 2)
    values, _, _ = launcher.bind((x, x, x), dict(SCALE=3.0, n=5, stride=2, BLOCK=128))
    assert values == (x, x, x, 5, 2, 3.0, 128)


def test_launch_options_are_keyed_by_name():
    # num_warps=4 and num_stages=4 compile different kernels: neither key may confuse them
    launcher = LeanLaunch(JITFunction(add_kernel))
    x = torch.zeros(4)
    keys = set()
    for options in (dict(num_warps=4), dict(num_stages=4), dict(num_warps=4, num_stages=2),
                    dict(num_stages=4, num_warps=2)):
        values, _, exact = launcher.bind((x, x, x, 4, 1), dict(SCALE=1.0, **options))
        keys.add((exact, launcher.class_key(values, dict(SCALE=1.0, **options))))
    assert len({exact for exact, _ in keys}) == len({class_key for _, class_key in keys}) == 4


def test_exact_key_is_at_least_as_fine_as_the_class_key():
    # the first lookup is by the binder's exact key: two calls that share it must share the class
    # key, or a cached kernel would be launched for arguments Triton specializes differently
    launcher = LeanLaunch(JITFunction(add_kernel))
    t = torch.zeros(16)
    arguments = [t, t[1:], t.half(), torch.nn.Parameter(t[4:]), None, True, False, 1, 0, 1.0, 0.0, 16, 17,
                 2 ** 31, 2 ** 63, -3, 0.5]
    seen = {}
    for x in arguments:
        for n in arguments:
            values, _, exact = launcher.bind((x, t, t, n, 1), dict(SCALE=1.0))
            class_key = launcher.class_key(values, dict(SCALE=1.0))
            assert seen.setdefault(exact, class_key) == class_key, (x, n)
    assert len(seen) == (len(arguments) - 1) ** 2  # t and the Parameter (both aligned float32) share their keys


@gpu_only
def test_lean_path_launches_the_kernel_triton_would():
    jit = triton.jit(add_kernel)
    launcher = LeanLaunch(jit)
    x, y = torch.randn(1000, device=DEVICE), torch.randn(1000, device=DEVICE)
    for n, stride, views in ((1000, 1, (x, y)), (999, 1, (x[1:], y[1:])), (499, 2, (x, y))):
        expected = torch.empty(n, device=DEVICE)
        jit[(triton.cdiv(n, 64),)](*views, expected, n, stride, SCALE=2.0)
        for _ in range(3):  # the first call takes Triton's path and caches, the others the lean one
            out = torch.full((n,), float("nan"), device=DEVICE)
            launcher[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](*views, out, n, stride, SCALE=2.0)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # aligned contiguous, misaligned contiguous, and a stride of 2 are three specializations
    assert len(launcher.compiled) == 3


@gpu_only
def test_lean_path_keeps_the_tuned_configuration():
    tuned = triton.autotune([triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 128})], key=["n"])(
        triton.jit(add_kernel))
    launcher = LeanLaunch(tuned)
    x, y = torch.randn(777, device=DEVICE), torch.randn(777, device=DEVICE)
    expected = x + 0.5 * y
    for _ in range(3):
        out = torch.full_like(x, float("nan"))
        launcher[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, 777, 1, SCALE=0.5)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (_, placed), = launcher.compiled.values()  # the tuned block sizes, by parameter index
    assert {launcher.param_names[i]: value for i, value in placed} == tuned.best_config.kwargs


# --- the lean path on the CPU, through a stand-in for Triton's launch path ----------------------------

class FakeTriton:
    """Stands for ``triton.jit(add_kernel)`` (or an autotuned one): ``kernel[grid](...)`` records the call
    and returns a compiled kernel whose ``run`` records the lean launches."""

    def __init__(self, best=None):
        self.fn = JITFunction(add_kernel)
        self.calls, self.runs = [], []
        if best is not None:
            self.keys, self.best_config = ["n"], types.SimpleNamespace(kwargs=best, pre_hook=None)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((args, kwargs))
            compiled = types.SimpleNamespace(function=len(self.calls), packed_metadata=None)
            compiled.run = lambda *a: self.runs.append((compiled.function, a))
            return compiled
        return call


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(launch_module, "current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "current_stream", lambda device: 1234)


def test_first_call_per_specialization_goes_through_triton_then_lean(device):
    fake = FakeTriton()
    lean = LeanLaunch(fake)
    t = torch.zeros(64)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)  # noqa: E731
    for views in ((t, t), (t[1:], t[1:]), (t, t), (t[1:], t[1:]), (t[4:], t[4:])):
        lean[grid](*views, t, 40, 1, SCALE=2.0)
    assert len(fake.calls) == 2 and len(lean.compiled) == 2     # aligned and misaligned
    assert [function for function, _ in fake.runs] == [1, 2, 1]  # t[4:] is aligned: kernel 1
    _, args = fake.runs[0]
    assert args[:4] == (1, 1, 1, 1234)                            # cdiv(40, 64) programs, the stream
    assert args[-7:] == (t.data_ptr(), t.data_ptr(), t.data_ptr(), 40, 1, 2.0, 64)
    lean[grid](t, t, t, 16, 1, SCALE=2.0)                         # n divisible by 16: another kernel
    assert len(fake.calls) == 3


def test_tuned_configuration_is_launched(device):
    fake = FakeTriton(best={"BLOCK": 32})
    lean = LeanLaunch(fake)
    t = torch.zeros(64)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)  # noqa: E731
    for _ in range(2):
        lean[grid](t, t, t, 40, 1, SCALE=2.0)
    (_, args), = fake.runs
    assert args[:3] == (2, 1, 1) and args[-1] == 32               # cdiv(40, 32) programs, BLOCK=32
