"""Mistral, Ministral and Ministral 3: sliding windows, per-layer types, YaRN and the query scale."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, DECODER_TP_PLAN, _sliding_windows


@dataclasses.dataclass(kw_only=True)
class MistralConfig(PretrainedConfig):
    """Mistral: every layer attends over a sliding window of `sliding_window` keys (None: full)."""

    model_type: ClassVar[str] = "mistral"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN

    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096  # keys a query sees, itself included; None = full causal attention

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        # transformers' Mistral applies sliding_window to every layer and ignores layer_types;
        # per-layer types are Ministral's (model_type "ministral").
        uniform = ["sliding_attention" if self.sliding_window is not None else "full_attention"]
        if (layer_types := self.extra.get("layer_types")) and set(layer_types) != set(uniform):
            raise ValueError(f"MistralConfig: layer_types={layer_types} disagrees with sliding_window="
                             f"{self.sliding_window} (transformers' Mistral ignores layer_types); use "
                             "model_type 'ministral' for per-layer attention types.")
        return _sliding_windows(self, uniform * self.num_hidden_layers)


@dataclasses.dataclass(kw_only=True)
class MinistralConfig(MistralConfig):
    """Ministral: Mistral with per-layer `layer_types` (sliding or full attention)."""

    model_type: ClassVar[str] = "ministral"

    layer_types: list[str] | None = None  # per layer; None -> all "sliding_attention" (or full if no window)

    def _fill_defaults(self) -> None:
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        super()._fill_defaults()

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        return _sliding_windows(self, self.layer_types)


@dataclasses.dataclass(kw_only=True)
class Ministral3Config(MistralConfig):
    """Ministral 3 (the text model of Mistral 3): Mistral with YaRN RoPE and, past the pre-training context,
    queries scaled up with their position (`rope_parameters["llama_4_scaling_beta"]`, Llama 4's attention
    temperature). As transformers' Ministral3: a set `sliding_window` applies to every layer."""

    model_type: ClassVar[str] = "ministral3"

    vocab_size: int = 131072
    num_hidden_layers: int = 34
    head_dim: int | None = 128
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = dataclasses.field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1})
    sliding_window: int | None = None
    pad_token_id: int | None = 11

    @property
    def query_position_scale(self) -> tuple[float, int] | None:
        scaling = self.rope_scaling or {}
        if scaling.get("llama_4_scaling_beta") is None:
            return None
        return scaling["llama_4_scaling_beta"], scaling["original_max_position_embeddings"]
