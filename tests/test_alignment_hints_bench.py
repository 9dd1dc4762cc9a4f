"""benchmarks/bench_alignment_hints.py compares what it says it compares: with the hints on, the
launchers see the block's row stride (3352, which 8 divides and 16 does not) and pass ALIGN 8; with
them off, ALIGN 1; and the benchmark leaves the launchers as it found them. (The timing itself needs a
GPU's profiler.)"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_alignment_hints as ab  # noqa: E402

from mamba_annotated import conv1d, gated_norm  # noqa: E402


def test_hints_on_and_off_reach_the_launchers():
    # small tensors with the block's row stride: (2, 5, ROW) as (batch, L, row)
    proj = torch.zeros(2, 5, ab.ROW)
    x = proj[..., ab.CONV_START:ab.CONV_START + ab.CHANNELS].transpose(1, 2)
    grad = torch.zeros(2, 5, ab.CHANNELS).transpose(1, 2)
    rows = proj.view(-1, ab.ROW)
    norm_rows = [rows[:, :ab.NORM_WIDTH], rows[:, ab.Z_START:ab.Z_START + ab.NORM_WIDTH]]
    aligns = {}
    for on in (True, False):
        ab.hints(on)
        aligns[on] = (conv1d.launch_alignment(ab.CHANNELS, x), conv1d.launch_alignment(ab.CHANNELS, x, grad),
                      gated_norm.launch_options(ab.NORM_WIDTH, norm_rows)["ALIGN"])
    ab.hints(True)
    assert aligns == {True: (8, 8, 8), False: (1, 1, 1)}
    assert conv1d.launch_alignment is ab.conv_alignment and gated_norm.launch_options is ab.norm_options
