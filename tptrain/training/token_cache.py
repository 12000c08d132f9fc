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
disk, a bad record, Ctrl-C) removes the temporary directory, so nothing that looks complete is left. The local
ranks of each node (LOCAL_RANK of LOCAL_WORLD_SIZE) build it together, before any process group exists, through
files beside the store: local rank 0 makes the temporary directory and says so in a status file; every local rank
tokenizes its share of the file (token_stream.Share: the documents starting in its r-th of the bytes) into a part
there, with the node's cores split among them for the tokenizers library's threads (RAYON_NUM_THREADS, unless
set), and marks it done or failed (part-<r>.json); local rank 0 joins the parts in rank order (the bytes one
process writes) and publishes the store, which the others then map. A failure anywhere is raised on every local
rank: rank 0's (or its death) through the status file, another rank's (or its death) by rank 0, which then fails
the build with that error. A cache root that cannot be written: an explicit one (flag, field, $TPTRAIN_CACHE) is
an error naming it; the default (e.g. a read-only HOME) falls back to tokenizing in memory on every rank, with a
message.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tptrain.io import fsync_path
from tptrain.io.writer import write_synced
from tptrain.training.token_stream import OFFSETS, TARGETS, TOKENS, Share, merge_parts, tokenize_share

CACHE_ENV = "TPTRAIN_CACHE"
DEFAULT_ROOT = "~/.cache/tptrain/data"
FORMAT_VERSION = 1
_MOVE_IT = f"move it with --data-cache DIR (TrainingArguments.data_cache_dir, ${CACHE_ENV})"
_USER_ERRORS = {e.__name__: e for e in (ValueError, TypeError, OSError, FileNotFoundError)}
_BUILDER_GRACE = 600.0  # seconds a rank waits for another local rank to start its part before giving up


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
    rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    builder = rank == 0
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
        job = _Job(directory, key, path, tokenizer, encoder, parts, rank, ranks)
        store = _build(job, why) if builder else _wait(job)
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


@dataclass
class _Job:
    """One local rank's part in building the store of `key` in `directory`."""

    directory: Path
    key: str
    path: Path
    tokenizer: Any
    encoder: Any
    parts: dict[str, Any]  # what the key hashes
    rank: int
    ranks: int

    def tokenize(self, tmp: Path, *, check: Callable[[], None], show_progress: bool = False) -> dict[str, Any]:
        """This rank's share of the file into tmp/part-<rank>; its stats."""
        if self.ranks > 1:  # the node's cores shared out: the tokenizers library reads it when its threads start
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, cores // self.ranks)))
        return tokenize_share(self.path, tmp / f"part-{self.rank}", self.tokenizer, encoder=self.encoder,
                              share=Share(self.rank, self.ranks, self.path.stat().st_size), check=check,
                              show_progress=show_progress)


def _build(job: _Job, why: str) -> Store:
    """Tokenize local rank 0's share into a temporary directory, join the other ranks' parts and publish it."""
    directory, path = job.directory, job.path
    status = _status_file(directory)
    if why != "absent":
        print(f"data cache: {directory} is not a complete store of this key ({why}); rebuilding it", flush=True)
    print(f"data cache: miss (tokenizing {path.name}, {path.stat().st_size / 1e6:,.0f} MB) -> {directory}",
          flush=True)
    prefix = f".{directory.name}.tmp-{socket.gethostname()}-"
    tmp = directory.parent / f"{prefix}{os.getpid()}"
    try:
        for stale in directory.parent.glob(f"{prefix}*"):  # left by a build on this host that was killed
            if not _alive(int(stale.name[len(prefix):])):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        _write_status(status, job.ranks, state="building", tmp=tmp.name)
        stats = job.tokenize(tmp, check=lambda: _parts(job, tmp, wait=False), show_progress=True)
        others = _parts(job, tmp, wait=True)
        if others is None:  # another node published the same store first (a shared filesystem)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _finish(job, tmp, merge_parts(tmp, [stats, *others], kind=stats["kind"]))
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            exc = OSError(errno.ENOSPC, f"data cache: no space left on the device while writing {tmp} (removed); "
                                        f"free space or {_MOVE_IT}")
        # Said before the directory goes: a rank whose part write then fails finds this error, not its own
        _write_status(status, job.ranks, state="failed", type=type(exc).__name__, error=str(exc))
        shutil.rmtree(tmp, ignore_errors=True)
        raise exc from None
    status.unlink(missing_ok=True)
    return _opened(directory, job.key)


def _finish(job: _Job, tmp: Path, stats: dict[str, Any]) -> None:
    """meta.json (written last: it marks the store complete) and fsync of the joined store in `tmp`; publish it."""
    for marker in tmp.glob("part-*"):  # the parts' markers (their directories went with the join)
        marker.unlink()
    meta = {"key": job.key, "version": FORMAT_VERSION, "source": str(job.path), "source_bytes": job.path.stat().st_size,
            "tokenizer": job.parts["tokenizer"], "parts": job.parts, **stats}
    write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    for name in (TOKENS, TARGETS, OFFSETS):
        if (tmp / name).exists():
            fsync_path(tmp / name)
    _publish(tmp, job.directory)


