"""Phi-3: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, _sliding_windows


@dataclasses.dataclass(kw_only=True)
class Phi3Config(PretrainedConfig):
    """Phi-3: fused qkv_proj and gate_up_proj (split per segment under TP by the `fused_colwise` style), RoPE on
    the first `partial_rotary_factor` of each head, default or `longrope` RoPE."""

    model_type: ClassVar[str] = "phi3"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": "fused_colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj": "fused_colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_sp_plan: ClassVar[dict[str, str]] = DECODER_SP_PLAN
    fused_projections: ClassVar[bool] = True

    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000
    original_max_position_embeddings: int = 4096  # pre-training context; longrope's long factors apply past it
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    sliding_window: int | None = None  # keys a query sees, itself included; None = full causal attention
    resid_pdrop: float = 0.0  # dropouts: only 0 is implemented
    embd_pdrop: float = 0.0
    attention_dropout: float = 0.0

    def _validate(self) -> None:
        super()._validate()
        for key in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
            if getattr(self, key):
                raise ValueError(f"Phi3Config: {key}={getattr(self, key)} is not implemented (tptrain has no dropout "
                                 f"there); set it to 0.0.")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"Phi3Config: partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and "
                             f"rotate an even number of features (head_dim={self.head_dim} gives {self.rotary_dim}).")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # transformers' truncation

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
        return _sliding_windows(self, [kind] * self.num_hidden_layers)
