"""A checkpoint's tokenizer: its tokenizer.json (the `tokenizers` library), else its SentencePiece tokenizer.model,
with the eos token its configs name; UTF-8 bytes for a model without weights.

    tokenizer = load_tokenizer("path/to/checkpoint")      # tokenizer.description says which file and kind
    ids = tokenizer.encode("To be, or not to be")          # no special tokens added; documents are joined with eos
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterable, Protocol

from tptrain.io import read_json, weights_file
from tptrain.text.spm_tokenizer import SPM_FILE, SentencePieceTokenizer


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
    config = read_json(directory / "config.json") if directory and (directory / "config.json").is_file() else {}
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
    if weights_file(directory) is not None:
        raise FileNotFoundError(
            f"the checkpoint {directory} has weights but no tokenizer (looked for tokenizer.json and {SPM_FILE}): "
            "its embedding was trained on its own tokenizer's ids, so the byte-level fallback (for models without "
            f"weights) would train it on noise. Copy the model's tokenizer files (tokenizer.json, "
            f"tokenizer_config.json) into {directory}, or pass the Trainer its tokenizer (tokenizer=)")
    return None


def _eos_id(tok: Any, path: Path, config: dict[str, Any]) -> int:
    """eos from tokenizer_config.json's eos_token (a string or {"content": ...}), else config.json's id."""
    directory = path.parent
    tok_config = directory / "tokenizer_config.json"
    eos = read_json(tok_config).get("eos_token") if tok_config.is_file() else None
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
