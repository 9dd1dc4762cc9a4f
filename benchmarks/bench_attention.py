"""Chapter 7's attention beside PyTorch's SDPA backends: forward and backward TFLOP/s, peak memory.

    python benchmarks/bench_attention.py --json attention.json   # the table (GPU)
    python benchmarks/bench_attention.py --tune                  # sweep the kernels' tile configs
    python benchmarks/bench_attention.py --features --json f.json  # windows, softcap, ALiBi, dropout (GPU)

FLOPs are counted as FlashAttention counts them: 4*B*H*N^2*d forward (two matmuls), halved when
causal, and 2.5x that backward (five matmuls). Peers, timed in the same run: SDPA's flash backend
(FlashAttention-2), its memory-efficient backend and cuDNN, chosen with
torch.nn.attention.sdpa_kernel. All take the flash_attn layout (batch, seqlen, heads, d); SDPA gets
transposed views of the same tensors.
"""
import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from costs import attention_flops  # the script's folder is on sys.path
from mamba_annotated.attention.backward import attention_backward, backward_config
from mamba_annotated.attention.forward import attention_forward, forward_config
from mamba_annotated.attention.reference import geometric_alibi_slopes
from mamba_annotated.attention.teaching import attention_variant
from mamba_annotated.bench import format_table, matmul_tflops, median_ms, print_table, progress, tflops
from mamba_annotated.runtime import DEVICE, device_name, size
from peak_memory import peak_mib

BATCH, HEADS = 4, 16


def make_inputs(seqlen, head_dim, dtype=torch.bfloat16):
    shape = (BATCH, seqlen, HEADS, head_dim)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=DEVICE, dtype=dtype)


def sdpa_backends():
    """name -> the SDPBackend to pin, for the backends this torch has."""
    from torch.nn.attention import SDPBackend

    names = {"sdpa flash": "FLASH_ATTENTION", "sdpa efficient": "EFFICIENT_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION"}
    return {name: getattr(SDPBackend, attr) for name, attr in names.items() if hasattr(SDPBackend, attr)}


def implementations(causal):
    """name -> (forward fn(q, k, v), context manager factory)."""
    import contextlib

    from torch.nn.attention import sdpa_kernel

    impls = {f"ours ({method})": (lambda q, k, v, m=method: attention_variant(q, k, v, causal, backward=m),
                                  contextlib.nullcontext)
             for method in ("split", "fused", "atomic")}
    for name, backend in sdpa_backends().items():
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
        impls[name] = (sdpa, lambda b=backend: sdpa_kernel([b]))
    return impls


def time_forward_backward(fn, q, k, v, grad_out):
    fwd_ms = median_ms(lambda: fn(q, k, v))
    out = fn(q, k, v)
    bwd_ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))
    return fwd_ms, bwd_ms


def run_table(seqlens, head_dims):
    rows = []
    peak = matmul_tflops(torch.bfloat16)
    cases = list(itertools.product(head_dims, seqlens, (False, True)))
    for head_dim, seqlen, causal in progress(cases, "attention "):
        q, k, v, grad_out = make_inputs(seqlen, head_dim)
        fwd_flops, bwd_flops = attention_flops(BATCH, HEADS, seqlen, head_dim, causal)
        results = {}
        for name, (fn, context) in implementations(causal).items():
            try:
                with context():
                    fwd_ms, bwd_ms = time_forward_backward(fn, q, k, v, grad_out)
                    measure_memory = DEVICE.type == "cuda" and seqlen == max(seqlens)
                    memory = (peak_mib(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out))
                              if measure_memory else float("nan"))
            except Exception as e:  # a backend that refuses this shape is reported, not fatal
                print(f"\n{name} d={head_dim} N={seqlen} causal={causal}: {type(e).__name__}: {str(e)[:120]}",
                      file=sys.stderr)
                continue
            results[name] = dict(d=head_dim, N=seqlen, causal=causal, impl=name, fwd_ms=fwd_ms,
                                 fwd_tflops=tflops(fwd_flops, fwd_ms), bwd_ms=bwd_ms,
                                 bwd_tflops=tflops(bwd_flops, bwd_ms), peak_mib=memory)
        flash = results.get("sdpa flash")
        for row in results.values():
            row["fwd_pct_peak"] = 100 * row["fwd_tflops"] / peak
            row["fwd_vs_flash"] = flash["fwd_ms"] / row["fwd_ms"] if flash else float("nan")
            row["bwd_vs_flash"] = flash["bwd_ms"] / row["bwd_ms"] if flash else float("nan")
            row["mem_vs_flash"] = row["peak_mib"] / flash["peak_mib"] if flash else float("nan")
            rows.append(row)
        print("\n" + format_table(list(results.values())), file=sys.stderr, flush=True)  # progress, in case of a time limit
        del q, k, v, grad_out
    print(f"device: {device_name()}; measured bf16 matmul peak {peak:.0f} TFLOP/s; batch {BATCH}, heads {HEADS}")
    print_table(rows)
    return rows


FORWARD_CANDIDATES = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                      for bm, bn in ((128, 64), (128, 128)) for w in (4, 8) for s in (2, 3, 4)]
FORWARD_CANDIDATES += [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=s) for s in (2, 3)]
LOOP_CANDIDATES = [dict(own=own, walk=walk, num_warps=w, num_stages=s)
                   for own, walk in ((128, 64), (128, 32), (64, 64)) for w in (4, 8) for s in (2, 3)]


