"""Tokenize a data file into the token cache's files, reading it in pieces (training/token_cache.py owns the store).

    stats = tokenize_share(Path("corpus.txt"), part, tokenizer, encoder=None, share=Share(0, 1, size))
    stats = merge_parts(directory, [stats, ...], kind=stats["kind"])      # the parts, in rank order, as one store

A text file is read 8 MB at a time and split at document breaks as `data.read_documents` splits it (a
piece ends after the last break that more text cannot extend), so only a batch of documents is held at
once. A .jsonl file is read line by line. Each local rank reads the whole file (reading is ~100x faster than
tokenizing) and tokenizes its `Share`: the documents (records) that start in its r-th of the file's bytes, in
file order, into a part of its own. Documents are cut into pieces of about 64K characters where the tokenizer
guarantees the same ids (training/token_pieces.py) and the pieces of about 4 MB of text encoded at once
(`encode_batch`: the tokenizers library's threads). The parts joined in rank order are the ids, target flags
and offsets a single process writes, byte for byte: exactly those of the in-memory path.
"""
from __future__ import annotations

import codecs
import itertools
import os
import shutil
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tptrain.losses import IGNORE_INDEX
from tptrain.io import jsonl_records, utf8_error
from tptrain.training.data import DOCUMENT_BREAK
from tptrain.training.token_pieces import Cutter, piece_cutter

TOKENS, TARGETS, OFFSETS, LENGTHS = "tokens.bin", "targets.bin", "offsets.npy", "lengths.npy"
_READ_BYTES = 8 << 20
_BATCH_CHARS = 4 << 20
_PIECE_CHARS = 1 << 16


@dataclass(frozen=True)
class Share:
    """Local rank `rank` of `ranks` tokenizes the documents (records) starting in its `rank`-th of the file's
    `size` bytes."""

    rank: int
    ranks: int
    size: int

    def owns(self, position: int) -> bool:
        return position * self.ranks // max(1, self.size) == self.rank


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

    def close(self) -> dict[str, Any]:
        """Flush the files and write the tokens per document (the store's offsets come from them)."""
        self.close_files()
        np.save(self.directory / LENGTHS, np.array(self.lengths, dtype=np.int64))
        return {"dtype": self.dtype.name, "num_tokens": self.num_tokens, "max_id": self.max_id}


