"""compute-sanitizer over every op's forward and backward (scripts/gpu_reliability.sh, step ``sanitize``).

Each (tool, op) pair runs in its own process under ``compute-sanitizer --tool TOOL`` (memcheck,
racecheck, initcheck, synccheck), so every error is charged to one op; the process is this file
with ``--driver``, which runs the op's small odd cases (:meth:`cases.Op.small`: lengths off the
blocks, odd head dims, permuted, strided, offset and stride-0 views, every option) once forward and
once backward, then, for the ops whose kernels have a checked pass that only a non-finite input
wakes (SSD's checked chunk_scan launch, attention's second sweep, the bidirectional op's dropped
non-finite x, and both SSD ops' dB/dC kernels' checked launch, which a NaN in B wakes), once more
for each such input with a NaN in it (:func:`poisoned_run`). The environment of each run:

* ``TRITON_DISABLE_LINE_INFO=0`` (Triton's default, set to be explicit): kernels keep their line
  tables, so the sanitizer names the source line of a bad access;
* ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor is its own cudaMalloc, so memcheck sees an
  access past a tensor's end (with the caching allocator it usually lands inside a pooled block);
* ``MAMBA_ANNOTATED_AUTOTUNE=0``: two configurations per tuned kernel, not the full sweep (the
  tuner's trial runs still run, on the real buffers, as they do for users).

Outputs are *not* poisoned (mamba_annotated/outputs.py): they come from ``torch.empty`` as in
production, so initcheck reports a kernel that reads an element nobody wrote (an accumulator
not zeroed, a tail read of the output); a NaN fill would initialise every element and hide exactly
that. An output a kernel fully writes is never read uninitialised, so it raises nothing.
The driver runs once without the sanitizer first, so Triton's compilation (ptxas, child
processes) is cached and the sanitized run only loads kernels.

    python scripts/reliability/sanitize.py --tools memcheck,racecheck --ops attention --json out.json
    python scripts/reliability/sanitize.py --driver --ops attention      (what runs under the tool)
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cli import comma_list, write_report  # noqa: E402
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
SANITIZER = os.environ.get("COMPUTE_SANITIZER", "/usr/local/cuda/bin/compute-sanitizer")
ENV = {"TRITON_DISABLE_LINE_INFO": "0", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "MAMBA_ANNOTATED_AUTOTUNE": "0"}
OP_NAMES = ("linear_scan", "sequential_scan", "selective_scan", "ssd_chunk_scan", "bidirectional_chunk_scan",
            "attention", "attention_varlen", "attention_with_kvcache", "ssd_state_update", "selective_state_update",
            "rmsnorm_fn", "depthwise_conv1d")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OP_NAMES))
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--driver", action="store_true", help="run the ops once (what the sanitizer watches)")
    parser.add_argument("--log-dir", default=None, help="keep each sanitizer log here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per (tool, op) run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.ops = comma_list(parser, args.ops, OP_NAMES, "--ops")
    args.tools = comma_list(parser, args.tools, TOOLS, "--tools")
    return args


# op -> the inputs whose NaN makes its kernels take a checked path: x and v the forward kernels'
# (attention over a KV cache: a NaN value in a window's masked block, which drop_hidden_nonfinite
# zeroes), B the dB/dC kernels' checked launch in both SSD ops' backward passes
CHECKED_PATH_INPUTS = {"ssd_chunk_scan": ("x", "B"), "attention": ("v",), "attention_varlen": ("v",),
                       "bidirectional_chunk_scan": ("x", "B"), "attention_with_kvcache": ("v",)}


def drive(ops):
    """Each op's small cases once forward and once backward, then a device synchronisation."""
    import torch
    from cases import OPS, forward_backward
    from mamba_annotated.testing import seed_everything

    for name in ops:
        op = OPS[name]
        for i, params in enumerate(op.small()):
            seed_everything(i)
            forward_backward(op, params, op.inputs(params), seed=i)
        for input_name in CHECKED_PATH_INPUTS.get(name, ()):
            poisoned_run(op, input_name)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(f"driver: {name} ran {len(op.small())} cases forward and backward"
              + "".join(f", and one with a NaN in {input_name}" for input_name in CHECKED_PATH_INPUTS.get(name, ())),
              flush=True)


