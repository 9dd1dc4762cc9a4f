"""Chapter 3: the packed-word scan agrees bit for bit with the tuple scan in float32, and in 16 bits
is as accurate as the same 16-bit accumulation done step by step in PyTorch."""
import pytest
import torch

from mamba_annotated.runtime import size
from mamba_annotated.scan.associative import tuple_scan_forward
from mamba_annotated.scan.packed import packed_scan_forward
from mamba_annotated.scan.reference import linear_scan_ref
from mamba_annotated.testing import randn, rel_error, uniform


LENGTHS = [1, 7, 100, size(gpu=4096, cpu=257)]  # the interpreter calls the packed combine per element


def inputs(length, dtype):
    rows = size(gpu=333, cpu=2)
    return uniform(rows, length, low=0.6, high=1.0, dtype=dtype), randn(rows, length, dtype=dtype)


@pytest.mark.parametrize("length", LENGTHS)
def test_float32_words_match_the_tuple_scan_bit_for_bit(length):
    a, b = inputs(length, torch.float32)
    assert torch.equal(packed_scan_forward(a, b), tuple_scan_forward(a, b))


def sixteen_bit_loop(a, b):
    """The same arithmetic as the 16-bit words: compose in float32, round the state to 16 bits to
    nearest even, as a GPU rounds (and Triton's interpreter, once mamba_annotated.interpreter_rounding
    is installed)."""
    h = torch.zeros_like(a[..., 0])
    states = []
    for t in range(a.shape[-1]):
        h = (a[..., t].float() * h.float() + b[..., t].float()).to(a.dtype)
        states.append(h)
    return torch.stack(states, dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", LENGTHS)
def test_sixteen_bit_words_are_as_accurate_as_sixteen_bit_accumulation(dtype, length):
    a, b = inputs(length, dtype)
    ref = linear_scan_ref(a, b)
    error = rel_error(packed_scan_forward(a, b), ref)
    baseline = rel_error(sixteen_bit_loop(a, b), ref)
    assert error <= 2 * baseline + 1e-3, f"{error:.2e} vs 16-bit loop {baseline:.2e}"


def test_sixteen_bit_words_lose_to_float32_accumulation_on_long_rows():
    a, b = inputs(LENGTHS[-1], torch.bfloat16)
    ref = linear_scan_ref(a, b)
    assert rel_error(tuple_scan_forward(a, b), ref) < rel_error(packed_scan_forward(a, b), ref)


def test_packed_scan_refuses_rows_longer_than_one_block():
    a = torch.ones(1, (1 << 16) + 1)
    with pytest.raises(ValueError, match="at most"):
        packed_scan_forward(a, a)
