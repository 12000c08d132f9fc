"""transformers' load-time checkpoint conversions, applied by tptrain's sliced reader, and reversed on save.

transformers renames and merges checkpoint tensors while loading (`transformers.conversion_mapping`): a
`WeightRenaming` (gpt_neox's `embed_out` -> `lm_head`, routers, sinks, whole prefixes) and a `WeightConverter` whose
operations build one parameter from several tensors (`MergeModulelist`: the hub's per-expert tensors stacked;
`Concatenate`: gate and up side by side; `Chunk`: one fused tensor cut into several parameters). The rules are read
from the installed transformers at run time and matched by its own `rename_source_key`, so a model type gains a rule
when transformers does. What a rule builds is described here as a small tree over the checkpoint's tensors
(`Stack`, `Cat`, `Part`, `Transposed` and row permutations, `Interleaved` and `RopePermuted`, over `Tensor` leaves:
conversion_tree.py), and each rank reads only the box of it that its `ShardSpec` holds: a merged expert stack reads only this rank's
experts (expert parallel) and only its rows of each (expert TP), a concatenation only the ranges it needs of each
source, a rope permutation only its heads' rows. An operation with no such reading (a Conv3d reshape, Ernie's
expert regrouping, ...) is refused before any collective, naming the model type, the rule, the operation and the
tensor.

Saving runs transformers' own `revert_weight_conversion` on each group of parameters that one reversed rule writes
(a stacked expert tensor alone; the parameters a Chunk made, together), so the files have the hub's names and layout
again, bit for bit, and transformers reloads them.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (Chunk, Concatenate, ErnieFuseAndSplitTextVisionExperts, Interleave,
                                             MergeModulelist, PermuteForRope, PrefixChange, Transpose, WeightConverter,
                                             WeightRenaming, apply_converters, dot_natural_key, rename_source_key,
                                             revert_weight_conversion)

from tptrain.hf.conversion_tree import (Cat, Converted, Interleaved, Part, RopePermuted, Stack, Tensor,
                                          Transposed)

# ---------------------------------------------------------------------------------------------------- loading


def conversion_rules(hf_model) -> list:
    """transformers' rules for this model, as its from_pretrained collects them, less a `PrefixChange` adding a
    prefix none of its parameter names has: a rule written for another class of the same model type (shieldgemma2's
    adds the `model.` of ShieldGemma2ForImageClassification, which wraps the Gemma 3 model that
    AutoModelForImageTextToText builds; applied to that model it would rename every tensor away)."""
    names = [n for n, _ in hf_model.named_parameters()]
    return [r for r in get_model_conversion_mapping(hf_model) if not _foreign_prefix(r, names)]


def _foreign_prefix(rule, names: list[str]) -> bool:
    if not isinstance(rule, PrefixChange) or rule.prefix_to_add is None:
        return False
    prefix = ".".join(p for p in (rule.model_prefix, rule.prefix_to_add) if p) + "."
    return not any(n.startswith(prefix) for n in names)


def interleaved_parameters(hf_model) -> dict[str, int]:
    """{parameter name: dim} of the parameters one stored tensor alone builds by `Interleave(dim)` (gate and up rows
    alternating in the file, [gate; up] in the model: Inkling's experts). transformers' TP cuts the stored tensor
    before converting it, so its rule 'colwise' on such a parameter gives each rank its rows of gate and of up."""
    out = {}
    for rule in conversion_rules(hf_model):
        ops = getattr(rule, "operations", ())
        if isinstance(rule, WeightConverter) and len(rule.target_patterns) == 1 and len(ops) == 1 \
                and type(ops[0]) is Interleave:
            out.update({n: ops[0].dim for n, _ in hf_model.named_parameters()
                        if re.search(rule.target_patterns[0], n)})
    return out


def checkpoint_sources(hf_model, reader) -> dict[str, str | Converted]:
    """{parameter name: the checkpoint tensor it is stored under, or how a rule builds it} for every parameter
    whose checkpoint name transformers' rules change; records the rules used (`_weight_conversions`, as
    transformers' loader does), which saving reverses."""
    rules = conversion_rules(hf_model)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict(hf_model.state_dict(keep_vars=True))
    prefix = hf_model.base_model_prefix
    experts = {name for name, m in hf_model.named_modules() if hasattr(m, "_is_expert_parallel")}
    out: dict[str, str | Converted] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(reader.keys(), key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target not in meta:
            continue  # a tensor the model does not have: transformers drops it too
        if pattern is None:
            if target != key:  # a renamed stacked-experts tensor is read by expert too (an ep axis splits dim 0)
                out[target] = Converted("WeightRenaming", Tensor(key, tuple(reader.shape(key)))) \
                    if target.rpartition(".")[0] in experts else key
        else:
            groups.setdefault(target, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(key)
    for first, (converter, keys) in groups.items():
        out.update(_build(hf_model, converter, first, keys, reader))
    hf_model._weight_conversions = [r for r in rules if r.was_used()]
    return out


def _build(hf_model, converter, first: str, keys: dict[str, list[str]], reader) -> dict[str, Converted]:
    """{target parameter: Converted} for one match of `converter` (its source pattern -> checkpoint keys); `hf_model`
    (on meta) gives the config and the target parameters' shapes."""
    rule = (f"{type(converter).__name__}({converter.source_patterns} -> {converter.target_patterns}, "
            f"operations={converter.operations})")
    patterns = [p for p in converter.source_patterns if p in keys]
    nodes = [[Tensor(k, tuple(reader.shape(k))) for k in keys[p]] for p in patterns]
    labels = [[p] * len(keys[p]) for p in patterns]  # each node's pattern, as transformers' ops key their inputs
    targets = [first.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
    for op in converter.operations:
        kind, single = type(op), len(nodes) == 1 and len(nodes[0]) == 1
        if kind is MergeModulelist:
            nodes, labels = [[Stack(group, op.dim)] for group in nodes], [g[:1] for g in labels]
        elif kind is Concatenate and op.num_shards_attribute is None and all(len(g) == 1 for g in nodes):
            nodes, labels = [[Cat([g[0] for g in nodes], op.dim)]], [converter.target_patterns[:1]]
        elif kind is Chunk and op.num_shards_attribute is None and single:
            nodes = [[Part(nodes[0][0], op.dim, i, len(targets)) for i in range(len(targets))]]
            labels = [list(converter.target_patterns)]
        elif kind is Interleave and single:
            nodes = [[Interleaved(nodes[0][0], op.dim, op.inverse)]]
        elif kind is Transpose and single:
            same = op.check_dims and tuple(nodes[0][0].shape) == tuple(hf_model.get_parameter(first).shape)
            nodes = nodes if same else [[Transposed(nodes[0][0], op.dim0, op.dim1)]]
        elif kind is ErnieFuseAndSplitTextVisionExperts:  # each list of experts cut in len(targets), stacked, the
            per = [_split_stacks(group, len(targets), op.stack_dim) for group in nodes]  # lists side by side
            nodes = [[Cat([stacks[i] for stacks in per], op.concat_dim) for i in range(len(targets))]]
        elif kind is PermuteForRope:
            config = getattr(hf_model.config, op.subconfig_key, hf_model.config) if op.subconfig_key else \
                hf_model.config
            heads = getattr(config, "num_attention_heads", 1)
            nodes = [[RopePermuted(n, heads, op.inverse) if op.permute_layer_names is None or any(
                name in label for name in op.permute_layer_names) else n for n, label in zip(group, names)]
                for group, names in zip(nodes, labels)]
        else:
            raise ValueError(f"model type {hf_model.config.model_type!r}: transformers converts checkpoint tensor "
                             f"{next(iter(keys.values()))[0]!r} into {first!r} with {rule}, whose operation {op!r} "
                             f"tptrain's sliced reader cannot apply (it reads MergeModulelist, Concatenate, Chunk, "
                             f"Interleave, Transpose, PermuteForRope and ErnieFuseAndSplitTextVisionExperts); load this model with transformers, or use "
                             f"tp_size=1 with a checkpoint saved by transformers in its converted layout")
    built = [n for group in nodes for n in group]
    assert len(built) == len(targets), (rule, len(built), targets)
    return {t: Converted(rule, n) for t, n in zip(targets, built)}


def _split_stacks(group: list, chunks: int, dim: int) -> list[Stack]:
    """ErnieFuseAndSplitTextVisionExperts' cut of one list of experts: `chunks` runs of ceil(len / chunks), each
    stacked along `dim` (its text experts, then its vision ones)."""
    size = math.ceil(len(group) / chunks)
    return [Stack(group[i * size:(i + 1) * size], dim) for i in range(chunks)]


# ---------------------------------------------------------------------------------------------------- saving


def _saving_rules(hf_model) -> list:
    """The rules saving reverses: those loading used, or (a model built by from_config) transformers' defaults,
    as `revert_weight_conversion` chooses them."""
    rules = getattr(hf_model, "_weight_conversions", None)
    if rules is None:
        rules = [r for r in get_model_conversion_mapping(hf_model, add_legacy=False) if not isinstance(r, PrefixChange)]
    return rules


def save_groups(hf_model, names: list[str]) -> list[list[str]]:
    """`names` grouped as transformers' reversed rules write them: the parameters one reversed converter reads
    together (those a Chunk made), each other parameter alone; in the order of `names`."""
    reverse = [r.reverse_transform() for r in _saving_rules(hf_model)[::-1]]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]
    groups: dict[str, list[str]] = {}
    for name in names:
        key, pattern = apply_converters(name, converters)
        groups.setdefault(key if pattern is not None else name, []).append(name)
    return list(groups.values())


def to_hub(hf_model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One group's full tensors (in-memory names) under the hub's names and layout: transformers' own reverse."""
    if not _saving_rules(hf_model):
        return tensors
    return revert_weight_conversion(_FullShapes(hf_model, tensors), tensors)


class _FullShapes:
    """`hf_model` as transformers' reverse operations see it while saving: its parameters at their global shapes
    (the group's full tensors), where a split model holds only this rank's piece; `Transpose(check_dims=True)`
    compares a tensor with the parameter's shape (qwen3_vl_moe's experts: transposed when they differ)."""

    def __init__(self, hf_model, tensors: dict[str, torch.Tensor]) -> None:
        self._model, self._tensors = hf_model, tensors
        self._weight_conversions = _saving_rules(hf_model)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def get_parameter(self, name: str):
        return self._tensors[name] if name in self._tensors else self._model.get_parameter(name)


def hub_sizes(hf_model, groups: list[list[str]],
              shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, int]:
    """{hub tensor name: bytes}, in the order saving writes them (the reverse run on meta tensors); `shapes`:
    {parameter: (global shape, dtype)}."""
    sizes: dict[str, int] = {}
    for group in groups:
        meta = {n: torch.empty(shapes[n][0], dtype=shapes[n][1], device="meta") for n in group}
        sizes.update({k: math.prod(v.shape) * v.element_size() for k, v in to_hub(hf_model, meta).items()})
    return sizes
