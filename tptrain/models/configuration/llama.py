"""Llama, Qwen2 and Qwen3: the plain decoder and its QKV-bias / q-k-norm flags."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, DECODER_TP_PLAN


@dataclasses.dataclass(kw_only=True)
class LlamaConfig(PretrainedConfig):
    """Llama 2/3 (and Llama-architecture models such as TinyLlama, SmolLM)."""

    model_type: ClassVar[str] = "llama"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN


@dataclasses.dataclass(kw_only=True)
class Qwen2Config(PretrainedConfig):
    """Qwen2 / Qwen2.5: bias on q/k/v, none on o_proj."""

    model_type: ClassVar[str] = "qwen2"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN

    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    attention_bias: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def o_proj_bias(self) -> bool:
        return False


@dataclasses.dataclass(kw_only=True)
class Qwen3Config(PretrainedConfig):
    """Qwen3 (dense): RMSNorm on q and k per head, explicit head_dim, no bias by default."""

    model_type: ClassVar[str] = "qwen3"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        **DECODER_TP_PLAN,
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    }
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN
    qk_norm: ClassVar[str | None] = "head"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    head_dim: int | None = 128  # transformers' Qwen3 default; not hidden_size // num_attention_heads
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
