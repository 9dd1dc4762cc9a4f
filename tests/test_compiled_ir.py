"""benchmarks/compiled_ir.py: what Triton compiles the chunk-state kernels (chapter 5's chunk_state,
chapter 6's chunk_states) to for sm_90, on a machine without a GPU. With and without seq_idx, the B
tile must reach the dot from shared memory as the asynchronous copy left it, and the weighted x
from registers: a select on either after its load (as before the masked loads) stores it to shared
memory again from registers."""
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "compiled_ir.py"


@pytest.mark.parametrize("packed", [False, True], ids=["one sequence", "packed"])
@pytest.mark.parametrize("case", ["chunk_state", "bidirectional_chunk_states"])
def test_chunk_state_operands_are_not_stored_again_from_registers(case, packed):
    run = subprocess.run([sys.executable, str(SCRIPT), case, *(["--packed"] if packed else [])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("counts:"))[7:])
    assert counts["shared_from_registers"] == 0, run.stdout
    assert counts["async_copies"] > 0 and counts["dots"] > 0, run.stdout
