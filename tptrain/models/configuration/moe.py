"""The mixture-of-experts configs: the router and experts fields every MoE family shares (MoeConfig), and
Qwen3-MoE, Mixtral, Qwen2-MoE and OLMoE."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tptrain.models.configuration.base import DECODER_SP_PLAN, PretrainedConfig, DECODER_TP_PLAN
from tptrain.models.configuration.llama import Qwen3Config
from tptrain.models.configuration.mistral import MistralConfig


# Attention rules of the MoE families (the dense MLP rules are added only where a layer keeps a dense MLP).
_ATTENTION_TP_PLAN = {k: v for k, v in DECODER_TP_PLAN.items() if ".mlp." not in k}
_DENSE_MLP_TP_PLAN = {k: v for k, v in DECODER_TP_PLAN.items() if ".mlp." in k}


@dataclasses.dataclass(kw_only=True)
class MoeConfig(PretrainedConfig):
    """Fields every mixture-of-experts family shares; mixed into each family's config (Qwen3-MoE, Mixtral, ...).

    An MoE layer replaces the MLP by a softmax top-k router (`mlp.gate`, no bias) over `num_experts` SwiGLU
    experts held stacked in memory (`mlp.experts.gate_proj` / `up_proj`: (experts, moe_intermediate, hidden),
    `down_proj`: (experts, hidden, moe_intermediate)); on disk they are the hub's per-expert tensors, renamed by
    `expert_checkpoint_names` at the checkpoint boundary only.
    """

    # config.json's spelling of the expert count (transformers 5 reads both, the hub's configs use this one).
    experts_key: ClassVar[str] = "num_experts"
    # The MoE layer's module name on disk, and each stacked projection's per-expert name there
    # (`{module}.experts.{i}.{name}.weight`). In memory the module is always `mlp` and the projections
    # gate_proj / up_proj / down_proj.
    expert_checkpoint_module: ClassVar[str] = "mlp"
    expert_checkpoint_names: ClassVar[dict[str, str]] = {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                         "down_proj": "down_proj"}
    # The routing weights stay in (at least) fp32 (Mixtral: the expert outputs are weighted in fp32, then cast);
    # False: cast to the activations' dtype first (Qwen-MoE, OLMoE).
    router_weights_in_float32: ClassVar[bool] = False
    # How the router scores experts: "softmax" (top-k of the softmax) or "sigmoid" (DeepSeek-V3's group-limited
    # top-k of sigmoid scores, models/moe.py GroupLimitedRouter).
    router_scoring: ClassVar[str] = "softmax"
    unread_keys: ClassVar[tuple[str, ...]] = ()  # keys of other MoE families that this family's model ignores
    # Router options of other MoE families: refused when config.json has them, rather than ignored.
    foreign_router_keys: ClassVar[tuple[str, ...]] = ("router_type", "scoring_func", "topk_method", "n_group",
                                                      "topk_group", "routed_scaling_factor")
    # Rules added to the plan under expert parallelism (DistributedConfig(enable_expert_parallel=True)).
    base_model_ep_plan: ClassVar[dict[str, str]] = {"layers.*.mlp.experts": "expert_parallel"}

    num_experts: int = 8  # routed experts per MoE layer
    num_experts_per_tok: int = 2  # top-k: experts each token is sent to
    moe_intermediate_size: int | None = None  # each expert's inner width; None -> intermediate_size
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int | None = None  # a sigmoid-gated shared expert of this width (Qwen2-MoE)
    decoder_sparse_step: int = 1  # every decoder_sparse_step-th layer is an MoE layer ...
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)  # ... except these (dense MLPs)
    output_router_logits: bool = False  # compute the load-balancing aux loss (added to the loss with labels)
    router_aux_loss_coef: float = 0.001  # its weight in the loss
    router_jitter_noise: float = 0.0  # only 0 is implemented

    def _fill_defaults(self) -> None:
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        super()._fill_defaults()

    def _validate(self) -> None:
        super()._validate()
        name = type(self).__name__
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                             f"{self.num_experts}; a token cannot be routed to more experts than exist.")
        if self.router_jitter_noise:
            raise ValueError(f"{name}: router_jitter_noise={self.router_jitter_noise} is not implemented (tptrain's "
                             "router is deterministic); set it to 0.0.")
        for key in self.foreign_router_keys:
            if key in self.extra:
                raise ValueError(f"{name}: router option {key}={self.extra[key]!r} is not implemented; tptrain's "
                                 "router is softmax top-k (with norm_topk_prob); remove the key.")
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"{name}: mlp_only_layers={self.mlp_only_layers} lists {bad}, not layer indices in "
                             f"[0, {self.num_hidden_layers}).")

    @property
    def layer_is_moe(self) -> list[bool]:
        """Per layer: an MoE block (router + experts) instead of the dense MLP, as transformers decides it."""
        return [i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                for i in range(self.num_hidden_layers)]

    @property
    def shared_experts_intermediate_size(self) -> int | None:
        """Inner width of the ungated shared experts (`mlp.shared_experts`, added to the routed experts' output:
        DeepSeek-V3); None: none."""
        return None

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Attention as the family's, experts tensor-parallel (`expert_tensor_parallel`), the router replicated,
        the shared expert and any dense-MLP layer as a dense MLP."""
        plan = {**self.attention_tp_plan, "layers.*.mlp.experts": "expert_tensor_parallel"}
        if self.shared_expert_intermediate_size:
            plan.update({k.replace(".mlp.", ".mlp.shared_expert."): v for k, v in _DENSE_MLP_TP_PLAN.items()})
        if not all(self.layer_is_moe):
            plan.update(_DENSE_MLP_TP_PLAN)
        return plan

    @property
    def attention_tp_plan(self) -> dict[str, str]:
        return _ATTENTION_TP_PLAN

    @property
    def base_model_sp_plan(self) -> dict[str, str]:
        """The decoder's SP plan (the norms on the residual stream) and the routers: under sequence parallelism each
        tp rank routes its own sequence shard, so a router's (and a shared expert's gate's) weight gradient is a
        partial sum over tp."""
        plan = dict(DECODER_SP_PLAN)
        if any(self.layer_is_moe):
            plan["layers.*.mlp.gate"] = "sequence_parallel"
            if self.shared_expert_intermediate_size:
                plan["layers.*.mlp.shared_expert_gate"] = "sequence_parallel"
        return plan

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out[self.experts_key] = out.pop("num_experts")
        return dict(sorted(out.items()))

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "PretrainedConfig":
        d = dict(config_dict)
        for key in ("num_local_experts", "num_experts"):  # either spelling (transformers' attribute_map)
            if key in d:
                d["num_experts"] = d.pop(key)
        # A key this family's transformers model never reads (a config.json may carry it: transformers keeps any
        # keyword it is given) must not build a piece the checkpoint does not hold.
        foreign = {key: d.pop(key) for key in cls.unread_keys if key in d}
        config = super().from_dict(d)
        config.extra.update(foreign)
        return config


