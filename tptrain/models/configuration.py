"""Model configs: one typed dataclass reading and writing Hugging Face `config.json`.

    cfg = AutoConfig.from_pretrained("path/to/checkpoint")   # or Qwen3Config.from_pretrained(...)
    cfg.save_pretrained("out/")                              # transformers' AutoConfig loads it too

Keys are written in the spelling every transformers version reads: `rope_theta` + `rope_scaling`
(not 5.x's `rope_parameters`) and `torch_dtype` (not `dtype`). Both spellings are read. Keys this
class does not know (`transformers_version`, `use_cache`, `layer_types`, ...) are kept in `extra` and
written back unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
from typing import Any, ClassVar

from tptrain.checkpoint.hub import resolve_checkpoint

CONFIG_NAME = "config.json"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (tanh-approximated GELU: Gemma)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")

# HF's plan for LlamaModel / Qwen2Model, plus our vocab-parallel embedding.
_DECODER_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

# Norms on the residual stream between TP regions: sharded along the sequence under sequence parallelism.
_DECODER_SP_PLAN = {
    "norm": "sequence_parallel",
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.post_attention_layernorm": "sequence_parallel",
}


@dataclasses.dataclass(kw_only=True)
class PretrainedConfig:
    """Architecture of a decoder-only LM. Defaults are transformers' LlamaConfig defaults."""

    model_type: ClassVar[str] = ""
    # {module glob relative to the base model: partition style name}; see parallel/plan.py.
    base_model_tp_plan: ClassVar[dict[str, str]] = {}
    # Rules added to it under sequence parallelism (DistributedConfig(enable_sequence_parallel=True)).
    base_model_sp_plan: ClassVar[dict[str, str]] = {}
    # RMSNorm on q and k before RoPE, fixed per architecture (not in config.json): None (none), "head" (over each
    # head's head_dim: Qwen3) or "width" (over the whole projected width, before the head split: OLMo 2).
    qk_norm: ClassVar[str | None] = None
    # Where each decoder layer's RMSNorms sit: on each sublayer's input (input_layernorm, post_attention_layernorm:
    # Llama), on each sublayer's output before the residual add (post_attention_layernorm,
    # post_feedforward_layernorm: OLMo 2), or both (input_layernorm, post_attention_layernorm,
    # pre_feedforward_layernorm, post_feedforward_layernorm: Gemma 2/3).
    norm_sublayer_input: ClassVar[bool] = True
    norm_sublayer_output: ClassVar[bool] = False
    # Every RMSNorm multiplies by (norm_weight_offset + weight): 1.0 for Gemma's norms, whose weights are offsets
    # from 1 (initialised to 0).
    norm_weight_offset: ClassVar[float] = 0.0
    # The embedding scale is rounded to the embedding's dtype before multiplying (Gemma: sqrt(hidden) in bf16).
    embedding_scale_in_weight_dtype: ClassVar[bool] = False
    # Low-precision arithmetic of OLMo 2: every RMSNorm multiplies by its weight in fp32 before casting back, and
    # RoPE rotates q and k in fp32 (Llama: cast first, then scale; rotate in the activations' dtype).
    norm_scale_in_float32: ClassVar[bool] = False
    rope_in_float32: ClassVar[bool] = False
    # The checkpoint packs q/k/v into one `self_attn.qkv_proj` (rows: q, then k, then v) and gate/up into one
    # `mlp.gate_up_proj` (rows: gate, then up), as Phi-3 does; False: separate q/k/v and gate/up projections.
    fused_projections: ClassVar[bool] = False

    vocab_size: int = 32000  # rows of embed_tokens and lm_head
    hidden_size: int = 4096  # residual stream width
    intermediate_size: int = 11008  # MLP inner width (gate/up output rows)
    num_hidden_layers: int = 32  # decoder layers
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int | None = None  # key/value heads (GQA); None -> num_attention_heads
    head_dim: int | None = None  # per-head width; None -> hidden_size // num_attention_heads
    hidden_act: str = "silu"  # MLP activation: "silu" or "gelu_pytorch_tanh"
    max_position_embeddings: int = 2048  # longest sequence the model was trained for
    initializer_range: float = 0.02  # std of the normal init of Linear/Embedding weights
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    rope_theta: float = 10000.0  # RoPE base wavelength
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    attention_bias: bool = False  # bias on q/k/v (and o, except Qwen2) projections
    mlp_bias: bool = False  # bias on gate/up/down projections
    tie_word_embeddings: bool = False  # lm_head.weight is model.embed_tokens.weight
    bos_token_id: int | None = 1  # beginning-of-sequence token
    eos_token_id: int | list[int] | None = 2  # end-of-sequence token(s)
    pad_token_id: int | None = None  # padding token; its embedding row gets no gradient (as in HF)
    torch_dtype: str | None = None  # dtype the weights were saved in, e.g. "bfloat16"
    architectures: list[str] | None = None  # model class names, e.g. ["LlamaForCausalLM"] (vLLM reads it)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # unknown keys, kept for round-trip

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._validate()

    def _validate(self) -> None:
        name = type(self).__name__
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it to be.")
        if self.mlp_activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{name}: {self.mlp_activation_key}={self.mlp_activation!r} is not implemented; "
                             f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}.")
        if self.extra.get("use_sliding_window"):
            raise ValueError(f"{name}: use_sliding_window=true is not implemented; set it to false "
                             "(full causal attention) to train this model with tptrain.")
        # Per-layer lists: their properties check the values, the lengths are checked here.
        for key, per_layer in (("layer_types", self.layer_sliding_windows), ("no_rope_layers", self.layer_uses_rope)):
            if len(per_layer) != self.num_hidden_layers:
                raise ValueError(f"{name}: {key} has {len(per_layer)} entries, num_hidden_layers="
                                 f"{self.num_hidden_layers} needs one per layer.")
        for _, scaling in self.layer_ropes:
            rope_type = rope_type_of(scaling)
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"{name}: rope_scaling type {rope_type!r} is not implemented; supported: "
                                 f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
            required = {"llama3": _LLAMA3_ROPE_KEYS, "linear": ("factor",),
                        "yarn": ("original_max_position_embeddings",)}.get(rope_type, ())
            if missing := [k for k in required if k not in scaling]:
                raise ValueError(f"{name}: rope_scaling of type {rope_type!r} lacks {missing}.")
            if rope_type == "longrope":
                self._validate_longrope(scaling)

    def _validate_longrope(self, scaling: dict[str, Any]) -> None:
        name, half = type(self).__name__, self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, list) or len(factors) != half:
                raise ValueError(f"{name}: rope_scaling of type 'longrope' needs {key}, a list of {half} numbers "
                                 f"(rotary_dim // 2), got {factors!r}.")
        has_top = getattr(self, "original_max_position_embeddings", None) or self.extra.get(
            "original_max_position_embeddings")
        if not (has_top or scaling.get("original_max_position_embeddings")):
            raise ValueError(f"{name}: rope_scaling of type 'longrope' needs original_max_position_embeddings.")

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.rope_scaling)

    @property
    def layer_ropes(self) -> list[tuple[float, dict[str, Any] | None]]:
        """Per layer: (RoPE base, rope_scaling dict or None) its q and k are rotated with."""
        return [(self.rope_theta, self.rope_scaling)] * self.num_hidden_layers

    @property
    def mlp_activation(self) -> str:
        """The MLP's gate activation, one of SUPPORTED_ACTIVATIONS."""
        return self.hidden_act

    @property
    def mlp_activation_key(self) -> str:
        return "hidden_act"

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per layer: how many keys back a query sees (itself included), None = full causal attention.

        Families without sliding windows accept only full-attention `layer_types` (transformers'
        Qwen2/Qwen3 write them); a window there would be ignored by tptrain, so it is an error.
        """
        layer_types = self.extra.get("layer_types") or ["full_attention"] * self.num_hidden_layers
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{type(self).__name__}: layer_types={layer_types} is not implemented for "
                             f"model_type {self.model_type!r}; only 'full_attention' layers are.")
        return [None] * len(layer_types)

    @property
    def layer_uses_rope(self) -> list[bool]:
        """Per layer: whether q and k are rotated (False: no positional encoding in that layer)."""
        return [True] * self.num_hidden_layers

    @property
    def layer_is_moe(self) -> list[bool]:
        """Per layer: a mixture-of-experts block instead of the dense MLP (MoeConfig's families)."""
        return [False] * self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        """Leading features of each head that RoPE rotates (the rest pass through): all of head_dim here."""
        return self.head_dim

    @property
    def attention_scale(self) -> float | None:
        """Softmax scale of q.k; None = 1/sqrt(head_dim) (SDPA's default)."""
        return None

    @property
    def query_position_scale(self) -> tuple[float, int] | None:
        """(beta, length): after RoPE, the queries at position p are multiplied by 1 + beta * log(1 + floor(p /
        length)) (Llama 4's attention temperature, Ministral 3); None = no position-dependent scale."""
        return None

    @property
    def embedding_scale(self) -> float:
        """Factor on the token embeddings before the first layer."""
        return 1.0

    @property
    def attn_softcap(self) -> float | None:
        """Attention scores become tanh(scores / cap) * cap before the softmax; None = no capping."""
        return None

    @property
    def logit_softcap(self) -> float | None:
        """The logits become tanh(logits / cap) * cap; None = no capping."""
        return None

    @property
    def residual_scale(self) -> float:
        """Factor on each attention / MLP output before it is added to the residual stream."""
        return 1.0

    @property
    def logits_divisor(self) -> float:
        """The logits (and so the loss) are lm_head's output divided by this."""
        return 1.0

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "PretrainedConfig":
        d = copy.deepcopy(config_dict)
        model_type = d.pop("model_type", cls.model_type)
        if cls.model_type and model_type != cls.model_type:
            raise ValueError(f"{cls.__name__} reads model_type {cls.model_type!r}, the config says "
                             f"{model_type!r}; use tptrain.models.AutoConfig to pick the class.")
        if (dtype := d.pop("dtype", None)) is not None:  # transformers-5 spelling wins, as there
            d["torch_dtype"] = dtype
        absorb_rope_parameters(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        return cls(**known, extra=d)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name))
               for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(copy.deepcopy(self.extra))
        out["model_type"] = self.model_type
        return dict(sorted(out.items()))

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike) -> "PretrainedConfig":
        """Read `config.json` from a checkpoint directory or hub id."""
        return cls.from_dict(load_config_dict(path_or_id))

    def save_pretrained(self, save_directory: str | os.PathLike) -> pathlib.Path:
        """Write `save_directory/config.json`; returns its path."""
        path = pathlib.Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        config_file = path / CONFIG_NAME
        config_file.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return config_file


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The rope type of a `rope_scaling` dict (None: "default"); transformers reads "rope_type", then "type"."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def absorb_rope_parameters(d: dict[str, Any]) -> None:
    """Fold transformers-5 `rope_parameters` into `rope_theta` / `rope_scaling`, in place.

    Priority is transformers': a `rope_scaling` key beats `rope_parameters`, and the theta inside
    `rope_parameters` beats a top-level `rope_theta`. Per-layer-type parameters (Gemma 3:
    {"full_attention": {...}, "sliding_attention": {...}}) become the full layers' `rope_theta` / `rope_scaling`
    and the sliding layers' `rope_local_base_freq`, the spelling earlier transformers versions read.
    """
    params = d.pop("rope_parameters", None)
    if not params:
        return
    params = dict(params)
    if "sliding_attention" in params:
        local = dict(params.pop("sliding_attention") or {})
        if rope_type_of(local) != "default":
            raise ValueError(f"rope_parameters['sliding_attention'] of type {rope_type_of(local)!r} is not "
                             "implemented; only 'default' RoPE on sliding-window layers is.")
        if "rope_theta" in local:
            d["rope_local_base_freq"] = local["rope_theta"]
        params = dict(params.pop("full_attention", None) or {})
    if "rope_theta" in params:
        d["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params:  # transformers 5 keeps it among the RoPE parameters
        d.setdefault("partial_rotary_factor", params.pop("partial_rotary_factor"))
    if d.get("rope_scaling") is None:  # also when "default": None, not a family's own default scaling
        d["rope_scaling"] = params if rope_type_of(params) != "default" else None


def load_config_dict(path_or_id: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory or hub id."""
    return json.loads((resolve_checkpoint(path_or_id, config_only=True) / CONFIG_NAME).read_text())


@dataclasses.dataclass(kw_only=True)
class LlamaConfig(PretrainedConfig):
    """Llama 2/3 (and Llama-architecture models such as TinyLlama, SmolLM)."""

    model_type: ClassVar[str] = "llama"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN


@dataclasses.dataclass(kw_only=True)
class Qwen2Config(PretrainedConfig):
    """Qwen2 / Qwen2.5: bias on q/k/v, none on o_proj."""

    model_type: ClassVar[str] = "qwen2"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN

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
        **_DECODER_TP_PLAN,
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    }
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN
    qk_norm: ClassVar[str | None] = "head"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    head_dim: int | None = 128  # transformers' Qwen3 default; not hidden_size // num_attention_heads
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None


def _sliding_windows(config: PretrainedConfig, layer_types: list[str]) -> list[int | None]:
    """`layer_types` ("full_attention" / "sliding_attention" per layer) -> each layer's window."""
    name = type(config).__name__
    unknown = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{name}: layer_types value(s) {unknown} not implemented; supported: "
                         f"{', '.join(SUPPORTED_LAYER_TYPES)}.")
    window = config.sliding_window
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{name}: sliding_window={window!r} must be a positive integer or null.")
    if window is None and "sliding_attention" in layer_types:
        raise ValueError(f"{name}: layer_types has 'sliding_attention' layers but sliding_window is null.")
    return [window if t == "sliding_attention" else None for t in layer_types]


@dataclasses.dataclass(kw_only=True)
class MistralConfig(PretrainedConfig):
    """Mistral: every layer attends over a sliding window of `sliding_window` keys (None: full)."""

    model_type: ClassVar[str] = "mistral"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN

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

    def __post_init__(self) -> None:
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        super().__post_init__()

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


@dataclasses.dataclass(kw_only=True)
class GraniteConfig(PretrainedConfig):
    """IBM Granite (3.x dense): scalar multipliers on embeddings, residual branches, scores and logits."""

    model_type: ClassVar[str] = "granite"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN

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


@dataclasses.dataclass(kw_only=True)
class SmolLM3Config(PretrainedConfig):
    """SmolLM3: some layers have no rotary embedding (NoPE), listed in `no_rope_layers`."""

    model_type: ClassVar[str] = "smollm3"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN

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

    def __post_init__(self) -> None:
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0)
                                   for i in range(self.num_hidden_layers)]
        super().__post_init__()

    @property
    def layer_uses_rope(self) -> list[bool]:
        if any(v not in (0, 1) for v in self.no_rope_layers):
            raise ValueError(f"SmolLM3Config: no_rope_layers={self.no_rope_layers} must hold 0 (no RoPE) or "
                             "1 (RoPE) per layer.")
        return [bool(v) for v in self.no_rope_layers]


