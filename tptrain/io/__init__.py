"""Hugging Face checkpoint I/O (not the resumable training checkpoints: those are training/checkpoint/):
resolve a local directory or hub id (hub.py), where a directory keeps its weights and whether it has any
(weights.py), read one rank's slice of a safetensors tensor (reader.py), write safetensors checkpoints
atomically, sharded and streamed (writer.py); room on the device for a checkpoint, and a full device said as such
(space.py); JSON and JSON Lines files with errors naming file and line (json_files.py).

Each name's module is imported on first use: hub.py, weights.py, space.py and json_files.py need no torch, so reading a
config.json stays light."""
from __future__ import annotations

import importlib

_EXPORTS = {"tptrain.io.hub": ("resolve_checkpoint",),
            "tptrain.io.weights": ("ADAPTER_FILE", "INDEX_FILE", "SINGLE_FILE", "weights_file"),
            "tptrain.io.json_files": ("jsonl_records", "read_json", "utf8_error"),
            "tptrain.io.reader": ("CheckpointReader", "check_tensor_shape"),
            "tptrain.io.space": ("free_bytes", "full_device_error", "size_text", "space_error"),
            "tptrain.io.writer": ("atomic_directory", "fsync_path", "parse_size", "plan_files", "publish",
                                  "save_checkpoint", "save_streamed", "staging_directory", "writable_error",
                                  "write_index", "write_shards")}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = ["ADAPTER_FILE", "INDEX_FILE", "SINGLE_FILE", "CheckpointReader", "atomic_directory", "check_tensor_shape",
           "free_bytes", "fsync_path", "full_device_error", "jsonl_records", "parse_size", "plan_files", "publish", "read_json", "resolve_checkpoint",
           "save_checkpoint", "save_streamed", "size_text", "space_error", "staging_directory", "utf8_error", "weights_file", "writable_error",
           "write_index", "write_shards"]
assert sorted(__all__) == sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'tptrain.io' has no attribute {name!r}")