def poisoned_run(op, input_name):
    """The op's causal (attention) or packed (SSD, bidirectional) plain case, forward and backward,
    with a NaN in the middle of ``input_name``: the checked paths run only on such inputs."""
    from cases import forward_backward
    from nonfinite import PROBES, plain_cases
    from mamba_annotated.testing import seed_everything

    params = plain_cases(op)[-1]
    seed_everything(0)
    leaves = op.inputs(params)
    time_dim = PROBES[op.name][1]
    poisoned = leaves[input_name].detach().clone()
    poisoned.select(time_dim, poisoned.shape[time_dim] // 2).fill_(float("nan"))
    leaves[input_name] = poisoned.requires_grad_(leaves[input_name].requires_grad)
    forward_backward(op, params, leaves, seed=0)


def sanitizer_command(tool, op):
    """The command line of one sanitized run."""
    # racecheck shows every hazard, each with its device frame only (no host backtrace: 7317 hazards
    # with one were 20 MB of log), so that racecheck_hazards can sort all of them, not the first 20
    extra = {"racecheck": ["--racecheck-report", "all", "--print-limit", "100000", "--show-backtrace", "device"],
             "initcheck": ["--print-limit", "20"], "synccheck": ["--print-limit", "20"],
             "memcheck": ["--leak-check", "no", "--print-limit", "20"]}[tool]
    # --launch-timeout: the sanitizer waits this long for the process's first CUDA call; its
    # default, 10 s, ran out while Python imported torch beside a dozen other processes (H100)
    return [SANITIZER, "--tool", tool, "--target-processes", "application-only", "--launch-timeout", "600", *extra,
            sys.executable, str(HERE / "sanitize.py"), "--driver", "--ops", op]


def count_errors(log):
    """(errors, the kernels they were found in) from a sanitizer log."""
    # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)", the
    # other tools with "ERROR SUMMARY: E errors"
    found = re.findall(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)", log)
    errors = int(next(filter(None, found[-1]))) if found else None
    # a frame names its kernel as "at NAME+0x..." (memcheck: "=========     at k+0x1a0 in f.py:120";
    # racecheck: "=========     Write Thread (0, 0, 0) at k+0x3c40 in f.py:150")
    kernels = sorted(set(re.findall(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>]*)\+0x", log)))
    return errors, kernels[:10]


# a racecheck hazard: a header line, then its two accesses, each "<Write|Read> Thread (x,y,z) at
# <kernel>+<pc>", then " in <file>:<line>" where the kernel has line information
HAZARD_HEADER = re.compile(r"Potential (\w+) hazard detected at __shared__")
ACCESS = re.compile(r"\w+ Thread \((\d+), ?(\d+), ?(\d+)\) at (.+?)\+(0x[0-9a-f]+)(?: in (\S+):(\d+))?\s*$")


def racecheck_hazards(log):
    """The hazards a racecheck log displays, counted by (kind, kernel, source line of each access,
    and whether both accesses are one instruction of two lanes of one warp); a hazard whose two
    accesses cannot be read is counted too, with its kind alone, so the counts add up to the
    hazards displayed.

    That last shape is what all 7317 hazards of the SSD backward kernels and all 95 of the
    bidirectional ones had on an H100: a WAW between lanes 15 and 16 of a warp (47 and 48, 79 and
    80...) at one st.shared, in the shared-memory layout conversion that follows a ``tl.sum`` whose
    result several lanes hold. Those lanes computed the same sum and disagreed in its last bit:
    the first step of the reduction was contracted into an FMA of the lane's own product and its
    partner's rounded one (``contraction.py`` finds such FMAs in the PTX; Triton issue 7264
    reports the same hazard). Each is still counted as an error: which lane's value lands is not
    up to us."""
    counts, lines = {}, log.splitlines()
    for i, line in enumerate(lines):
        header = HAZARD_HEADER.search(line)
        if not header:
            continue
        accesses = [ACCESS.search(x) for x in lines[i + 1:i + 3]]
        if not all(accesses):
            key = (header.group(1), "?", "?", "accesses not read")
        else:
            (x1, y1, z1, kernel, pc1, file1, line1), (x2, y2, z2, _, pc2, file2, line2) = (a.groups() for a in accesses)
            where1, where2 = (f"{Path(f).name}:{n}" if f else "?" for f, n in ((file1, line1), (file2, line2)))
            # Triton launches one-dimensional blocks: a warp is 32 consecutive x
            one_warp = pc1 == pc2 and y1 == z1 == y2 == z2 == "0" and int(x1) // 32 == int(x2) // 32
            key = (header.group(1), kernel, where1 if where1 == where2 else f"{where1} / {where2}",
                   "one instruction, one warp" if one_warp else "two instructions or warps")
        counts[key] = counts.get(key, 0) + 1
    return [dict(kind=k[0], kernel=k[1], line=k[2], shape=k[3], count=n)
            for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def describe_hazards(hazards):
    """One line per entry of :func:`racecheck_hazards`."""
    return [f"{h['count']} {h['kind']} at {h['kernel']} ({h['line']}), {h['shape']}" for h in hazards]


def main(argv=None):
    args = parse_args(argv)
    if args.driver:
        drive(args.ops)
        return 0
    import torch

    if not torch.cuda.is_available() or not shutil.which(SANITIZER):
        print(f"sanitize: skipped (needs a CUDA device and {SANITIZER})")
        return 0
    env = dict(os.environ, **ENV)
    warm = subprocess.run([sys.executable, str(HERE / "sanitize.py"), "--driver", "--ops", ",".join(args.ops)],
                          env=env)
    report, failed = {}, warm.returncode != 0
    for op in args.ops:
        report[op] = {}
        for tool in args.tools:
            start = time.monotonic()
            try:
                run = subprocess.run(sanitizer_command(tool, op), env=env, capture_output=True, text=True,
                                     timeout=args.timeout)
                log, code = run.stdout + run.stderr, run.returncode
            except subprocess.TimeoutExpired as e:
                log, code = f"timed out after {args.timeout} s\n{e.stdout or ''}", "timeout"
            errors, kernels = count_errors(log)
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                Path(args.log_dir, f"{tool}_{op}.log").write_text(log)
            ok = errors == 0 and code == 0
            failed |= not ok
            report[op][tool] = dict(errors=errors, exit=code, kernels=kernels, seconds=round(time.monotonic() - start))
            if tool == "racecheck":
                report[op][tool]["hazards"] = racecheck_hazards(log)
            print(f"sanitize {tool:9s} {op:25s} errors={errors} exit={code} {'' if ok else kernels}", flush=True)
            for line in describe_hazards(report[op][tool].get("hazards", [])):
                print(f"  {line}", flush=True)
    write_report(args.json, "sanitize", report, env=ENV)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