@dataclasses.dataclass(kw_only=True)
class Olmo2Config(PretrainedConfig):
    """OLMo 2: RMSNorm on each sublayer's output (no input norms) and on q and k over their whole projected
    width. Under TP the q/k norms are `distributed_rmsnorm`, so attention stays sharded (transformers gathers
    q/k/v to every rank instead)."""

    model_type: ClassVar[str] = "olmo2"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        **_DECODER_TP_PLAN,
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


# Gemma's residual-stream norms: all four per layer and the final one hold sequence shards under SP.
_GEMMA_SP_PLAN = {
    **_DECODER_SP_PLAN,
    "layers.*.pre_feedforward_layernorm": "sequence_parallel",
    "layers.*.post_feedforward_layernorm": "sequence_parallel",
}


@dataclasses.dataclass(kw_only=True)
class Gemma2Config(PretrainedConfig):
    """Gemma 2: (1 + weight) RMSNorms before and after each sublayer, embeddings times sqrt(hidden_size), a
    tanh-GELU MLP, softmax scale query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores and logits,
    sliding-window and full layers (`layer_types`), tied embeddings."""

    model_type: ClassVar[str] = "gemma2"
    base_model_tp_plan: ClassVar[dict[str, str]] = _DECODER_TP_PLAN
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

    def __post_init__(self) -> None:
        if self.layer_types is None:  # transformers' default: every n-th layer full, the others sliding
            n = self._full_attention_every()
            self.layer_types = ["sliding_attention" if (i + 1) % n else "full_attention"
                                for i in range(self.num_hidden_layers)]
        super().__post_init__()

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
        **_DECODER_TP_PLAN,
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


