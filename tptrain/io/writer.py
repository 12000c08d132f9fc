"""Writing Hugging Face safetensors checkpoints: atomically and sharded, also streamed (shard file by shard
file as the tensors arrive), with the layout transformers' save_pretrained writes (see reader.py)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from tptrain.io.space import full_device_error, space_error
from tptrain.io.weights import ADAPTER_FILE, INDEX_FILE, SINGLE_FILE, weights_file

# HF convention: "5GB" is decimal (5 * 10**9); the binary units are spelled "GiB".
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB" (10**9), "500MB", "2GiB" (2**30)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(size))
        if match is None or match.group(2).upper() not in _SIZE_UNITS:
            raise ValueError(f"cannot parse size {size!r}; use an int (bytes) or e.g. '5GB', '500MB', '2GiB'")
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def save_checkpoint(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", metadata: dict[str, str] | None = None,
                    extra_files: dict[str, bytes | str] | None = None) -> None:
    """Write `state_dict` (plus `extra_files`, e.g. config.json) as an HF checkpoint in `directory`.

    `metadata` goes into every safetensors header next to {"format": "pt"}. The write is atomic:
    everything is written and fsynced in a sibling `.{name}.tmp-<pid>`, then swapped into place; an
    existing `directory` is replaced whole (its old contents are deleted). A crash leaves either the old
    or the new checkpoint at `directory`, or, between the two renames of the swap, neither there but the
    old one intact at `.{name}.bak-<pid>` and the new one complete at `.{name}.tmp-<pid>`.
    """
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.is_meta:
            raise ValueError(f"state_dict[{name!r}] is on the meta device; materialise it before saving")
    sizes = {name: t.numel() * t.element_size() for name, t in state_dict.items()}
    save_streamed(sizes, iter(state_dict.items()), directory, max_shard_size=max_shard_size, metadata=metadata,
                  extra_files=extra_files)


def save_streamed(sizes: dict[str, int], tensors: Iterator[tuple[str, torch.Tensor]], directory: str | os.PathLike,
                  *, max_shard_size: int | str = "5GB", metadata: dict[str, str] | None = None,
                  extra_files: dict[str, bytes | str] | None = None) -> None:
    """`save_checkpoint` for tensors that arrive one at a time (e.g. gathered from shards): `tensors` yields
    (name, tensor) in the order of `sizes` ({name: bytes}, which plans the shard files up front). Each file
    is written as soon as its tensors are in, so at most one shard plus one tensor is held; the index and
    `extra_files` are written last, then the directory is swapped into place (atomic as save_checkpoint)."""
    (files,) = plan_files([sizes], max_shard_size)
    extra = extra_files or {}
    _check_extra_files(extra, [f for f, _ in files])
    needed = sum(sizes.values()) + sum(len(content) for content in extra.values())
    error = space_error(Path(directory).parent, needed, what=f"checkpoint {directory}")
    if error:  # before the first byte: the tensors' sizes are known
        raise OSError(errno.ENOSPC, f"{error}; free some space or save elsewhere")
    with atomic_directory(directory, needed=needed) as tmp:
        total = write_shards(tmp, files, tensors, metadata=metadata)
        write_index(tmp, files, total, extra_files=extra)


def plan_files(part_sizes: list[dict[str, int]], max_shard_size: int | str) -> list[list[tuple[str, list[str]]]]:
    """Each part's shard files, as (file name, tensor names), for a checkpoint written in parts (one per pipeline
    stage, say; one part: a plain save): each part's tensors split at `max_shard_size`, the files numbered over
    all parts in order, as transformers names them (`model-0000K-of-0000N.safetensors`; one file in all:
    `model.safetensors`)."""
    max_size = parse_size(max_shard_size)
    plans = [_plan_shards(sizes, max_size) if sizes else [] for sizes in part_sizes]
    names = iter(_shard_file_names(sum(map(len, plans))))
    return [[(next(names), shard) for shard in plan] for plan in plans]


def write_shards(directory: Path, files: list[tuple[str, list[str]]], tensors: Iterator[tuple[str, torch.Tensor]],
                 *, metadata: dict[str, str] | None = None) -> int:
    """Write `files` ((file name, tensor names), from `plan_files`) into `directory`, each as soon as its tensors
    are taken from `tensors` (which yields them in that order), and fsync each. Returns the bytes written."""
    header_meta = _header_metadata(metadata)
    total = 0
    for file_name, names in files:
        shard = {}
        for expected in names:
            name, tensor = next(tensors)
            assert name == expected, (name, expected)  # `tensors` follows the plan
            shard[name] = tensor
        shard = _shard_tensors(shard, names)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, os.fspath(directory / file_name), metadata=header_meta)
        fsync_path(directory / file_name)
        del shard
    return total


def write_index(directory: Path, files: list[tuple[str, list[str]]], total: int, *,
                extra_files: dict[str, bytes | str] | None = None) -> None:
    """The index of `files` (every part's, when several; none for a single file) and `extra_files` (config.json),
    written last, each fsynced."""
    if len(files) > 1:
        weight_map = {name: file_name for file_name, names in files for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_file(directory / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    for name, content in (extra_files or {}).items():
        _write_file(directory / name, content.encode() if isinstance(content, str) else content)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike, *, needed: int | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling of `directory` to fill. On success every file in it is
    fsynced and it is swapped into place (an existing `directory` is replaced whole); on any error,
    KeyboardInterrupt too, it is removed and `directory` is left untouched. A write that failed on a full
    device is raised as OSError(ENOSPC) saying so (`needed`: the bytes the whole checkpoint takes)."""
    tmp = staging_directory(directory)
    try:
        yield tmp
        publish(tmp, directory)
    except BaseException as exc:
        full = full_device_error(exc, tmp.parent, what=f"checkpoint {directory}", needed=needed)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, full) from exc
        raise