def tune(seqlen, head_dims):
    """Time each candidate tile config of the forward kernel, the dK/dV loop and the dQ loop."""
    for head_dim in head_dims:
        q, k, v, grad_out = make_inputs(seqlen, head_dim)
        q, k, v = q.detach(), k.detach(), v.detach()
        scale = head_dim ** -0.5
        flops_fwd, flops_bwd = attention_flops(BATCH, HEADS, seqlen, head_dim, False)

        def report(kind, cfg, fn, flops):
            try:
                ms = median_ms(fn)
                print(f"tune d={head_dim} N={seqlen} {kind} {cfg}: {ms:.3f} ms {tflops(flops, ms):.0f} TFLOP/s", flush=True)
            except Exception as e:
                print(f"tune d={head_dim} {kind} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)

        print(f"default forward {forward_config(head_dim, q.dtype)}; backward {backward_config(head_dim, q.dtype)}")
        for cfg in FORWARD_CANDIDATES:
            report("fwd", cfg, lambda: attention_forward(q, k, v, softmax_scale=scale, config=cfg),
                   flops_fwd)
        out, lse = attention_forward(q, k, v, softmax_scale=scale)
        default = backward_config(head_dim, q.dtype)
        for loop in ("dkdv", "dq"):
            for cand in LOOP_CANDIDATES:
                tiles = (dict(BLOCK_N=cand["own"], BLOCK_M=cand["walk"]) if loop == "dkdv"
                         else dict(BLOCK_M=cand["own"], BLOCK_N=cand["walk"]))
                cfg = dict(default, **{loop: dict(tiles, num_warps=cand["num_warps"], num_stages=cand["num_stages"])})
                report(f"bwd[{loop}]", cfg[loop],
                       lambda: attention_backward(q, k, v, out, lse, grad_out, softmax_scale=scale,
                                                  config=cfg), flops_bwd)


def flex_attention_peer(causal, window_left=-1, softcap=0.0, slopes=None):
    """PyTorch's FlexAttention (compiled) with the same mask and score modification, or None where
    this torch has none: the peer that takes windows, soft-capping and ALiBi without a dense bias."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = q_idx >= kv_idx if causal else q_idx >= 0
        return seen & (q_idx - kv_idx <= window_left) if window_left >= 0 else seen

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    block_masks = {}  # built once per length, outside the timed calls

    def run(q, k, v):
        seqlen = q.shape[1]
        if (causal or window_left >= 0) and seqlen not in block_masks:
            block_masks[seqlen] = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=DEVICE)
        block_mask = block_masks.get(seqlen)
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                       score_mod=score_mod if softcap > 0 or slopes is not None else None)
        return out.transpose(1, 2)
    return run


def feature_cases():
    """(case, batch, seqlen, our kwargs, flex peer kwargs or None where FlexAttention has no such
    feature). The windowed case and the dense causal one at a quarter of its length and four times
    its batch hold the same tokens, and their queries see about as many keys each (4096); so a
    window's cost should follow its width, not seqlen^2."""
    slopes = geometric_alibi_slopes(HEADS, DEVICE)
    long, width = size(gpu=32768, cpu=128), size(gpu=4096, cpu=16)
    cases = [("dense causal", 4, long // 4, dict(causal=True), dict(causal=True)),
             (f"window ({width}, 0)", 1, long, dict(causal=True, window_size=(width, 0)),
              dict(causal=True, window_left=width))]
    for narrow in (width // 8, width // 2):
        cases.append((f"window ({narrow}, 0)", 1, long, dict(causal=True, window_size=(narrow, 0)),
                      dict(causal=True, window_left=narrow)))
    n = size(gpu=4096, cpu=64)
    cases += [("dense", 4, n, dict(), dict(causal=False)),
              ("softcap 30", 4, n, dict(softcap=30.0), dict(causal=False, softcap=30.0)),
              ("alibi", 4, n, dict(alibi_slopes=slopes), dict(causal=False, slopes=slopes)),
              ("dropout 0.1", 4, n, dict(dropout_p=0.1), None)]
    return cases


def run_features(head_dims):
    from mamba_annotated import attention

    rows = []
    for head_dim in head_dims:
        for case, batch, seqlen, ours_kwargs, flex_kwargs in progress(feature_cases(), "features "):
            shape = (batch, seqlen, HEADS, head_dim)
            q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad_out = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
            peers = {"ours": lambda q, k, v, kw=ours_kwargs: attention(q, k, v, **kw),
                     "flex": None if flex_kwargs is None else flex_attention_peer(**flex_kwargs)}
            for name, fn in peers.items():
                if fn is None:
                    continue
                try:
                    fwd_ms, bwd_ms = time_forward_backward(fn, q, k, v, grad_out)
                except Exception as e:  # a peer that cannot run this case is reported, not fatal
                    print(f"\n{name} {case} d={head_dim}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                    continue
                rows.append(dict(d=head_dim, case=case, batch=batch, N=seqlen, impl=name, fwd_ms=fwd_ms,
                                 bwd_ms=bwd_ms))
            del q, k, v, grad_out
    print(f"device: {device_name()}; bfloat16, heads {HEADS}")
    print_table(rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--tune", action="store_true", help="sweep tile configs instead")
    parser.add_argument("--features", action="store_true", help="windows, softcap, ALiBi (against FlexAttention) and dropout")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=size(gpu=[1024, 4096, 16384], cpu=[64]))
    args = parser.parse_args()
    if args.tune:
        tune(size(gpu=4096, cpu=64), args.head_dims)
        return
    if args.features:
        rows = run_features(args.head_dims)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=device_name(), heads=HEADS, dtype="bfloat16", rows=rows), f, indent=1)
        return
    rows = run_table(args.seqlens, args.head_dims)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), batch=BATCH, heads=HEADS, matmul_TFLOPs=matmul_tflops(torch.bfloat16),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
