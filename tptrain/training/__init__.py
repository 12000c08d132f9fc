"""Training: Trainer, TrainingArguments, ParallelismConfig (TP x FSDP2 / HSDP / DDP), data, checkpoints.

The names below are imported on first use, so a submodule (the launcher's checks: args, checkpoint.dirs, the
data) loads without the Trainer and what it pulls in (DCP, pipelining, torch.compile's front end).
"""
from __future__ import annotations

import importlib

__all__ = ["DPOConfig", "DPOTrainer", "NonFiniteStepError", "ParallelismConfig", "Trainer", "TrainOutput",
           "TrainingArguments"]
_EXPORTS = {"ParallelismConfig": "tptrain.training.args", "TrainingArguments": "tptrain.training.args",
            "Trainer": "tptrain.training.trainer", "TrainOutput": "tptrain.training.trainer",
            "NonFiniteStepError": "tptrain.training.nonfinite",
            "DPOConfig": "tptrain.training.preference", "DPOTrainer": "tptrain.training.preference"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tptrain.training' has no attribute {name!r}")
