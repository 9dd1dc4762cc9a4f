"""Decoding attention over a KV cache: attention_with_kvcache beside PyTorch's SDPA, against the
memory floor.

    python benchmarks/bench_decoding.py --json decoding.json   # the table (GPU)
    python benchmarks/bench_decoding.py --tune                 # sweep the split-KV kernel's configs
    python benchmarks/bench_decoding.py --splits --json s.json # the kernels' time at each split count
    python benchmarks/bench_decoding.py --smoke                # tiny sizes: runs on CPU (interpreter)

One query per sequence (a decoding step), 32 query heads over 8 kv heads, head dim 128, bfloat16,
a contiguous cache full to its length N (cache_seqlens = N for every sequence), batch 1 to 64.
Times are medians of ``triton.testing.do_bench`` (:func:`mamba_annotated.bench.median_ms`).

Rows: ``ours`` is the public call (argument checks, the device-side index checks, the launch
plan and the kernels); ``ours (kernels)`` calls :func:`split_kv_attention` directly, the same
kernels without the checks. A server captures its decoding step in a CUDA graph and replays it,
which takes the host out of the step: ``ours (CUDA graph)`` and ``sdpa default (CUDA graph)``
replay one captured call each (on a GPU; the index checks are skipped while capturing, so ours
replays the two kernels). Peers: SDPA
(``F.scaled_dot_product_attention``) on transposed views of the same cache, as PyTorch picks its
backend and pinned to each of its backends with ``torch.nn.attention.sdpa_kernel``; grouped-query
heads go in with ``enable_gqa=True`` (the kv heads are not copied), and where a backend refuses
that, with the kv heads repeated (``repeat_interleave``, a copy made outside the timed call) if the
copy fits in memory: the ``gqa`` column says which. A backend that refuses the case is reported
and left out.

The floor is the bytes that must move, the keys and values of the cache read once (2 * batch * N *
kv_heads * d * 2 bytes; q and out are a few KiB), over the device-to-device copy bandwidth
measured in the same run (a 1 GiB copy, bytes read plus written); ``GB/s`` is those bytes over the
measured time and ``% floor`` the floor's time over it.
"""
import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from mamba_annotated import attention_with_kvcache
from mamba_annotated.attention.split_kv import decoding_config, default_splits, split_kv_attention
from mamba_annotated.bench import (capture_graph, copy_bandwidth_gbps, format_table, gbps, median_ms, memory_floor_ms,
                                   print_table, progress)
from mamba_annotated.runtime import DEVICE, device_name, sm_count

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 4, 16, 64)
LENGTHS = (4096, 16384, 131072)
SMOKE = dict(heads=4, kv_heads=2, head_dim=32, batches=(1, 2), lengths=(40,))
REPEAT_BUDGET = 40 * 2 ** 30  # the most memory a repeated (GQA -> MHA) copy of the cache may take


def make_inputs(batch, length, heads, kv_heads, head_dim, dtype=torch.bfloat16):
    q = torch.randn(batch, 1, heads, head_dim, device=DEVICE, dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, length, kv_heads, head_dim, device=DEVICE, dtype=dtype)
                        for _ in range(2))
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, seqlens


def picked_splits(batch, length, kv_heads, head_dim, dtype):
    """The split count that ``num_splits=0`` picks (:func:`default_splits`, on the split launches' key tile)."""
    block_n = decoding_config(head_dim, dtype, split=True)["BLOCK_N"]
    return default_splits(batch, kv_heads, length, DEVICE, block_n=block_n)


def sdpa_backends():
    """name -> the SDPBackend to pin, None for PyTorch's own choice."""
    from torch.nn.attention import SDPBackend

    names = {"sdpa flash": "FLASH_ATTENTION", "sdpa efficient": "EFFICIENT_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION",
             "sdpa math": "MATH"}
    backends = {"sdpa default": None}
    backends.update({name: getattr(SDPBackend, attr) for name, attr in names.items() if hasattr(SDPBackend, attr)})
    return backends


