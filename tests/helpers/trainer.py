"""The Trainer tests' tiny models, data and arguments. The Trainer's modules are imported inside the functions: the
ranks a test starts import this module."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tests.helpers.configs import MOE_TRAIN_TINY, TRAINER_TINY
from tptrain.models import AutoConfig, AutoModelForCausalLM

if TYPE_CHECKING:
    from tptrain.training.args import TrainingArguments
    from tptrain.training.data import PackedDataset

SEQ = 16


def tiny_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", **{**TRAINER_TINY, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def tiny_moe(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The training tests' tiny Qwen3-MoE with top-2 routing and no router aux loss."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**MOE_TRAIN_TINY, "num_experts_per_tok": 2,
                                                  "output_router_logits": False})
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tiny_dataset(num_blocks: int = 64, seed: int = 1) -> PackedDataset:
    from tptrain.training.data import PackedDataset

    g = torch.Generator().manual_seed(seed)
    return PackedDataset(torch.randint(0, TRAINER_TINY["vocab_size"], (num_blocks * SEQ,), generator=g), SEQ)


def training_args(output_dir, **kw) -> TrainingArguments:
    from tptrain.training.args import TrainingArguments

    defaults = dict(per_device_train_batch_size=4, max_steps=20, seq_len=SEQ, learning_rate=3e-3, weight_decay=0.1,
                    warmup_steps=3, lr_scheduler_type="cosine", max_grad_norm=0.5, seed=7, logging_steps=5)
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **kw})
