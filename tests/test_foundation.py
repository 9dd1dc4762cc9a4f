"""The shared pieces every chapter relies on: the CPU switch, the checkers, the timing helpers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_annotated import outputs
from mamba_annotated.bench import format_table, gbps, median_ms, tflops
from mamba_annotated.scan.combine import first_order_combine_torch
from mamba_annotated.runtime import DEVICE
from mamba_annotated.testing import (assert_associative, assert_close, check, check_within_same_computation,
                                     poisoned_outputs, reading_back_fails, rel_error, uniform)


def test_import_without_cuda_turns_on_the_interpreter_and_says_so_once():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = ("import mamba_annotated, mamba_annotated.runtime as r, os, importlib;"
            "importlib.reload(r);"  # a second look must not repeat the message
            "print(os.environ['TRITON_INTERPRET'], r.INTERPRETED, r.DEVICE, r.size(gpu=1, cpu=2))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "True", "cpu", "2"]
    assert done.stderr.count("Triton's interpreter") == 1


def test_rel_error_and_assert_close():
    ref = torch.tensor([3.0, 4.0])
    assert rel_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(torch.tensor([3.0, 4.5]), ref, 0.05)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([3.0, float("nan")]), ref, 1.0)  # NaN never passes
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_error(torch.zeros(3), ref)


def test_check_prints_the_error_and_nbval_masks_it(capsys):
    """check() prints the measured error beside the bound; book/nbval_sanitize.cfg's regex turns the
    line into one that no longer depends on the error, so strict nbval compares the rest."""
    import configparser
    import pathlib
    import re

    check("forward", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), 1e-3)
    line = capsys.readouterr().out
    assert line == "forward: rel err 4.5e-04 < 1e-03\n"
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parent.parent / "book" / "nbval_sanitize.cfg")
    rule = config["measured relative error"]
    assert re.sub(rule["regex"], rule["replace"], line) == "forward: rel err ERR < 1e-03\n"
    with pytest.raises(AssertionError, match="forward"):
        check("forward", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]), 1e-3)


def test_check_within_same_computation_prints_both_errors_and_nbval_masks_them(capsys):
    """check_within_same_computation() prints the measured error beside its bound (twice PyTorch's
    error, plus the floor); the sanitizer masks both numbers, so strict nbval compares the rest."""
    import configparser
    import pathlib
    import re

    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    same = torch.tensor([1.0, 2.004])          # PyTorch's error 1.8e-03 (+ the float32 floor 1e-06)
    check_within_same_computation("forward, out", torch.tensor([1.0, 2.002]), same, ref, torch.float32)
    line = capsys.readouterr().out
    assert line == "forward, out: rel err 8.9e-04 <= 2 x PyTorch's 1.8e-03 in float32\n"
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parent.parent / "book" / "nbval_sanitize.cfg")
    for rule in config.values():
        if "regex" in rule:
            line = re.sub(rule["regex"], rule["replace"], line)
    assert line == "forward, out: rel err ERR <= 2 x PyTorch's ERR in float32\n"
    with pytest.raises(AssertionError, match="forward, out"):
        check_within_same_computation("forward, out", torch.tensor([1.0, 2.01]), same, ref, torch.float32)


def test_poisoned_outputs_fill_nan_and_restore_the_setting():
    previous = outputs.set_poison(False)
    with poisoned_outputs():
        assert torch.isnan(outputs.empty((4,), torch.float32, "cpu")).all()
        assert (outputs.empty((4,), torch.int32, "cpu") == -1).all()
    assert outputs.set_poison(previous) is False  # the block put back the setting it found


def test_first_order_combine_is_associative_and_the_checker_can_fail():
    def sample():
        return uniform(64, low=0.5, high=1.0, device="cpu"), torch.randn(64)

    def damped_sum(left, right):  # (x o y) o z weighs z by 1/2, x o (y o z) by 1/4: not associative
        return left[0] * right[0], left[1] + 0.5 * right[1]

    assert_associative(first_order_combine_torch, sample)
    with pytest.raises(AssertionError):
        assert_associative(damped_sum, sample)


@pytest.mark.parametrize("read", [
    lambda x: bool(x[0] > 0), lambda x: x.sum().item(), lambda x: x.tolist(), lambda x: x.cpu(),
    lambda x: torch.nonzero(x), lambda x: x[x > 0], lambda x: torch.masked_select(x, x > 0),
    lambda x: torch.equal(x, x), lambda x: torch.is_nonzero(x[:1]), lambda x: torch.unique(x),
    lambda x: torch.repeat_interleave(x, torch.ones(x.shape[0], dtype=torch.long, device=x.device)),
], ids=["bool", "item", "tolist", "cpu", "nonzero", "mask index", "masked_select", "equal", "is_nonzero",
        "unique", "repeat_interleave"])
def test_reading_back_fails_catches_every_read(read):
    x = torch.randn(5, device=DEVICE)
    read(x)  # allowed outside
    with pytest.raises(AssertionError, match="back to the host"), reading_back_fails():
        read(x)


def test_reading_back_fails_lets_device_work_through_and_restores_everything():
    x, rows = torch.randn(5, device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    with reading_back_fails():
        y = x[rows] * 2 + torch.where(x > 0, x, 0).sum()
        torch.repeat_interleave(x, torch.ones(5, dtype=torch.long, device=DEVICE), output_size=5)
    assert bool(y[0] == y[0]) and y.tolist() and torch.equal(x, x)


def test_rates_and_table():
    assert gbps(2e9, 1000.0) == pytest.approx(2.0)
    assert tflops(3e12, 1000.0) == pytest.approx(3.0)
    table = format_table([dict(name="kernel", ms=0.1234), dict(name="loop", ms=12.0)])
    assert table.splitlines()[0].split() == ["name", "ms"]
    assert "0.123" in table and "12" in table
    assert median_ms(lambda: torch.ones(10).sum()) > 0


def compile_offline(tmp_path, *arguments) -> dict:
    """The kernels' report of ``scripts/compile_offline.py *arguments`` (skipped where this Triton
    ships no NVIDIA tools)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton ships no NVIDIA tools")
    report = tmp_path / "report.json"
    script = Path(__file__).resolve().parent.parent / "scripts" / "compile_offline.py"
    subprocess.run([sys.executable, str(script), *arguments, "--json", str(report)], capture_output=True,
                   text=True, check=True, timeout=600)
    return json.loads(report.read_text())["kernels"]


