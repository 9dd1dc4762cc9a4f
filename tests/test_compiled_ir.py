"""scripts/compile_offline.py's ``states`` family: the chunk-state kernels (chapter 5's chunk_state,
chapter 6's chunk_states) compiled for sm_90 as launched, on a machine without a GPU. With and
without seq_idx, no operand of a dot may be stored to shared memory from registers: the B tile
must reach the dot as the asynchronous copy left it, and the weighted x from registers. A select
on either after its load (the code before the masked loads) stored it again from registers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_no_dot_operand_of_the_chunk_state_kernels_is_stored_again_from_registers(tmp_path):
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton ships no NVIDIA tools")
    report = tmp_path / "report.json"
    script = Path(__file__).resolve().parent.parent / "scripts" / "compile_offline.py"
    subprocess.run([sys.executable, str(script), "states", "--json", str(report)], capture_output=True, text=True,
                   check=True, timeout=600)
    kernels = json.loads(report.read_text())["kernels"]
    assert sorted(kernels) == sorted(f"{kernel} {tag}" for kernel in ("chunk_state_kernel", "chunk_states_kernel")
                                     for tag in ("plain", "seq_idx"))
    for name, found in kernels.items():
        # shared memory is used, tiles are copied into it and the dots run: the counts see the IR
        assert found["shared_allocations"] > 0 and found["tile_async_copies"] > 0 and found["dots"] > 0, name
        assert found["shared_from_registers"] == 0, (name, found)
