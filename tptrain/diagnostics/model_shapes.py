"""What the memory planner reads from a model: the widths of each decoder layer and every parameter's shape per rank,
from the config alone (the model is built on the meta device: no weights are read).

    shapes = ModelShapes.of(AutoConfig.from_pretrained("meta-llama/Llama-3.1-8B"), dtype=torch.float32)
    shapes.params(tp=2, ep=1)              # [ParamShape(unit, local shape, ...), ...] as `check_plan` splits them
    shapes.resolved(tp=3, ep=1).problems   # why tp=3 cannot run (the plan's own checks)

A parameter's unit is what FSDP2 wraps it in and what a pipeline stage holds: its decoder layer's index, "first"
(the embedding, held by the first stage) or "last" (final norm and head, held by the last stage).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tptrain.models import AutoModelForCausalLM, AutoModelForImageTextToText
from tptrain.models.registry import vision_language
from tptrain.parallel import contract
from tptrain.parallel.plan import ResolvedPlan, check_plan
from tptrain.parallel.styles import ShardSpec

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    inner: int  # one expert's inner width
    shared_inner: int = 0  # shared expert(s)' inner width (0: none)
    gated_shared: bool = False  # a sigmoid gate on the shared expert (Qwen2-MoE)
    renormalise: bool = False  # top-k weights divided by their sum


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's widths, whole (before any split). q_dim / v_dim: one head's query-key and value width;
    qk_norm: None, "head" or "width"; norms_in / norms_out: RMSNorms on each sublayer's input / output; softcap:
    attention scores materialised (soft-capped eager attention); latent: DeepSeek's MLA, with its (q, kv) ranks."""

    hidden: int
    heads: int
    kv_heads: int
    q_dim: int
    v_dim: int
    mlp_inner: int
    moe: MoEShape | None = None
    qk_norm: str | None = None
    norms_in: bool = True
    norms_out: bool = False
    norm_fp32: bool = False
    softcap: bool = False
    gqa_expanded: bool = True  # K and V repeated to every query head before attention
    latent: tuple[int, int] | None = None
    fused: bool = False  # one qkv_proj and one gate_up_proj (Phi-3) instead of separate projections
    window: int | None = None  # a sliding window (keys back a query sees), None: full causal attention


