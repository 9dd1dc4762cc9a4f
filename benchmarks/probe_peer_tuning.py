"""Does mamba_ssm's autotuner pick different configurations (and times) at the SSD benchmark's
first shape from one tuning to the next? Each round clears every mamba_ssm autotuner's cache,
retunes through one call of each pass, and times both passes with do_bench; rounds after the first
name the autotuners whose pick differs from the first round's, with the configuration picked.
``--warm`` runs bfloat16 matmuls for 3 s before the first tuning, to bring the GPU's clocks up.

    python benchmarks/probe_peer_tuning.py ROUNDS [--warm]

Its one run so far is book/data/peer_tuning_probe.json (made before this file printed the picked
configurations: it compared the picks by object, which names the same configuration, and printed
object addresses).
"""
import importlib
import pkgutil
import sys
import time

import torch
import triton.testing

sys.path.insert(0, "benchmarks")  # run from the repository's top
import bench_ssd  # noqa: E402
from peers import autotuners, mamba_ssm_module  # noqa: E402


def mamba_ssm_autotuners():
    """Every autotuned kernel of mamba_ssm's Triton ops, by module and name, once each of its modules
    is imported (modules that need a CUDA extension the machine lacks are skipped)."""
    for info in pkgutil.iter_modules(sys.modules["mamba_ssm.ops.triton"].__path__):
        try:
            importlib.import_module(f"mamba_ssm.ops.triton.{info.name}")
        except Exception as e:
            print("skip", info.name, type(e).__name__)
    return autotuners("mamba_ssm.")


def main():
    rounds, warm = int(sys.argv[1]), "--warm" in sys.argv
    ssd_combined = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    tuners = mamba_ssm_autotuners()
    if warm:  # bring the clocks up before any tuning
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        start = time.time()
        while time.time() - start < 3:
            a @ a
        torch.cuda.synchronize()
    inp = bench_ssd.make_inputs(*bench_ssd.SHAPES[0])
    leaves, dy = bench_ssd.differentiable(inp)
    fwd, fwd_bwd = bench_ssd.passes(ssd_combined.mamba_chunk_scan_combined, inp, leaves, dy, chunk_size=256)
    first = None
    for round_ in range(rounds):
        for tuner in tuners.values():
            tuner.cache.clear()
        fwd()
        fwd_bwd()
        torch.cuda.synchronize()
        # a pick is one of the autotuner's own Config objects: the same object, the same configuration
        picks = {name: dict(tuner.cache) for name, tuner in tuners.items() if tuner.cache}
        ms = (triton.testing.do_bench(fwd), triton.testing.do_bench(fwd_bwd))
        print(f"warm={warm} round {round_}: fwd {ms[0]:.3f} ms, fwd+bwd {ms[1]:.3f} ms", flush=True)
        if first is None:
            first = picks
        for name, pick in picks.items():
            configs = "; ".join(map(str, pick.values()))
            if first is picks:
                print("  ", name, configs)
            elif any(config is not first.get(name, {}).get(key) for key, config in pick.items()):
                print("   differs:", name, configs)


if __name__ == "__main__":
    main()
