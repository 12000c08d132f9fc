"""The PEFT adapter directory on disk: adapter_config.json + adapter_model.safetensors with full tensors.

Keys are peft's: the in-memory name under `base_model.model.` with the adapter name dropped
(`...q_proj.lora_A.default.weight` -> `base_model.model....q_proj.lora_A.weight`). Writing is atomic
(temp dir, fsync, rename: the checkpoint writer's swap); reading checks every key and shape before
any byte is loaded, then reads only this rank's slice.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from tptrain.io import CheckpointReader, atomic_directory
from tptrain.parallel.styles import ShardSpec
from tptrain.parallel.tensor_parallel import read_shard
from tptrain.peft.config import CONFIG_NAME, WEIGHTS_NAME, LoraConfig
from tptrain.peft.lora import ADAPTER

PREFIX = "base_model.model."


def disk_key(name: str) -> str:
    """peft's checkpoint key for a parameter `name` of the adapted model (adapter name removed)."""
    parts = name.split(".")
    if parts[-1] == ADAPTER:  # a bare nn.Parameter (lora_embedding_A.default)
        parts.pop()
    elif len(parts) > 1 and parts[-2] == ADAPTER:  # a module's parameter (lora_A.default.weight)
        del parts[-2]
    return PREFIX + ".".join(parts)


def write_adapter(directory: str | os.PathLike, state: dict[str, torch.Tensor], config: LoraConfig) -> None:
    with atomic_directory(directory) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, os.fspath(tmp / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        config.save(tmp)


def open_adapter(directory: str | os.PathLike) -> CheckpointReader:
    """The adapter's tensors (headers checked, nothing read yet)."""
    if not (Path(directory) / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"adapter directory {directory} has {CONFIG_NAME} but no {WEIGHTS_NAME}; "
                                "re-save the adapter (tptrain and peft write safetensors)")
    return CheckpointReader(directory, single_file=WEIGHTS_NAME)


def check_adapter_file(reader: CheckpointReader, expected: dict[str, str], extra: dict[str, str],
                       shapes: dict[str, tuple[int, ...]], *, elsewhere=lambda name: False) -> dict[str, str]:
    """Match the file's keys to model parameters: `expected` {disk key: name} must all be present, `extra`
    {disk key: name} may be (base tensors peft saves too, e.g. a targeted embedding's base weight); keys whose
    parameter name `elsewhere` says another pipeline stage holds are skipped.
    Raises on a missing, unknown or wrongly shaped tensor. Returns {disk key: parameter name} to load."""
    path = reader.files[0]
    file_shapes = {k: reader.shape(k) for k in reader.keys() if not elsewhere(k[len(PREFIX):])}
    missing = [k for k in expected if k not in file_shapes]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensor(s) the adapter config implies, e.g. {missing[:3]}; "
                         "the file does not match its adapter_config.json")
    known = {**extra, **expected}
    unknown = [k for k in file_shapes if k not in known]
    if unknown:
        raise ValueError(f"{path} holds tensor(s) that match no parameter of this model, e.g. {unknown[:3]}; "
                         "the adapter was saved for a different architecture")
    for key, shape in file_shapes.items():
        want = shapes[known[key]]
        if shape != tuple(want):
            raise ValueError(f"adapter tensor {key!r} in {path} has shape {shape}, but this model needs {tuple(want)}; "
                             "the adapter was trained for a different base model (or a different r)")
    return {k: known[k] for k in file_shapes}


def read_slices(reader: CheckpointReader, keys: dict[str, str], params: dict[str, torch.nn.Parameter],
                specs: dict[str, ShardSpec], tp_size: int, tp_rank: int) -> None:
    """Copy this rank's slice of every file tensor `keys` {disk key: name} into `params[name]`."""
    with torch.no_grad():
        for key, name in keys.items():
            spec, p = specs.get(name, ShardSpec()), params[name]
            p.copy_(read_shard(reader, key, spec, tp_size=tp_size, tp_rank=tp_rank, dtype=p.dtype))