def staging_directory(directory: str | os.PathLike, *, tag: str | None = None) -> Path:
    """A new, empty temporary sibling `.{name}.tmp-<tag>` of `directory` (tag: this process's pid) to fill and then
    `publish`; refused if `directory` exists and does not look like a checkpoint (it would be replaced)."""
    target = Path(os.path.abspath(directory))
    _check_replaceable(target)
    tmp = target.parent / f".{target.name}.tmp-{tag or os.getpid()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier process that had our pid
    tmp.mkdir()
    return tmp


def publish(tmp: Path, directory: str | os.PathLike) -> None:
    """Fsync every file of the filled `tmp` (a `staging_directory`) and swap it into place as `directory`."""
    for path in tmp.iterdir():
        fsync_path(path)
    _swap_into_place(tmp, Path(os.path.abspath(directory)))


def writable_error(target: Path) -> str | None:
    """Why `target` cannot be written as a checkpoint directory, or None (its parent is created)."""
    parent = target.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {parent}: {exc}"
    if not os.access(parent, os.W_OK):
        return f"output directory {parent} is not writable; choose another save_directory"
    if target.exists() and not target.is_dir():
        return f"{target} exists and is not a directory"
    return None


def _check_replaceable(target: Path) -> None:
    # The swap deletes the old directory, so refuse anything that is not (or no longer) a checkpoint,
    # e.g. a mistyped `save_checkpoint(sd, "~")`.
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save a checkpoint to {target}: it exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (
            (target / "config.json").is_file() or weights_file(target) or weights_file(target, single_file=ADAPTER_FILE)):
        raise ValueError(f"refusing to replace {target}: it is a non-empty directory without config.json or the "
                         f"weights of a model ({SINGLE_FILE}, {INDEX_FILE}) or an adapter ({ADAPTER_FILE}), so it "
                         "does not look like a checkpoint; save to a new directory")


def _header_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    header = {"format": "pt", **(metadata or {})}
    bad = {k: v for k, v in header.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"safetensors metadata must map str to str; got {bad}")
    return header


def _plan_shards(sizes: dict[str, int], max_size: int) -> list[list[str]]:
    """Tensor names per shard, in order, starting a new shard when one would exceed max_size
    (a single tensor larger than max_size gets a shard of its own, as in transformers)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_file_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _check_extra_files(extra: dict[str, bytes | str], weight_files: list[str]) -> None:
    for name in extra:
        if Path(name).name != name or name in ("", ".", "..") or name in (*weight_files, INDEX_FILE):
            raise ValueError(f"extra file name {name!r} must be a plain file name that is not a weight file")


def _shard_tensors(state_dict: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors for one shard (moved one shard at a time to bound host memory)."""
    out, storages = {}, set()
    for name in names:
        tensor = state_dict[name].detach().to("cpu")
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses tensors sharing memory in one file (tied weights); a copy keeps both names.
        tensor = tensor.clone() if storage in storages else tensor
        storages.add(storage)
        out[name] = tensor.contiguous()
    return out


def write_synced(path: Path, content: bytes) -> None:
    """Write `content` to `path` and fsync it (a file that will be renamed into place is complete on disk)."""
    with open(path, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())


_write_file = write_synced  # the writer's own calls go through this name (tests replace it to inject failures)


def fsync_path(path: Path) -> None:
    # Directories too: a rename or a new file is durable only once its parent directory is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(tmp: Path, target: Path) -> None:
    fsync_path(tmp)
    if not target.exists():
        os.rename(tmp, target)
        fsync_path(target.parent)
        return
    backup = target.parent / f".{target.name}.bak-{os.getpid()}"
    shutil.rmtree(backup, ignore_errors=True)
    os.rename(target, backup)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(backup, target)  # put the good checkpoint back
        raise
    fsync_path(target.parent)
    shutil.rmtree(backup)
