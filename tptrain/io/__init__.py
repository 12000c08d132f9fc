"""Hugging Face checkpoint I/O (not the resumable training checkpoints: those are training/checkpoint/):
resolve a local directory or hub id (hub.py), read one rank's slice of a safetensors tensor (reader.py),
write safetensors checkpoints atomically, sharded and streamed (writer.py).

Each name's module is imported on first use: hub.py needs no torch, so reading a config.json stays light."""
from __future__ import annotations

import importlib

_EXPORTS = {"tptrain.io.hub": ("resolve_checkpoint",),
            "tptrain.io.reader": ("INDEX_FILE", "SINGLE_FILE", "CheckpointReader", "check_tensor_shape"),
            "tptrain.io.writer": ("atomic_directory", "fsync_path", "parse_size", "plan_files", "publish",
                                  "save_checkpoint", "save_streamed", "staging_directory", "writable_error",
                                  "write_index", "write_shards")}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointReader", "atomic_directory", "check_tensor_shape", "fsync_path",
           "parse_size", "plan_files", "publish", "resolve_checkpoint", "save_checkpoint", "save_streamed",
           "staging_directory", "writable_error", "write_index", "write_shards"]
assert sorted(__all__) == sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'tptrain.io' has no attribute {name!r}")
