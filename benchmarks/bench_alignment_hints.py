"""The stride-alignment hints (``triton_ops.known_multiple``) on and off, timed by the GPU itself.

A Mamba-2 block hands its convolution and its gated norm slices of the in-projection's output,
whose row stride (2 d_inner + 2 groups d_state + heads) 8 divides and 16 does not. Triton assumes
nothing of a stride that 16 does not divide, and reads through it one element at a time; the hints
tell the kernels what does divide it. "off" patches the launchers to ALIGN 1, the code before the
hints. The data are the block's at d_model 768, batch 8 x 2048: the conv reads the x/B/C slice
(1792 channels, width 4, SiLU) of a (8, 2048, 3352) bfloat16 tensor and gets its output gradient
channels-last, as the block gives it; the norm reads x and z rows 3352 apart (width 1536, one group).

Each kernel's time is PyTorch's profiler's device time (``bench.kernel_times``), so the host and
the gaps between launches are left out. On and off alternate over six rounds; the table gives the
medians over rounds and each round's time.

Usage: python benchmarks/bench_alignment_hints.py [--json book/data/alignment_hints_ab.json]
"""
import argparse
import json
import pathlib
import statistics

from mamba_annotated import bench  # first: decides interpreter or GPU before triton is imported

import torch  # noqa: E402

from mamba_annotated import conv1d, gated_norm  # noqa: E402
from mamba_annotated.conv1d import depthwise_conv1d  # noqa: E402
from mamba_annotated.gated_norm import rmsnorm_fn  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402

BATCH, LENGTH, ROW = 8, 2048, 3352          # the in-projection output: 2 x 1536 + 2 x 128 + 24 heads
CONV_START, CHANNELS, WIDTH = 1536, 1792, 4  # x, B and C after z
NORM_WIDTH, Z_START = 1536, 1536 + 256       # x, then z past a gap, rows ROW apart
ROUNDS = 6

conv_alignment, norm_options = conv1d.launch_alignment, gated_norm.launch_options


def hints(on):
    conv1d.launch_alignment = conv_alignment if on else (lambda *a: 1)
    gated_norm.launch_options = norm_options if on else (lambda g, rows: {**norm_options(g, rows), "ALIGN": 1})


def block_step():
    """One forward and backward of the conv and of the norm on the block's slices."""
    torch.manual_seed(0)
    proj = torch.randn(BATCH, LENGTH, ROW, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn(CHANNELS, 1, WIDTH, device=DEVICE) / WIDTH).requires_grad_()
    bias = torch.randn(CHANNELS, device=DEVICE).requires_grad_()
    conv_grad = torch.randn(BATCH, LENGTH, CHANNELS, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    rows = proj.view(BATCH * LENGTH, ROW)
    norm_weight = (1 + 0.1 * torch.randn(NORM_WIDTH, device=DEVICE)).requires_grad_()
    norm_grad = torch.randn(BATCH * LENGTH, NORM_WIDTH, device=DEVICE, dtype=torch.bfloat16)

    def step():
        leaf = proj.detach().requires_grad_()
        x = leaf[..., CONV_START:CONV_START + CHANNELS].transpose(1, 2)
        torch.autograd.grad(depthwise_conv1d(x, weight, bias, WIDTH - 1, activation="silu"), (leaf, weight, bias),
                            conv_grad)
        leaf = rows.detach().requires_grad_()
        out = rmsnorm_fn(leaf[:, :NORM_WIDTH], norm_weight, None, leaf[:, Z_START:Z_START + NORM_WIDTH], 1e-5,
                         NORM_WIDTH, False)
        torch.autograd.grad(out, (leaf, norm_weight), norm_grad)
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    step, times = block_step(), {}
    for round_ in range(ROUNDS):
        for on in ((True, False) if round_ % 2 else (False, True)):  # who goes first alternates too
            hints(on)
            for stage in bench.kernel_times(step):
                if "conv" in stage["stage"] or "norm" in stage["stage"]:
                    times.setdefault((stage["stage"], on), []).append(1e3 * stage["ms"])
    hints(True)
    rows = [dict(kernel=kernel, hints="on" if on else "off", us=statistics.median(us), rounds=[round(t, 1) for t in us])
            for (kernel, on), us in sorted(times.items())]
    for row in rows:
        off = times[(row["kernel"], False)]
        row["speedup"] = statistics.median(off) / row["us"]
    bench.print_table([{k: v for k, v in row.items() if k != "rounds"} for row in rows])
    if args.json:
        args.json.write_text(json.dumps(dict(device=device_name(), torch=torch.__version__, rounds=ROUNDS,
                                             results=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
