"""Preference tuning on the one Trainer: DPOTrainer and DPOConfig (DPO and TRL's loss types, SimPO, ORPO).

    from tptrain.training.preference import DPOConfig, DPOTrainer

The names are imported on first use, so `tptrain dpo`'s flags (cli/dpo.py, reading names.py) load no torch.
"""
from __future__ import annotations

import importlib

__all__ = ["DPOConfig", "DPOTrainer"]
_EXPORTS = {"DPOConfig": "tptrain.training.preference.config", "DPOTrainer": "tptrain.training.preference.trainer"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tptrain.training.preference' has no attribute {name!r}")
