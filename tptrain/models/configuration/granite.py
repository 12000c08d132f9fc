"""Granite: the embedding, residual, attention and logits multipliers."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, DECODER_TP_PLAN


@dataclasses.dataclass(kw_only=True)
class GraniteConfig(PretrainedConfig):
    """IBM Granite (3.x dense): scalar multipliers on embeddings, residual branches, scores and logits."""

    model_type: ClassVar[str] = "granite"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN

    embedding_multiplier: float = 1.0  # token embeddings are multiplied by it
    residual_multiplier: float = 1.0  # each attention / MLP output is multiplied by it before the residual add
    attention_multiplier: float = 1.0  # the softmax scale of q.k (replaces 1/sqrt(head_dim))
    logits_scaling: float = 1.0  # logits are divided by it

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier

    @property
    def embedding_scale(self) -> float:
        return self.embedding_multiplier

    @property
    def residual_scale(self) -> float:
        return self.residual_multiplier

    @property
    def logits_divisor(self) -> float:
        return self.logits_scaling
