"""Resolve a checkpoint argument (local directory or Hugging Face hub id) to a local directory, and a hub
dataset id to the local snapshot of its data files (what `StreamingText` then streams).

Hub ids go through `huggingface_hub.snapshot_download`, so HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE and
the shared cache behave exactly as they do for `transformers`, without importing it.
"""
from __future__ import annotations

import os
from pathlib import Path

# Tokenizer (and generation) files: downloaded with the weights, copied next to a trained model.
TOKENIZER_PATTERNS = (
    "generation_config.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.jinja",
)
# A vision-language model's processor: its image (and video) processor's settings and its tokenizer's files.
PROCESSOR_PATTERNS = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    *TOKENIZER_PATTERNS,
)
# Only what building and training a model needs: never *.bin / *.pt / original/ duplicates, which can
# double the download of a large repository.
HUB_ALLOW_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", *PROCESSOR_PATTERNS]


def resolve_checkpoint(path_or_id: str | os.PathLike, *, revision: str | None = None,
                       config_only: bool = False) -> Path:
    """Return the local directory holding the checkpoint `path_or_id`.

    An existing local directory is returned as-is (it must contain config.json). Anything else is
    treated as a hub id (`org/name`) and resolved through the HF cache, downloading when online
    (only config.json with `config_only`: reading a config, or `tptrain plan`, never fetches weights).
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"checkpoint directory {path} has no config.json; pass the directory that "
                "save_pretrained wrote (it holds config.json and the *.safetensors files)"
            )
        return path
    if path.exists():
        raise NotADirectoryError(f"checkpoint {path} is a file; pass the directory that contains it")
    return _resolve_hub_id(os.fspath(path_or_id), revision, ["config.json"] if config_only else HUB_ALLOW_PATTERNS)


def _resolve_hub_id(repo_id: str, revision: str | None, allow_patterns: list[str]) -> Path:
    # Imported here: a local directory (the common case, and the CLI's first check) skips its ~0.4 s import.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise FileNotFoundError(
            f"checkpoint {repo_id!r} is not a local directory and not a valid hub id (org/name); "
            "check the path"
        ) from e
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns))
    # LocalEntryNotFoundError: offline (HF_HUB_OFFLINE=1 or no network) and not cached.
    # RepositoryNotFoundError: online, but the hub has no such repo (often a mistyped local path).
    except (LocalEntryNotFoundError, RepositoryNotFoundError) as e:
        raise FileNotFoundError(_not_found_message(repo_id, revision)) from e
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(
            f"hub checkpoint {repo_id!r} resolved to {snapshot}, which has no config.json; "
            "it is not a transformers model repository (or the cached snapshot is incomplete)"
        )
    return snapshot


def _not_found_message(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants

    at = f" at revision {revision!r}" if revision else ""
    # The effective values (env vars are read once, when huggingface_hub is imported).
    return (
        f"checkpoint {repo_id!r} is neither a local directory nor a hub model{at} found in the HF cache "
        f"({constants.HF_HUB_CACHE}, HF_HUB_OFFLINE={int(constants.HF_HUB_OFFLINE)}). Fix: pass the path "
        "of a local checkpoint directory, or point HF_HOME / HF_HUB_CACHE at a cache that holds it, or "
        f"download it first on a machine with network (`hf download {repo_id}`)."
    )


# The shard formats StreamingText reads: a dataset repository's README, scripts and images are not fetched.
DATASET_PATTERNS = ["*.parquet", "*.arrow", "*.jsonl"]


def resolve_dataset(repo_id: str, *, revision: str | None = None) -> Path:
    """The local snapshot of hub dataset `repo_id`'s data files (parquet / arrow / jsonl only), fetched into the
    HF cache on first use when online, found there when offline (HF_HUB_OFFLINE honoured)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise FileNotFoundError(f"streaming data: {repo_id!r} is not a local path, a glob that matches files, "
                                "or a valid hub dataset id (org/name); check the path") from e
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                      allow_patterns=DATASET_PATTERNS))
    except (LocalEntryNotFoundError, RepositoryNotFoundError) as e:
        from huggingface_hub import constants

        raise FileNotFoundError(
            f"streaming data: {repo_id!r} is neither a local path nor a hub dataset found in the HF cache "
            f"({constants.HF_HUB_CACHE}, HF_HUB_OFFLINE={int(constants.HF_HUB_OFFLINE)}). Fix: pass a local "
            "directory of parquet/arrow/jsonl shards, or download it first on a machine with network "
            f"(`hf download --repo-type dataset {repo_id}`) and point HF_HOME at that cache.") from e
