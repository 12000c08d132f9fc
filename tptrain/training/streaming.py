"""Streaming text: documents read from parquet / arrow / jsonl shards while training, packed on the fly.

    data = StreamingText("corpus/*.parquet", text_column="text")   # a directory, a file, a glob or a list of files
    Trainer(model=model, args=TrainingArguments(output_dir="run", max_steps=1000), train_dataset=data).train()

    tptrain train --model ./ckpt --data 'corpus/*.parquet' --streaming --max-steps 1000

Nothing is copied or tokenized ahead: the files are read in order (a directory's or a glob's files sorted by
path, a list's as given; rows in file order), each document is tokenized when it is reached and joined to the
next with eos, and the token stream is cut into blocks of `seq_len`, exactly as `PackedDataset` cuts the same
documents. A step takes the next `global_batch` blocks and dp rank r keeps the r-th contiguous share (as
`DataOrder` does), so the batches do not depend on the dp size and the ranks agree without talking. The cost of
that: every rank reads and tokenizes the whole stream (dp times the I/O and tokenizer work of reading only its
share), which is small next to a training step. When the files run out, the last partial global batch (and the
tokens of a partial block) is dropped and the next epoch starts again from the first file, as `DataOrder` skips
a partial batch; streams do not shuffle.

The position in the stream (epoch, file, row, and how many tokens of that row's document are already in
blocks) is `StreamOrder.state_dict()`, saved in the resumable checkpoint's trainer state, so a run stopped at
step N and resumed trains on the same batches as an uninterrupted one, at any dp size. Since a block always
ends inside the last document read, the carried-over tokens are that document's tail: it is re-read and
re-tokenized on resume instead of being saved.

parquet and arrow files are read with pyarrow (`pip install datasets`, or `pip install pyarrow`); jsonl needs
nothing. Hub dataset ids are not streamed: download the repository (`huggingface-cli download --repo-type
dataset ID --local-dir DIR`) and pass DIR.
"""
from __future__ import annotations

import glob
import hashlib
import importlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from tptrain.io import jsonl_records
from tptrain.training.data import check_dp_split

SUFFIXES = (".parquet", ".arrow", ".jsonl")
_READ_ROWS = 1024  # rows per pyarrow batch
_ENCODE_CHUNK = 256  # documents per tokenizer call


@dataclass(frozen=True)
class StreamingText:
    """Plain-text documents streamed from files (see the module docstring).

    source: a directory (its .parquet/.arrow/.jsonl files, recursively), one file, a glob, or a list of files.
    text_column: the column (parquet, arrow) or key (jsonl) holding each document's text.
    """

    source: str | Path | Sequence[str | Path]
    text_column: str = "text"

    def files(self) -> list[Path]:
        """The files, in stream order; ValueError / FileNotFoundError when there is none to read."""
        if isinstance(self.source, (list, tuple)):
            files = [Path(p).expanduser() for p in self.source]
            for path in files:
                if not path.is_file():
                    raise FileNotFoundError(f"streaming data: {path} (in the list given) is not a file")
        else:
            files = _resolve(str(Path(self.source).expanduser()))
        for path in files:
            if path.suffix not in SUFFIXES:
                raise ValueError(f"streaming data: {path} is not a {'/'.join(SUFFIXES)} file")
        return files

    def check(self) -> None:
        """Fails fast on what a user can get wrong, before training: no files, a missing column, no text."""
        files = self.files()
        for _ in _documents(files, self.text_column, 0, 0):
            return
        raise ValueError(f"streaming data {self.source} is empty: its {len(files)} file(s) hold no text in column "
                         f"{self.text_column!r}")

    def bind(self, tokenizer: Any, seq_len: int) -> TextStream:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2 (a block needs an input and a next token), got {seq_len!r}")
        return TextStream(self, self.files(), tokenizer, seq_len)


def _resolve(source: str) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            found = sorted({p.suffix or p.name for p in path.rglob("*") if p.is_file()})
            raise ValueError(f"streaming data: directory {path} has no {'/'.join(SUFFIXES)} file (found: "
                             f"{', '.join(found) or 'nothing'}); pass a directory of parquet, arrow or jsonl shards")
        return files
    if path.is_file():
        return [path]
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"streaming data: the pattern {source} matches no file")
        return files
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):  # org/name: a hub dataset id
        from tptrain.io.hub import resolve_dataset

        return _resolve(str(resolve_dataset(source)))
    raise FileNotFoundError(f"streaming data: {source} does not exist (a local directory, file or glob of "
                            f"{'/'.join(SUFFIXES)} shards, or a hub dataset id org/name)")


def fingerprint(files: list[Path]) -> str:
    """Identifies the data by file names and sizes (not their directory, so a moved copy resumes)."""
    listing = json.dumps([(p.name, p.stat().st_size) for p in files])
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- reading rows

