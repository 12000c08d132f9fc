"""transformers' load-time checkpoint conversions, applied by tptrain's sliced reader, and reversed on save.

transformers renames and merges checkpoint tensors while loading (`transformers.conversion_mapping`): a
`WeightRenaming` (gpt_neox's `embed_out` -> `lm_head`, routers, sinks, whole prefixes) and a `WeightConverter` whose
operations build one parameter from several tensors (`MergeModulelist`: the hub's per-expert tensors stacked;
`Concatenate`: gate and up side by side; `Chunk`: one fused tensor cut into several parameters). The rules are read
from the installed transformers at run time and matched by its own `rename_source_key`, so a model type gains a rule
when transformers does. What a rule builds is described here as a small tree over the checkpoint's tensors
(`Stack`, `Cat`, `Part`, `Transposed` and row permutations, `Interleaved` and `RopePermuted`, over `Tensor` leaves),
and each rank reads only the box of it that its `ShardSpec` holds: a merged expert stack reads only this rank's
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
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (Chunk, Concatenate, Interleave, MergeModulelist, PermuteForRope, PrefixChange,
                                             Transpose, WeightConverter, WeightRenaming, apply_converters,
                                             dot_natural_key, rename_source_key, revert_weight_conversion)

from tptrain.parallel.styles import ShardSpec

Box = dict[int, list[tuple[int, int]]]  # dim -> the [start, stop) ranges wanted along it, in order (absent: all)


@dataclass
class Tensor:
    """A checkpoint tensor as stored."""

    key: str
    shape: tuple[int, ...]

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        if not box:
            return reader.read(self.key, **kwargs)
        (dim, ranges), *rest = sorted(box.items())
        out = reader.read_ranges(self.key, dim=dim, ranges=ranges, **kwargs)
        for dim, ranges in rest:  # no plan splits a stored tensor along two dims; correct all the same
            out = torch.cat([out.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
        return out

    def keys(self) -> Iterator[str]:
        yield self.key


@dataclass
class Stack:
    """`MergeModulelist(dim)`: the parts (one per expert) stacked along a new `dim`."""

    parts: list[Any]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return (*inner[:self.dim], len(self.parts), *inner[self.dim:])

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        ranges = box.get(self.dim, [(0, len(self.parts))])
        inner = {d - (d > self.dim): r for d, r in box.items() if d != self.dim}
        picked = [self.parts[i] for a, b in ranges for i in range(a, b)]  # only these experts are read
        out = None
        for i, part in enumerate(picked):  # into the stack as read: the peak is the stack plus one expert's slice
            t = part.read(reader, inner, **kwargs)
            out = t.new_empty((*t.shape[:self.dim], len(picked), *t.shape[self.dim:])) if out is None else out
            out.select(self.dim, i).copy_(t)
        return out

    def keys(self) -> Iterator[str]:
        for p in self.parts:
            yield from p.keys()


@dataclass
class Cat:
    """`Concatenate(dim)`: the parts side by side along `dim`."""

    parts: list[Any]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        bounds, start = [], 0
        for part in self.parts:
            bounds.append((start, start + part.shape[self.dim]))
            start += part.shape[self.dim]
        out, offset = None, 0
        for a, b in box.get(self.dim, [(0, start)]):  # each wanted range, in order, cut at the parts' borders
            for part, (lo, hi) in zip(self.parts, bounds):
                if max(a, lo) < min(b, hi):
                    t = part.read(reader, {**box, self.dim: [(max(a, lo) - lo, min(b, hi) - lo)]}, **kwargs)
                    out = t.new_empty(_box_shape(self.shape, box)) if out is None else out
                    out.narrow(self.dim, offset, t.shape[self.dim]).copy_(t)  # peak: the result plus one piece
                    offset += t.shape[self.dim]
        return out

    def keys(self) -> Iterator[str]:
        for p in self.parts:
            yield from p.keys()


@dataclass
class Part:
    """`Chunk(dim)`: chunk `index` of `count` equal chunks of `whole` along `dim`."""

    whole: Any
    dim: int
    index: int
    count: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.whole.shape)
        shape[self.dim] //= self.count
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        size = self.shape[self.dim]
        offset = self.index * size
        ranges = [(a + offset, b + offset) for a, b in box.get(self.dim, [(0, size)])]
        return self.whole.read(reader, {**box, self.dim: ranges}, **kwargs)

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


class RowPermutation:
    """A permutation of `whole`'s rows along `dim`: row t of the result is row `source(t)` of `whole`. A wanted range
    reads the rows it comes from (as few ranges as they make), then puts them in order. Subclasses are dataclasses
    with `whole` and `dim`."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.whole.shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        rows = [self.source(t) for a, b in box.get(self.dim, [(0, self.shape[self.dim])]) for t in range(a, b)]
        wanted = sorted(set(rows))  # read as runs of consecutive rows
        ranges = list(zip([r for i, r in enumerate(wanted) if i == 0 or wanted[i - 1] != r - 1],
                          [r + 1 for i, r in enumerate(wanted) if i + 1 == len(wanted) or wanted[i + 1] != r + 1]))
        out = self.whole.read(reader, {**box, self.dim: ranges}, **kwargs)
        if rows == wanted:
            return out
        at = {r: i for i, r in enumerate(wanted)}
        return out.index_select(self.dim, torch.tensor([at[r] for r in rows], device=out.device))

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


