"""Gemma 2 and Gemma 3 (text): sandwich norms, soft-capping, scaled embeddings, per-layer RoPE bases."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_SP_PLAN, DECODER_TP_PLAN, _sliding_windows


# Gemma's residual-stream norms: all four per layer and the final one hold sequence shards under SP.
_GEMMA_SP_PLAN = {
    **DECODER_SP_PLAN,
    "layers.*.pre_feedforward_layernorm": "sequence_parallel",
    "layers.*.post_feedforward_layernorm": "sequence_parallel",
}


@dataclasses.dataclass(kw_only=True)
class Gemma2Config(PretrainedConfig):
    """Gemma 2: (1 + weight) RMSNorms before and after each sublayer, embeddings times sqrt(hidden_size), a
    tanh-GELU MLP, softmax scale query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores and logits,
    sliding-window and full layers (`layer_types`), tied embeddings."""

    model_type: ClassVar[str] = "gemma2"
    base_model_tp_plan: ClassVar[dict[str, str]] = DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _GEMMA_SP_PLAN
    norm_sublayer_output: ClassVar[bool] = True
    norm_weight_offset: ClassVar[float] = 1.0
    norm_scale_in_float32: ClassVar[bool] = True  # (1 + weight) * normalised, in fp32, then cast (as transformers)
    embedding_scale_in_weight_dtype: ClassVar[bool] = True

    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"  # Gemma 1's key; transformers' Gemma 2/3 read hidden_activation only
    hidden_activation: str = "gelu_pytorch_tanh"  # MLP activation: "gelu_pytorch_tanh" (or "silu")
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    query_pre_attn_scalar: float = 256  # softmax scale is query_pre_attn_scalar ** -0.5
    sliding_window: int | None = 4096  # keys a sliding-attention query sees, itself included
    layer_types: list[str] | None = None  # per layer; None -> transformers' default pattern
    final_logit_softcapping: float | None = 30.0  # logits = tanh(logits / cap) * cap; None: none
    attn_logit_softcapping: float | None = 50.0  # scores = tanh(scores / cap) * cap; None: none
    attention_dropout: float = 0.0  # only 0 is implemented

    def _fill_defaults(self) -> None:
        if self.layer_types is None:  # transformers' default: every n-th layer full, the others sliding
            n = self._full_attention_every()
            self.layer_types = ["sliding_attention" if (i + 1) % n else "full_attention"
                                for i in range(self.num_hidden_layers)]
        super()._fill_defaults()

    def _full_attention_every(self) -> int:
        return 2

    def _validate(self) -> None:
        super()._validate()
        name = type(self).__name__
        if self.extra.get("use_bidirectional_attention"):
            raise ValueError(f"{name}: use_bidirectional_attention=true is not implemented (tptrain trains causal "
                             "LMs); set it to false.")
        if self.attention_dropout:
            raise ValueError(f"{name}: attention_dropout={self.attention_dropout} is not implemented; set it to 0.0.")
        if self.mlp_bias:
            raise ValueError(f"{name}: mlp_bias=true is not part of Gemma (transformers builds its MLP without bias).")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, key)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
                raise ValueError(f"{name}: {key}={cap!r} must be a positive number or null.")

    @property
    def mlp_activation(self) -> str:
        return self.hidden_activation

    @property
    def mlp_activation_key(self) -> str:
        return "hidden_activation"

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        return _sliding_windows(self, self.layer_types)

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    @property
    def embedding_scale(self) -> float:
        return self.hidden_size ** 0.5

    @property
    def attn_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def logit_softcap(self) -> float | None:
        return self.final_logit_softcapping


@dataclasses.dataclass(kw_only=True)
class Gemma3TextConfig(Gemma2Config):
    """Gemma 3 (text): Gemma 2 plus (1 + weight) RMSNorms on q and k per head, a second RoPE base for the
    sliding layers (`rope_local_base_freq`; `rope_theta` and `rope_scaling` are the full layers'), five sliding
    layers to one full by default, no soft-capping by default."""

    model_type: ClassVar[str] = "gemma3_text"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        **DECODER_TP_PLAN,
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    }
    qk_norm: ClassVar[str | None] = "head"

    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0  # full-attention layers
    rope_local_base_freq: float = 10000.0  # sliding-window layers
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # transformers' Gemma 3 ignores it: only null is accepted

    def _full_attention_every(self) -> int:
        return self.extra.get("sliding_window_pattern", 6)  # older hub configs' key (transformers reads it too)

    def _validate(self) -> None:
        super()._validate()
        if self.attn_logit_softcapping is not None:
            raise ValueError(f"Gemma3TextConfig: attn_logit_softcapping={self.attn_logit_softcapping} is not applied "
                             "by transformers' Gemma 3 attention; set it to null.")

    @property
    def layer_ropes(self) -> list[tuple[float, dict[str, Any] | None]]:
        local, full = (self.rope_local_base_freq, None), (self.rope_theta, self.rope_scaling)
        return [local if t == "sliding_attention" else full for t in self.layer_types]
