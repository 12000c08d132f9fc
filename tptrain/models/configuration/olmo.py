"""OLMo 2 and OLMo 3: norms after the blocks, q/k norms over all heads, OLMo 3's sliding windows."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tptrain.models.configuration.base import PretrainedConfig, DECODER_TP_PLAN, _sliding_windows


@dataclasses.dataclass(kw_only=True)
class Olmo2Config(PretrainedConfig):
    """OLMo 2: RMSNorm on each sublayer's output (no input norms) and on q and k over their whole projected
    width. Under TP the q/k norms are `distributed_rmsnorm`, so attention stays sharded (transformers gathers
    q/k/v to every rank instead)."""

    model_type: ClassVar[str] = "olmo2"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        **DECODER_TP_PLAN,
        "layers.*.self_attn.q_norm": "distributed_rmsnorm",
        "layers.*.self_attn.k_norm": "distributed_rmsnorm",
    }
    base_model_sp_plan: ClassVar[dict[str, str]] = {
        "norm": "sequence_parallel",
        "layers.*.post_attention_layernorm": "sequence_parallel",
        "layers.*.post_feedforward_layernorm": "sequence_parallel",
    }
    qk_norm: ClassVar[str | None] = "width"
    norm_sublayer_input: ClassVar[bool] = False
    norm_sublayer_output: ClassVar[bool] = True
    norm_scale_in_float32: ClassVar[bool] = True
    rope_in_float32: ClassVar[bool] = True

    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    attention_dropout: float = 0.0  # only 0 is implemented

    def _validate(self) -> None:
        super()._validate()
        if self.attention_dropout:
            raise ValueError(f"Olmo2Config: attention_dropout={self.attention_dropout} is not implemented (tptrain's "
                             "attention has no dropout); set it to 0.0.")
        if self.mlp_bias:
            raise ValueError("Olmo2Config: mlp_bias=true is not part of OLMo 2 (transformers builds its MLP without "
                             "bias); remove mlp_bias from config.json or set it to false.")


@dataclasses.dataclass(kw_only=True)
class Olmo3Config(Olmo2Config):
    """OLMo 3: OLMo 2 plus sliding-window and full layers (`layer_types`; by default every 4th layer full), each
    kind with its RoPE (transformers' `rope_parameters` per layer type: `rope_theta` and `rope_scaling` are the full
    layers', `rope_local_base_freq` the sliding layers' base, default RoPE there)."""

    model_type: ClassVar[str] = "olmo3"

    rope_theta: float = 500000.0  # full-attention layers
    # sliding-window layers. transformers 5.x gives them 500000 unless rope_parameters["sliding_attention"] says
    # otherwise, even when a top-level rope_theta is set (that one is the full layers').
    rope_local_base_freq: float = 500000.0
    sliding_window: int | None = 4096  # keys a sliding-attention query sees, itself included
    layer_types: list[str] | None = None  # per layer; None -> transformers' default (every 4th layer full)

    def _fill_defaults(self) -> None:
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        super()._fill_defaults()

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        return _sliding_windows(self, self.layer_types)

    @property
    def layer_ropes(self) -> list[tuple[float, dict[str, Any] | None]]:
        local, full = (self.rope_local_base_freq, None), (self.rope_theta, self.rope_scaling)
        return [local if t == "sliding_attention" else full for t in self.layer_types]

    def to_dict(self) -> dict[str, Any]:
        # transformers 5.x's Olmo3Config cannot read the sliding layers' base from rope_theta-style keys: also write
        # its per-layer-type rope_parameters (its rope_scaling / rope_theta then agree with them).
        out = super().to_dict()
        full = {**(self.rope_scaling or {}), "rope_type": self.rope_type, "rope_theta": self.rope_theta}
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": self.rope_local_base_freq}}
        return dict(sorted(out.items()))
