"""Reinforcement learning with verifiable rewards on the one Trainer: GRPOTrainer and GRPOConfig (TRL's GRPO, DAPO,
Dr. GRPO, BNPO and CISPO losses), completions generated on the training shards.

    from tptrain.training.rl import GRPOConfig, GRPOTrainer

The names are imported on first use, so `tptrain grpo`'s flags (cli/grpo.py, reading names.py) load no torch.
"""
from __future__ import annotations

import importlib

__all__ = ["GRPOConfig", "GRPOTrainer"]
_EXPORTS = {"GRPOConfig": "tptrain.training.rl.config", "GRPOTrainer": "tptrain.training.rl.trainer"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tptrain.training.rl' has no attribute {name!r}")
