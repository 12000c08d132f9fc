"""Where a Hugging Face checkpoint directory keeps its weights, and the one answer to "does it have weights?".

    model.safetensors                  everything in one file (transformers prefers it when both exist), else
    model.safetensors.index.json       {"weight_map": {tensor name: shard file}}, naming the shard files

A PEFT adapter's one file is adapter_model.safetensors (`single_file=ADAPTER_FILE`). A directory with neither
file has no weights (a config to initialise at random), whatever other *.safetensors lie in it: an adapter beside
a config.json is not the model's weights. Whether an index's shards are all there is the reader's check
(`CheckpointReader` names the missing ones). No torch: the launcher asks before anything heavy is imported.
"""
from __future__ import annotations

import os
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"


def weights_file(directory: str | os.PathLike, *, single_file: str = SINGLE_FILE) -> Path | None:
    """The file in `directory` that holds (`single_file`) or lists (the index) its checkpoint's weights; None when
    it has neither, i.e. no weights."""
    for name in (single_file, INDEX_FILE):
        path = Path(directory) / name
        if path.is_file():
            return path
    return None
