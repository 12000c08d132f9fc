"""tptrain: tensor-parallel training of Hugging Face-format language models on PyTorch."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

__all__ = ["AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText", "DPOConfig", "DPOTrainer",
           "DistributedConfig", "ParallelismConfig", "Trainer", "TrainingArguments"]
# Each name's module is imported on first use: `import tptrain` (and so the `tptrain` command) stays free of torch
# until then, so `tptrain --version` and the CLI's checks of a config answer in a fraction of a second.
_EXPORTS = {"AutoConfig": "tptrain.models", "AutoModelForCausalLM": "tptrain.models",
            "AutoModelForImageTextToText": "tptrain.models",
            "DistributedConfig": "tptrain.distributed", "ParallelismConfig": "tptrain.training",
            "Trainer": "tptrain.training", "TrainingArguments": "tptrain.training",
            "DPOConfig": "tptrain.training", "DPOTrainer": "tptrain.training"}


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tptrain' has no attribute {name!r}")


def _version() -> str:
    """The installed distribution's version; in a source tree that was never installed, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("tptrain")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE) if 'name = "tptrain"' in text else None
        return found.group(1) if found else "unknown"
