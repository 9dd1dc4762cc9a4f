"""Data for training small language models: two synthetic recall tasks and a byte-level corpus.

* :func:`mqar`: multi-query associative recall (MQAR) from Zoology (Arora et al. 2023, "Zoology:
  Measuring and Improving Recall in Efficient Language Models"): key-value pairs, then the keys
  again, each to be answered with its value. Attention solves it at any length; a recurrent model
  must hold every pair in its fixed-size state, so accuracy against sequence length and number
  of pairs separates the mixers.
* :func:`selective_copying`: the selective copying task of the Mamba paper (Gu & Dao 2023,
  "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", section 4.1.1; a variant of
  the copying task of Arjovsky et al. 2016): a few tokens scattered among blanks, to be repeated
  in order. A time-invariant SSM cannot skip the blanks by content; a selective one can.
* :func:`stdlib_corpus`: the installed Python's standard library source as bytes, split into
  training and validation by file, and :func:`sample_windows` to draw training batches from it.

Every generator takes a ``torch.Generator``, so a seed fixes the data. Targets use -100 where no
prediction is scored (PyTorch's ``cross_entropy`` ``ignore_index`` default), as Zoology does.
"""
import pathlib
import sysconfig
import zlib
from typing import NamedTuple

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: positions that are not scored


def mqar(num_examples, seq_len, num_pairs, vocab_size, *, generator, power_a=0.01, random_non_queries=True):
    """Multi-query associative recall, as Zoology's ``multiquery_ar`` builds it.

    Each sequence starts with ``num_pairs`` pairs ``k_1 v_1 ... k_n v_n``: distinct keys from
    [1, vocab_size // 2), values from [vocab_size // 2, vocab_size) (distinct too). The rest of
    the sequence holds each key once more, as a query, at even offsets from the end of the
    pairs; the offsets are drawn without replacement with probability proportional to
    ``power_a * i ** (power_a - 1)`` (i = 1, 2, ...: short gaps are likely, long ones possible).
    The other positions are random tokens (``random_non_queries``) or 0.

    Returns ``(inputs, targets)``, int64 (num_examples, seq_len): targets hold the queried key's
    value at the query's position (the model reads the key and must output its value there) and
    -100 everywhere else. Zoology writes the same sequence one token longer and shifts the
    targets by one; the positions and values are the same.
    """
    context = 2 * num_pairs
    space = (seq_len - context) // 2  # query slots: even offsets after the pairs
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be at least 1; got {num_pairs}")
    if num_pairs > space:
        raise ValueError(f"seq_len ({seq_len}) must be at least 4 * num_pairs ({4 * num_pairs}): "
                         f"the pairs and one query slot per pair")
    if num_pairs > vocab_size // 2 - 1:
        raise ValueError(f"vocab_size ({vocab_size}) must be at least 2 * (num_pairs + 1) ({2 * (num_pairs + 1)}): "
                         f"distinct keys from [1, vocab_size // 2)")
    key_count, value_count = vocab_size // 2 - 1, vocab_size - vocab_size // 2
    # distinct draws per row: the first num_pairs of a random permutation
    keys = 1 + torch.rand(num_examples, key_count, generator=generator).argsort(dim=1)[:, :num_pairs]
    values = vocab_size // 2 + torch.rand(num_examples, value_count, generator=generator).argsort(dim=1)[:, :num_pairs]

    slot = torch.arange(1, space + 1, dtype=torch.float64)
    weights = (power_a * slot ** (power_a - 1)).expand(num_examples, space)
    gaps = torch.multinomial(weights, num_pairs, replacement=False, generator=generator)
    query_positions = context + 2 * gaps

    if random_non_queries:
        inputs = torch.randint(vocab_size, (num_examples, seq_len), generator=generator)
    else:
        inputs = torch.zeros(num_examples, seq_len, dtype=torch.int64)
    inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
    inputs.scatter_(1, query_positions, keys)
    targets = torch.full((num_examples, seq_len), IGNORE_INDEX, dtype=torch.int64)
    targets.scatter_(1, query_positions, values)
    return inputs, targets


