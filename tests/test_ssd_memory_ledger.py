"""benchmarks/memory_ledger.py counts what is alive, and benchmarks/ssd_memory_ledger.py: the SSD
forward pass's peak is made of the tensors it names."""
import functools
import pathlib
import sys

import torch

from mamba_annotated import runtime, ssd_chunk_scan

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_ledger  # noqa: E402
import ssd_memory_ledger as ledger_script  # noqa: E402


def test_ledger_counts_live_storages_and_their_peak():
    ledger = memory_ledger.Ledger()
    with ledger:
        first = torch.empty(1024)               # 4 KiB
        second = torch.empty(2048)              # 8 KiB: 12 KiB alive, the peak
        view = second[:10].view(2, 5)          # shares second's storage: nothing new
        del first
        third = torch.empty(512)                # 2 KiB: 10 KiB alive
    assert ledger.peak_bytes == 12 * 1024
    assert sorted(v[0] for v in ledger.at_peak.values()) == [4096, 8192]
    assert ledger.live_bytes == 10 * 1024
    del second, view, third
    assert ledger.live_bytes == 0 and not ledger.live


def test_ssd_forward_peak_is_its_output_states_and_sums():
    """At a small shape: the peak is the sum of the tensors alive then, among them the output and the
    states entering each chunk, and the launches are restored afterwards."""
    assert runtime.INTERPRETED
    from triton.runtime import interpreter
    launch, device = interpreter.GridExecutor.__call__, torch.cuda.device
    batch, length, heads, headdim, dstate = 1, 300, 4, 16, 32
    inp = ledger_script.make_inputs(batch, length, heads, headdim, dstate)
    ledger = ledger_script.forward_ledger(ssd_chunk_scan, inp)
    assert interpreter.GridExecutor.__call__ is launch and torch.cuda.device is device
    alive = list(ledger.at_peak.values())
    assert ledger.peak_bytes == sum(v[0] for v in alive)
    shapes = {(shape, dtype) for _, shape, dtype, _ in alive}
    n_chunks = -(-length // ledger_script.CHUNK)
    assert ((batch, length, heads, headdim), torch.bfloat16) in shapes          # the output
    assert ((batch, n_chunks, heads, headdim, dstate), torch.bfloat16) in shapes  # the states entering each chunk
    assert all(owner.startswith(("chunk_", "state_passing")) for *_, owner in alive)


def test_the_final_states_are_allocated_only_when_asked_for():
    """mamba_ssm allocates and stores the final states whether asked for or not; ssd_chunk_scan only
    with return_final_states (at the benchmark's first shape, 10 MiB of its forward peak)."""
    batch, length, heads, headdim, dstate = 1, 300, 4, 16, 32
    inp = ledger_script.make_inputs(batch, length, heads, headdim, dstate)
    final = ((batch, heads, headdim, dstate), torch.float32)

    def peak_tensors(fn):
        return {(shape, dtype) for _, shape, dtype, _ in ledger_script.forward_ledger(fn, inp).at_peak.values()}

    assert final not in peak_tensors(ssd_chunk_scan)
    assert final in peak_tensors(functools.partial(ssd_chunk_scan, return_final_states=True))
