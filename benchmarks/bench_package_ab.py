"""An A/B run of a kernel change: times the same calls of two or more copies of the package on one GPU.

    python benchmarks/bench_package_ab.py OLD_DIR NEW_DIR [...] [--rounds 2] [--json out.json]

Each DIR holds a ``mamba_annotated/`` (``git archive <commit> mamba_annotated | tar x -C DIR`` makes
one). Every copy runs in its own process, started from a neutral working folder with DIR first on
``sys.path``: run from the repository, a script's own folder would otherwise put the repository's
copy ahead of the one under test. The processes take turns, ``--rounds`` times, each round starting
with the next copy, so that a drift of the GPU's clocks, or a cost of running first, shows up as a
spread between rounds rather than as a difference between copies;
the first round also compiles and tunes. Times are ``triton.testing.do_bench`` medians (ms), except in
the cases named "host ...": at those shapes the GPU waits on Python, so their time is the host's per
call, taken by bench_host_cost.py's own cases and timing (a loop of calls, one synchronisation after
it; the median of seven loops).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))  # bench_host_cost.py and peers.py, for the workers

# (name, code building `fn`, a zero-argument call); the code runs with torch and the package imported
CASES = {
    "attention fwd causal d128 L1024": "attention_case(1024, 128, True)",
    "attention fwd causal d128 L4096": "attention_case(4096, 128, True)",
    "attention fwd causal d128 L8192": "attention_case(8192, 128, True)",
    "attention fwd causal d64 L4096": "attention_case(4096, 64, True)",
    "attention fwd full d128 L4096": "attention_case(4096, 128, False)",
    # the backward pass alone at bench_attention.py's shapes (batch 4, 16 heads, bfloat16)
    **{f"attention bwd {'causal' if causal else 'full'} d{d} L{length}": f"attention_backward_case({length}, {d}, {causal})"
       for d, length, causal in ((128, 16384, True), (64, 16384, True), (128, 4096, True), (128, 4096, False))},
    "ssd fwd (4, 4096, 80, 64, 128)": "ssd_case(0)",
    "ssd fwd packed (4, 4096, 80, 64, 128)": "ssd_case(1000)",
    "ssd fwd 8 packed (4, 4096, 80, 64, 128)": "ssd_case(512)",
    "ssd fwd 41 packed (4, 4096, 80, 64, 128)": "ssd_case(100)",
    **{f"ssd chunk_state kernel{name}": f"chunk_state_case({run})"
       for name, run in (("", 0), (" packed", 1000), (" 8 packed", 512), (" 41 packed", 100))},
    "ssd chunk_scan kernel": "chunk_scan_case(0)",
    "ssd chunk_scan kernel packed": "chunk_scan_case(1000)",
    "ssd chunk_scan kernel 8 packed": "chunk_scan_case(512)",
    "ssd chunk_scan kernel gated": "chunk_scan_case(0, gated=True)",
    "bidirectional fwd (4, 4096, 80, 64, 128)": "bidirectional_case(0)",
    "bidirectional fwd packed (4, 4096, 80, 64, 128)": "bidirectional_case(1000)",
    "ssd bwd (4, 4096, 80, 64, 128)": "ssd_backward_case()",
    "bidirectional bwd (4, 4096, 80, 64, 128)": "bidirectional_backward_case()",
    "ssd fwd+bwd with D and z (4, 4096, 80, 64, 128)": "gated_training_case(ma.ssd_chunk_scan)",
    "ssd fwd+bwd packed (4, 4096, 80, 64, 128)": "packed_training_case()",
    "bidirectional fwd+bwd with D and z (4, 4096, 80, 64, 128)": "gated_training_case(ma.bidirectional_chunk_scan)",
    # the speed bars' forms: Bi-Mamba2's (shared parameters) and Hydra's (the shift, separate ones)
    "bidirectional fwd+bwd bar form (4, 4096, 80, 64, 128)": "bidirectional_bar_case(False, True)",
    "bidirectional fwd hydra form (4, 4096, 80, 64, 128)": "bidirectional_bar_case(True, False)",
    "bidirectional fwd+bwd hydra form (4, 4096, 80, 64, 128)": "bidirectional_bar_case(True, True)",
    **{f"linear_scan bwd {dtype} (12288, {length})": f"linear_scan_backward_case({length}, '{dtype}')"
       for dtype, length in (("float32", 4096), ("float32", 65536), ("float32", 100000), ("bfloat16", 65536),
                             ("bfloat16", 100000))},
    # bench_decoding.py's step (one query, 32 heads over 8, head dim 128, a full bfloat16 cache): the
    # public call, and its CUDA graph's replay (the kernels alone, the host taken out)
    **{f"decoding b{batch} N{length}{' graph' if graph else ''}": f"decoding_case({batch}, {length}, {graph})"
       for batch, length in ((1, 4096), (1, 131072), (4, 131072)) for graph in (False, True)},
    "selective_scan fwd+bwd gated (16, 1536, 16, 2048)": "selective_training_case()",
    # host-bound: bench_host_cost.py's cases, timed per call on the host
    **{f"host {op} {'fwd+bwd' if backward else 'fwd'}": f"host_case({op!r}, {backward})"
       for op in ("linear_scan (1, 64, 4096)", "selective_scan (1, 64, 16, 256)", "attention (1, 128, 4, 64) causal")
       for backward in (False, True)},
}

WORKER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.append(sys.argv[3])  # benchmarks/, after the copy under test
import torch, triton.testing
import mamba_annotated as ma
assert ma.__file__.startswith(sys.argv[1]), ma.__file__
torch.manual_seed(0)
dev = "cuda"

def attention_case(seqlen, head_dim, causal, batch=4, heads=16):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
    return lambda: ma.attention(q, k, v, causal=causal)

def attention_backward_case(seqlen, head_dim, causal, batch=4, heads=16):  # the kernels, from the forward's out and lse
    from mamba_annotated.attention.backward import attention_backward
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(4))
    out, lse = ma.attention(q, k, v, causal=causal, return_lse=True)
    window = (-1, 0) if causal else (-1, -1)
    return lambda: attention_backward(q, k, v, out, lse, dout, softmax_scale=head_dim ** -0.5, window=window)

def decoding_case(batch, length, graph, heads=32, kv_heads=8, head_dim=128):
    bf = dict(device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch, 1, heads, head_dim, **bf)
    k_cache, v_cache = (torch.randn(batch, length, kv_heads, head_dim, **bf) for _ in range(2))
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    step = lambda: ma.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    if not graph:
        return step
    from mamba_annotated.bench import capture_graph
    return capture_graph(step)[0].replay

def ssd_inputs(batch=4, length=4096, heads=80, headdim=64, dstate=128):
    bf = dict(device=dev, dtype=torch.bfloat16)
    return (torch.randn(batch, length, heads, headdim, **bf), torch.randn(batch, length, heads, device=dev) - 1,
            -torch.rand(heads, device=dev) - 0.5, 0.3 * torch.randn(batch, length, 1, dstate, **bf),
            0.3 * torch.randn(batch, length, 1, dstate, **bf))

def packed_ids(x, run):
    """seq_idx marking sequences of ``run`` tokens in every row (none when 0): runs of 1000 put 4 of
    a row's 16 chunks across a boundary, runs of 512 (bench_ssd.py's 8 packed sequences) none, runs
    of 100 (41 sequences, short ones as in fine-tuning data) every chunk."""
    return (torch.arange(x.shape[1], device=dev) // run).int().expand(x.shape[0], -1).contiguous() if run else None

def ssd_case(run):
    x, dt, A, B, C = ssd_inputs()
    seq_idx = packed_ids(x, run)
    return lambda: ma.ssd_chunk_scan(x, dt, A, B, C, 256, dt_softplus=True, seq_idx=seq_idx)

def forward_intermediates(run):
    """(x, B, C, seq_idx, the forward pass's saved dA_cumsum, dt_out, CB, H) at ssd_case's inputs."""
    from mamba_annotated.ssd.forward import ssd_forward
    x, dt, A, B, C = ssd_inputs()
    seq_idx = packed_ids(x, run)
    return (x, B, C, seq_idx, *ssd_forward(x, dt, A, B, C, 256, dt_softplus=True, seq_idx=seq_idx).saved.tensors())

def chunk_scan_case(run, gated=False):  # the output kernel alone, on the forward pass's own intermediates
    from mamba_annotated.ssd.chunk_scan import chunk_scan
    x, _, C, seq_idx, dA, dt_out, CB, H = forward_intermediates(run)
    # gated as a Mamba-2 block calls it: D and z
    D, z = (torch.randn(x.shape[2], device=dev), torch.randn_like(x)) if gated else (None, None)
    return lambda: chunk_scan(CB, x, C, H, dA, dt_out, z=z, D=D, seq_idx=seq_idx)

def chunk_state_case(run):  # the forward's chunk-state kernel alone, on the forward pass's own sums and steps
    from mamba_annotated.ssd.chunk_state import chunk_state
    x, B, _, seq_idx, dA, dt_out, _, _ = forward_intermediates(run)
    return lambda: chunk_state(x, B, dA, dt_out, seq_idx=seq_idx, to_end=True)

def ssd_backward_case():  # the backward pass alone, from the forward pass's saved tensors
    from mamba_annotated.ssd.forward import ssd_forward
    from mamba_annotated.ssd.backward import ssd_backward
    x, dt, A, B, C = ssd_inputs()
    saved = ssd_forward(x, dt, A, B, C, 256, dt_softplus=True).saved
    dy = torch.randn_like(x)
    return lambda: ssd_backward(dy, x, dt, A, B, C, saved, dt_softplus=True)

def bidirectional_backward_case():  # as ssd_backward_case
    from mamba_annotated.bidirectional.forward import bidirectional_forward
    from mamba_annotated.bidirectional.backward import bidirectional_backward
    x, dt, A, B, C = ssd_inputs()
    saved = bidirectional_forward(x, dt, A, B, C, 256, dt_softplus=True)[2]
    dy = torch.randn_like(x)
    return lambda: bidirectional_backward(dy, x, dt, A, B, C, saved, dt_softplus=True)

def gated_training_case(op):  # through autograd, so the gate's backward is timed with the rest
    x, dt, A, B, C = ssd_inputs()
    D, z, dy = torch.randn(x.shape[2], device=dev), torch.randn_like(x), torch.randn_like(x)
    inputs = [t.requires_grad_() for t in (x, dt, B, C, D, z)]

    def step():
        with torch.enable_grad():
            out = op(x, dt, A, B, C, 256, D=D, z=z, dt_softplus=True)
            return torch.autograd.grad(out, inputs, dy)
    return step

def packed_training_case():  # seq_idx, through autograd
    x, dt, A, B, C = ssd_inputs()
    seq_idx, dy = packed_ids(x, 1000), torch.randn_like(x)
    inputs = [t.requires_grad_() for t in (x, dt, B, C)]

    def step():
        with torch.enable_grad():
            return torch.autograd.grad(ma.ssd_chunk_scan(x, dt, A, B, C, 256, dt_softplus=True, seq_idx=seq_idx),
                                       inputs, dy)
    return step

def linear_scan_backward_case(length, dtype, rows=8 * 1536):  # the backward kernel alone
    from mamba_annotated.scan.blocked import linear_scan_backward, linear_scan_forward
    a = (torch.rand(rows, length, device=dev) * 0.4 + 0.6).to(getattr(torch, dtype))
    grad_h = torch.randn_like(a)
    h = linear_scan_forward(a, torch.randn_like(a))
    return lambda: linear_scan_backward(a, h, None, grad_h)

def bidirectional_case(run):
    x, dt, A, B, C = ssd_inputs()
    seq_idx = packed_ids(x, run)
    return lambda: ma.bidirectional_chunk_scan(x, dt, A, B, C, 256, dt_softplus=True, seq_idx=seq_idx)

def bidirectional_bar_case(shift, backward):  # with D, dt_bias and softplus, as bench_bidirectional.py
    x, dt, A, B, C = ssd_inputs()
    heads = x.shape[2]
    D, dt_bias, dy = torch.randn(heads, device=dev), 0.5 * torch.randn(heads, device=dev), torch.randn_like(x)
    separate = dict(dt_rev=torch.randn_like(dt) - 1, B_rev=0.3 * torch.randn_like(B), C_rev=0.3 * torch.randn_like(C))
    extra = separate if shift else {}
    inputs = [t.requires_grad_(backward) for t in (x, dt, B, C, D, dt_bias, *extra.values())]

    def step():
        with torch.enable_grad():
            out = ma.bidirectional_chunk_scan(x, dt, A, B, C, 256, D=D, dt_bias=dt_bias, dt_softplus=True,
                                              shift=shift, **extra)
            return torch.autograd.grad(out, inputs, dy) if backward else out
    return step

def selective_training_case(batch=16, dim=1536, dstate=16, length=2048):
    # bench_selective_scan_cuda.py's "Mamba-130M training" shape and inputs, bfloat16, with z, D,
    # delta_bias and softplus, forward and backward through autograd
    import bench_selective_scan_cuda as peer_bench
    inputs, flags = peer_bench.make_inputs(batch, dim, dstate, length, torch.bfloat16, True)
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    dy = torch.randn(batch, dim, length, device=dev, dtype=torch.bfloat16)

    def step():
        with torch.enable_grad():
            return torch.autograd.grad(ma.selective_scan(**leaves, **flags), list(leaves.values()), dy)
    return step

def host_case(op, backward):  # bench_host_cost.py's case ``op``, ours: its forward, or forward and backward
    import bench_host_cost as host
    _, _, make_inputs, ours, _ = next(case for case in host.cases() if case[0] == op)
    return (host.forward_backward if backward else host.forward_only)(ours, make_inputs(backward))

times = {}
for name, make in json.loads(sys.argv[2]).items():
    if name.startswith("host"):
        import bench_host_cost
        times[name] = bench_host_cost.per_call_us(eval(make), calls=200) / 1e3
        continue
    with torch.no_grad():
        fn = eval(make)
        times[name] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
print(json.dumps(times))
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="folders that each hold a mamba_annotated package")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default="", help="comma-separated substrings of the case names to run")
    parser.add_argument("--json", help="write {dir: {case: [ms per round]}} here, after every round")
    parser.add_argument("--pin", type=lambda s: {int(c) for c in s.split(",")},
                        help="run every copy's process on these CPU cores (comma-separated), as taskset -c would; "
                        "on one core a worker died at start on an H200 host, twice ('terminate called without an "
                        "active exception'), on two it ran (book/data/host_path_ab.json). What pinning does to "
                        "host-bound times: book/data/host_cost_pinning_probe.json")
    args = parser.parse_args()
    cases = {k: v for k, v in CASES.items() if not args.cases or any(c in k for c in args.cases.split(","))}
    dirs = [os.path.abspath(d) for d in args.dirs]
    results = {d: {name: [] for name in cases} for d in dirs}
    with tempfile.TemporaryDirectory() as neutral:
        for round_ in range(args.rounds):
            # each round starts with the next copy: a copy that always ran first (or second) would
            # carry whatever running in that place does to its times (seen: host times of copies of
            # the same code 7-22 % apart, book/data/host_path_ab.json)
            for d in dirs[round_ % len(dirs):] + dirs[:round_ % len(dirs)]:
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
                    "PYTHONPATH": os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                  if p and os.path.abspath(p) != os.getcwd())}
                pin = None if args.pin is None else lambda: os.sched_setaffinity(0, args.pin)
                run = subprocess.run([sys.executable, "-c", WORKER, d, json.dumps(cases), BENCHMARKS], cwd=neutral,
                                     env=env, capture_output=True, text=True, preexec_fn=pin)
                if run.returncode:
                    sys.exit(f"{d} failed:\n{run.stderr[-3000:]}")
                times = json.loads(run.stdout.strip().splitlines()[-1])
                for name, ms in times.items():
                    results[d][name].append(ms)
                # as it goes, so that a run cut off by a time limit still leaves its rounds in the log
                # and in the JSON file (a cold cache of two copies' backward kernels can take minutes)
                print(f"round of {os.path.basename(d)}: " + json.dumps(times), file=sys.stderr, flush=True)
                write_json(args.json, results)
    width = max(len(n) for n in cases)
    labels = [os.path.basename(d) for d in dirs]
    print(f"{'case (ms, median of rounds; min-max)':<{width}}  " + "  ".join(f"{lab:>22}" for lab in labels))
    for name in cases:
        cells = []
        for d in dirs:
            runs = results[d][name]
            cells.append(f"{statistics.median(runs):8.4f} ({min(runs):.4f}-{max(runs):.4f})")
        print(f"{name:<{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    write_json(args.json, results)


def write_json(path, results):
    """{dir: {case: [ms per round so far]}} to ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
