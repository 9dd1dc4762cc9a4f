"""The training chapter's data and loop: the recall tasks' construction, the corpus split, equal
parameter counts, the schedule, the loop learning something, the evaluations and the records."""
import json
import math
import pathlib
import sysconfig

import pytest
import torch
import torch.nn as nn

from mamba_annotated.modules import LMHeadModel
from mamba_annotated.modules.lm import CausalLMOutput
from mamba_annotated.runtime import DEVICE
from mamba_annotated.tasks import (IGNORE_INDEX, bytes_to_text, mqar, sample_windows, selective_copying,
                                   stdlib_corpus, text_to_bytes)
from mamba_annotated.train import (KINDS, byte_lm_eval, decode_benchmark, fit_config, lr_factor, model_config,
                                   mqar_accuracy, param_count, train)


def generator(seed):
    return torch.Generator().manual_seed(seed)


def mqar_pairs(inputs, num_pairs):
    return inputs[:, 0:2 * num_pairs:2], inputs[:, 1:2 * num_pairs:2]


@pytest.mark.parametrize("random_non_queries", [True, False])
def test_mqar_pairs_queries_and_targets(random_non_queries):
    n, seq_len, num_pairs, vocab = 64, 48, 8, 40
    inputs, targets = mqar(n, seq_len, num_pairs, vocab, generator=generator(0), random_non_queries=random_non_queries)
    assert inputs.shape == targets.shape == (n, seq_len) and inputs.dtype == targets.dtype == torch.int64
    assert 0 <= int(inputs.min()) and int(inputs.max()) < vocab
    keys, values = mqar_pairs(inputs, num_pairs)
    assert ((1 <= keys) & (keys < vocab // 2)).all() and ((vocab // 2 <= values) & (values < vocab)).all()
    for row in range(n):
        pairs = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert len(pairs) == num_pairs, "keys repeat within a sequence"
        assert len(set(values[row].tolist())) == num_pairs, "values repeat within a sequence"
        positions = (targets[row] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert len(positions) == num_pairs
        queried = [int(inputs[row, p]) for p in positions]
        assert sorted(queried) == sorted(pairs), "every key is queried once"
        for p, key in zip(positions, queried):
            assert p >= 2 * num_pairs and (p - 2 * num_pairs) % 2 == 0, "queries follow the pairs, at even offsets"
            assert int(targets[row, p]) == pairs[key]
        if not random_non_queries:
            rest = torch.ones(seq_len, dtype=torch.bool)
            rest[:2 * num_pairs] = False
            rest[positions] = False
            assert (inputs[row, rest] == 0).all()


def test_mqar_favours_short_gaps_and_is_seeded():
    inputs, targets = mqar(512, 256, 4, 64, generator=generator(1))
    offsets = (targets != IGNORE_INDEX).nonzero()[:, 1] - 8
    # p(gap i) ~ i^-0.99 over 124 slots: about half of the mass lies in the first ten
    assert (offsets < 20).float().mean() > 0.35
    again = mqar(512, 256, 4, 64, generator=generator(1))
    other = mqar(512, 256, 4, 64, generator=generator(2))
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    assert not torch.equal(inputs, other[0])


def test_mqar_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="seq_len"):
        mqar(2, 15, 4, 64, generator=generator(0))
    with pytest.raises(ValueError, match="vocab_size"):
        mqar(2, 64, 8, 16, generator=generator(0))
    with pytest.raises(ValueError, match="num_pairs"):
        mqar(2, 64, 0, 16, generator=generator(0))


def test_selective_copying():
    n, seq_len, num_tokens, vocab = 32, 24, 5, 12
    inputs, targets = selective_copying(n, seq_len, num_tokens, vocab, generator=generator(3))
    context = seq_len - num_tokens
    assert (inputs[:, context:] == 1).all() and (targets[:, :context] == IGNORE_INDEX).all()
    for row in range(n):
        data = inputs[row, :context][inputs[row, :context] != 0]
        assert torch.equal(data, targets[row, context:]), "the data tokens, in order, are the targets"
    assert ((2 <= targets[:, context:]) & (targets[:, context:] < vocab)).all()
    assert torch.equal(inputs, selective_copying(n, seq_len, num_tokens, vocab, generator=generator(3))[0])


def make_tree(root):
    files = {f"pkg{i % 3}/mod{i}.py": f"x = {i}\n" * (i + 1) for i in range(40)}
    files.update({"site-packages/numpy/core.py": "installed\n", "test/test_os.py": "suite\n",
                  "pkg0/data.txt": "not source\n"})
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return files


def test_corpus_split_is_by_file_disjoint_and_deterministic(tmp_path):
    files = make_tree(tmp_path)
    corpus = stdlib_corpus(0.25, root=tmp_path)
    expected = sorted(f for f in files if f.startswith("pkg") and f.endswith(".py"))
    assert sorted(corpus.train_files + corpus.validation_files) == expected
    assert not set(corpus.train_files) & set(corpus.validation_files)
    assert corpus.train_files == sorted(corpus.train_files) and corpus.validation_files
    for data, names in ((corpus.train, corpus.train_files), (corpus.validation, corpus.validation_files)):
        assert data.dtype == torch.uint8
        assert bytes(data.tolist()) == "".join(files[f] for f in names).encode()
    again = stdlib_corpus(0.25, root=tmp_path)
    assert again.validation_files == corpus.validation_files and torch.equal(again.train, corpus.train)
    # the split of a file depends on its own path: a new file moves no other
    (tmp_path / "pkg1" / "new.py").write_text("y = 1\n")
    grown = stdlib_corpus(0.25, root=tmp_path)
    assert set(corpus.validation_files) <= set(grown.validation_files)
    assert set(corpus.train_files) <= set(grown.train_files)
    with pytest.raises(ValueError, match="validation_fraction"):
        stdlib_corpus(0.0, root=tmp_path)


def test_stdlib_corpus():
    corpus = stdlib_corpus()
    assert "os.py" in corpus.train_files + corpus.validation_files
    assert not any(part in ("site-packages", "test") for f in corpus.train_files for part in f.split("/")[:-1])
    assert 0 < corpus.validation.numel() < corpus.train.numel()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert corpus.validation.numel() == sum((root / f).stat().st_size for f in corpus.validation_files)


def test_sample_windows():
    data = torch.arange(200, dtype=torch.uint8)
    inputs, targets = sample_windows(data, 16, 10, generator=generator(4))
    assert inputs.shape == targets.shape == (16, 10) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets - inputs, torch.ones_like(inputs)), "consecutive bytes of the data"
    assert int(targets.max()) < 200
    assert torch.equal(inputs, sample_windows(data, 16, 10, generator=generator(4))[0])
    with pytest.raises(ValueError, match="seq_len"):
        sample_windows(data[:10], 1, 10, generator=generator(4))
    assert bytes_to_text(text_to_bytes("déjà vu")[0]) == "déjà vu"


@pytest.mark.parametrize("target, tolerance", [(200_000, 0.1), (10_000_000, 0.04), (30_000_000, 0.04)])
def test_fit_config_matches_counts(target, tolerance):
    """Within a few percent at the chapter's sizes; at a CPU size one layer is a third of the
    model or more, so the nearest shape is further off."""
    small = target < 1e6
    kwargs = dict(head_dim=16, d_state=16) if small else {}
    for kind in KINDS:
        config, count = fit_config(kind, target, 256, **kwargs)
        assert abs(count - target) / target < tolerance, (kind, config.d_model, config.n_layer, count)
        if small:  # the count of the model itself, not of its meta-device copy
            assert count == sum(p.numel() for p in LMHeadModel(config).parameters())
        if kind == "hybrid":
            assert {"attn", "mamba2"} == set(config.layer_types)
    width = kwargs.get("head_dim", 64) * 4
    config, count = fit_config("mamba2", target, 256, d_model=width, **kwargs)
    assert config.d_model == width and count == param_count(config)


def test_model_config_kinds():
    with pytest.raises(ValueError, match="kind"):
        model_config("rnn", 64, 2, 256)
    with pytest.raises(ValueError, match="head_dim"):
        model_config("mamba2", 80, 2, 256)
    assert model_config("hybrid", 64, 8, 256).layer_types.count("attn") == 2
    assert model_config("transformer", 96, 2, 256, head_dim=32).d_intermediate == 256
    assert model_config("mamba", 64, 2, 256).d_intermediate == 0


def test_lr_factor():
    factors = [lr_factor(s, 4, 20, min_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(factors[3:], factors[4:]))
    assert math.isclose(factors[-1], 0.1)


def identity_batches(vocab, batch, seq_len, seed):
    """Predict the token just read: learnable through the tied embedding and head alone."""
    g = generator(seed)

    def next_batch(step):
        tokens = torch.randint(vocab, (batch, seq_len), generator=g)
        return tokens, tokens
    return next_batch


@pytest.mark.parametrize("kind", ["transformer", "mamba2"])
def test_train_reduces_loss_and_records_metrics(kind):
    vocab, steps = 16, 8 if kind == "transformer" else 5
    config = model_config(kind, 32, 1, vocab, head_dim=16, d_state=16, chunk_size=16)
    model = LMHeadModel(config, device=DEVICE)  # train() moves each batch to DEVICE
    record = train(model, identity_batches(vocab, 4, 16, seed=5), steps, lr=2e-2, warmup_steps=1)
    expected = {"loss", "lr", "grad_norm", "tokens_per_step", "tokens_per_s", "wall_s", "peak_memory_bytes",
                "params", "device", "autocast", "compiled"}
    assert set(record) == expected
    assert json.loads(json.dumps(record)) == record
    assert len(record["loss"]) == len(record["lr"]) == len(record["grad_norm"]) == steps
    assert record["lr"][0] == pytest.approx(2e-2) and record["lr"][-1] == pytest.approx(2e-3)
    assert record["tokens_per_step"] == 64 and record["tokens_per_s"] > 0 and record["params"] == param_count(config)
    assert math.log(vocab) * 0.9 < record["loss"][0]  # starts near chance
    assert record["loss"][-1] < 0.75 * record["loss"][0], record["loss"]


class Lookup(nn.Module):
    """A stand-in model that answers each known input row with the given prediction row."""

    def __init__(self, inputs, predictions, vocab_size):
        super().__init__()
        self.config = model_config("mamba", 64, 1, vocab_size)
        self.table = {tuple(row.tolist()): answer for row, answer in zip(inputs, predictions)}

    def forward(self, input_ids):
        chosen = torch.stack([self.table[tuple(row.tolist())] for row in input_ids]).to(input_ids.device)
        logits = torch.zeros(*input_ids.shape, self.config.padded_vocab_size(), device=input_ids.device)
        return CausalLMOutput(logits=logits.scatter(-1, chosen[..., None], 1.0))


def recall(inputs, num_pairs):
    """What a perfect recall model answers: the value stored with each key read so far."""
    keys, values = mqar_pairs(inputs, num_pairs)
    answers = torch.zeros_like(inputs)
    for row in range(inputs.shape[0]):
        table = dict(zip(keys[row].tolist(), values[row].tolist()))
        answers[row] = torch.tensor([table.get(t, 0) for t in inputs[row].tolist()])
    return answers


def test_mqar_accuracy_counts_query_positions_only():
    inputs, targets = mqar(20, 32, 4, 32, generator=generator(6))
    answers = recall(inputs, 4)
    wrong = answers.clone()
    wrong[:5] = 0  # a quarter of the rows answered wrongly everywhere
    wrong[5:, :8] = 0  # wrong outside the queries changes nothing
    for predictions, expected in ((answers, 1.0), (wrong, 0.75)):
        assert mqar_accuracy(Lookup(inputs, predictions, 32), inputs, targets, batch_size=7) == expected


class Uniform(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = model_config("mamba", 64, 1, 256)

    def forward(self, input_ids):
        return CausalLMOutput(logits=torch.zeros(*input_ids.shape, 256, device=input_ids.device))


def test_byte_lm_eval_of_uniform_model_is_eight_bits():
    data = torch.randint(256, (1000,), dtype=torch.uint8)
    result = byte_lm_eval(Uniform(), data, 64, batch_size=4)
    assert result["bytes"] == 15 * 64 and result["bits_per_byte"] == pytest.approx(8.0)
    assert byte_lm_eval(Uniform(), data, 64, batch_size=4, max_batches=2)["bytes"] == 8 * 64


def test_decode_benchmark_record():
    model = LMHeadModel(model_config("transformer", 32, 1, 16, head_dim=16), device=DEVICE)
    record = decode_benchmark(model, torch.randint(16, (2, 8)), 3, repeats=1)
    assert json.loads(json.dumps(record)) == record
    assert record["batch"] == 2 and record["prompt_len"] == 8 and record["new_tokens"] == 3
    assert record["prefill_tokens_per_s"] > 0 and record["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="new_tokens"):
        decode_benchmark(model, torch.randint(16, (2, 8)), 1)