def _opened(directory: Path, key: str) -> Store:
    store, why = open_store(directory, key)
    assert store is not None, f"the store just written does not verify: {why}"
    return store


def _parts(job: _Job, tmp: Path, *, wait: bool) -> list[dict[str, Any]] | None:
    """The other local ranks' part stats, in rank order (wait: until every part is done; None if the store was
    published meanwhile by another node). A rank's failure is raised here with its error; its death, or its not
    starting within the grace period, as a RuntimeError / TimeoutError naming it."""
    start, delay = time.monotonic(), 0.05
    while True:
        states = [_read_status(tmp / f"part-{rank}.json") for rank in range(1, job.ranks)]
        for rank, state in enumerate(states, 1):
            if state.get("state") == "failed":
                raise _error(state, f"local rank {rank} could not tokenize its share of {job.path}")
            if state.get("state") == "running" and not _alive(state["pid"]):
                raise RuntimeError(f"local rank {rank} (pid {state['pid']}) died while tokenizing its share of "
                                   f"{job.path} for the data cache {job.directory}; run again (nothing partial was kept)")
        if not wait or all(state.get("state") == "done" for state in states):
            return states
        if open_store(job.directory, job.key)[0] is not None:
            return None
        if not all(states) and time.monotonic() - start > _BUILDER_GRACE:
            missing = [rank for rank, state in enumerate(states, 1) if not state]
            raise TimeoutError(f"waited {_BUILDER_GRACE:.0f} s for local rank(s) {missing} to start their share of "
                               f"the data cache {job.directory}, and they never did")
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def _error(state: dict[str, Any], context: str) -> BaseException:
    """Another rank's error as it was (a user error reads the same on every rank), else a RuntimeError."""
    error = _USER_ERRORS.get(state["type"])
    return error(state["error"]) if error else RuntimeError(f"{context}: {state['type']}: {state['error']}")


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


def _wait(job: _Job) -> Store:
    """Poll until local rank 0 has published the store, tokenizing this rank's part once it has started; its
    failure, or its death, raised here."""
    status, start, delay, joined = _status_file(job.directory), time.monotonic(), 0.05, False
    while True:
        store, _ = open_store(job.directory, job.key)
        if store is not None:
            return store
        state = _read_status(status)
        _raise_failed(state, job.directory)
        if state.get("state") == "building" and not _alive(state["pid"]):
            raise RuntimeError(f"local rank 0 (pid {state['pid']}) died while building the data cache "
                               f"{job.directory}; run again (nothing partial was kept), or build it first with "
                               "`tptrain prepare-data`")
        if state.get("state") == "building" and "tmp" in state and 0 < job.rank < job.ranks and not joined:
            joined = True
            _tokenize_part(job, job.directory.parent / state["tmp"], status)
            continue
        if not state and time.monotonic() - start > _BUILDER_GRACE:
            raise TimeoutError(f"waited {_BUILDER_GRACE:.0f} s for local rank 0 to build the data cache "
                               f"{job.directory}, and it never started (no {status.name})")
        time.sleep(delay)
        delay = min(2.0, delay * 2)


def _raise_failed(state: dict[str, Any], directory: Path) -> None:
    """Local rank 0's failure as it was: the launcher reports it once for all ranks."""
    if state.get("state") == "failed":
        raise _error(state, f"local rank 0 could not build the data cache {directory}")


def _tokenize_part(job: _Job, tmp: Path, status: Path) -> None:
    """This rank's part, marked running, then done (its stats) or failed (its error, which rank 0 raises)."""
    marker = tmp / f"part-{job.rank}.json"
    _write_state(marker, state="running")
    try:
        stats = job.tokenize(tmp, check=lambda: _raise_failed(_read_status(status), job.directory))
    except BaseException as exc:
        _raise_failed(_read_status(status), job.directory)  # rank 0 failed first: its error, not this echo of it
        if open_store(job.directory, job.key)[0] is not None:  # another node published it: rank 0 dropped tmp
            return
        _write_state(marker, state="failed", type=type(exc).__name__, error=str(exc))
        raise
    _write_state(marker, state="done", **stats)


def _status_file(directory: Path) -> Path:
    """Where local rank 0 tells this node's other ranks of this launch how the build goes: named by host,
    launcher (parent pid), MASTER_PORT and restart, so a status left by another launch is never read."""
    launch = "-".join([socket.gethostname(), str(os.getppid()), os.environ.get("MASTER_PORT", "0"),
                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")])
    return directory.parent / f".{directory.name}.{launch}.status"


def _write_status(status: Path, ranks: int, **state: Any) -> None:
    if ranks > 1:  # nobody reads it in a one-process run
        _write_state(status, **state)


def _write_state(path: Path, **state: Any) -> None:
    """{"pid": this process, **state} into `path`, atomically."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"pid": os.getpid(), **state}))
        os.replace(tmp, path)
    except OSError:  # a full disk, a removed directory: the readers still see this pid die, and the error is
        tmp.unlink(missing_ok=True)  # raised here


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