def _pyarrow(module: str, path: Path) -> Any:
    try:
        return importlib.import_module(f"pyarrow.{module}")
    except ImportError:
        raise ImportError(f"streaming {path.suffix} files ({path}) needs pyarrow: `pip install datasets` (which "
                          "installs it) or `pip install pyarrow`; jsonl files stream without it") from None


def _column_error(path: Path, columns: list[str], column: str) -> ValueError:
    return ValueError(f"streaming data: {path} has no column {column!r} (its columns: {', '.join(columns)}); "
                      "pass text_column= (--text-column) naming the text column")


def _parquet_rows(path: Path, column: str, start: int) -> Iterator[Any]:
    parquet = _pyarrow("parquet", path)
    file = parquet.ParquetFile(path)
    if column not in file.schema_arrow.names:
        raise _column_error(path, file.schema_arrow.names, column)
    groups, skip = [], start  # whole row groups before `start` are skipped from the footer, unread
    for g in range(file.num_row_groups):
        rows = file.metadata.row_group(g).num_rows
        if skip >= rows and not groups:
            skip -= rows
        else:
            groups.append(g)
    for batch in file.iter_batches(batch_size=_READ_ROWS, row_groups=groups, columns=[column]) if groups else ():
        values = batch.column(0).to_pylist()
        yield from values[skip:]
        skip = max(0, skip - len(values))


def _arrow_rows(path: Path, column: str, start: int) -> Iterator[Any]:
    ipc = _pyarrow("ipc", path)
    pyarrow = importlib.import_module("pyarrow")
    source = pyarrow.memory_map(str(path))
    try:  # `datasets.save_to_disk` writes the IPC stream format; pyarrow's writers also the file format
        reader = ipc.open_stream(source)
        batches = iter(reader)
    except pyarrow.ArrowInvalid:
        reader = ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    if column not in reader.schema.names:
        raise _column_error(path, reader.schema.names, column)
    skip = start
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield from batch.column(column).to_pylist()[skip:]
        skip = 0


def _jsonl_rows(path: Path, column: str, start: int) -> Iterator[Any]:
    """One row per non-blank line (as data.py reads jsonl)."""
    for _, record in jsonl_records(path, start=start):
        if not isinstance(record, dict) or column not in record:
            keys = sorted(record) if isinstance(record, dict) else [type(record).__name__]
            raise _column_error(path, keys, column)
        yield record[column]


_READERS = {".parquet": _parquet_rows, ".arrow": _arrow_rows, ".jsonl": _jsonl_rows}


def _documents(files: list[Path], column: str, file: int, row: int) -> Iterator[tuple[int, int, str]]:
    """(file index, row, text) of every non-empty document from `files[file]` row `row` on."""
    for f in range(file, len(files)):
        path = files[f]
        for r, text in enumerate(_READERS[path.suffix](path, column, row if f == file else 0),
                                 start=row if f == file else 0):
            if not isinstance(text, str):
                raise ValueError(f"streaming data: {path} row {r}: {column!r} is {type(text).__name__}, not a "
                                 "string")
            if text:
                yield f, r, text


# ---------------------------------------------------------------------------------------------- blocks and order

@dataclass(frozen=True)
class Cursor:
    """Where a stream resumes: document (file, row), of whose tokens (eos included) `offset` are in blocks."""

    file: int = 0
    row: int = 0
    offset: int = 0


class TextStream:
    """A StreamingText bound to a tokenizer and seq_len: the blocks, and the order the Trainer takes them in."""

    def __init__(self, spec: StreamingText, files: list[Path], tokenizer: Any, seq_len: int) -> None:
        self.spec, self.files, self.tokenizer, self.seq_len = spec, files, tokenizer, seq_len
        self.name = str(spec.source)
        self.fingerprint = fingerprint(files)  # once: every checkpoint saves it

    def blocks(self, start: Cursor = Cursor()) -> Iterator[tuple[torch.Tensor, Cursor]]:
        """One pass from `start`: each (seq_len,) block with the cursor just after it."""
        buffer: list[int] = []
        skip = start.offset
        for f, r, ids in self._tokenized(start.file, start.row):
            buffer.extend(ids[skip:])
            skip = 0
            while len(buffer) >= self.seq_len:
                block, buffer = buffer[:self.seq_len], buffer[self.seq_len:]
                # Before this document the buffer held < seq_len tokens, so what is left is this document's tail.
                yield torch.tensor(block, dtype=torch.long), Cursor(f, r, len(ids) - len(buffer))

    def _tokenized(self, file: int, row: int) -> Iterator[tuple[int, int, list[int]]]:
        eos = self.tokenizer.eos_token_id
        encode = getattr(self.tokenizer, "encode_batch", None) or (lambda ts: [self.tokenizer.encode(t) for t in ts])
        chunk: list[tuple[int, int, str]] = []
        for document in _documents(self.files, self.spec.text_column, file, row):
            chunk.append(document)
            if len(chunk) == _ENCODE_CHUNK:
                yield from self._encode(chunk, encode, eos)
                chunk = []
        yield from self._encode(chunk, encode, eos)

    @staticmethod
    def _encode(chunk: list[tuple[int, int, str]], encode: Any, eos: int) -> Iterator[tuple[int, int, list[int]]]:
        ids = encode([text for _, _, text in chunk]) if chunk else []
        for (f, r, _), tokens in zip(chunk, ids):
            yield f, r, list(tokens) + [eos]

    def order(self, *, dp_rank: int, dp_size: int, global_batch: int) -> StreamOrder:
        """The Trainer's data order for this stream."""
        return StreamOrder(self, dp_rank=dp_rank, dp_size=dp_size, global_batch=global_batch)