@dataclass
class Interleaved(RowPermutation):
    """`Interleave(dim)`: `whole`'s rows along `dim` de-interleaved (its even rows first, then its odd ones;
    `inverse`: the first half's rows and the second's alternately)."""

    whole: Any
    dim: int
    inverse: bool

    def source(self, row: int) -> int:
        half = self.shape[self.dim] // 2
        return (row % 2) * half + row // 2 if self.inverse else (row % half) * 2 + row // half


@dataclass
class RopePermuted(RowPermutation):
    """`PermuteForRope`: within each of `heads` heads along dim 0, rows in interleaved rotary pairs put in the
    rotate-half order (each pair's first elements, then its second ones; `inverse`: back)."""

    whole: Any
    heads: int
    inverse: bool
    dim: int = 0

    def source(self, row: int) -> int:
        size = self.shape[0] // self.heads
        head, r = divmod(row, size)
        if self.inverse:
            i, j = divmod(r, 2)
            return head * size + j * (size // 2) + i
        j, i = divmod(r, size // 2)
        return head * size + 2 * i + j


@dataclass
class Transposed:
    """`Transpose(dim0, dim1)`: `whole` with two dims swapped."""

    whole: Any
    dim0: int
    dim1: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.whole.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(shape)

    def read(self, reader, box: Box, **kwargs) -> torch.Tensor:
        swap = {self.dim0: self.dim1, self.dim1: self.dim0}
        out = self.whole.read(reader, {swap.get(d, d): r for d, r in box.items()}, **kwargs)
        return out.transpose(self.dim0, self.dim1).contiguous()

    def keys(self) -> Iterator[str]:
        yield from self.whole.keys()


@dataclass
class Converted:
    """A parameter that a transformers rule builds from checkpoint tensors: `node`'s tree, read slice by slice."""

    rule: str
    node: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.node.shape)

    def keys(self) -> list[str]:
        """The checkpoint tensors it is built from."""
        return list(self.node.keys())

    def read(self, reader, spec: ShardSpec, *, tp_size: int, tp_rank: int, ep_size: int = 1, ep_rank: int = 0,
             dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """This rank's piece (its experts over ep, then its TP chunk), reading only its bytes."""
        return self.node.read(reader, local_box(spec, self.shape, tp_size, tp_rank, ep_size, ep_rank),
                              dtype=dtype, device=device)


def _box_shape(shape: tuple[int, ...], box: Box) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in box[d]) if d in box else n for d, n in enumerate(shape))


def local_box(spec: ShardSpec, shape: tuple[int, ...], tp_size: int, tp_rank: int, ep_size: int,
              ep_rank: int) -> Box:
    """The global ranges, per dim, of the piece of a tensor of `shape` that `spec` gives this rank (in local order)."""
    box: Box = {}
    offset = 0
    if spec.ep_split:
        per_rank = shape[0] // ep_size
        offset = ep_rank * per_rank
        shape = (per_rank, *shape[1:])
        box[0] = [(offset, offset + per_rank)]
    if spec.dim is not None and tp_size > 1:
        ranges = spec.local_ranges(shape, tp_size, tp_rank)
        box[spec.dim] = [(a + offset, b + offset) for a, b in ranges] if spec.dim == 0 else ranges
    return box


# ---------------------------------------------------------------------------------------------------- loading


def conversion_rules(hf_model) -> list:
    """transformers' rules for this model, as its from_pretrained collects them."""
    return get_model_conversion_mapping(hf_model)


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
                             f"Interleave, Transpose and PermuteForRope); load this model with transformers, or use "
                             f"tp_size=1 with a checkpoint saved by transformers in its converted layout")
    built = [n for group in nodes for n in group]
    assert len(built) == len(targets), (rule, len(built), targets)
    return {t: Converted(rule, n) for t, n in zip(targets, built)}


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
    return revert_weight_conversion(hf_model, tensors)


def hub_sizes(hf_model, groups: list[list[str]],
              shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, int]:
    """{hub tensor name: bytes}, in the order saving writes them (the reverse run on meta tensors); `shapes`:
    {parameter: (global shape, dtype)}."""
    sizes: dict[str, int] = {}
    for group in groups:
        meta = {n: torch.empty(shapes[n][0], dtype=shapes[n][1], device="meta") for n in group}
        sizes.update({k: math.prod(v.shape) * v.element_size() for k, v in to_hub(hf_model, meta).items()})
    return sizes
