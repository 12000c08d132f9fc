"""Reading Hugging Face safetensors checkpoints: one rank's slice of a tensor, straight from the files.

Layout (what transformers' save_pretrained writes and from_pretrained reads; weights.py decides which a
directory has):
  model.safetensors                                   when everything fits in one shard, else
  model-00001-of-0000N.safetensors ... + model.safetensors.index.json
      {"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tptrain.io.json_files import read_json
from tptrain.io.weights import INDEX_FILE, SINGLE_FILE, weights_file

# safetensors header dtype strings (the spec's spelling) -> torch dtypes.
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


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
        """The [start, stop) ranges of tensor `name` along `dim`, concatenated in order (a fused tensor's rows
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
    declared = weights_file(directory, single_file=single_file)
    if declared is None:
        raise FileNotFoundError(
            f"checkpoint directory {directory} has neither {single_file} nor {INDEX_FILE}")
    if declared.name == single_file:
        return [declared], {name: _tensor_info(name, entry, declared)
                            for name, entry in _read_header(declared).items()}
    weight_map = _read_weight_map(declared)
    files = [directory / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{declared} lists shard file(s) missing from {directory}: {', '.join(missing)}")
    headers = {f: _read_header(f) for f in files}
    table = {}
    for name, file_name in weight_map.items():
        file = directory / file_name
        if name not in headers[file]:
            raise ValueError(f"{declared} maps tensor {name!r} to {file_name}, which has no such tensor")
        table[name] = _tensor_info(name, headers[file][name], file)
    return files, table


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = read_json(index)["weight_map"]
    except (ValueError, KeyError) as e:
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