class StreamOrder:
    """This dp rank's rows, step by step, from a TextStream; `DataOrder`'s interface, except that
    `next_batch()` returns the rows themselves (this rank's (seq_len,) blocks) rather than indices."""

    def __init__(self, stream: TextStream, *, dp_rank: int, dp_size: int, global_batch: int) -> None:
        check_dp_split("StreamOrder", dp_rank=dp_rank, dp_size=dp_size, global_batch=global_batch)
        self.stream, self.global_batch = stream, global_batch
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.epoch, self.steps_in_epoch, self.cursor = 0, 0, Cursor()
        self._blocks: Iterator[tuple[torch.Tensor, Cursor]] | None = None

    def next_batch(self) -> list[torch.Tensor]:
        """This dp rank's blocks for the next step (the rest of the global batch is read and dropped)."""
        if self._blocks is None:
            self._blocks = self.stream.blocks(self.cursor)
        taken = list(itertools.islice(self._blocks, self.global_batch))
        if len(taken) < self.global_batch:  # the files ran out: the partial batch is dropped, a new epoch starts
            self._end_epoch(len(taken))
            return self.next_batch()
        self.steps_in_epoch += 1
        self.cursor = taken[-1][1]  # a resume starts right after this step's last block
        start = self.dp_rank * self.local_batch
        return [block for block, _ in taken[start:start + self.local_batch]]

    def _end_epoch(self, left: int) -> None:
        if self.steps_in_epoch == 0:
            blocks = "no block" if left == 0 else f"only {left} block(s)"
            raise ValueError(f"streaming data {self.stream.name} gives {blocks} of seq_len={self.stream.seq_len} "
                             f"tokens, but one step needs a global batch of {self.global_batch}; add data, lower "
                             "the batch size, or lower seq_len")
        self.epoch, self.steps_in_epoch, self.cursor, self._blocks = self.epoch + 1, 0, Cursor(), None

    def state_dict(self) -> dict[str, Any]:
        c = self.cursor
        return {"epoch": self.epoch, "steps_in_epoch": self.steps_in_epoch, "file": c.file, "row": c.row,
                "offset": c.offset, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" not in state:
            raise ValueError("cannot resume the data stream: the checkpoint's data order is not a stream's (that run "
                             "read its data into memory); resume it without StreamingText / --streaming")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(f"cannot resume the data stream: the checkpoint was saved with {key}="
                                 f"{state.get(key)!r} but this run has {key}={value!r}; resume with the same "
                                 "streaming files (names and sizes), text column, seq_len and global batch size")
        self.epoch, self.steps_in_epoch = int(state["epoch"]), int(state["steps_in_epoch"])
        self.cursor, self._blocks = Cursor(int(state["file"]), int(state["row"]), int(state["offset"])), None

    def _identity(self) -> dict[str, Any]:
        """What a saved position is only valid for (the dp size is not: batches do not depend on it)."""
        s = self.stream
        return {"stream": s.fingerprint, "text_column": s.spec.text_column, "seq_len": s.seq_len,
                "global_batch": self.global_batch}


def as_stream(source: StreamingText | TextStream, tokenizer: Any, seq_len: int) -> TextStream:
    """`source` bound to `tokenizer` and `seq_len`; a TextStream already bound must have this seq_len."""
    if isinstance(source, StreamingText):
        return source.bind(tokenizer, seq_len)
    if source.seq_len != seq_len:
        raise ValueError(f"the TextStream given cuts blocks of {source.seq_len} tokens but seq_len={seq_len} was "
                         "asked for; bind it with the same seq_len, or pass the StreamingText")
    return source


def check_streaming(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """The Trainer's arguments a stream cannot serve (its length is unknown until it is read)."""
    if isinstance(eval_dataset, (StreamingText, TextStream)):
        raise ValueError("eval_dataset cannot be a StreamingText: evaluation reads the whole set every time; pass "
                         "the eval files as a path or list (read into memory)")
    if not isinstance(train_dataset, (StreamingText, TextStream)):
        return
    if args.num_train_epochs is not None:
        raise ValueError("a StreamingText (--streaming) has no known length, so num_train_epochs (--num-epochs cannot "
                         "be used with it) cannot be turned into steps; set max_steps (--max-steps)")
    if args.eval_split:
        raise ValueError("eval_split (--eval-split) cannot hold out rows of a StreamingText (--streaming); pass "
                         "an eval set of its own (eval_dataset, --eval-data)")
