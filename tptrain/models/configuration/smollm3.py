"""SmolLM3: RoPE skipped on every few layers (NoPE)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, DECODER_TP_PLAN


@dataclasses.dataclass(kw_only=True)
class SmolLM3Config(PretrainedConfig):
    """SmolLM3: some layers have no rotary embedding (NoPE), listed in `no_rope_layers`."""

    model_type: ClassVar[str] = "smollm3"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN

    vocab_size: int = 128256
    hidden_size: int = 2048
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 128004
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    # per layer: 1 = RoPE, 0 = none; None -> 0 for every no_rope_layer_interval-th layer, as transformers
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4  # only used to fill in no_rope_layers

    def _fill_defaults(self) -> None:
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0)
                                   for i in range(self.num_hidden_layers)]
        super()._fill_defaults()

    @property
    def layer_uses_rope(self) -> list[bool]:
        if any(v not in (0, 1) for v in self.no_rope_layers):
            raise ValueError(f"SmolLM3Config: no_rope_layers={self.no_rope_layers} must hold 0 (no RoPE) or "
                             "1 (RoPE) per layer.")
        return [bool(v) for v in self.no_rope_layers]