@dataclasses.dataclass(kw_only=True)
class Phi3Config(PretrainedConfig):
    """Phi-3: fused qkv_proj and gate_up_proj (split per segment under TP by the `packed_colwise` style), RoPE on
    the first `partial_rotary_factor` of each head, default or `longrope` RoPE."""

    model_type: ClassVar[str] = "phi3"
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": "packed_colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj": "packed_colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_sp_plan: ClassVar[dict[str, str]] = _DECODER_SP_PLAN
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

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        super().__post_init__()

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


# ---------------------------------------------------------------- mixture of experts

# Attention rules of the MoE families (the dense MLP rules are added only where a layer keeps a dense MLP).
_ATTENTION_TP_PLAN = {k: v for k, v in _DECODER_TP_PLAN.items() if ".mlp." not in k}
_DENSE_MLP_TP_PLAN = {k: v for k, v in _DECODER_TP_PLAN.items() if ".mlp." in k}


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

    def __post_init__(self) -> None:
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        super().__post_init__()

    def _validate(self) -> None:
        super()._validate()
        name = type(self).__name__
        for key in ("num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {key}={value!r} must be a positive integer.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                             f"{self.num_experts}; a token cannot be routed to more experts than exist.")
        if self.router_jitter_noise:
            raise ValueError(f"{name}: router_jitter_noise={self.router_jitter_noise} is not implemented (tptrain's "
                             "router is deterministic); set it to 0.0.")
        for key in ("router_type", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor"):
            if key in self.extra:  # router options of other MoE families: refused rather than ignored
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
        return super().from_dict(d)


@dataclasses.dataclass(kw_only=True)
class Qwen3MoeConfig(MoeConfig, Qwen3Config):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), MoE layers with softmax top-k routing."""

    model_type: ClassVar[str] = "qwen3_moe"

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
        for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
                    "shared_expert_intermediate_size"):  # not Mixtral keys: transformers' Mixtral has none of them
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
        for key in ("decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
                    "shared_expert_intermediate_size"):  # not OLMoE keys
            out.pop(key)
        return out

    @property
    def layer_is_moe(self) -> list[bool]:
        return [True] * self.num_hidden_layers

    @property
    def attention_tp_plan(self) -> dict[str, str]:
        return {**_ATTENTION_TP_PLAN, "layers.*.self_attn.q_norm": "distributed_rmsnorm",
                "layers.*.self_attn.k_norm": "distributed_rmsnorm"}
