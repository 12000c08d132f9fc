"""Hugging Face checkpoint I/O (not the resumable training checkpoints: those are training/checkpoint/):
resolve a local directory or hub id (hub.py), read one rank's slice of a safetensors tensor (reader.py),
write safetensors checkpoints atomically, sharded and streamed (writer.py)."""
from tptrain.io.hub import resolve_checkpoint
from tptrain.io.reader import INDEX_FILE, SINGLE_FILE, CheckpointReader, check_tensor_shape
from tptrain.io.writer import atomic_directory, fsync_path, parse_size, save_checkpoint, save_streamed, writable_error

__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointReader", "atomic_directory", "check_tensor_shape", "fsync_path",
           "parse_size", "resolve_checkpoint", "save_checkpoint", "save_streamed", "writable_error"]
