"""Benchmark issue 17's speed bars: a Mamba-2 language model on our kernels beside the same model
on mamba_ssm 2.3.2.post1's ``Mamba2`` module, same weights, same batches, in one run.

    training   tokens/s of forward + backward + AdamW step (bf16 autocast), sequence 2048 and 8192
               (the bar: ours at least 1.2x the peer's)
    decoding   tokens/s of greedy generation through the recurrent step, batch 1 and 64, after a
               prefill (the bar: ours at least the peer's); each model also decodes from a captured
               CUDA graph (generate's cg=True, rows "..., CUDA graph", beside each other)
    compile    tokens/s of our model under torch.compile(fullgraph=True) against eager (the bar:
               not slower)

The peer model is ours with every block's mixer swapped for mamba_ssm's ``Mamba2``
(``use_mem_eff_path=False``: its fused path needs the causal_conv1d CUDA extension, which the GPU
box lacks; both then run the depthwise conv through PyTorch) and our weights loaded into it with
``strict=True``, so the embedding, norms, MLP-free blocks and head are the same code on both sides
and only the mixers differ. mamba_ssm's own ``MambaLMHeadModel`` cannot be built on the box: its
module imports the Mamba-1 CUDA extension.

Usage: python benchmarks/bench_models.py [--json book/data/models_bench.json] [--quick]
                                       [--passes train,decode] [--merge]
"""
import argparse
import copy
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mamba_annotated import LMHeadModel, bench  # noqa: E402
from mamba_annotated.modules.lm import DEFAULT_MIXER_CFG  # noqa: E402
from mamba_annotated.runtime import DEVICE, device_name  # noqa: E402
from mamba_annotated.train import decode_benchmark, model_config, param_count, train  # noqa: E402

# a Mamba-130M-like stack (768 wide, 24 deep, GPT-NeoX's vocabulary) and the batches of the bars
MODEL = dict(d_model=768, n_layer=24, vocab_size=50277, head_dim=64, d_state=128, chunk_size=256)
TRAINING = [dict(batch=8, seq_len=2048), dict(batch=2, seq_len=8192)]
DECODING = [dict(batch=1, prompt_len=512, new_tokens=128), dict(batch=64, prompt_len=512, new_tokens=128)]
QUICK_MODEL = dict(d_model=256, n_layer=4, vocab_size=1024, head_dim=64, d_state=64, chunk_size=128)
QUICK_TRAINING = [dict(batch=2, seq_len=1024)]
QUICK_DECODING = [dict(batch=4, prompt_len=128, new_tokens=32)]
# 30 timed steps, a few seconds per model (the first two pay for compiling and autotuning: train's untimed_steps)
TRAIN_STEPS = 32
# each training row is the median of this many runs: on an H200 two runs of the same model, one run
# of another between them, differed by 7 to 31 % in tokens/s, while its kernel time per step stayed at 80 ms
TRAIN_ROUNDS = 3


def build_models(shape, peer_module):
    """(ours, the peer's or None): the same weights, ours in float32 parameters (autocast runs bf16)."""
    config = model_config("mamba2", shape["d_model"], shape["n_layer"], shape["vocab_size"], head_dim=shape["head_dim"],
                          d_state=shape["d_state"], chunk_size=shape["chunk_size"])
    torch.manual_seed(0)
    ours = LMHeadModel(config, device=DEVICE)
    if peer_module is None:
        return config, ours, None
    theirs = copy.deepcopy(ours)
    kwargs = {**DEFAULT_MIXER_CFG.get("mamba2", {}), **config.mixer_cfg.get("mamba2", {})}
    for i, layer in enumerate(theirs.backbone.layers):
        layer.mixer = peer_module.Mamba2(config.d_model, layer_idx=i, use_mem_eff_path=False, device=DEVICE, **kwargs)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return config, ours, theirs