@dataclasses.dataclass(kw_only=True)
class Qwen3MoeConfig(MoeConfig, Qwen3Config):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), MoE layers with softmax top-k routing."""

    model_type: ClassVar[str] = "qwen3_moe"
    unread_keys: ClassVar[tuple[str, ...]] = ("shared_expert_intermediate_size",)  # no shared expert

    intermediate_size: int = 6144
    moe_intermediate_size: int | None = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    head_dim: int | None = None  # transformers' Qwen3-MoE: hidden_size // num_attention_heads unless given

    @property
    def attention_tp_plan(self) -> dict[str, str]:
        return {**_ATTENTION_TP_PLAN, "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}


@dataclasses.dataclass(kw_only=True)
class MixtralConfig(MoeConfig, MistralConfig):
    """Mixtral: Mistral attention, MoE in every layer with the top-k probabilities renormalised; on disk the layer
    is `block_sparse_moe` and expert i's projections `w1` (gate), `w3` (up), `w2` (down)."""

    model_type: ClassVar[str] = "mixtral"
    # transformers' model reads none of these (its experts are intermediate_size wide, in every layer)
    unread_keys: ClassVar[tuple[str, ...]] = ("shared_expert_intermediate_size", "moe_intermediate_size",
                                              "decoder_sparse_step", "mlp_only_layers")
    experts_key: ClassVar[str] = "num_local_experts"
    expert_checkpoint_module: ClassVar[str] = "block_sparse_moe"
    expert_checkpoint_names: ClassVar[dict[str, str]] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    router_weights_in_float32: ClassVar[bool] = True

    num_experts: int = 8
    norm_topk_prob: bool = True  # Mixtral always renormalises; transformers' Mixtral has no such key
    sliding_window: int | None = None
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-5

    def _validate(self) -> None:
        super()._validate()
        if not self.norm_topk_prob:
            raise ValueError("MixtralConfig: norm_topk_prob=false is not Mixtral (transformers' Mixtral always "
                             "renormalises the top-k probabilities); remove the key.")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("norm_topk_prob", *self.unread_keys):  # not Mixtral keys: transformers' Mixtral has none of them
            out.pop(key)
        return out

    @property
    def layer_is_moe(self) -> list[bool]:
        return [True] * self.num_hidden_layers


@dataclasses.dataclass(kw_only=True)
class Qwen2MoeConfig(MoeConfig, PretrainedConfig):
    """Qwen2-MoE: Qwen2 attention (bias on q/k/v only), MoE layers plus a shared expert whose output is scaled by
    sigmoid(shared_expert_gate(x)) and added to the routed experts'."""

    model_type: ClassVar[str] = "qwen2_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    moe_intermediate_size: int | None = 1408
    shared_expert_intermediate_size: int | None = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_experts: int = 60
    num_experts_per_tok: int = 4
    max_position_embeddings: int = 32768
    qkv_bias: bool = True  # bias on q/k/v (o_proj has none)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def o_proj_bias(self) -> bool:
        return False


@dataclasses.dataclass(kw_only=True)
class OlmoeConfig(MoeConfig, PretrainedConfig):
    """OLMoE: Llama-style input norms, RMSNorm on q and k over their whole projected width (`distributed_rmsnorm`
    under TP, as OLMo 2), MoE in every layer."""

    model_type: ClassVar[str] = "olmoe"
    # transformers' model reads none of these (its experts are intermediate_size wide, in every layer)
    unread_keys: ClassVar[tuple[str, ...]] = ("shared_expert_intermediate_size", "moe_intermediate_size",
                                              "decoder_sparse_step", "mlp_only_layers")
    qk_norm: ClassVar[str | None] = "width"

    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_experts: int = 64
    num_experts_per_tok: int = 8
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    clip_qkv: float | None = None  # only None is implemented

    def _validate(self) -> None:
        super()._validate()
        if self.clip_qkv is not None:
            raise ValueError(f"OlmoeConfig: clip_qkv={self.clip_qkv} is not implemented; set it to null.")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in self.unread_keys:  # not OLMoE keys
            out.pop(key)
        return out

    @property
    def layer_is_moe(self) -> list[bool]:
        return [True] * self.num_hidden_layers

    @property
    def attention_tp_plan(self) -> dict[str, str]:
        return {**_ATTENTION_TP_PLAN, "layers.*.self_attn.q_norm": "distributed_rmsnorm",
                "layers.*.self_attn.k_norm": "distributed_rmsnorm"}
