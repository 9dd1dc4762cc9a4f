"""Where the bidirectional scores kernel's H100 defect comes from (issue 14; README, "Using the kernels").

With B' stored time major (strides (1, 1, L, L)) at L = 1021, dstate 100, chunk 32 and 4 warps,
``chunk_scores`` computed wrong scores on the H100 with Triton 3.6 (the op copies such a B', so its
users do not meet it). The configurations that fail compile to one binary
(``scripts/compile_offline.py scores``). This probe asks the GPU three things about that binary:

1. which entries are wrong: per chunk, per triangle (forward j <= i, reverse j > i, the reverse
   diagonal Gd), whether they are zero, and whether they equal the forward product (a branch's
   result taken for the other's);
2. whether the code Triton emits is at fault or what ptxas makes of it: the same kernel compiled
   with ptxas's optimizations off (``DISABLE_PTXAS_OPT=1``) and, where the CUDA toolkit has one, with
   the toolkit's own ptxas (``TRITON_PTXAS_PATH``), each in a fresh Triton cache;
3. whether compute-sanitizer (racecheck, synccheck, memcheck) sees anything in that launch.

    python scripts/reliability/scores_defect.py            (every variant, one process each)
    python scripts/reliability/scores_defect.py --once     (one run in this process's environment)

On the H100 (2026-11-25) the stores of G went to wrong addresses: both triangles wrong, memcheck's
out-of-bounds writes at the store, the same with either ptxas (README, "Using the kernels"). A
strict GPU xfail, test_scores_of_a_time_major_B_rev_at_an_odd_length in
tests/test_reliability_smoke.py, runs ``--once`` in a process of its own.
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LENGTH, DSTATE, CHUNK = 1021, 100, 32
SANITIZER = os.environ.get("COMPUTE_SANITIZER", "/usr/local/cuda/bin/compute-sanitizer")
TOOLKIT_PTXAS = "/usr/local/cuda/bin/ptxas"


def once():
    """Run the failing configuration, print where the time-major B' result departs from the
    contiguous one and from float64."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mamba_annotated.bidirectional.chunk_scores import chunk_scores
    from mamba_annotated.runtime import DEVICE

    torch.manual_seed(0)
    C, B, C_rev = (torch.randn(1, LENGTH, 1, DSTATE, device=DEVICE).bfloat16() for _ in range(3))
    B_rev = torch.randn(1, DSTATE, 1, LENGTH, device=DEVICE).bfloat16().permute(0, 3, 2, 1)  # strides (., 1, L, L)
    G, Gd = chunk_scores(C, B, C_rev, B_rev, CHUNK, shift=False)
    G_want, Gd_want = chunk_scores(C, B, C_rev, B_rev.contiguous(), CHUNK, shift=False)

    n_chunks = G.shape[1]
    padded = n_chunks * CHUNK

    def blocks(q, k):  # float64 q_t . k_s within each chunk, zero past L
        q, k = (torch.nn.functional.pad(t[0, :, 0].double(), (0, 0, 0, padded - LENGTH)) for t in (q, k))
        return torch.einsum("cin,cjn->cij", q.view(n_chunks, CHUNK, -1), k.view(n_chunks, CHUNK, -1))

    forward, reverse = blocks(C, B), blocks(C_rev, B_rev)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=DEVICE).tril()
    G_ref = torch.where(lower, forward, reverse)
    got, want = G[0, :, 0].double(), G_want[0, :, 0].double()
    scale = G_ref.abs().max().item()
    print(f"contiguous B' vs float64: max |diff| {(want - G_ref).abs().max().item() / scale:.1e} of max |G|")
    wrong = ~((got - want).abs() <= 1e-6 * scale)  # NaN counts as wrong
    print(f"time-major B': {int(wrong.sum())} of {wrong.numel()} entries of G differ from the contiguous B' "
          f"result; Gd differs at {int((Gd != Gd_want).sum())} of {Gd.numel()}")
    if not wrong.any():
        return 0
    print(f"  wrong in the forward triangle (j <= i): {int((wrong & lower).sum())}, "
          f"reverse (j > i): {int((wrong & ~lower).sum())}")
    print(f"  chunks with a wrong entry: {wrong.flatten(1).any(1).nonzero().flatten().tolist()[:40]}")
    bad = got[wrong]
    print(f"  wrong entries that are zero: {int((bad == 0).sum())}, NaN: {int(bad.isnan().sum())}, "
          f"equal to the forward product: {int(((got - forward).abs() < 1e-6 * scale)[wrong & ~lower].sum())}")
    rows, cols = wrong.any(0).any(1).nonzero().flatten(), wrong.any(0).any(0).nonzero().flatten()
    print(f"  rows i with a wrong entry: {rows.tolist()}\n  columns j with a wrong entry: {cols.tolist()}")
    first = int(wrong.flatten(1).any(1).nonzero()[0])
    print(f"  chunk {first}, time-major result (rows 0-7, columns 0-7 and 24-31):")
    for i in range(8):
        print("   ", " ".join(f"{v:7.2f}" for v in got[first, i, :8].tolist()), " | ",
              " ".join(f"{v:7.2f}" for v in got[first, i, 24:].tolist()))
    print("  the same entries with a contiguous B':")
    for i in range(8):
        print("   ", " ".join(f"{v:7.2f}" for v in want[first, i, :8].tolist()), " | ",
              " ".join(f"{v:7.2f}" for v in want[first, i, 24:].tolist()))
    return 1


def variants():
    """(name, extra environment, command prefix) of every run."""
    yield "as compiled", {}, []
    yield "ptxas optimizations off", {"DISABLE_PTXAS_OPT": "1"}, []
    if Path(TOOLKIT_PTXAS).exists():
        version = subprocess.run([TOOLKIT_PTXAS, "--version"], capture_output=True, text=True).stdout.strip()
        yield f"the toolkit's ptxas ({version.splitlines()[-1]})", {"TRITON_PTXAS_PATH": TOOLKIT_PTXAS}, []
    if Path(SANITIZER).exists():
        for tool in ("racecheck", "synccheck", "memcheck"):
            yield f"compute-sanitizer {tool}", {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, [
                SANITIZER, "--tool", tool, "--print-limit", "20"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="one run in this environment")
    args = parser.parse_args(argv)
    if args.once:
        return once()
    import triton  # the version only: the runs import it in their own processes

    print(f"triton {triton.__version__}; L = {LENGTH}, dstate {DSTATE}, chunk {CHUNK}, B' time major", flush=True)
    for name, env, prefix in variants():
        with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the variant compiles its own binary
            run = subprocess.run([*prefix, sys.executable, __file__, "--once"], capture_output=True, text=True,
                                 env={**os.environ, **env, "TRITON_CACHE_DIR": cache})
        print(f"=== {name}: exit {run.returncode}\n{run.stdout}{run.stderr[-3000:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