def selective_copying(num_examples, seq_len, num_tokens, vocab_size, *, generator):
    """Selective copying (Gu & Dao 2023, section 4.1.1): ``num_tokens`` data tokens from
    [2, vocab_size) at random positions, in order, among blanks (token 0), in the first
    ``seq_len - num_tokens`` positions; then ``num_tokens`` markers (token 1), where the model
    must output the data tokens in their order.

    Returns ``(inputs, targets)``, int64 (num_examples, seq_len): targets hold the data tokens at
    the marker positions and -100 everywhere else.
    """
    context = seq_len - num_tokens
    if not 0 < num_tokens <= context:
        raise ValueError(f"num_tokens ({num_tokens}) must be at least 1 and at most seq_len - num_tokens ({context})")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 (blank, marker, one data token); got {vocab_size}")
    data = torch.randint(2, vocab_size, (num_examples, num_tokens), generator=generator)
    # sorted distinct positions keep the tokens in order
    positions = torch.rand(num_examples, context, generator=generator).argsort(dim=1)[:, :num_tokens].sort(dim=1).values
    inputs = torch.zeros(num_examples, seq_len, dtype=torch.int64)
    inputs.scatter_(1, positions, data)
    inputs[:, context:] = 1
    targets = torch.full((num_examples, seq_len), IGNORE_INDEX, dtype=torch.int64)
    targets[:, context:] = data
    return inputs, targets


class ByteCorpus(NamedTuple):
    """A corpus split by file: the concatenated bytes (uint8) of each side and the files' paths,
    relative to the corpus root, in the order their bytes appear."""

    train: torch.Tensor
    validation: torch.Tensor
    train_files: list
    validation_files: list


STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test")


def stdlib_corpus(validation_fraction=0.05, *, root=None, exclude=STDLIB_EXCLUDED_DIRS):
    """The installed Python's standard library source (``*.py`` under
    ``sysconfig.get_paths()["stdlib"]``, or under ``root``) as a :class:`ByteCorpus`.

    Files under a directory named in ``exclude`` are left out: installed packages (which pyenv
    and conda keep inside the stdlib directory) and the test suite (which some distributions do
    not ship), so the corpus is the library's code. The files are read in sorted order; a file
    goes to validation when the CRC-32 of its relative path falls in the first
    ``validation_fraction`` of the 32-bit range: a deterministic split by file (no window of
    validation text was seen in training) that does not move when another Python version adds
    or removes files.
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction}")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if path.is_file() and not set(exclude) & set(path.relative_to(root).parts[:-1]))
    validation_files = [f for f in files if zlib.crc32(f.encode()) < validation_fraction * 2 ** 32]
    train_files = [f for f in files if zlib.crc32(f.encode()) >= validation_fraction * 2 ** 32]
    if not train_files or not validation_files:
        raise ValueError(f"{root}: {len(files)} source files give {len(train_files)} for training and "
                         f"{len(validation_files)} for validation; both need at least one")
    return ByteCorpus(read_bytes(root, train_files), read_bytes(root, validation_files), train_files, validation_files)


def read_bytes(root, files):
    """The files' bytes, concatenated, as a uint8 tensor."""
    data = b"".join((pathlib.Path(root) / f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def sample_windows(data, batch_size, seq_len, *, generator):
    """A batch of random windows of a byte tensor for next-byte prediction: ``(inputs, targets)``,
    int64 (batch_size, seq_len), targets being the inputs shifted by one byte. Starts are uniform
    over every window that fits."""
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} bytes; a window of seq_len {seq_len} needs {seq_len + 1}")
    starts = torch.randint(data.numel() - seq_len, (batch_size,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def text_to_bytes(text):
    """A string as a (1, n) int64 tensor of its UTF-8 bytes: a prompt for a byte-level model."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)[None]


def bytes_to_text(tokens):
    """A 1-D tensor of byte values as text (bytes that are not valid UTF-8 become U+FFFD)."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")