def random_batches(vocab_size, batch, seq_len, steps):
    """Token ids made once, on the device, so the timed loop measures the model, not the data."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    data = torch.randint(0, vocab_size, (steps, batch, seq_len + 1), device=DEVICE, generator=g)
    return lambda step: (data[step, :, :-1], data[step, :, 1:])


def training_rows(ours, theirs, config, runs):
    rows = []
    for run in runs:
        next_batch = random_batches(config.vocab_size, run["batch"], run["seq_len"], TRAIN_STEPS)
        variants = [("ours", ours, False), ("ours, torch.compile", ours, True)]
        if theirs is not None:
            variants.append(("mamba_ssm Mamba2", theirs, False))
        records = {name: [] for name, _, _ in variants}
        for _ in range(TRAIN_ROUNDS):  # the variants take turns, so a slow spell of the host hits each alike
            for name, model, compiled in variants:
                start = copy.deepcopy(model.state_dict())  # each variant starts from the same weights
                records[name].append(train(model, next_batch, TRAIN_STEPS, compiled=compiled))
                model.load_state_dict(start)
        for name, runs_of_variant in records.items():
            median = sorted(runs_of_variant, key=lambda r: r["tokens_per_s"])[len(runs_of_variant) // 2]
            rows.append(dict(pass_="train", impl=name, batch=run["batch"], seq_len=run["seq_len"],
                             tokens_per_s=median["tokens_per_s"],
                             peak_GB=max(r["peak_memory_bytes"] or 0 for r in runs_of_variant) / 2**30,
                             final_loss=median["loss"][-1]))
    return rows


def decoding_rows(ours, theirs, config, runs):
    rows = []
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for run in runs:
        prompt = torch.randint(0, config.vocab_size, (run["batch"], run["prompt_len"]), device=DEVICE, generator=g)
        # each also with generate's CUDA-graph decoding (cg=True), which replays a captured step
        variants = [("ours", ours, False), ("ours, CUDA graph", ours, True)]
        if theirs is not None:
            variants += [("mamba_ssm Mamba2", theirs, False), ("mamba_ssm Mamba2, CUDA graph", theirs, True)]
        for name, model, cg in variants:
            record = decode_benchmark(model, prompt, run["new_tokens"], cg=cg)
            rows.append(dict(pass_="decode", impl=name, batch=run["batch"], seq_len=run["prompt_len"],
                             tokens_per_s=record["decode_tokens_per_s"],
                             prefill_tokens_per_s=record["prefill_tokens_per_s"]))
    return rows


def bars(rows):
    """Each speed bar of issue 17: the ratio of tokens/s and whether it holds."""
    out = []
    for pass_, num, den, target in (("train", "ours", "mamba_ssm Mamba2", 1.2), ("decode", "ours", "mamba_ssm Mamba2", 1.0),
                                    ("train", "ours, torch.compile", "ours", 1.0)):
        for key in dict.fromkeys((r["batch"], r["seq_len"]) for r in rows if r["pass_"] == pass_):
            pick = {r["impl"]: r for r in rows if r["pass_"] == pass_ and (r["batch"], r["seq_len"]) == key}
            if num in pick and den in pick:
                ratio = pick[num]["tokens_per_s"] / pick[den]["tokens_per_s"]
                out.append(dict(bar=f"{pass_}: {num} / {den}", batch=key[0], seq_len=key[1], ratio=ratio,
                                target=f">= {target}", holds=ratio >= target))
    return out


def save(path, shape, rows):
    """Write the rows and the bars they decide (after each pass, so a run cut short keeps its rows)."""
    verdicts = bars(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(device=device_name(), model=shape, rows=rows, bars=verdicts), indent=1))
    return verdicts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="a small model and one shape: a smoke run")
    parser.add_argument("--passes", default="train,decode",
                        help="comma list of train, decode (split a run across device calls)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the passes not run that are already in --json (same device and model)")
    args = parser.parse_args()
    passes = args.passes.split(",")
    if not set(passes) <= {"train", "decode"}:
        parser.error(f"--passes: expected a comma list of train, decode; got {args.passes!r}")
    if DEVICE.type != "cuda":
        sys.exit("bench_models: needs a CUDA GPU (this machine runs the kernels in Triton's interpreter)")
    from peers import mamba_ssm_module
    peer_module = mamba_ssm_module("mamba_ssm.modules.mamba2")
    shape = QUICK_MODEL if args.quick else MODEL
    rows = []
    if args.merge and args.json and args.json.exists():
        old = json.loads(args.json.read_text())
        if old["device"] != device_name() or old["model"] != shape:
            sys.exit(f"bench_models: --merge needs the same device and model as {args.json} ({old['device']}, {old['model']})")
        rows = [r for r in old["rows"] if r["pass_"] not in passes]
    config, ours, theirs = build_models(shape, peer_module)
    print(f"device: {device_name()}; model {shape}, {param_count(config) / 1e6:.1f} M parameters", flush=True)
    for pass_, measure, runs in (("train", training_rows, QUICK_TRAINING if args.quick else TRAINING),
                                 ("decode", decoding_rows, QUICK_DECODING if args.quick else DECODING)):
        if pass_ in passes:
            new = measure(ours, theirs, config, runs)
            bench.print_table(new)
            rows += new
            if args.json:
                save(args.json, shape, rows)
    print("bars:")
    bench.print_table(bars(rows))


if __name__ == "__main__":
    main()
