"""Training data: tokenize text, pack it into fixed-length blocks, and hand each data-parallel rank its batch.

    tokenizer = load_tokenizer("path/to/checkpoint")          # tptrain.text: its tokenizer.json (or .model), or bytes
    dataset = build_dataset("corpus.txt", tokenizer, seq_len=128)
    order = DataOrder(len(dataset), seed=0, dp_rank=0, dp_size=1, global_batch=8)
    batch = torch.stack([dataset[i] for i in order.next_batch()])  # (8, 128)

Documents are joined with the eos token and cut into blocks of `seq_len` tokens (the remainder is
dropped), so no token is padding. Every rank tokenizes the same text to the same blocks, and the
order of the blocks depends only on the seed and the epoch, so the ranks of a TP group agree on
their batch without talking to each other.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tptrain.io import jsonl_records, utf8_error
from tptrain.text import Tokenizer

# Inside a document a single blank line separates paragraphs; two or more separate documents.
DOCUMENT_BREAK = re.compile(r"\n[ \t\r]*\n[ \t\r]*\n\s*")
_ENCODE_CHUNK = 1024  # documents per tokenizers.encode_batch call


class PackedDataset(Dataset):
    """Fixed-length blocks of a token stream: `dataset[i]` is a LongTensor of `seq_len` ids.

    tokens: a 1-D LongTensor, or a 1-D numpy array (the token cache's read-only memory map: the blocks are
        a view of it, and each item is converted to int64 when asked for, so a rank holds no copy).
    data_key: the token cache key of the data (None: not cached); DataOrder records it for resumes.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int, *, data_key: str | None = None) -> None:
        assert tokens.ndim == 1 and tokens.shape[0] >= seq_len > 0
        self.seq_len, self.data_key = seq_len, data_key
        self.num_tokens = int(tokens.shape[0])
        n = self.num_tokens // seq_len
        self.blocks = tokens[: n * seq_len].reshape(n, seq_len)  # (num_blocks, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        block = self.blocks[index]
        return block if isinstance(block, torch.Tensor) else torch.from_numpy(block.astype(np.int64))


def build_dataset(source: Any, tokenizer: Tokenizer, seq_len: int) -> PackedDataset:
    """Tokenize and pack `source` into blocks of `seq_len` tokens.

    source: a path to a JSONL file (`.jsonl`: one `{"text": ...}` object per line) or to a plain-text
        file (anything else: documents separated by two or more blank lines, else the whole file is one
        document); a list of strings; a `datasets.Dataset`/`IterableDataset` with a "text" column; or
        a PackedDataset (returned as-is).
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (a block needs an input and a next token), got {seq_len!r}")
    if isinstance(source, PackedDataset):
        if source.seq_len != seq_len:
            raise ValueError(f"the PackedDataset given has blocks of {source.seq_len} tokens but seq_len={seq_len} "
                             "was asked for; build it with the same seq_len, or pass the raw text")
        return source
    name, documents = read_documents(source)
    return packed_dataset(_pack(documents, tokenizer), seq_len, name=name)


def packed_dataset(tokens: torch.Tensor | np.ndarray, seq_len: int, *, name: str,
                   data_key: str | None = None) -> PackedDataset:
    """The blocks of a token stream (documents joined with eos), refusing one shorter than a block."""
    if tokens.shape[0] < seq_len:
        raise ValueError(f"dataset {name} is too short: it has {tokens.shape[0]} tokens (eos separators included) "
                         f"but one block of seq_len={seq_len} needs {seq_len}. Add text or lower seq_len.")
    return PackedDataset(tokens, seq_len, data_key=data_key)


def read_documents(source: Any) -> tuple[str, list[str]]:
    """(name, documents) of a `build_dataset` source that is not a PackedDataset: read, decoded and parsed
    (not tokenized), so a bad file fails in a fraction of a second, before any worker starts."""
    name, documents = _documents(source)
    if not any(documents):
        raise ValueError(f"dataset {name} is empty: it has no text to train on")
    return name, documents


def _documents(source: Any) -> tuple[str, list[str]]:
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.suffix == ".jsonl":
            _check_file(path)
            return str(path), _jsonl_documents(path)
        return str(path), [d for d in DOCUMENT_BREAK.split(_read_text(path)) if d.strip()]
    if isinstance(source, (list, tuple)):
        for i, doc in enumerate(source):
            if not isinstance(doc, str):
                raise TypeError(f"dataset list item {i} is a {type(doc).__name__}, not a str; pass a list of texts")
        return f"(list of {len(source)} texts)", [d for d in source if d]
    if type(source).__module__.split(".")[0] == "datasets":  # duck-typed: `datasets` is optional
        return _hf_documents(source)
    raise TypeError(f"cannot build a dataset from a {type(source).__name__}; pass a .txt or .jsonl path, a list "
                    "of strings, a datasets.Dataset with a 'text' column, or a PackedDataset")


def _check_file(path: Path) -> None:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"dataset file {path} {what}; pass a .txt or .jsonl file")


def _read_text(path: Path) -> str:
    _check_file(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise utf8_error(path, exc, exc.start) from None


def _jsonl_documents(path: Path) -> list[str]:
    documents = []
    for number, row in jsonl_records(path):
        if not isinstance(row, dict) or "text" not in row:
            raise ValueError(f"{path} line {number} has no \"text\" field; each line must be an object like "
                             '{"text": "..."}')
        if not isinstance(row["text"], str):
            raise ValueError(f"{path} line {number}: \"text\" is a {type(row['text']).__name__}, not a string")
        documents.append(row["text"])
    return documents


def _hf_documents(source: Any) -> tuple[str, list[str]]:
    name = f"({type(source).__name__})"
    columns = getattr(source, "column_names", None)
    if columns is not None and "text" not in columns:
        raise ValueError(f"dataset {name} has columns {columns} but no 'text' column; rename the column with "
                         "dataset.rename_column(old, 'text')")
    documents = []
    for i, row in enumerate(source):
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"dataset {name} row {i}: 'text' is {type(text).__name__}, not a string")
        documents.append(text)
    return name, [d for d in documents if d]


def _pack(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One 1-D LongTensor: doc, eos, doc, eos, ..."""
    eos = tokenizer.eos_token_id
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    pieces = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        for ids in encode_batch(documents[start:start + _ENCODE_CHUNK]):
            pieces.append(torch.tensor(ids + [eos], dtype=torch.long))
    return torch.cat(pieces)


