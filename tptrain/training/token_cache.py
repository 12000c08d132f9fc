"""The token cache: a data file tokenized once, on one rank per node, into files every rank maps read-only.

    store = open_or_build(Path("corpus.txt"), tokenizer, cache_dir=None, options={}, encoder=None)
    blocks = PackedDataset(store.tokens, 128)      # views of the memory map: no copy, constant memory per rank

The store (Megatron's indexed dataset, not `datasets`' Arrow cache: `datasets` is only a test dependency,
and a flat array of ids plus an offsets index is all that packing needs; numpy maps it with no copy and
no schema) is one directory per key under the cache root ($TPTRAIN_CACHE, `--data-cache DIR` /
TrainingArguments.data_cache_dir, default ~/.cache/tptrain/data):
    tokens.bin    every document's ids, one after another (uint16 when the tokenizer has <= 65536 ids, else
                  uint32); plain text: each document followed by eos, the stream PackedDataset cuts
    targets.bin   instruction records only: 1 where a token is a target (its label), 0 where the label is -100
    offsets.npy   (documents + 1,) int64: where each document or record starts
    meta.json     the key, what it was made from, the counts and the largest id: written last, it marks the
                  store complete
Blocks and rows are cut at seq_len when they are read, so seq_len, packing and truncation are not in the key.
The key hashes (blake2b) the file's bytes (streamed; size and mtime are not enough), the tokenizer's file (or
"bytes") and eos id, the format version, and for .jsonl files the chat template's text and assistant_only_loss:
a changed file, tokenizer or format is a new key and a new store, never a reuse. meta.json is checked against
the key and the files' sizes on every load.

A store is written into a hidden temporary directory, fsynced, and renamed into place; any failure (a full
disk, a bad record, Ctrl-C) removes the temporary directory, so nothing that looks complete is left. Local
rank 0 (LOCAL_RANK) of each node builds it; the node's other ranks poll for it and fail with rank 0's error
(a status file beside the store) or when rank 0 died, so this works before any process group exists. A
cache root that cannot be written: an explicit one (flag, field, $TPTRAIN_CACHE) is an error naming it; the
default (e.g. a read-only HOME) falls back to tokenizing in memory on every rank, with a message.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tptrain.io import fsync_path
from tptrain.io.writer import write_synced
from tptrain.training.token_stream import OFFSETS, TARGETS, TOKENS, tokenize_file

CACHE_ENV = "TPTRAIN_CACHE"
DEFAULT_ROOT = "~/.cache/tptrain/data"
FORMAT_VERSION = 1
_MOVE_IT = f"move it with --data-cache DIR (TrainingArguments.data_cache_dir, ${CACHE_ENV})"
_USER_ERRORS = {e.__name__: e for e in (ValueError, TypeError, OSError, FileNotFoundError)}
_BUILDER_GRACE = 600.0  # seconds a waiting rank gives local rank 0 to start building before giving up


@dataclass
class Store:
    """A complete store, mapped read-only."""

    directory: Path
    meta: dict[str, Any]
    tokens: np.ndarray  # (num_tokens,) uint16 / uint32 memory map
    targets: np.ndarray | None  # (num_tokens,) bool memory map; records only
    offsets: np.ndarray  # (num_documents + 1,) int64

    @property
    def key(self) -> str:
        return self.meta["key"]


def cache_root(cache_dir: str | os.PathLike | None) -> tuple[Path, bool]:
    """(the cache root, whether the user chose it)."""
    chosen = cache_dir or os.environ.get(CACHE_ENV)
    return Path(chosen or DEFAULT_ROOT).expanduser(), bool(chosen)


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """What the tokenizer's ids depend on: its file's hash (or "bytes"); None when it cannot be named."""
    path = getattr(tokenizer, "path", None)
    if path is not None and Path(path).is_file():
        return f"{Path(path).name}:{file_digest(Path(path))}"
    if type(tokenizer).__name__ == "ByteTokenizer":
        return "bytes"
    return None


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(path: Path, tokenizer: Any, options: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(key, what it hashes), or None when the tokenizer cannot be fingerprinted (then nothing is cached)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    parts = {"version": FORMAT_VERSION, "data": file_digest(path), "kind": "jsonl" if path.suffix == ".jsonl" else
             "text", "tokenizer": fingerprint, "eos": tokenizer.eos_token_id, "vocab": tokenizer.vocab_size,
             "options": options}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest(), parts


def open_store(directory: Path, key: str) -> tuple[Store | None, str | None]:
    """(the store, None) when `directory` holds a complete store of `key`; (None, why not) otherwise."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except FileNotFoundError:
        return None, "absent"
    except (OSError, ValueError) as exc:
        return None, f"unreadable meta.json ({exc})"
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("version") != FORMAT_VERSION:
        return None, "meta.json names another key or format version"
    try:
        n, dtype = meta["num_tokens"], np.dtype(meta["dtype"])
        sizes = {TOKENS: n * dtype.itemsize, **({TARGETS: n} if meta["kind"] == "records" else {})}
        for name, size in sizes.items():
            actual = (directory / name).stat().st_size if (directory / name).is_file() else None
            if actual != size:
                return None, f"{name} has {actual} bytes, meta.json says {size}"
        offsets = np.load(directory / OFFSETS, mmap_mode="r")
        if offsets.shape != (meta["num_documents"] + 1,) or int(offsets[-1]) != n:
            return None, f"{OFFSETS} does not match meta.json"
    except (KeyError, TypeError, ValueError, OSError) as exc:  # fields missing, a damaged offsets.npy
        return None, f"damaged ({type(exc).__name__}: {exc})"
    tokens = np.memmap(directory / TOKENS, dtype=dtype, mode="r", shape=(n,))
    targets = np.memmap(directory / TARGETS, dtype=bool, mode="r", shape=(n,)) if TARGETS in sizes else None
    return Store(directory, meta, tokens, targets, offsets), None


