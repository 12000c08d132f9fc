"""Hugging Face safetensors checkpoints: read one rank's slice of a tensor, write atomically and sharded
(also streamed: shard file by shard file as the tensors arrive).

Layout (what transformers' save_pretrained writes and from_pretrained reads):
  model.safetensors                                   when everything fits in one shard, else
  model-00001-of-0000N.safetensors ... + model.safetensors.index.json
      {"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}
"""
from __future__ import annotations

import contextlib

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype strings (the spec's spelling) -> torch dtypes.
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# HF convention: "5GB" is decimal (5 * 10**9); the binary units are spelled "GiB".
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


class CheckpointReader:
    """Tensors of an HF checkpoint directory, read one slice at a time.

    All headers are parsed and checked up front (missing shards, truncated or corrupt files fail here,
    naming the file); the files themselves are opened lazily, on the first `read` that needs them.

        with CheckpointReader(path) as ckpt:
            w = ckpt.read("model.layers.0.mlp.up_proj.weight", dim=0, index=rank, count=tp_size)
    """

    def __init__(self, directory: str | os.PathLike, *, single_file: str = SINGLE_FILE) -> None:
        # single_file: the one-file name to look for (a PEFT adapter's is adapter_model.safetensors).
        self.directory = Path(directory)
        self.files, self._tensors = _load_tensor_table(self.directory, single_file)
        self._handles: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._info(name).dtype

    def file_of(self, name: str) -> Path:
        """The safetensors file holding tensor `name` (for error messages)."""
        return self._info(name).file

    def read(self, name: str, *, dim: int | None = None, index: int = 0, count: int = 1,
             dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Chunk `index` of `count` equal chunks of tensor `name` along `dim` (None: the whole tensor).

        Only the chunk's bytes are copied out of the memory-mapped file (the full tensor is never
        materialised); the result is a fresh, contiguous tensor in `dtype` on `device`.
        """
        info = self._info(name)
        handle = self._handle(info.file)
        if dim is None:
            if (index, count) != (0, 1):
                raise ValueError(f"reading tensor {name!r} with dim=None reads the whole tensor; "
                                 f"index={index}, count={count} need a dim to split along")
            view = handle.get_tensor(name)
        else:
            dim = _check_chunk(name, info.shape, dim, index, count)
            size = info.shape[dim] // count
            view = handle.get_slice(name)[(slice(None),) * dim + (slice(index * size, (index + 1) * size),)]
        # safetensors returns views into its memory map; copying into a fresh tensor converts dtype and
        # device in one pass and keeps parameters from aliasing (or outliving) the mapped file.
        out = torch.empty(tuple(view.shape), dtype=dtype or view.dtype, device=device or "cpu")
        return out.copy_(view)

    def read_ranges(self, name: str, *, dim: int, ranges: list[tuple[int, int]], dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
        """The [start, stop) ranges of tensor `name` along `dim`, concatenated in order (a packed tensor's rows
        of one rank: its q, k and v heads). Only those bytes are copied out of the memory-mapped file."""
        info = self._info(name)
        dim = _check_chunk(name, info.shape, dim, 0, 1)
        bad = [r for r in ranges if not 0 <= r[0] <= r[1] <= info.shape[dim]]
        if bad:
            raise ValueError(f"reading tensor {name!r} of shape {info.shape}: row ranges {bad} along dim {dim} "
                             f"are out of bounds")
        shape = list(info.shape)
        shape[dim] = sum(stop - start for start, stop in ranges)
        out = torch.empty(shape, dtype=dtype or info.dtype, device=device or "cpu")
        tensor_slice, offset = self._handle(info.file).get_slice(name), 0
        for start, stop in ranges:
            out.narrow(dim, offset, stop - start).copy_(tensor_slice[(slice(None),) * dim + (slice(start, stop),)])
            offset += stop - start
        return out

    def close(self) -> None:
        self._handles.clear()  # dropping the handles unmaps the files

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            searched = ", ".join(f.name for f in self.files)
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory} "
                           f"(searched {searched})") from None

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(os.fspath(file), framework="pt", device="cpu")
        return self._handles[file]


def _check_chunk(name: str, shape: tuple[int, ...], dim: int, index: int, count: int) -> int:
    """Validate a chunked read and return `dim` made non-negative."""
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"cannot split tensor {name!r} of shape {shape} along dim {dim}: "
                         f"it has {len(shape)} dims")
    dim %= len(shape)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"reading tensor {name!r}: chunk index {index} is not in range for count={count}")
    if shape[dim] % count:
        raise ValueError(f"tensor {name!r} of shape {shape} cannot be split into {count} equal chunks "
                         f"along dim {dim} ({shape[dim]} % {count} != 0); choose a count that divides it")
    return dim


def _load_tensor_table(directory: Path, single_file: str) -> tuple[list[Path], dict[str, _TensorInfo]]:
    """The checkpoint's files and, for every tensor, where it lives, its dtype and shape."""
    single, index = directory / single_file, directory / INDEX_FILE
    if single.is_file():  # transformers prefers the single file too
        return [single], {name: _tensor_info(name, entry, single)
                          for name, entry in _read_header(single).items()}
    if not index.is_file():
        raise FileNotFoundError(
            f"checkpoint directory {directory} has neither {single_file} nor {INDEX_FILE}")
    weight_map = _read_weight_map(index)
    files = [directory / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard file(s) missing from {directory}: {', '.join(missing)}")
    headers = {f: _read_header(f) for f in files}
    table = {}
    for name, file_name in weight_map.items():
        file = directory / file_name
        if name not in headers[file]:
            raise ValueError(f"{index} maps tensor {name!r} to {file_name}, which has no such tensor")
        table[name] = _tensor_info(name, headers[file][name], file)
    return files, table


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"checkpoint index {index} is corrupt (expected JSON with a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {index} is corrupt: 'weight_map' is not an object")
    return weight_map


def _read_header(path: Path) -> dict[str, dict]:
    """Parse a safetensors header (u64 little-endian length + JSON) and check the file is complete."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + n > size:
            raise ValueError(f"safetensors file {path} is truncated or corrupt: it has {size} bytes, "
                             "too few for its header")
        try:
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"safetensors file {path} is corrupt: unparsable header ({e})") from e
    if end > size - 8 - n:
        raise ValueError(f"safetensors file {path} is truncated: its header describes {end} bytes of "
                         f"tensor data but only {size - 8 - n} follow the header; re-download or re-save it")
    return header


def _tensor_info(name: str, entry: dict, file: Path) -> _TensorInfo:
    if entry.get("dtype") not in _DTYPES or not isinstance(entry.get("shape"), list):
        raise ValueError(f"tensor {name!r} in {file} has an unsupported dtype or no shape: {entry}")
    return _TensorInfo(file, _DTYPES[entry["dtype"]], tuple(entry["shape"]))


def check_tensor_shape(name: str, expected: tuple[int, ...], actual: tuple[int, ...],
                       file: str | os.PathLike) -> None:
    """Raise if a checkpoint tensor's shape differs from the one the model config implies."""
    if tuple(expected) != tuple(actual):
        raise ValueError(f"checkpoint tensor {name!r} in {file} has shape {tuple(actual)} but the config "
                         f"implies {tuple(expected)}; the checkpoint does not match config.json")


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
    header_meta = _header_metadata(metadata)
    shards = _plan_shards(sizes, parse_size(max_shard_size))
    files = _shard_file_names(len(shards))
    extra = extra_files or {}
    _check_extra_files(extra, files)
    with atomic_directory(directory) as tmp:
        total = 0
        for file_name, names in zip(files, shards):
            shard = {}
            for expected in names:
                name, tensor = next(tensors)
                assert name == expected, (name, expected)  # `tensors` follows `sizes`
                shard[name] = tensor
            shard = _shard_tensors(shard, names)
            total += sum(t.numel() * t.element_size() for t in shard.values())
            save_file(shard, os.fspath(tmp / file_name), metadata=header_meta)
            del shard
        if len(shards) > 1:
            weight_map = {name: file_name for file_name, names in zip(files, shards) for name in names}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_file(tmp / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        for name, content in extra.items():
            _write_file(tmp / name, content.encode() if isinstance(content, str) else content)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary sibling of `directory` to fill. On success every file in it is
    fsynced and it is swapped into place (an existing `directory` is replaced whole); on any error,
    KeyboardInterrupt too, it is removed and `directory` is left untouched."""
    target = Path(os.path.abspath(directory))
    _check_replaceable(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier process that had our pid
    try:
        tmp.mkdir()
        yield tmp
        for path in tmp.iterdir():
            fsync_path(path)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
            (target / "config.json").exists() or any(target.glob("*.safetensors"))):
        raise ValueError(f"refusing to replace {target}: it is a non-empty directory without config.json or "
                         "*.safetensors, so it does not look like a checkpoint; save to a new directory")


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


def _write_file(path: Path, content: bytes) -> None:
    with open(path, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())


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