def check_dp_split(owner: str, *, dp_rank: int, dp_size: int, global_batch: int) -> None:
    """Raise unless `global_batch` splits evenly over `dp_size` data-parallel ranks and `dp_rank` is one of them."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{owner}: dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    if global_batch < 1 or global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} cannot be split evenly over {dp_size} data-parallel "
                         f"ranks; make the global batch (per-device batch x grad accumulation x dp size) a "
                         f"multiple of {dp_size}")


class DataOrder:
    """Which blocks each data-parallel rank trains on, step by step.

    Each epoch is a permutation of the blocks seeded by `seed + epoch`; a step takes the next
    `global_batch` of them (a partial batch at the end of an epoch is skipped) and dp rank r gets
    the r-th contiguous `global_batch // dp_size` of those. The global sequence of batches does
    not depend on dp_size, so a run can resume at a different data-parallel layout. data_key: the token
    cache key of the data (its content, tokenizer and format), recorded so a resume on other data is refused.
    """

    def __init__(self, num_samples: int, *, seed: int, dp_rank: int, dp_size: int, global_batch: int,
                 data_key: str | None = None) -> None:
        check_dp_split("DataOrder", dp_rank=dp_rank, dp_size=dp_size, global_batch=global_batch)
        if global_batch > num_samples:
            raise ValueError(f"the dataset has only {num_samples} block(s) but one step needs a global batch of "
                             f"{global_batch}; add data, lower the batch size, or lower seq_len")
        self.num_samples, self.seed, self.global_batch, self.data_key = num_samples, seed, global_batch, data_key
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.steps_per_epoch = num_samples // global_batch
        self.epoch, self.position = 0, 0
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) cache

    def next_batch(self) -> list[int]:
        """This dp rank's sample indices for the next step."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.num_samples, generator=g))
        start = self.position * self.global_batch + self.dp_rank * self.local_batch
        self.position += 1
        return self._perm[1][start:start + self.local_batch].tolist()

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                 "num_samples": self.num_samples, "global_batch": self.global_batch}
        return state if self.data_key is None else {**state, "data_key": self.data_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" in state:  # the reverse of StreamOrder's check
            raise ValueError(f"cannot resume the data order: the checkpoint was saved by a streaming run (files "
                             f"fingerprint {state['stream']}, text column {state.get('text_column')!r}); resume it "
                             "with the same StreamingText / --streaming data")
        saved = state.get("data_key")
        if saved is not None and self.data_key is not None and saved != self.data_key:
            raise ValueError(f"cannot resume the data order: the checkpoint was trained on data with token cache "
                             f"key {saved}, but this run's data has key {self.data_key} (another file content, "
                             "tokenizer or format); resume with the same data file and tokenizer")
        for key in ("seed", "num_samples", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the data order: the checkpoint was saved with {key}={state[key]} "
                                 f"but this run has {key}={getattr(self, key)}; resume with the same data, "
                                 "seq_len, seed and global batch size")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
