"""Training data: tokenize text, pack it into fixed-length blocks, and hand each data-parallel rank its batch.

    tokenizer = load_tokenizer("path/to/checkpoint")          # its tokenizer.json (or .model), or bytes
    dataset = build_dataset("corpus.txt", tokenizer, seq_len=128)
    order = DataOrder(len(dataset), seed=0, dp_rank=0, dp_size=1, global_batch=8)
    batch = torch.stack([dataset[i] for i in order.next_batch()])  # (8, 128)

Documents are joined with the eos token and cut into blocks of `seq_len` tokens (the remainder is
dropped), so no token is padding. Every rank tokenizes the same text to the same blocks, and the
order of the blocks depends only on the seed and the epoch, so the ranks of a TP group agree on
their batch without talking to each other.
"""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, Iterable, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from tptrain.io import INDEX_FILE, SINGLE_FILE
from tptrain.training.spm_tokenizer import SPM_FILE, SentencePieceTokenizer

# Inside a document a single blank line separates paragraphs; two or more separate documents.
DOCUMENT_BREAK = re.compile(r"\n[ \t\r]*\n[ \t\r]*\n\s*")
_ENCODE_CHUNK = 1024  # documents per tokenizers.encode_batch call


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (the `tokenizers` library), with the eos token its configs name.

    config: the checkpoint's config.json, whose eos_token_id is used when tokenizer_config.json names none.
    """

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.path = path
        self.description = f"{path} (tokenizer.json)"
        self._tok = _Tokenizer.from_file(str(path))
        self.eos_token_id = _eos_id(self._tok, path, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encoding(self, text: str) -> Any:
        """The `tokenizers.Encoding` of `text`: `.ids` and `.char_to_token(i)` (chat label masks need both)."""
        return self._tok.encode(text, add_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class ByteTokenizer:
    """For a model without weights that has no tokenizer: UTF-8 bytes are ids 0..255, eos is 256."""

    eos_token_id = 256
    vocab_size = 257
    description = "byte-level fallback (the model has no weights)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encoding(self, text: str) -> Any:
        return _ByteEncoding(text)

    def token_to_id(self, token: str) -> int | None:
        return None


class _ByteEncoding:
    """`.ids` and `.char_to_token` of a text under ByteTokenizer (a character is one or more byte tokens)."""

    def __init__(self, text: str) -> None:
        self.ids = list(text.encode("utf-8"))
        self._starts = list(itertools.accumulate((len(c.encode("utf-8")) for c in text), initial=0))[:-1]

    def char_to_token(self, index: int) -> int | None:
        return self._starts[index] if 0 <= index < len(self._starts) else None


def load_tokenizer(model_dir: str | Path | None) -> Any:
    """The tokenizer of the checkpoint in `model_dir` (a local directory): its tokenizer.json, else its SentencePiece
    tokenizer.model; bytes only for a model without weights (a config to train from scratch, or no directory).
    Its `description` says which (path and kind), for the run to print.

    Raises FileNotFoundError for a checkpoint with weights but neither file (byte ids would be noise to its
    embedding), and ValueError when the model's embedding (config.json `vocab_size`) cannot hold the
    tokenizer's ids, e.g. a byte-level fallback (257 ids) for a model with a smaller vocabulary.
    """
    directory = None if model_dir is None else Path(model_dir)
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"load_tokenizer: {directory} is not a directory; pass the checkpoint directory "
                                "(it holds config.json and, usually, tokenizer.json)")
    config = _read_json(directory / "config.json") if directory and (directory / "config.json").is_file() else {}
    tokenizer = _checkpoint_tokenizer(directory, config) if directory is not None else None
    if tokenizer is None:
        tokenizer = ByteTokenizer()
        source = f"the byte-level fallback tokenizer (no tokenizer.json in {directory})"
    else:
        source = f"tokenizer {tokenizer.path}"
    model_vocab = config.get("vocab_size")
    if isinstance(model_vocab, int) and model_vocab < tokenizer.vocab_size:
        raise ValueError(f"{source} produces ids up to {tokenizer.vocab_size - 1}, but the model in {directory} "
                         f"has vocab_size={model_vocab} (config.json), so its embedding cannot hold them. Add the "
                         f"model's tokenizer.json to {directory}, or use a model with vocab_size >= "
                         f"{tokenizer.vocab_size}.")
    return tokenizer


def _checkpoint_tokenizer(directory: Path, config: dict[str, Any]) -> Any:
    """The tokenizer `directory` ships (None: none, and no weights either)."""
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory / "tokenizer.json", config)
    if (directory / SPM_FILE).is_file():
        tokenizer = SentencePieceTokenizer(directory / SPM_FILE)
        tokenizer.eos_token_id = _eos_id(tokenizer, tokenizer.path, config)
        return tokenizer
    if (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file():
        raise FileNotFoundError(
            f"the checkpoint {directory} has weights but no tokenizer (looked for tokenizer.json and {SPM_FILE}): "
            "its embedding was trained on its own tokenizer's ids, so the byte-level fallback (for models without "
            f"weights) would train it on noise. Copy the model's tokenizer files (tokenizer.json, "
            f"tokenizer_config.json) into {directory}, or pass the Trainer its tokenizer (tokenizer=)")
    return None
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _eos_id(tok: Any, path: Path, config: dict[str, Any]) -> int:
    """eos from tokenizer_config.json's eos_token (a string or {"content": ...}), else config.json's id."""
    directory = path.parent
    tok_config = directory / "tokenizer_config.json"
    eos = _read_json(tok_config).get("eos_token") if tok_config.is_file() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        eos_id = tok.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"{tok_config} names eos_token {eos!r}, which is not in {path}")
        return eos_id
    eos_id = config.get("eos_token_id")
    if isinstance(eos_id, list) and eos_id:
        eos_id = eos_id[0]
    if not isinstance(eos_id, int):
        raise ValueError(f"no eos token for {path}: set eos_token in {tok_config} or eos_token_id in "
                         f"{directory / 'config.json'} (documents are joined with it when packing)")
    return eos_id


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


def utf8_error(path: Path, exc: UnicodeDecodeError, offset: int) -> ValueError:
    """The error for a file that is not UTF-8; `offset`: the bad byte's offset in the file."""
    return ValueError(f"dataset file {path} is not valid UTF-8: byte offset {offset} "
                      f"({exc.object[exc.start:exc.start + 4]!r}...) cannot be decoded ({exc.reason}). Convert "
                      f"the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`.")


def jsonl_records(path: Path, progress: Callable[[int], None] = lambda n: None, *,
                  start: int = 0) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) of each non-blank line of a .jsonl file from the `start`-th on (the ones before
    are counted, not parsed), read a line at a time; `progress` gets each line's bytes."""
    offset, row = 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            progress(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise utf8_error(path, exc, offset + exc.start) from None
            offset += len(raw)
            if not line.strip():
                continue
            row += 1
            if row <= start:
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number} is not valid JSON: {exc.msg}") from None


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
