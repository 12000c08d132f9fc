"""Preference tuning on the one Trainer: DPOTrainer and DPOConfig (DPO and TRL's loss types, SimPO, ORPO).

    from tptrain.training.preference import DPOConfig, DPOTrainer
"""
from tptrain.training.preference.config import DPOConfig
from tptrain.training.preference.trainer import DPOTrainer

__all__ = ["DPOConfig", "DPOTrainer"]
