"""DeepSeek-V3 (and V3.1, same model_type): multi-head latent attention, a sigmoid router
with group-limited top-k and a score-correction bias, shared experts, the first layers dense."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from tptrain.models.configuration.base import PretrainedConfig, rope_type_of
from tptrain.models.configuration.moe import _DENSE_MLP_TP_PLAN, MoeConfig

# transformers' DeepSeek-V2 attention plan: the MLA heads split over tp by their per-head projections (q_b_proj or
# q_proj, kv_b_proj) and o_proj; the low-rank down-projections and their norms whole on every rank (their gradients
# arrive whole: the colwise boundary after them sums its input gradient), except kv_a_proj_with_mqa's RoPE key, read
# straight by this rank's heads, whose partial gradient 'mla_kv_a_proj' sums.
_MLA_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}

# Under sequence parallelism (Megatron-Core's MLA): the down-projections and their norms run on this rank's sequence
# shard (per token; their weight gradients summed over tp), the per-head projections gather the latents (colwise
# under SP), and the shared RoPE key, read by every head over the whole sequence, is gathered where it leaves the
# latent path (all-gather fwd / reduce-scatter bwd).
_MLA_SP_PLAN = {
    "layers.*.self_attn.q_a_proj": "sequence_parallel",
    "layers.*.self_attn.q_a_layernorm": "sequence_parallel",
    "layers.*.self_attn.kv_a_proj_with_mqa": "sequence_parallel",
    "layers.*.self_attn.kv_a_layernorm": "sequence_parallel",
    "layers.*.self_attn.rope_key": "sequence_gather",
}


@dataclasses.dataclass(kw_only=True)
class DeepseekV3Config(MoeConfig, PretrainedConfig):
    """DeepSeek-V3. Attention (`latent_attention`): q from `q_proj`, or low-rank through `q_a_proj` ->
    `q_a_layernorm` -> `q_b_proj` (q_lora_rank); k and v from one shared latent `kv_a_proj_with_mqa` (kv_lora_rank
    features plus one RoPE key of qk_rope_head_dim shared by all heads) -> `kv_a_layernorm` -> `kv_b_proj`; each
    head's q/k are qk_nope_head_dim features without RoPE then qk_rope_head_dim with it, v is v_head_dim wide.
    MLP: dense for the first `first_k_dense_replace` layers, then `n_routed_experts` experts picked by a sigmoid
    router (`mlp.gate`, its `e_score_correction_bias` frozen), plus `n_shared_experts` shared experts."""

    model_type: ClassVar[str] = "deepseek_v3"
    # transformers' DeepSeek-V3 reads none of these (its shared experts are n_shared_experts wide, its dense layers
    # the first first_k_dense_replace)
    unread_keys: ClassVar[tuple[str, ...]] = ("shared_expert_intermediate_size", "decoder_sparse_step",
                                              "mlp_only_layers")
    experts_key: ClassVar[str] = "n_routed_experts"
    router_scoring: ClassVar[str] = "sigmoid"
    router_weights_in_float32: ClassVar[bool] = True  # the sigmoid router's weights stay fp32, as transformers'
    foreign_router_keys: ClassVar[tuple[str, ...]] = ("router_type",)

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # the dense layers' MLP
    moe_intermediate_size: int | None = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128  # must equal num_attention_heads: kv_b_proj makes every head's k and v
    num_experts: int = 256  # config.json: n_routed_experts
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    n_shared_experts: int = 1  # shared experts, one MLP of n_shared_experts * moe_intermediate_size
    routed_scaling_factor: float = 2.5  # factor on the routing weights (after renormalising)
    n_group: int = 8  # experts form n_group groups; a token picks among the topk_group best groups only
    topk_group: int = 4
    first_k_dense_replace: int = 3  # layers [0, first_k_dense_replace) keep the dense MLP
    q_lora_rank: int | None = 1536  # None: q from one q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # the RoPE features of q and k are pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    def _fill_defaults(self) -> None:
        if self.head_dim is None:  # transformers' DeepseekV3Config: head_dim is the RoPE part
            self.head_dim = self.qk_rope_head_dim
        super()._fill_defaults()

    def _validate(self) -> None:
        super()._validate()
        name, experts = "DeepseekV3Config", self.num_experts
        problems = []
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                            f"{self.num_attention_heads}: kv_b_proj makes a key and a value for every head")
        if experts % self.n_group or experts // self.n_group < 2:
            problems.append(f"n_routed_experts={experts} must split into n_group={self.n_group} groups of at least "
                            "2 experts (a group scores by its two best experts)")
        elif not self.topk_group <= self.n_group or self.num_experts_per_tok > self.topk_group * (
                experts // self.n_group):
            problems.append(f"topk_group={self.topk_group} groups of {experts // self.n_group} experts (of n_group="
                            f"{self.n_group}) must hold num_experts_per_tok={self.num_experts_per_tok} experts")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            problems.append(f"n_shared_experts={self.n_shared_experts} and first_k_dense_replace="
                            f"{self.first_k_dense_replace} must be >= 0")
        if self.output_router_logits:
            problems.append("output_router_logits=true: DeepSeek-V3 has no load-balancing loss (its balance is the "
                            "e_score_correction_bias, as in transformers); set it to false")
        for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if self.extra.get(key, value) != value:
                problems.append(f"{key}={self.extra[key]!r} is not implemented; DeepSeek-V3's is {value!r}")
        if "quantization_config" in self.extra:
            problems.append("quantization_config is set (the hub's FP8 weights with their scales): tptrain reads "
                            "plain weights; dequantize the checkpoint to bf16 first")
        if problems:
            raise ValueError(f"{name}: " + "; ".join(problems) + ".")

    @property
    def latent_attention(self) -> bool:
        return True

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def key_value_head_dims(self) -> tuple[int, int]:
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    @property
    def attention_scale(self) -> float:
        """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared (transformers'
        `yarn_apply_mscale`): the softmax temperature follows the context extension."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling or {}
        factor = scaling.get("factor") or 1.0
        if rope_type_of(scaling) != "default" and scaling.get("mscale_all_dim") and factor > 1:
            mscale = 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    @property
    def layer_is_moe(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    @property
    def shared_experts_intermediate_size(self) -> int | None:
        return self.moe_intermediate_size * self.n_shared_experts or None

    @property
    def attention_tp_plan(self) -> dict[str, str]:
        absent = "q_b_proj" if self.q_lora_rank is None else "q_proj"  # a rule must match a module
        return {k: v for k, v in _MLA_TP_PLAN.items() if not k.endswith(f".{absent}")}

    @property
    def base_model_sp_plan(self) -> dict[str, str]:
        """The MoE decoder's SP plan and the latent attention's (without q_lora_rank: no q_a_* to rule)."""
        low_rank_q = self.q_lora_rank is not None
        return {**super().base_model_sp_plan,
                **{k: v for k, v in _MLA_SP_PLAN.items() if low_rank_q or ".q_a_" not in k}}

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        plan = super().base_model_tp_plan
        if self.shared_experts_intermediate_size:
            plan.update({k.replace(".mlp.", ".mlp.shared_experts."): v for k, v in _DENSE_MLP_TP_PLAN.items()})
        return plan

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in (*self.unread_keys, "router_aux_loss_coef", "router_jitter_noise"):  # not DeepSeek-V3 keys
            out.pop(key)
        return out

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "PretrainedConfig":
        d = dict(config_dict)
        if "n_routed_experts" in d:
            d["num_experts"] = d.pop("n_routed_experts")
        return super().from_dict(d)
