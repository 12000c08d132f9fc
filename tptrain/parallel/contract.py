"""The model-engine contract: every fact a model gives the tensor-parallel engine, in one place.

`parallel/` never names a model's modules (`k_proj`, `lm_head`): what it must know, the model declares as data on
itself, on its modules and on its config. The Protocols below are that contract, one per kind of object;
tptrain's native models (`models/decoder.py`, `models/layers.py`, `models/moe.py`) and the transformers backend
(`hf/model.py`, `hf/plan.py`) satisfy them (tests/test_contract.py checks it on a built model of each family).

    TPConfig          the config: model_type, the base TP plan (plus the SP / EP plans), the head counts
    TPModel           the model: its config, base_model_prefix, the head's `_tp_plan`, get_output_embeddings()
    TPBlock           a module whose children the plan splits column- then row-wise: `tp_pairs`
    TPAttention       a module split by attention heads: `tp_kv_projections`
    FusedProjection   a linear holding several projections in its rows: `tp_segments`
    SplitNorm         a norm that can run over split features: `mean_square(h)`
    TPExperts         stacked experts: num_experts, top_k, expert_offset, gate/up/down_proj, grouped()

A Protocol's members are what every model tptrain builds declares. The engine reads a fact a model may leave out
(an optional one, or any fact of a foreign nn.Module handed to `check_plan`) only through the accessor functions
at the end of this file, so each default is stated once, here. Some facts go the other way: the engine writes
them on the model's modules at `install` (each named in its Protocol), and the model or the reports read them.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

Plan = Mapping[str, str]  # {module glob: style name}, as HF configs spell it ("layers.*.self_attn.q_proj": "colwise")
Segments = tuple[tuple[int, bool], ...]  # ((global rows, holds KV heads), ...) of a fused projection


@runtime_checkable
class TPConfig(Protocol):
    """A model's config: tptrain's `PretrainedConfig`, or transformers' own (transformers backend).

    model_type: named in errors.
    base_model_tp_plan: {glob under the base model: style}, HF's field (`config_plan`; absent or None: {}: the
        model cannot be sharded beyond its head's `_tp_plan`, which `check_plan` reports).
    num_attention_heads: the query heads (`attention_heads`; absent: no head-count checks).
    Optional:
    num_key_value_heads: the KV heads (`kv_heads`; absent or None: num_attention_heads, no grouped queries).
    base_model_sp_plan: rules added under sequence parallelism, the norms on the residual stream (`sp_plan`;
        absent: {}).
    base_model_ep_plan: rules `enable_expert_parallel` adds, the experts split by expert (`ep_plan`; absent or
        empty: the model has no experts to split, and expert parallelism is refused).
    Any other int field is read only to name the one behind a size that does not split (`plan._fix_hint`).
    """

    model_type: str
    base_model_tp_plan: Plan | None
    num_attention_heads: int


@runtime_checkable
class TPModel(Protocol):
    """The model `check_plan` / `apply_tensor_parallel` take: an nn.Module with HF parameter names.

    config: its TPConfig.
    base_model_prefix: the base model's attribute name, under which the config's plans apply (`prefix`; absent:
        "model").
    _tp_plan: rules in full module names for what sits outside the base model, the output head (`head_plan`;
        absent or None: {}).
    get_output_embeddings(): the output head (`output_head`; absent or None: no head, so no vocab-parallel
        loss). When its style keeps logits vocab-sharded, the engine replaces `loss_function`, a (logits, labels,
        num_items_in_batch) -> loss attribute every model has, and `forward` must take `labels`.
    Optional:
    head_loss_function: the chunked head + loss the model calls from its final hidden states (native models;
        `has_head_loss`: the engine replaces it by the vocab-parallel one; absent: nothing to replace).
    tp_base_plan: the base plan in tptrain's style names, read instead of the config's (`base_plan`; the
        transformers backend, whose config spells transformers' styles; absent or None: the config's).
    tp_ep_plan: the same for the rules enable_expert_parallel adds (`model_ep_plan`; absent: the config's).
    layer_list: the dotted name of the decoder layers (an nn.ModuleList; a pipeline stage's nn.ModuleDict), each its
        own FSDP2 unit and compiled on its own (`layers`; absent: `{base_model_prefix}.layers`; a vision-language
        model's text decoder's, e.g. "model.language_model.layers").
    tp_optional_plans: {what: {full-name glob: style}}: rules applied only at a tp size where they split (every
        width and head count they split divides it, `plan.check_plan`); elsewhere their modules stay whole on every
        rank, and the resolved plan's `notes` say so (`optional_plans`; absent: {}; a vision-language model's derived
        plan of its tower and of its projector).
    tp_plan_problems(styles, tp_size) -> [str]: layout problems only the model can see, added to the plan
        check's (`plan_problems`; the transformers backend: weights its plan leaves unsplit; absent: none).
    sequence_mixers: {module name: class name} of modules that mix tokens other than through an attention's
        `attend` and cannot run on the whole sequence either (an indexer or compressor choosing among all keys)
        (`sequence_mixers`; absent: {}): context parallelism, which splits every sequence, refuses the model,
        naming them.
    cp_whole_sequence: {module name: class name} of token mixers outside attention (a recurrence, a short
        convolution) that context parallelism runs on the whole sequence (`whole_sequence_modules`; absent: {}): a
        module called with (batch, seq, ...) tensors returning (batch, seq, ...) ones (or a tuple led by one), whose
        every token's output depends on the tokens of its sequence alone; no attention inside.
    cp_sequence_entry: the dotted name of the module the model's token sequence enters to be mixed, where that is not
        the model's forward (`sequence_entry`; absent: None, the batch is split before the forward): a
        vision-language model's text decoder, called with keyword arguments `inputs_embeds` (batch, seq, hidden),
        `position_ids` (batch, seq), (rows, batch, seq) (multimodal RoPE) or None, and `attention_mask` (batch,
        seq), a dict of built masks, or None. Under context parallelism the forward takes the whole batch, so
        what runs before this module (the vision tower and projector on every image, the image features placed
        among the token embeddings, the multimodal position ids) computes on every token, and the sequence is split
        at this module's entry; only the attention modules inside it are split over cp, and the masks it is given
        or builds are this rank's rows.
    router_statistics(router_logits, attention_mask) -> stats and router_aux_loss_function(stats) -> loss: the
        load-balancing loss of a mixture-of-experts model in two steps (`router_aux`; absent: None, no aux loss
        to split): its MoE layers' token statistics (models/moe.py `router_statistics`), then the loss of them,
        this rank's share when the engine sums the counts over the ranks holding the batch's other tokens (context
        and sequence parallelism: parallel/expert_parallel.py `router_aux_over_token_shards` wraps both).
    The base model's (`mask_builder`; absent: None, and context parallelism refuses the model)
    attention_masks(position_ids, attention_mask, windows, *, query_index=None, key_index=None) -> {window: mask}:
        the masks its attention modules get, over the sequence of `position_ids`; `query_index` / `key_index` pick
        and order their rows / columns (context parallelism wraps it: this rank's queries, the keys as gathered).
    """

    config: TPConfig
    base_model_prefix: str
    _tp_plan: Plan

    def get_output_embeddings(self) -> nn.Module | None: ...


@runtime_checkable
class TPBlock(Protocol):
    """A module whose children form a column- then row-parallel region (attention, MLP).

    tp_pairs: {consumer child: (producer children, ...)} (`pairs`; absent: {}): a producer's split output must
        feed a consumer that takes a split input, and a whole one a whole one (`plan._pair_problems`); a child
        reading only KV projections is laid out like them (a norm over k_proj's output). Names the module lacks
        are skipped, so one class can declare the pairs of all its variants.
    """

    tp_pairs: Mapping[str, tuple[str, ...]]


@runtime_checkable
class TPAttention(Protocol):
    """A module split by attention heads: the plan check then applies the config's head counts.

    tp_kv_projections: its children whose output rows are KV heads, replicated when tp_size exceeds
        num_key_value_heads (`kv_projections`; absent: (), and the module is not split by heads; () on an
        attention whose projections are fused: `tp_segments` says which rows are KV heads).
    Optional:
    tp_heads: (query heads, KV heads) of this module, where they are not the config's (`heads`; absent: the config's
        num_attention_heads and num_key_value_heads): a vision-language model's text decoder and vision tower, each
        with its own counts, under one composite config that has neither.
    attend(q, k, v, mask): q (batch, heads, queries, head_dim), k (batch, kv_heads, keys, head_dim) and v (batch,
        kv_heads, keys, v dim: MLA's is narrower) after RoPE, mask (batch or 1, 1, queries, keys) bool or None (plain
        causal) -> (batch, heads, queries, v dim) (`attend`; absent: None, and context parallelism refuses the model,
        naming the module). Context parallelism wraps it on the instance to gather the keys and values of the whole
        sequence first (side by side: `key_value_head_dims` of the config says how wide each is).
    """

    tp_kv_projections: tuple[str, ...]


@runtime_checkable
class FusedProjection(Protocol):
    """A linear whose output rows are several projections one after another (Phi-3's qkv_proj, gate_up_proj).

    tp_segments: ((global rows, holds KV heads), ...) in the checkpoint's order (`segments`; absent or empty: an
        ordinary projection; the 'fused_colwise' style refuses it, the others refuse a fused one).
    Written by the engine: `segment_sizes`, this rank's rows of each segment, by which the model splits its
    local output.
    """

    tp_segments: Segments


@runtime_checkable
class SplitNorm(Protocol):
    """A norm over features that may be split over the TP ranks ('distributed_rmsnorm', OLMo 2's q/k norms).

    mean_square(h): (..., features) -> (..., 1), the mean of squares the norm divides by. Written by the engine:
    the style replaces it with the sum over ranks of each rank's share, over the global width.
    """

    def mean_square(self, h: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TPExperts(Protocol):
    """Stacked experts, one module with one style (`parallel/expert_parallel.py`), called on the MoE block's input.

    num_experts: the global expert count (the module may hold a contiguous share of them).
    top_k: experts per token, the router's k: what 'expert_parallel' sizes its choice by.
    expert_offset: the global index of gate_proj[0]; 0 until an expert-parallel style writes this rank's.
    gate_proj, up_proj (experts, inner, hidden), down_proj (experts, hidden, inner): the stacked weights.
    grouped(rows, counts): rows (n, hidden) sorted by held expert, counts[i] rows for held expert i ->
        (n, hidden); every held expert runs, with no row too.
    forward(x, expert_ids, weights): x (..., hidden), the block input (batch, seq, hidden) or its tokens,
        expert_ids and weights (tokens, k) -> x's shape, a tensor of its own (FSDP2 may wrap the module): the
        weighted sum over the experts held here.
    Written by the engine for the reports: `tp_dispatch` ("all_reduce" / "all_to_all": how the TP group
    exchanged the experts' work) and, over an ep axis, `ep_dispatch` ("all_to_all").
    Another stacked-experts module an ep axis can split by expert declares `tp_routed_experts = True`: it has an int
    `num_experts` and forward(x, expert_ids, weights) on the ids of the experts it holds (`routed_experts`; the
    transformers backend: transformers' experts).
    """

    num_experts: int
    top_k: int
    expert_offset: int
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


def members(protocol: type) -> tuple[str, ...]:
    """The attribute and method names `protocol` declares (what `isinstance(obj, protocol)` looks for)."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return tuple(sorted(names))


def missing(obj: Any, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks (empty: it satisfies it)."""
    return [name for name in members(protocol) if not hasattr(obj, name)]


# ---------------------------------------------------------------------- accessors: each optional fact's default


def routed_experts(module: nn.Module) -> bool:
    """Whether `module` holds stacked experts called as forward(x, expert_ids, weights) with an int `num_experts`: a
    TPExperts, or a module declaring `tp_routed_experts` (see TPExperts)."""
    return isinstance(getattr(module, "num_experts", None), int) and (
        not missing(module, TPExperts) or getattr(module, "tp_routed_experts", False))


def config_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def sp_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_sp_plan", None) or {})


def ep_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_ep_plan", None) or {})


def model_ep_plan(model: nn.Module) -> dict[str, str]:
    """The rules enable_expert_parallel adds: the model's own `tp_ep_plan` if it has one (the transformers backend,
    in tptrain's style names), else its config's."""
    plan = getattr(model, "tp_ep_plan", None)
    return dict(plan) if plan is not None else ep_plan(model.config)


def attention_heads(config: Any) -> int | None:
    return getattr(config, "num_attention_heads", None)


def kv_heads(config: Any) -> int | None:
    return getattr(config, "num_key_value_heads", None) or attention_heads(config)


def heads(module: nn.Module, config: Any) -> tuple[int | None, int | None]:
    """(query heads, KV heads) of an attention module: its own `tp_heads`, else the config's."""
    own = getattr(module, "tp_heads", None)
    return tuple(own) if own is not None else (attention_heads(config), kv_heads(config))


def key_value_head_dims(config: Any) -> tuple[int, int]:
    """(features of one key head, of one value head): the config's `key_value_head_dims` (MLA's differ), else
    head_dim (or hidden_size / heads) for both."""
    dims = getattr(config, "key_value_head_dims", None)
    if dims is not None:
        return tuple(dims)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, head_dim


def prefix(model: nn.Module) -> str:
    return getattr(model, "base_model_prefix", "model")


def layers(model: nn.Module) -> str:
    return getattr(model, "layer_list", None) or f"{prefix(model)}.layers"


def head_plan(model: nn.Module) -> dict[str, str]:
    return dict(getattr(model, "_tp_plan", None) or {})


def base_plan(model: nn.Module) -> dict[str, str]:
    """The base model's plan: the model's own `tp_base_plan` if it has one, else its config's."""
    plan = getattr(model, "tp_base_plan", None)
    return dict(plan) if plan is not None else config_plan(model.config)


def optional_plans(model: nn.Module) -> dict[str, dict[str, str]]:
    return {what: dict(rules) for what, rules in (getattr(model, "tp_optional_plans", None) or {}).items()}


def plan_problems(model: nn.Module, styles: dict[str, str], tp_size: int) -> list[str]:
    check = getattr(model, "tp_plan_problems", None)
    return list(check(styles, tp_size)) if check is not None else []


def output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def has_head_loss(model: nn.Module) -> bool:
    return hasattr(model, "head_loss_function")


def pairs(module: nn.Module) -> Mapping[str, tuple[str, ...]]:
    return module.tp_pairs if isinstance(module, TPBlock) else {}


def kv_projections(module: nn.Module) -> tuple[str, ...]:
    return tuple(module.tp_kv_projections) if isinstance(module, TPAttention) else ()


def segments(module: nn.Module) -> Segments:
    return tuple(getattr(module, "tp_segments", None) or ())


def param_specs(module: nn.Module) -> Mapping[str, Any]:
    """{own parameter: ShardSpec} a module declares for its parameters one by one (`tp_param_specs`: the
    transformers backend's per-parameter rules, read by 'local_params' / 'moe_tp_experts' / 'all_reduce'; absent: {})."""
    return dict(getattr(module, "tp_param_specs", None) or {})


def replicated_tail(module: nn.Module) -> int:
    """Features at the end of the module's output that every rank's heads read whole ('mla_kv_a_proj'; absent: 0)."""
    return int(getattr(module, "tp_replicated_tail", 0) or 0)


def attend(module: nn.Module):
    return getattr(module, "attend", None) if isinstance(module, TPAttention) else None


def sequence_mixers(model: nn.Module) -> dict[str, str]:
    return dict(getattr(model, "sequence_mixers", None) or {})


def whole_sequence_modules(model: nn.Module) -> dict[str, str]:
    return dict(getattr(model, "cp_whole_sequence", None) or {})


def sequence_entry(model: nn.Module) -> str | None:
    return getattr(model, "cp_sequence_entry", None)


def in_sequence(model: nn.Module, name: str) -> bool:
    """Whether module `name` runs on the token sequence as context parallelism splits it: inside the model's
    `sequence_entry` where it declares one (a vision-language model's tower runs before, on the whole batch)."""
    entry = sequence_entry(model)
    return entry is None or name == entry or name.startswith(f"{entry}.")


def base_model(model: nn.Module) -> nn.Module | None:
    return getattr(model, prefix(model), None)


def mask_builder(model: nn.Module):
    return getattr(base_model(model), "attention_masks", None)


@runtime_checkable
class PipelineModel(Protocol):
    """What a model offers to be cut into pipeline stages (parallel/pipeline_parallel.py; absent: pp_size > 1 is
    refused, naming the model).

    pp_layers: the dotted name of the decoder-layer list (an nn.ModuleList; a stage keeps its own layers in an
        nn.ModuleDict keyed by their index, so every parameter keeps its whole-model name).
    pp_first: dotted names of the modules only the first stage holds (the embedding); the others hold None there.
    pp_last: dotted names of the modules only the last stage holds (the final norm and the head).
    pipeline_forward(x, *carried, position_ids=None, **inputs): the stage's computation on what the module holds:
        token ids or hidden states in, hidden states or logits out (the loss is computed from the logits by
        `loss_function`); or (output, *carried): tensors besides x each stage passes on to the next (the router
        statistics of the layers so far), `carried` being the stage before's (none on the first). The Pipeline
        always passes `position_ids` (batch, tokens), or (batch, rows, tokens) where `input_positions` gives
        multimodal ones: the sequence's length and positions come from them, not from `x`, which under sequence
        parallelism is a tp rank's shard of the hidden states. `inputs`: the batch's other inputs where it has any
        (a vision-language model's): those of one row per token on every stage, those of rows per sample (images,
        patches) on the first stage only, each the microbatch's own.
    Optional:
    pipeline_loss(loss, *carried) -> loss: the last stage's microbatch loss with what was carried (the router aux
        loss; needed when pipeline_forward carries anything).
    input_positions(input_ids, **inputs) -> (batch, rows, seq) or None: the whole batch's position ids where the
        model computes them from its inputs (`input_positions`; absent or None: 0..seq-1): multimodal RoPE's rows
        (time, height, width) from the ids and the image grids, which every stage needs and only the whole rows
        give.
    A model that is not one may say why (`pp_refusal`, a str; `pipeline_refusal`), which the refusal repeats.
    """

    pp_layers: str
    pp_first: tuple[str, ...]
    pp_last: tuple[str, ...]

    def pipeline_forward(self, x: torch.Tensor, *carried: torch.Tensor,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def input_positions(model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, torch.Tensor]
                    ) -> torch.Tensor | None:
    compute = getattr(model, "input_positions", None)
    return compute(input_ids, **inputs) if compute is not None else None


def long_context(module: nn.Module):
    """A module's `long_context(position_ids) -> bool tensor or None` (a rotary embedding whose frequencies switch on
    the longest position of the batch: longrope; context parallelism hands it the whole batch's positions), or None
    when it has none."""
    return getattr(module, "long_context", None)


def router_aux(model: nn.Module) -> tuple[Any, Any] | None:
    """(router_statistics, router_aux_loss_function) of a model computing the router aux loss through them (see
    TPModel), or None."""
    if not hasattr(model, "router_aux_loss_function"):
        return None
    return model.router_statistics, model.router_aux_loss_function


def pipeline_refusal(model: nn.Module) -> str | None:
    return getattr(model, "pp_refusal", None)


def sequence_parallel_refusal(model: nn.Module) -> str | None:
    """Why the model's sequence cannot be split over the TP group (`sp_refusal`, a str; absent: None, it can be
    where its plan allows), which the rule table's `sp_refused` repeats."""
    return getattr(model, "sp_refusal", None)


def pipeline_parts(model: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(layer list, first-stage modules, last-stage modules) of a `PipelineModel`; None if the model is not one."""
    return (model.pp_layers, tuple(model.pp_first), tuple(model.pp_last)) if isinstance(model, PipelineModel) else None