def test_compile_offline_reports_the_gpu_build_of_a_kernel(tmp_path):
    """scripts/compile_offline.py compiles a kernel for sm_90 without a GPU (Triton's front end and
    ptxas) and reads its registers and spill stack from the cubin."""
    (name, usage), = compile_offline(tmp_path, "ssd", "--first").items()
    assert name.startswith("chunk_scan_kernel plain")
    assert 0 < usage["REG"] <= 255 and usage["STACK"] >= 0 and usage["triton_shared"] > 0


def test_compile_offline_compiles_the_scores_kernel_as_launched(tmp_path):
    """Issue 14's wrong scores showed on the H100 in six configurations of the bidirectional
    scores kernel and in none of its neighbours; compiled as the launcher launches them (arguments
    specialized by the installed Triton's binder), the six are one binary and each neighbour a
    binary of its own. It checks the script's specialization, with this machine's Triton: the README
    quotes the same split with Triton 3.6.0, the GPU's."""
    kernels = compile_offline(tmp_path, "scores")
    wrong = {usage["cubin_md5"] for name, usage in kernels.items() if name.endswith("(H100: wrong)")}
    right = {usage["cubin_md5"] for name, usage in kernels.items() if name.endswith("(H100: right)")}
    assert len(kernels) == 17 and len(wrong) == 1 and not wrong & right


def test_no_dot_operand_of_the_chunk_state_kernels_is_stored_again_from_registers(tmp_path):
    """compile_offline's ``states`` family: the chunk-state kernels (chapter 5's chunk_state, chapter
    6's chunk_states) compiled for sm_90 as launched. With and without seq_idx, no operand of a dot
    may be stored to shared memory from registers: the B tile must reach the dot as the asynchronous
    copy left it, and the weighted x from registers. A select on either after its load (the code
    before the masked loads) stored it again from registers."""
    kernels = compile_offline(tmp_path, "states")
    assert sorted(kernels) == sorted(f"{kernel} {tag}" for kernel in ("chunk_state_kernel", "chunk_states_kernel")
                                     for tag in ("plain", "seq_idx"))
    for name, found in kernels.items():
        # shared memory is used, tiles are copied into it and the dots run: the counts see the IR
        assert found["shared_allocations"] > 0 and found["tile_async_copies"] > 0 and found["dots"] > 0, name
        assert found["shared_from_registers"] == 0, (name, found)


