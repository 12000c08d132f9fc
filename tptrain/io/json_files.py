"""JSON and JSON Lines files, read with errors that name the file (and the line): config.json,
tokenizer_config.json, a checkpoint's index, data records. No torch: a config is read before torch is imported.

    config = read_json(directory / "config.json")               # a dict; ValueError naming the file and line
    for number, record in jsonl_records(Path("chat.jsonl")):    # one parsed line at a time, blank lines skipped
        ...
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def read_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`. ValueError naming the file (and the line) when it is not UTF-8, not JSON or not
    an object; FileNotFoundError when it does not exist."""
    path = Path(path)
    data = path.read_bytes()
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid UTF-8: byte offset {exc.start} cannot be decoded ({exc.reason})"
                         ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} line {exc.lineno} is not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object ({{...}})")
    return value


def jsonl_records(path: Path, progress: Callable[[int], None] = lambda n: None, *,
                  start: int = 0) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) of each non-blank line of a .jsonl file from the `start`-th on (the ones before
    are counted, not parsed), read a line at a time; `progress` gets each line's bytes. ValueError naming the file
    and line (or byte offset, for a file that is not UTF-8)."""
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


def utf8_error(path: Path, exc: UnicodeDecodeError, offset: int) -> ValueError:
    """The error for a data file that is not UTF-8; `offset`: the bad byte's offset in the file."""
    return ValueError(f"dataset file {path} is not valid UTF-8: byte offset {offset} "
                      f"({exc.object[exc.start:exc.start + 4]!r}...) cannot be decoded ({exc.reason}). Convert "
                      f"the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`.")