@dataclass(frozen=True)
class TowerShape:
    """A vision-language model's vision tower, whole (before any split), as the planner counts it: `depth` encoder
    layers of `hidden` features, `heads` of `head_dim`, an MLP of `inner`; the variants its ledger reads (norm:
    "layer" or "rms"; one fused qkv, whose towers attend image by image and copy the output; rotary positions;
    act_tensors: the MLP's inner-wide tensors kept, 4 gated, 3 for quick_gelu's sigmoid, else 2); an image's tokens:
    (side / patch)^2 patches (and a class token); `outside`: the norms (kind, width) and linears (in, out) on the
    image's side outside the layers (patch norms, the projector), in order. root / layers: module names."""

    root: str
    layers: str
    depth: int
    hidden: int
    heads: int
    head_dim: int
    inner: int
    norm: str
    fused_qkv: bool
    rotary: bool
    act_tensors: int
    patch: int
    image_size: int | None  # the side the tower is built for (None: any, e.g. Qwen2.5-VL's)
    class_token: bool
    outside: tuple[tuple, ...]

    def tokens(self, image_size: int | None) -> int:
        """The tower's tokens for one image of `image_size` pixels a side (default: the config's)."""
        side = image_size or self.image_size
        if side is None:
            raise ValueError(f"the vision tower at {self.root} takes images of any size: give --image-size (pixels a "
                             "side of the images the run trains on)")
        return (side // self.patch) ** 2 + self.class_token


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a rank holds it before FSDP2: its unit (a layer index, "first" or "last"), its shape after
    TP (and EP), whether it is a stacked expert tensor (FSDP2 wraps those over the ranks holding the same experts) and
    whether it is an nn.Linear's weight below the head (LoRA's "all-linear" targets)."""

    name: str
    unit: int | str
    shape: tuple[int, ...]
    expert: bool
    linear: bool
    tied: bool = False  # the head's copy of the embedding (held apart only by a last stage without the first)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(eq=False)  # hashed by identity: its methods cache per layout
class ModelShapes:
    """The model's shapes as the planner needs them: each decoder layer's widths (`layers`), every parameter's shape
    per rank (`params`). `model`: the meta model (kept for the plan checks)."""

    config: Any
    model: nn.Module
    dtype: torch.dtype
    layers: list[LayerShape]
    vocab: int
    tied: bool
    family: str  # what the layer widths were read from: "native" or "transformers (as a Llama-style decoder)"
    tower: TowerShape | None = None  # a vision-language model's vision tower

    @classmethod
    def of(cls, config: Any, *, dtype: torch.dtype) -> "ModelShapes":
        model = meta_model(config, dtype=dtype)
        native = getattr(model, "backend", "native") == "native"
        facts = model.tower_facts() if hasattr(model, "tower_facts") else None
        text = config.get_text_config() if facts is not None else config  # a vision-language model's decoder
        n = int(text.num_hidden_layers)
        return cls(config, model, dtype, [layer_shape(text, i) for i in range(n)], int(text.vocab_size),
                   bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)),
                   "native" if native else "transformers (its layers counted as a Llama-style decoder's)",
                   TowerShape(**facts) if facts is not None else None)

    @functools.lru_cache(maxsize=None)
    def tower_tp(self, tp: int, ep: int) -> int:
        """The ranks the tower's layers are split over at (tp, ep): tp where the plan splits them, else 1 (kept
        whole: a tp size its heads or widths do not divide)."""
        specs = self.resolved(tp, ep).specs
        prefix = self.tower.layers + "."
        return tp if any(n.startswith(prefix) and s.dim is not None for n, s in specs.items()) else 1

    @property
    def hidden(self) -> int:
        return self.layers[0].hidden

    @property
    def is_moe(self) -> bool:
        return any(layer.moe is not None for layer in self.layers)

    @functools.lru_cache(maxsize=None)
    def resolved(self, tp: int, ep: int, sp: bool = False, expert_parallel: bool = False) -> ResolvedPlan:
        """The model's plan checked at (tp, ep): the specs and every problem (`check_plan`, as from_pretrained)."""
        return check_plan(self.model, "auto", tp, sequence_parallel=sp, expert_parallel=expert_parallel,
                          ep_size=ep)

    @functools.lru_cache(maxsize=None)
    def params(self, tp: int, ep: int, sp: bool = False, expert_parallel: bool = False) -> tuple[ParamShape, ...]:
        """Every parameter (a tied one once, in its first unit, and flagged again as the head's copy) as a rank holds
        it at (tp, ep)."""
        specs = self.resolved(tp, ep, sp, expert_parallel).specs
        layers_path, first, last = contract.pipeline_parts(self.model) or (contract.layers(self.model), (), ())
        head = contract.output_head(self.model)
        linear = {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Linear) and m is not head}
        out, seen = [], {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            unit = _unit(name, layers_path, first, last, tower=self.tower is not None)
            spec = specs.get(name, ShardSpec())
            shape = spec.local_shape(tuple(p.shape), tp, ep)
            if id(p) in seen:  # the tied head: the same tensor as the embedding
                out.append(ParamShape(name, unit, shape, False, False, tied=True))
                continue
            seen[id(p)] = name
            out.append(ParamShape(name, unit, shape, ".experts." in name, id(p) in linear))
        return tuple(out)


def _unit(name: str, layers_path: str, first: tuple[str, ...], last: tuple[str, ...], *, tower: bool) -> int | str:
    if name.startswith(layers_path + "."):
        return int(name[len(layers_path) + 1:].split(".")[0])
    if any(name.startswith(path + ".") for path in first):
        return "first"
    if any(name.startswith(path + ".") for path in last):
        return "last"
    if tower:  # a vision-language model: its tower and projector in the root's unit (data_parallel.decoder_layers)
        return "first"
    match = _LAYER.search(name)  # a model that declares no pipeline parts: layers by index, the rest first
    return int(match.group(1)) if match else "first"


def meta_model(config: Any, *, dtype: torch.dtype) -> nn.Module:
    """The model of `config` on the meta device: a vision-language model's image-text-to-text class (a config with a
    `vision_config` of such a type), else the causal LM's."""
    if hasattr(config, "vision_config") and vision_language(config.to_dict()):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype, device="meta")
    return AutoModelForCausalLM.from_config(config, dtype=dtype, device="meta")


def layer_shape(config: Any, index: int) -> LayerShape:
    """Layer `index`'s widths from the config: tptrain's own fields, or, for a transformers config, the fields every
    Llama-style decoder has (its own layers are counted as such: an approximation)."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv = int(contract.kv_heads(config) or heads)
    try:
        q_dim, v_dim = contract.key_value_head_dims(config)
    except Exception:  # noqa: BLE001 - a transformers config with per-layer head dims: the common width
        q_dim = v_dim = getattr(config, "head_dim", None) or hidden // heads
    moe = _moe_shape(config, index)
    inner = int(getattr(config, "intermediate_size", 0) or 0)
    latent = None
    if getattr(config, "latent_attention", False):
        latent = (int(getattr(config, "q_lora_rank", 0) or 0), int(config.kv_lora_rank))
    norm_in, norm_out = getattr(config, "norm_sublayer_input", True), getattr(config, "norm_sublayer_output", False)
    return LayerShape(hidden, heads, kv, int(q_dim), int(v_dim), inner if moe is None else 0, moe,
                      qk_norm=getattr(config, "qk_norm", None), norms_in=bool(norm_in), norms_out=bool(norm_out),
                      norm_fp32=bool(getattr(config, "norm_scale_in_float32", False)),
                      softcap=getattr(config, "attn_softcap", None) is not None, gqa_expanded=latent is None,
                      latent=latent, fused=bool(getattr(config, "fused_projections", False)),
                      window=_window(config, index))


def _window(config: Any, index: int) -> int | None:
    try:
        return config.layer_sliding_windows[index]
    except (AttributeError, IndexError, TypeError, ValueError):  # a transformers config: none counted
        return None


def _moe_shape(config: Any, index: int) -> MoEShape | None:
    per_layer = getattr(config, "layer_is_moe", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts or (per_layer is not None and not per_layer[index]):
        return None
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or getattr(config, "shared_experts_intermediate_size", None) or 0)
    return MoEShape(int(experts), int(config.num_experts_per_tok), int(inner), int(shared),
                    gated_shared=bool(getattr(config, "shared_expert_intermediate_size", None)),
                    renormalise=bool(getattr(config, "norm_topk_prob", False)))