def sdpa_call(backend, q, k_cache, v_cache, gqa):
    """A callable timing SDPA on the cache (transposed views), the GQA way asked: "enable_gqa", or
    "repeat" (the repeated copy made here, outside the timed call)."""
    import contextlib

    from torch.nn.attention import sdpa_kernel

    query, key, value = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    group = q.shape[2] // k_cache.shape[2]
    if gqa == "repeat":
        key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    context = (lambda: sdpa_kernel([backend])) if backend is not None else contextlib.nullcontext
    kwargs = dict(enable_gqa=True) if gqa == "enable_gqa" and group > 1 else {}

    def run():
        with context():
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
    run()  # raises here if the backend refuses the case
    return run


def graph_replay(fn):
    """``fn`` captured once in a CUDA graph: the graph's replay, which launches the captured kernels
    with no host work."""
    return capture_graph(fn)[0].replay


def time_case(batch, length, heads, kv_heads, head_dim):
    q, k_cache, v_cache, seqlens = make_inputs(batch, length, heads, kv_heads, head_dim)
    cache_bytes = 2 * k_cache.numel() * k_cache.element_size()
    floor_ms = memory_floor_ms(cache_bytes)
    splits = picked_splits(batch, length, kv_heads, head_dim, q.dtype)
    key_end = seqlens
    impls = {"ours": lambda: attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
             "ours (kernels)": lambda: split_kv_attention(q, k_cache, v_cache, key_end=key_end,
                                                          softmax_scale=head_dim ** -0.5, num_splits=splits)}
    if DEVICE.type == "cuda":
        impls["ours (CUDA graph)"] = graph_replay(impls["ours"])
    rows = []
    for name, fn in impls.items():
        rows.append(dict(batch=batch, N=length, impl=name, gqa="", splits=splits, ms=median_ms(fn)))
    if DEVICE.type == "cuda":
        replay = graph_replay(sdpa_call(None, q, k_cache, v_cache, "enable_gqa"))
        rows.append(dict(batch=batch, N=length, impl="sdpa default (CUDA graph)", gqa="enable_gqa", splits="",
                         ms=median_ms(replay)))
        del replay
    repeat_bytes = cache_bytes * (heads // kv_heads)
    for name, backend in sdpa_backends().items():
        for gqa in ("enable_gqa", "repeat"):
            if gqa == "repeat" and (heads == kv_heads or DEVICE.type == "cuda" and repeat_bytes > REPEAT_BUDGET):
                continue
            try:
                fn = sdpa_call(backend, q, k_cache, v_cache, gqa)
                rows.append(dict(batch=batch, N=length, impl=name, gqa=gqa, splits="", ms=median_ms(fn)))
                break
            except Exception as e:  # a backend that refuses this case is reported, not fatal
                print(f"\n{name} ({gqa}) batch={batch} N={length}: {type(e).__name__}: {str(e).splitlines()[0][:150]}",
                      file=sys.stderr)
            finally:
                if DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
    for row in rows:
        row["GB/s"] = gbps(cache_bytes, row["ms"])
        row["floor_ms"] = floor_ms
        row["% floor"] = 100 * floor_ms / row["ms"]
    del q, k_cache, v_cache
    return rows


def run_table(batches, lengths, heads, kv_heads, head_dim):
    rows = []
    for batch, length in progress(list(itertools.product(batches, lengths)), "decoding "):
        found = time_case(batch, length, heads, kv_heads, head_dim)
        print("\n" + format_table(found), file=sys.stderr, flush=True)  # progress, in case of a time limit
        rows += found
    print(f"device: {device_name()}; measured copy bandwidth {copy_bandwidth_gbps():.0f} GB/s; bfloat16, "
          f"{heads} heads over {kv_heads} kv heads, d {head_dim}, one query per sequence")
    print_table(rows)
    return rows


def tune(batch, length, heads, kv_heads, head_dim):
    """Every config of the sweep at the heuristic's split count, then the best config at each split
    count; prints the times and the best."""
    q, k_cache, v_cache, seqlens = make_inputs(batch, length, heads, kv_heads, head_dim)
    cache_bytes = 2 * k_cache.numel() * k_cache.element_size()
    floor_ms = memory_floor_ms(cache_bytes)
    heuristic = picked_splits(batch, length, kv_heads, head_dim, q.dtype)
    default = decoding_config(head_dim, q.dtype, split=heuristic > 1)

    def measure(config, splits):
        try:
            ms = median_ms(lambda: split_kv_attention(q, k_cache, v_cache, key_end=seqlens, softmax_scale=0.1,
                                                      num_splits=splits, config=config))
        except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"tune {config} splits={splits}: {type(e).__name__} {str(e)[:100]}", flush=True)
            return float("inf")
        print(f"tune batch={batch} N={length} {config} splits={splits}: {ms * 1e3:.1f} us, "
              f"{gbps(cache_bytes, ms):.0f} GB/s, {100 * floor_ms / ms:.0f} % of the floor", flush=True)
        return ms

    print(f"default {default} at the heuristic's {heuristic} splits; "
          f"floor {floor_ms * 1e3:.1f} us", flush=True)
    configs = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
               for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4, 5)]
    times = {json.dumps(config): measure(config, heuristic) for config in configs}
    best = json.loads(min(times, key=times.get))
    split_times = {splits: measure(best, splits) for splits in (1, 2, 4, 8, 16, 32, 64, 128)}
    best_splits = min(split_times, key=split_times.get)
    print(f"best config at {heuristic} splits: {best} ({times[json.dumps(best)] * 1e3:.1f} us); best split count "
          f"with it: {best_splits} ({split_times[best_splits] * 1e3:.1f} us)")
    return dict(best=best, best_splits=best_splits, heuristic_splits=heuristic, configs=times, splits=split_times)