@pytest.mark.parametrize("kernel, tiles", [("chunk_state_kernel", (2, 2)), ("chunk_states_kernel", (2, 3))])
def test_packed_chunk_state_tiles_are_fetched_as_far_ahead(tmp_path, kernel, tiles):
    """With seq_idx as many copies per tile as without (chunk_states loads a shared B twice with
    seq_idx, once per direction: three tiles a step against two). Masks made from ids loaded in the
    same step (the code before the runs were found first) fetched the tiles one step ahead instead
    of three."""
    kernels = compile_offline(tmp_path, "states")
    plain, packed = kernels[f"{kernel} plain"]["tile_async_copies"], kernels[f"{kernel} seq_idx"]["tile_async_copies"]
    assert packed * tiles[0] == plain * tiles[1], (plain, packed)


def test_kernels_on_in_projection_slices_load_rows_as_if_aligned(tmp_path):
    """compile_offline's ``in_projection`` family: the convolution's and the gated norm's kernels as
    a Mamba-2 block launches them on slices of its in-projection output. Where 8 divides the row
    stride (3352 at the model benchmark's width) or the channel count (1800) and 16 does not, told
    what divides them (triton_ops.known_multiple), they load exactly as where 16 divides both: the
    same loads of the same widths, none of one 16-bit element. Without the hints the compiler,
    which knows only whether 16 divides an integer argument, read those rows element by element
    (under Triton 3.9: 128 such loads in the forward convolution kernel and 256 or 288 in the first
    backward one; 8 in each norm kernel), and a weaker hint (2 or 4) reads them 4 or 8 bytes at a time."""
    kernels = compile_offline(tmp_path, "in_projection")
    names = ("depthwise_conv_fwd_kernel", "depthwise_conv_bwd_pre_kernel", "depthwise_conv_bwd_x_kernel",
             "gated_rms_norm_fwd_kernel", "gated_rms_norm_bwd_kernel")
    layouts = ("rows 3352", "rows 3360", "channels 1800")
    assert sorted(kernels) == sorted(f"{name} {layout}" for name in names for layout in layouts)
    for name in names:
        aligned = kernels[f"{name} rows 3360"]["load_widths"]
        assert "b16" not in aligned and any(width.startswith("v4.") for width in aligned), (name, aligned)
        for layout in ("rows 3352", "channels 1800"):
            assert kernels[f"{name} {layout}"]["load_widths"] == aligned, (name, layout)


def test_the_backward_kernels_compile_as_launched(tmp_path):
    """compile_offline's ``backward`` family: the kernels of chapter 5's and chapter 6's backward
    passes that read dy with x (the dx kernels and their checked second launches, which keep a NaN
    of dy to the rows that see it, the dCB/dG kernels and the dB/dC kernels) compile for sm_90 as
    launched, with and without seq_idx; chapter 5's dx kernels, at the first tuned configuration,
    without spilling. (Some of the others spill at that configuration under Triton 3.6: chapter 6's
    dx kernel 32 bytes a thread, 80 with seq_idx; chapter 5's dB/dC kernel 8, 24 with seq_idx, and
    its checked launch, which runs only where B or C holds a non-finite value, 192 and 296.)"""
    kernels = compile_offline(tmp_path, "backward")
    names = {"ssd": ("chunk_scan_bwd_dx_kernel", "chunk_scan_bwd_dx_checked_kernel", "chunk_scan_bwd_dcb_kernel",
                     "chunk_scan_bwd_dbc_kernel", "chunk_scan_bwd_dbc_checked_kernel"),
             "bidirectional": ("chunk_scan_bwd_dx_kernel", "chunk_scan_bwd_dx_checked_kernel",
                               "chunk_scan_bwd_dscores_kernel 0", "chunk_scan_bwd_dscores_kernel 1",
                               "chunk_scan_bwd_dbc_kernel", "chunk_scan_bwd_dbc_checked_kernel")}
    assert sorted(kernels) == sorted(f"{chapter} {kernel} {tag}" for chapter, chapter_kernels in names.items()
                                     for kernel in chapter_kernels for tag in ("plain", "seq_idx"))
    for name, found in kernels.items():
        assert 0 < found["REG"] <= 255, name
        if name.startswith("ssd chunk_scan_bwd_dx"):
            assert found["STACK"] == 0, (name, found)