def open_or_build(path: Path, tokenizer: Any, *, cache_dir: str | os.PathLike | None, options: dict[str, Any],
                  encoder: Any, vocab_size: int | None = None) -> Store | None:
    """The store of `path` (built by local rank 0 on a miss); None when it is not cached (a tokenizer without
    a fingerprint, or the default root not writable): then the caller tokenizes in memory."""
    root, chosen = cache_root(cache_dir)
    keyed = cache_key(path, tokenizer, options)
    builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if keyed is None:
        _say(builder, f"data cache: off ({type(tokenizer).__name__} has no tokenizer file to key the cache by); "
                      "tokenizing in memory")
        return None
    key, parts = keyed
    directory = root / f"{path.stem}-{key}"
    store, why = open_store(directory, key)
    if store is None:
        error = _unwritable(root)
        if error and chosen:
            raise OSError(f"data cache directory {root} cannot be written ({error}); {_MOVE_IT}")
        if error:
            _say(builder, f"data cache: {root} cannot be written ({error}); tokenizing in memory on every rank "
                          f"instead ({_MOVE_IT} to cache)")
            return None
        store = _build(directory, key, path, tokenizer, parts, encoder, why) if builder else _wait(directory, key)
    else:
        _say(builder, f"data cache: hit {directory}")
    check_vocab(store, vocab_size)
    return store


def check_vocab(store: Store, vocab_size: int | None) -> None:
    largest = store.meta["max_id"]
    if vocab_size is not None and largest >= vocab_size:
        raise ValueError(f"data cache {store.directory}: the data's largest token id is {largest} (tokenizer "
                         f"{store.meta['tokenizer']}), but the model's vocab_size is {vocab_size}, so its embedding "
                         "cannot hold it; tokenize with the model's own tokenizer")


def _say(builder: bool, message: str) -> None:
    if builder:
        print(message, flush=True)


def _unwritable(root: Path) -> str | None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if os.access(root, os.W_OK | os.X_OK) else "permission denied"