# (batch, N, split counts): around the counts that fill two programs per SM on 132 SMs
SPLIT_CASES = ((1, 131072, (16, 24, 28, 32, 33, 40, 48)), (1, 16384, (4, 8, 16, 24, 32, 33)),
               (4, 131072, (2, 3, 4, 6, 7, 8, 9)), (4, 16384, (2, 4, 6, 7, 8, 9)),
               (16, 131072, (1, 2, 3)), (16, 16384, (1, 2, 3)))


def sweep_splits(heads, kv_heads, head_dim):
    """The split-KV kernels' time (called directly) at each split count of SPLIT_CASES, beside
    the count ``num_splits=0`` picks: the measurements behind :func:`default_splits`' rule."""
    rows = []
    for batch, length, counts in SPLIT_CASES:
        q, k_cache, v_cache, seqlens = make_inputs(batch, length, heads, kv_heads, head_dim)
        floor_ms = memory_floor_ms(2 * k_cache.numel() * k_cache.element_size())
        picked = picked_splits(batch, length, kv_heads, head_dim, q.dtype)
        for splits in counts:
            ms = median_ms(lambda: split_kv_attention(q, k_cache, v_cache, key_end=seqlens,
                                                      softmax_scale=head_dim ** -0.5, num_splits=splits))
            rows.append(dict(batch=batch, N=length, splits=splits, programs=batch * kv_heads * splits, ms=ms,
                             pct_floor=100 * floor_ms / ms, default=picked))
            print(f"batch {batch} N {length} splits {splits} ({rows[-1]['programs']} programs): {ms * 1e3:.1f} us, "
                  f"{rows[-1]['pct_floor']:.0f} % of the floor (num_splits=0 picks {picked})", flush=True)
        del q, k_cache, v_cache
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows (or the tuning sweep) here")
    parser.add_argument("--tune", action="store_true",
                        help="sweep the kernel's configs and split counts at the first of --batches and the "
                             "last of --lengths")
    parser.add_argument("--splits", action="store_true", help="time the kernels at each split count of SPLIT_CASES")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, interpreter)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = parser.parse_args()
    shape = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    batches, lengths = args.batches, args.lengths
    if args.smoke:
        shape = {k: SMOKE[k] for k in shape}
        batches, lengths = SMOKE["batches"], SMOKE["lengths"]
    if args.tune:  # at the first batch and the last length asked (by default batch 1, 131072 keys)
        result = tune(batches[0], lengths[-1], **shape)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=device_name(), batch=batches[0], N=lengths[-1], **shape, **result), f, indent=1)
        return
    if args.splits:
        rows = sweep_splits(**shape)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=device_name(), dtype="bfloat16", **shape, sms=sm_count(), rows=rows), f, indent=1)
        return
    rows = run_table(batches, lengths, **shape)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), dtype="bfloat16", **shape, copy_GBps=copy_bandwidth_gbps(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
