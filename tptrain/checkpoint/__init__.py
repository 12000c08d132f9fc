"""Checkpoint I/O in the Hugging Face format: resolve a path or hub id, read slices, write atomically."""
from tptrain.checkpoint.hub import resolve_checkpoint
from tptrain.checkpoint.safetensors_io import (
    CheckpointReader,
    atomic_directory,
    check_tensor_shape,
    parse_size,
    save_checkpoint,
    writable_error,
)

__all__ = ["CheckpointReader", "atomic_directory", "check_tensor_shape", "parse_size", "resolve_checkpoint",
           "save_checkpoint", "writable_error"]
