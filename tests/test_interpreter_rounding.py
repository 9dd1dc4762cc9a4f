"""float32 -> bfloat16 in a kernel rounds to nearest even, as PyTorch rounds: on a GPU by the
hardware, in Triton's interpreter through mamba_annotated.interpreter_rounding (Triton 3.9's own
interpreter truncates). Ties, a carry into the exponent, overflow to infinity, subnormals, signed
zeros, infinities and NaN included."""
import pytest
import torch
import triton
import triton.language as tl

from mamba_annotated.runtime import DEVICE


@triton.jit
def to_bfloat16_kernel(x_ptr, default_ptr, rtne_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(default_ptr + i, x.to(tl.bfloat16), mask=i < n)
    tl.store(rtne_ptr + i, x.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=i < n)


def edge_values():
    bits = torch.tensor([
        0x3F808000,  # 1 + 2^-8: a tie, to the even neighbour 1
        0x3F818000,  # 1 + 3 * 2^-8: a tie, to the even neighbour 1 + 2^-6
        0x3F808001,  # just past the tie: up
        0x3F807FFF,  # just below it: down
        0x3FFFFFFF,  # rounds up across the exponent: 4
        0x7F7FFFFF,  # the largest float32: infinity
        0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals, ties among them, a negative one
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # signed zeros, infinities
    ], dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    return torch.cat([values, -values, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3.0])


@pytest.mark.parametrize("rounding", ["default", "rtne"])
def test_a_kernel_rounds_float32_to_bfloat16_as_pytorch_does(rounding):
    x = edge_values().to(DEVICE)
    out = {name: torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE) for name in ("default", "rtne")}
    to_bfloat16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out["default"], out["rtne"], x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(out[rounding].view(torch.int16), want.view(torch.int16))


def test_nan_stays_a_nan():
    x = torch.tensor([float("nan"), -float("nan")], device=DEVICE)
    out = {name: torch.empty(2, dtype=torch.bfloat16, device=DEVICE) for name in ("default", "rtne")}
    to_bfloat16_kernel[(1,)](x, out["default"], out["rtne"], 2, BLOCK=16)
    assert out["default"].isnan().all() and out["rtne"].isnan().all()
