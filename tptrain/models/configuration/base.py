"""The config base: one typed dataclass reading and writing Hugging Face `config.json`, the decoder's default
TP/SP plans (DECODER_TP_PLAN, DECODER_SP_PLAN), and the RoPE-key helpers every family shares.

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

from tptrain.checks import is_positive_int
from tptrain.io.hub import resolve_checkpoint
from tptrain.io.json_files import read_json

CONFIG_NAME = "config.json"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (tanh-approximated GELU: Gemma)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
# Fields that size a tensor, a loop or a window: positive ints wherever a config has them (`int | None` ones may be
# null: a default fills them in, or None means none, as for sliding_window).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
               "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
               "sliding_window", "original_max_position_embeddings", "no_rope_layer_interval", "kv_lora_rank",
               "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group")

# The decoder's TP plan, shared by the families (a family's `base_model_tp_plan` is it, or it with rules added or
# left out): transformers' plan for LlamaModel / Qwen2Model, plus the vocab-parallel embedding.
DECODER_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

# The decoder's SP plan (a family's `base_model_sp_plan`): the norms on the residual stream between TP regions,
# sharded along the sequence under sequence parallelism.
DECODER_SP_PLAN = {
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
        self._check_sizes()  # first: the defaults below divide by them and build per-layer lists of them
        self._fill_defaults()
        self._validate()

    def _fill_defaults(self) -> None:
        """The fields config.json may leave out, derived from the others (families add theirs)."""
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def _check_sizes(self) -> None:
        """Every SIZE_FIELDS field this config has is a positive int (or null where its type allows None), so a bad
        config.json is this error, raised wherever the config is read (every rank), not torch's "negative
        dimension" from deep inside the model build."""
        for f in dataclasses.fields(self):
            value, nullable = getattr(self, f.name), "None" in str(f.type)  # typed `int | None`
            if f.name not in SIZE_FIELDS or (value is None and nullable):
                continue
            if not is_positive_int(value):
                key = getattr(self, "experts_key", f.name) if f.name == "num_experts" else f.name  # Mixtral's
                null = " or null" if nullable else ""
                raise ValueError(f"{type(self).__name__}: {key} must be a positive integer{null}, got {value!r} "
                                 f"(config.json's \"{key}\")")

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
            _check_rope_scaling(self, scaling)

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
    def key_value_head_dims(self) -> tuple[int, int]:
        """(features of one key head, of one value head) as attention sees them (context parallelism gathers both)."""
        return self.head_dim, self.head_dim

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek's MLA: low-rank q and kv, decoupled RoPE) instead of q/k/v heads."""
        return False

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


def _check_rope_scaling(config: PretrainedConfig, scaling: dict[str, Any] | None) -> None:
    """One layer's rope_scaling: a supported type, with the keys that type needs."""
    name, rope_type = type(config).__name__, rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{name}: rope_scaling type {rope_type!r} is not implemented; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    required = {"llama3": _LLAMA3_ROPE_KEYS, "linear": ("factor",),
                "yarn": ("original_max_position_embeddings",)}.get(rope_type, ())
    if missing := [k for k in required if k not in scaling]:
        raise ValueError(f"{name}: rope_scaling of type {rope_type!r} lacks {missing}.")
    if rope_type != "longrope":
        return
    half = config.rotary_dim // 2
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != half:
            raise ValueError(f"{name}: rope_scaling of type 'longrope' needs {key}, a list of {half} numbers "
                             f"(rotary_dim // 2), got {factors!r}.")
    has_top = getattr(config, "original_max_position_embeddings", None) or config.extra.get(
        "original_max_position_embeddings")
    if not (has_top or scaling.get("original_max_position_embeddings")):
        raise ValueError(f"{name}: rope_scaling of type 'longrope' needs original_max_position_embeddings.")


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
    """The parsed `config.json` of a checkpoint directory or hub id (ValueError naming the file and line when it is
    not a JSON object)."""
    return read_json(resolve_checkpoint(path_or_id, config_only=True) / CONFIG_NAME)


def _sliding_windows(config: PretrainedConfig, layer_types: list[str]) -> list[int | None]:
    """`layer_types` ("full_attention" / "sliding_attention" per layer) -> each layer's window."""
    name = type(config).__name__
    unknown = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{name}: layer_types value(s) {unknown} not implemented; supported: "
                         f"{', '.join(SUPPORTED_LAYER_TYPES)}.")
    window = config.sliding_window  # a positive int or None (PretrainedConfig._check_sizes)
    if window is None and "sliding_attention" in layer_types:
        raise ValueError(f"{name}: layer_types has 'sliding_attention' layers but sliding_window is null.")
    return [window if t == "sliding_attention" else None for t in layer_types]
