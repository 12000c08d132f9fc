"""Tokenize a data file into the token cache's files, reading it in pieces (training/token_cache.py owns the store).

    stats = tokenize_file(Path("corpus.txt"), directory, tokenizer, encoder=None, show_progress=True)

A text file is read 8 MB at a time and split at document breaks as `data.read_documents` splits it (a
piece ends after the last break that more text cannot extend), so only a batch of documents is held at
once (one document longer than memory cannot be split: it is tokenized whole, as before). A .jsonl file is
read line by line. Documents are tokenized in batches of about 4 MB of text (`encode_batch`: the tokenizers
library's threads) and appended to the files; the ids are exactly those of the in-memory path.
"""
from __future__ import annotations

import codecs
import itertools
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tptrain.losses import IGNORE_INDEX
from tptrain.io import jsonl_records, utf8_error
from tptrain.training.data import DOCUMENT_BREAK

TOKENS, TARGETS, OFFSETS = "tokens.bin", "targets.bin", "offsets.npy"
_READ_BYTES = 8 << 20
_BATCH_CHARS = 4 << 20


def text_documents(path: Path, progress: Callable[[int], None]) -> Iterator[str]:
    """The documents of a plain-text file (two or more blank lines separate them), piece by piece."""
    rest = ""
    for text, last in _decoded_pieces(path, progress):
        buffer = rest + text
        # A break starts with "\n", so one not seen before can only start in rest's trailing whitespace.
        cut = len(buffer) if last else _last_break_end(buffer, len(rest.rstrip()))
        for document in DOCUMENT_BREAK.split(buffer[:cut]):
            if document.strip():
                yield document
        rest = buffer[cut:]


def _last_break_end(buffer: str, start: int) -> int:
    """End of the last document break that more text cannot extend (it ends before the buffer does), or 0."""
    end = 0
    for match in DOCUMENT_BREAK.finditer(buffer, start):
        if match.end() < len(buffer):
            end = match.end()
    return end


def _decoded_pieces(path: Path, progress: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    """(text, is the last piece) of a UTF-8 file, decoded without newline translation, as read_bytes().decode."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes fed to the decoder
    with open(path, "rb") as f:
        while True:
            data = f.read(_READ_BYTES)
            pending = len(decoder.getstate()[0])  # an incomplete character carried over from the last piece
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise utf8_error(path, exc, offset - pending + exc.start) from None
            offset += len(data)
            progress(len(data))
            yield text, not data
            if not data:
                return


class TokenWriter:
    """Appends documents' token ids (and, for records, their target flags) to the files in `directory`."""

    def __init__(self, directory: Path, dtype: np.dtype, *, targets: bool) -> None:
        self.directory, self.dtype = directory, dtype
        self.ids = open(directory / TOKENS, "wb")  # noqa: SIM115 - appended to batch by batch, closed by close()
        self.targets = open(directory / TARGETS, "wb") if targets else None  # noqa: SIM115
        self.lengths = array("q")  # tokens per document
        self.max_id, self.num_tokens = -1, 0
        self.on_write: Callable[[], None] = lambda: None  # the progress bar's tokens/s

    def write(self, ids: list[list[int]], targets: list[list[bool]] | None = None) -> None:
        count = sum(len(d) for d in ids)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=count)
        if count:
            self.max_id = max(self.max_id, int(flat.max()))
        assert self.max_id <= np.iinfo(self.dtype).max, "the dtype is chosen from the tokenizer's vocabulary"
        self.ids.write(flat.astype(self.dtype).tobytes())
        if self.targets is not None:
            self.targets.write(np.fromiter(itertools.chain.from_iterable(targets), dtype=np.uint8, count=count)
                               .tobytes())
        self.lengths.extend(len(d) for d in ids)
        self.num_tokens += count
        self.on_write()

    def close_files(self) -> None:
        for f in (self.ids, self.targets):
            if f is not None:
                f.close()

    def close(self, *, keep_targets: bool) -> dict[str, int]:
        """Flush the files, write the offsets; drop the target flags when no record needed them."""
        self.close_files()
        if self.targets is not None and not keep_targets:
            (self.directory / TARGETS).unlink()
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self.lengths, dtype=np.int64), out=offsets[1:])
        np.save(self.directory / OFFSETS, offsets)
        return {"num_tokens": self.num_tokens, "num_documents": len(self.lengths), "max_id": self.max_id}


def tokenize_file(path: Path, directory: Path, tokenizer: Any, *, encoder: Any, show_progress: bool
                  ) -> dict[str, Any]:
    """Write `path`'s tokens into `directory`; {"kind": "text" | "records", counts, max_id}.
    encoder: a `sft_data.SampleEncoder` for a .jsonl file (None for plain text)."""
    from tqdm import tqdm

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    writer = TokenWriter(directory, dtype, targets=encoder is not None)
    start = time.perf_counter()
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"tokenizing {path.name}",
              file=sys.stderr, disable=not show_progress, mininterval=1.0) as bar:
        writer.on_write = lambda: bar.set_postfix_str(
            f"{writer.num_tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
        try:
            if encoder is None:
                kind, texts = "text", _encode_texts(text_documents(path, bar.update), tokenizer, writer, targets=False)
            else:
                kind, texts = _encode_records((r for _, r in jsonl_records(path, bar.update)), tokenizer, writer, encoder)
        finally:  # on an error too: the caller removes the directory
            writer.close_files()
    if kind == "text" and not texts:
        raise ValueError(f"dataset {path} is empty: it has no text to train on")
    return {"kind": kind, "dtype": dtype.name, **writer.close(keep_targets=kind == "records")}


def _encode_texts(texts: Iterator[str], tokenizer: Any, writer: TokenWriter, *, targets: bool) -> bool:
    """Each text's ids then eos, in batches; whether any text was non-empty. targets: write the flags of a
    {"text"} record (every token but the first, which nothing precedes)."""
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    batch, size, any_text = [], 0, False
    for text in itertools.chain(texts, [None]):
        if text is not None:
            batch.append(text)
            size += len(text)
            any_text |= bool(text)
        if batch and (text is None or size >= _BATCH_CHARS):
            ids = [d + [tokenizer.eos_token_id] for d in encode_batch(batch)]
            writer.write(ids, [[False] + [True] * (len(d) - 1) for d in ids] if targets else None)
            batch, size = [], 0
    return any_text


def _encode_records(records: Iterator[Any], tokenizer: Any, writer: TokenWriter, encoder: Any) -> tuple[str, bool]:
    """("records" if any record is a chat or prompt/completion, else "text"; whether any text was non-empty).
    Runs of {"text"} records are batched: their tokens are the same whichever kind the file turns out to be."""
    structured, any_text, texts = False, False, []
    for index, record in enumerate(itertools.chain(records, [None])):
        if record is not None and encoder.format(record, index) == "text" and isinstance(record["text"], str):
            texts.append(record["text"])
            continue
        any_text |= _encode_texts(iter(texts), tokenizer, writer, targets=True)
        texts = []
        if record is None:
            break
        structured = True
        sample = encoder(record, index)
        writer.write([sample.input_ids], [[label != IGNORE_INDEX for label in sample.labels]])
    if not writer.lengths:
        raise ValueError(f"dataset {encoder.name} is empty: it has no records to train on")
    return ("records" if structured else "text"), any_text or structured