def _build(directory: Path, key: str, path: Path, tokenizer: Any, parts: dict[str, Any], encoder: Any,
           why: str) -> Store:
    """Tokenize `path` into a temporary directory and publish it as `directory` (local rank 0)."""
    status = _status_file(directory)
    if why != "absent":
        print(f"data cache: {directory} is not a complete store of this key ({why}); rebuilding it", flush=True)
    print(f"data cache: miss (tokenizing {path.name}, {path.stat().st_size / 1e6:,.0f} MB) -> {directory}",
          flush=True)
    _write_status(status, state="building")
    prefix = f".{directory.name}.tmp-{socket.gethostname()}-"
    tmp = directory.parent / f"{prefix}{os.getpid()}"
    try:
        for stale in directory.parent.glob(f"{prefix}*"):  # left by a build on this host that was killed
            if not _alive(int(stale.name[len(prefix):])):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        stats = tokenize_file(path, tmp, tokenizer, encoder=encoder, show_progress=True)
        meta = {"key": key, "version": FORMAT_VERSION, "source": str(path),
                "source_bytes": path.stat().st_size, "tokenizer": parts["tokenizer"], "parts": parts, **stats}
        write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        for name in (TOKENS, TARGETS, OFFSETS):
            if (tmp / name).exists():
                fsync_path(tmp / name)
        _publish(tmp, directory)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            exc = OSError(errno.ENOSPC, f"data cache: no space left on the device while writing {tmp} (removed); "
                                        f"free space or {_MOVE_IT}")
        _write_status(status, state="failed", type=type(exc).__name__, error=str(exc))
        raise exc from None
    status.unlink(missing_ok=True)
    store, why = open_store(directory, key)
    assert store is not None, f"the store just written does not verify: {why}"
    return store


def _publish(tmp: Path, directory: Path) -> None:
    """Rename `tmp` into place; an incomplete or stale `directory` is moved aside first. Another node that
    published the same key first (a shared filesystem) wins: the same bytes, so `tmp` is dropped."""
    fsync_path(tmp)
    if directory.exists():
        stale = directory.parent / f".{directory.name}.stale-{os.getpid()}"
        os.rename(directory, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, directory)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_path(directory.parent)


def _wait(directory: Path, key: str) -> Store:
    """Poll until local rank 0 has published the store; its failure, or its death, raised here."""
    status, start, delay = _status_file(directory), time.monotonic(), 0.05
    while True:
        store, _ = open_store(directory, key)
        if store is not None:
            return store
        state = _read_status(status)
        if state.get("state") == "failed":  # rank 0's error as it is: the launcher reports it once for all
            error = _USER_ERRORS.get(state["type"])
            raise error(state["error"]) if error else RuntimeError(
                f"local rank 0 could not build the data cache {directory}: {state['type']}: {state['error']}")
        if state.get("state") == "building" and not _alive(state["pid"]):
            raise RuntimeError(f"local rank 0 (pid {state['pid']}) died while building the data cache {directory}; "
                               "run again (nothing partial was kept), or build it first with `tptrain prepare-data`")
        if not state and time.monotonic() - start > _BUILDER_GRACE:
            raise TimeoutError(f"waited {_BUILDER_GRACE:.0f} s for local rank 0 to build the data cache {directory}, "
                               f"and it never started (no {status.name})")
        time.sleep(delay)
        delay = min(2.0, delay * 2)


def _status_file(directory: Path) -> Path:
    """Where local rank 0 tells this node's other ranks of this launch how the build goes: named by host,
    launcher (parent pid), MASTER_PORT and restart, so a status left by another launch is never read."""
    launch = "-".join([socket.gethostname(), str(os.getppid()), os.environ.get("MASTER_PORT", "0"),
                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")])
    return directory.parent / f".{directory.name}.{launch}.status"


def _write_status(status: Path, **state: Any) -> None:
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < 2:  # nobody reads it in a one-process run
        return
    tmp = status.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"pid": os.getpid(), **state}))
        os.replace(tmp, status)
    except OSError:  # a full disk: the waiting ranks still see this pid die, and the error is raised here
        tmp.unlink(missing_ok=True)


def _read_status(status: Path) -> dict[str, Any]:
    try:
        return json.loads(status.read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