def tokenize_share(path: Path, directory: Path, tokenizer: Any, *, encoder: Any, share: Share,
                   check: Callable[[], None] = lambda: None, show_progress: bool = False) -> dict[str, Any]:
    """Write the ids of `share`'s documents (records) of `path` into `directory` (tokens.bin, targets.bin for a
    .jsonl file, lengths.npy); {"kind": "text" | "records", "dtype", "num_tokens", "max_id"}. The kind and the
    emptiness checks are the whole file's, the same on every rank. encoder: a `sft_data.SampleEncoder` for a
    .jsonl file (a preference PreferenceEncoder: two samples a record; None for plain text). `check` runs before
    each batch (another rank's failure raised there)."""
    from tqdm import tqdm

    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    directory.mkdir()
    writer = TokenWriter(directory, dtype, targets=encoder is not None)
    encode = _Encoder(tokenizer, writer, piece_cutter(tokenizer), check)
    start = time.perf_counter()
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"tokenizing {path.name}",
              file=sys.stderr, disable=not show_progress, mininterval=1.0) as bar:
        writer.on_write = lambda: bar.set_postfix_str(
            f"{writer.num_tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
        try:
            if encoder is None:
                seen = [0]
                encode.texts(_text_share(path, share, bar.update, seen), targets=False)
                kind, any_text = "text", seen[0] > 0
            else:
                kind, any_text = _encode_records(_record_share(path, share, bar.update), encode, encoder)
        finally:  # on an error too: the caller removes the directory
            writer.close_files()
    if kind == "text" and not any_text:
        raise ValueError(f"dataset {path} is empty: it has no text to train on")
    return {"kind": kind, **writer.close()}


def _text_share(path: Path, share: Share, progress: Callable[[int], None], seen: list[int]) -> Iterator[str]:
    """The documents of `share`, counting every document of the file in `seen`."""
    position = 0  # the documents' bytes before this one
    for document in text_documents(path, progress):
        seen[0] += 1
        if share.owns(position):
            yield document
        position += len(document) if document.isascii() else len(document.encode("utf-8"))


def _record_share(path: Path, share: Share, progress: Callable[[int], None]) -> Iterator[tuple[bool, Any]]:
    """(whether `share` holds it, record) of every record of a .jsonl file, by its line's last byte."""
    end = [0]

    def count(n: int) -> None:
        end[0] += n
        progress(n)

    for _, record in jsonl_records(path, count):
        yield share.owns(end[0] - 1), record


class _Encoder:
    """Texts to ids in batches, each text cut into pieces where `cut` (token_pieces) allows, its ids then eos."""

    def __init__(self, tokenizer: Any, writer: TokenWriter, cut: Cutter | None, check: Callable[[], None]) -> None:
        self.tokenizer, self.writer, self.cut, self.check = tokenizer, writer, cut, check
        self.encode_batch = getattr(tokenizer, "encode_batch", None) or (
            lambda texts: [tokenizer.encode(t) for t in texts])

    def texts(self, texts: Iterable[str], *, targets: bool) -> None:
        """targets: write the flags of {"text"} records (every token but the first, which nothing precedes)."""
        pieces, counts, size = [], [], 0
        for text in itertools.chain(texts, [None]):
            if text is not None:
                cut = [text] if self.cut is None else self.cut(text, _PIECE_CHARS)
                pieces += cut
                counts.append(len(cut))
                size += len(text)
            if counts and (text is None or size >= _BATCH_CHARS):
                self.check()
                encoded = iter(self.encode_batch(pieces))
                eos = [self.tokenizer.eos_token_id]
                ids = [list(itertools.chain.from_iterable(next(encoded) for _ in range(n))) + eos for n in counts]
                self.writer.write(ids, [[False] + [True] * (len(d) - 1) for d in ids] if targets else None)
                pieces, counts, size = [], [], 0

    def sample(self, sample: Any) -> None:
        """One record's sample, or its samples side by side (a preference pair: chosen, rejected)."""
        samples = sample if isinstance(sample, tuple) else (sample,)
        self.writer.write([s.input_ids for s in samples], [[label != IGNORE_INDEX for label in s.labels]
                                                           for s in samples])


def _encode_records(records: Iterator[tuple[bool, Any]], encode: _Encoder, encoder: Any) -> tuple[str, bool]:
    """("records" if any record of the file is a chat or prompt/completion, else "text"; whether it has any text).
    Runs of {"text"} records are batched: their tokens are the same whichever kind the file turns out to be."""
    structured, any_text, texts, count = False, False, [], 0
    for index, (mine, record) in enumerate(itertools.chain(records, [(False, None)])):
        if record is not None and encoder.format(record, index) == "text" and isinstance(record["text"], str):
            any_text |= bool(record["text"])
            if mine:
                texts.append(record["text"])
            continue
        encode.texts(texts, targets=True)
        texts = []
        if record is None:
            count = index
            break
        structured = True
        if mine:
            encode.sample(encoder(record, index))
    if not count:
        raise ValueError(f"dataset {encoder.name} is empty: it has no records to train on")
    return ("records" if structured else "text"), any_text or structured


def merge_parts(directory: Path, parts: list[dict[str, Any]], *, kind: str) -> dict[str, Any]:
    """Join the parts `tokenize_share` wrote into directory/part-<rank> (`parts`: their stats, in rank order)
    into the store's tokens.bin, targets.bin (records only) and offsets.npy; the parts are removed."""
    dirs = [directory / f"part-{rank}" for rank in range(len(parts))]
    for name in (TOKENS, TARGETS) if kind == "records" else (TOKENS,):
        os.replace(dirs[0] / name, directory / name)  # rank 0's part starts the file: only the others are copied
        with open(directory / name, "ab") as out:
            for part in dirs[1:]:
                with open(part / name, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
    lengths = np.concatenate([np.load(part / LENGTHS) for part in dirs])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(directory / OFFSETS, offsets)
    for part in dirs:
        shutil.rmtree(part)
    return {"kind": kind, "dtype": parts[0]["dtype"], "num_tokens": int(offsets[-1]), "num_documents": len(lengths),
            "max_id": max(p["max_id"] for p in parts)}
