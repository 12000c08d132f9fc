"""Resolve a `{module-glob: style}` plan against a model and find every layout problem up front.

Everything here is pure: no process group, no collectives. That is what lets `tptrain plan` run as
a dry run, and lets `from_pretrained` raise the same clear error on every rank before any collective
could hang.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from tptrain.layout import check
from tptrain.parallel import contract
from tptrain.parallel import expert_parallel as _expert_styles
from tptrain.parallel.styles import STYLES, ParallelStyle, ShardSpec, canonical_style, make_style

assert _expert_styles.ExpertParallel.name in STYLES  # importing expert_parallel registers the expert styles


def model_plan(model: nn.Module, *, sequence_parallel: bool = False, expert_parallel: bool = False) -> dict[str, str]:
    """The model's own plan in full module names: the base plan (`contract.base_plan`, plus the config's
    `base_model_sp_plan` under sequence parallelism, its `base_model_ep_plan` under expert parallelism)
    under the base-model prefix, plus the head's class-level `_tp_plan`."""
    prefix = contract.prefix(model)
    base = contract.base_plan(model)
    if sequence_parallel and base:  # the config's own SP rules (norms on the residual stream)
        base.update(contract.sp_plan(model.config))
    if expert_parallel:  # the model's own EP rules (experts split by expert)
        base.update(contract.model_ep_plan(model))
    plan = {f"{prefix}.{glob}": style for glob, style in base.items()}
    plan.update(contract.head_plan(model))
    return plan


def merge_overrides(model: nn.Module, plan: dict[str, str], overrides: Mapping[str, Any]) -> dict:
    """User overrides replace rules with the same glob and add new ones; a value of None removes a
    rule. Keys may be spelled as in `base_model_tp_plan` (relative to the base model) or in full."""
    prefix = contract.prefix(model)
    top_level = {name for name, _ in model.named_children()}
    merged = dict(plan)
    for key, style in overrides.items():
        full = key if key.split(".")[0] in top_level else f"{prefix}.{key}"
        if style is None:
            merged.pop(full, None)
        else:
            merged[full] = style
    return merged


def _glob_regex(glob: str) -> re.Pattern:
    # HF plans use `*` for one path component ("layers.*.mlp"); it never crosses a dot.
    return re.compile("^" + re.escape(glob).replace(r"\*", r"[^.]+") + "$")


def resolve_plan(model: nn.Module, tp_plan: str | Mapping[str, Any] | None = "auto", *,
                 sequence_parallel: bool = False, expert_parallel: bool = False,
                 optional: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """Return ({module name: style name}, problems). Later rules win over earlier ones; `optional`: the model's
    optional rules kept at this tp size (full names), before the overrides."""
    plan = {**model_plan(model, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel),
            **(optional or {})}
    if isinstance(tp_plan, Mapping):
        plan = merge_overrides(model, plan, tp_plan)
    elif tp_plan not in (None, "auto"):
        raise ValueError(f"tp_plan must be 'auto' or a dict of {{module-glob: style}} overrides, got {tp_plan!r}")
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    problems: list[str] = []
    for glob, style in plan.items():
        style = canonical_style(style)
        if style not in STYLES:
            problems.append(f"tp_plan rule {glob!r}: unknown style {style!r}; known styles: "
                            f"{', '.join(sorted(STYLES))}")
            continue
        rx = _glob_regex(glob)
        hits = [n for n in names if rx.match(n)]
        if not hits:
            generic = dict.fromkeys(_generic(n) for n in names)  # layers.0 -> layers.*
            near = difflib.get_close_matches(glob, generic, n=1) or [names[min(3, len(names) - 1)]]
            problems.append(f"tp_plan rule {glob!r} matches no module of {type(model).__name__} "
                            f"(closest module name: {near[0]!r}); fix or remove the rule")
        resolved.update({n: style for n in hits})
    return resolved, problems


def kv_replicas(config: Any, tp_size: int, *, n_kv: int | None = None) -> int:
    """Ranks holding each KV head: tp_size // KV heads when tp_size is a multiple of them, else 1. `n_kv`: an
    attention module's own KV heads (`contract.heads`), else the config's."""
    n_kv = n_kv or contract.kv_heads(config) or 1
    return tp_size // n_kv if tp_size > n_kv and tp_size % n_kv == 0 else 1


def head_problems(config: Any, tp_size: int, *, counts: tuple[int | None, int | None] | None = None,
                  where: str = "") -> list[str]:
    """Why `tp_size` cannot split attention heads of the config's counts (or an attention module's own `counts`,
    named by `where`)."""
    heads, n_kv = counts or (contract.attention_heads(config), contract.kv_heads(config))
    if heads is None:
        return []
    n_kv, at = n_kv or heads, f"{where}: " if where else ""
    out = []
    if heads % tp_size:
        out.append(f"{at}num_attention_heads={heads} is not divisible by tp_size={tp_size}: every rank must hold "
                   f"whole attention heads; use a tp_size that divides {heads}")
    if where and n_kv == heads:  # no grouped queries: the line above says it all
        return out
    if tp_size <= n_kv and n_kv % tp_size:
        out.append(f"{at}num_key_value_heads={n_kv} is not divisible by tp_size={tp_size}; use a tp_size that "
                   f"divides {n_kv}, or a multiple of it (KV heads are then replicated)")
    if tp_size > n_kv and tp_size % n_kv:
        out.append(f"{at}tp_size={tp_size} exceeds num_key_value_heads={n_kv} and is not a multiple of it, so KV "
                   f"heads cannot be replicated evenly; use a tp_size that divides {n_kv} or is a multiple of it")
    return out


def _split_attention_heads(model: nn.Module, objects: Mapping[str, ParallelStyle]) -> dict[tuple, list[str]]:
    """{(query heads, KV heads): [attention modules]} of the attention modules the plan splits by heads, each
    module's own counts (`contract.heads`)."""
    out: dict[tuple, list[str]] = {}
    for name, style in objects.items():
        owner = name.rpartition(".")[0]
        module = model.get_submodule(owner)
        if isinstance(module, contract.TPAttention) and (style.splits_output or style.needs_split_input):
            names = out.setdefault(contract.heads(module, model.config), [])
            if _generic(owner) not in names:
                names.append(_generic(owner))
    return out


def _attention_head_problems(model: nn.Module, objects: Mapping[str, ParallelStyle], tp_size: int) -> list[str]:
    """head_problems of every head count the plan splits; a module's own counts named by the module."""
    config_counts = (contract.attention_heads(model.config), contract.kv_heads(model.config))
    return [problem for counts, names in _split_attention_heads(model, objects).items()
            for problem in head_problems(model.config, tp_size, counts=counts,
                                         where="" if counts == config_counts else ", ".join(names))]


def _generic(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)  # one line for all layers, not one per layer


def _fix_hint(config: Any, size: int, chunks: int) -> str:
    """The config field behind a dim of `size` that does not split, and what to do about it."""
    fields = [k for k, v in vars(config).items() if v == size and isinstance(v, int) and not isinstance(v, bool)]
    if "vocab_size" in fields:
        return (f"vocab_size={size} must be a multiple of {chunks}. tptrain does not pad the vocabulary for you: "
                f"pad it (the embedding and output-head rows, then vocab_size in config.json) to a multiple of "
                f"{chunks}, or choose a tp_size that divides it")
    if fields:
        return f"{fields[0]}={size} must be a multiple of {chunks}; choose a tp_size that divides it"
    return "choose a tp_size that divides it"


def _kv_replicas_of(model: nn.Module, name: str, tp_size: int) -> int:
    """The KV replicas of module `name` (1 unless it holds KV-head rows: its parent declares it a KV projection
    (`tp_kv_projections`), it is fused with KV segments (`tp_segments`), or it reads only KV projections (`tp_pairs`:
    a norm over k_proj's output is laid out like k_proj)), by its attention module's KV heads."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent)
    kv = contract.kv_projections(owner)
    producers = contract.pairs(owner).get(leaf, ())
    fused_kv = any(is_kv for _, is_kv in contract.segments(model.get_submodule(name)))
    if not (leaf in kv or fused_kv or bool(producers) and all(p in kv for p in producers)):
        return 1
    return kv_replicas(model.config, tp_size, n_kv=contract.heads(owner, model.config)[1])


@dataclass
class ResolvedPlan:
    """A plan checked against one model at one tp_size: what `apply_tensor_parallel` applies as is.

    styles: {module name: style name}; objects: the style object of each module (KV projections
    carry their replica count); specs: the ShardSpec of every planned parameter (full names);
    problems: every reason the layout is impossible (empty: fine); vocab_parallel_loss: the output
    head's style keeps logits vocab-sharded for the vocab-parallel loss.
    """

    tp_size: int
    sequence_parallel: bool
    styles: dict[str, str]
    objects: dict[str, ParallelStyle]
    specs: dict[str, ShardSpec]
    problems: list[str]
    vocab_parallel_loss: bool
    ep_size: int = 1  # the experts also split by expert over an ep axis of this size (ShardSpec.ep_split)
    notes: list[str] = dataclasses.field(default_factory=list)  # the optional rules left out at this size, and why

    def raise_problems(self, model: nn.Module) -> None:
        """One ValueError listing every problem (identical on every rank: nothing here communicates)."""
        if self.problems:
            over = f"tp_size={self.tp_size}" + (f", ep_size={self.ep_size}" if self.ep_size > 1 else "")
            raise ValueError(f"cannot shard {type(model).__name__} over {over}:\n  - " + "\n  - ".join(self.problems))


def check_plan(model: nn.Module, tp_plan: str | Mapping[str, Any] | None, tp_size: int, *,
               sequence_parallel: bool = False, expert_parallel: bool = False, ep_size: int = 1) -> ResolvedPlan:
    """Resolve and validate `tp_plan` for `model` without touching the model or any process group.
    `expert_parallel`: the experts split by expert over the TP group (ep_size = tp_size). `ep_size` > 1: split by
    expert over an ep axis of their own, each expert tensor-parallel over tp (`ep_problems`)."""
    if expert_parallel:  # the rule table's expert_parallel_dense
        check("expert_parallel_dense", expert_parallel=True, name=type(model).__name__,
              model_type=model.config.model_type, ep_plan=bool(contract.model_ep_plan(model)))
    optional, notes = _optional_rules(model, tp_size)
    styles, problems = resolve_plan(model, tp_plan, sequence_parallel=sequence_parallel,
                                    expert_parallel=expert_parallel, optional=optional)
    user_rules = isinstance(tp_plan, Mapping) and any(style is not None for style in tp_plan.values())
    if tp_size > 1 and not problems and not contract.base_plan(model) and not user_rules:
        # The head's own plan alone would split only the output head: that is not tensor parallelism of the model.
        problems.append(f"{type(model).__name__}'s config declares no base_model_tp_plan, so tptrain does not know "
                        f"how to shard it at tp_size={tp_size}; pass DistributedConfig(tp_plan={{module-glob: style}}) "
                        f"rules, or use tp_size=1")
    elif tp_size > 1 and not problems and not styles:
        problems.append(f"the tensor-parallel plan of {type(model).__name__} is empty (the tp_plan overrides removed "
                        f"every rule), so tp_size={tp_size} has nothing to shard; keep some rules or use tp_size=1")
    objects = {name: make_style(style, where=name, kv_replicas=_kv_replicas_of(model, name, tp_size))
               for name, style in styles.items()}
    specs, layout_problems = _layout_specs(model, objects, tp_size)
    layout_problems += contract.plan_problems(model, styles, tp_size)  # tptrain.hf: the weights it leaves unplanned
    if tp_size > 1:
        layout_problems += _pair_problems(model, objects, sequence_parallel)
    if tp_size > 1 and sequence_parallel:
        layout_problems += [f"{_generic(name)} has style {style.name!r}, which needs its inputs whole: it does not "
                            f"work under sequence parallelism (each rank holds a shard of the sequence); disable "
                            f"enable_sequence_parallel, or give it a style that does"
                            for name, style in objects.items() if not style.sequence_parallel_ok]
    if ep_size > 1:
        layout_problems += ep_problems(model, objects, ep_size)
        specs = {name: dataclasses.replace(spec, ep_split=True) if name.rpartition(".")[0] in _experts(objects)
                 else spec for name, spec in specs.items()}
    head = _output_head(model)
    if head in objects:
        objects[head].output_head = True
    return ResolvedPlan(tp_size, sequence_parallel, styles, objects, specs,
                        list(dict.fromkeys(problems + layout_problems)),
                        vocab_parallel_loss=head in objects and objects[head].vocab_parallel_loss, ep_size=ep_size,
                        notes=notes)


def _optional_rules(model: nn.Module, tp_size: int) -> tuple[dict[str, str], list[str]]:
    """(the model's optional rules that split at `tp_size`, a note for each group kept whole instead)."""
    kept, notes = {}, []
    for what, rules in contract.optional_plans(model).items():
        objects = {}
        for glob, style in rules.items():
            rx = _glob_regex(glob)
            objects.update({n: make_style(canonical_style(style), where=n) for n, _ in model.named_modules()
                            if n and rx.match(n)})
        why = _layout_specs(model, objects, tp_size)[1] if tp_size > 1 else []
        if why:
            notes.append(f"{what} kept whole on every rank at tp_size={tp_size} (its gradients complete on each): "
                         f"{why[0]}")
        else:
            kept.update(rules)
    return kept, notes


def working_tp_sizes(model: nn.Module, tp_plan: str | Mapping[str, Any] | None = "auto", *,
                     sequence_parallel: bool = False, expert_parallel: bool = False, ep_size: int = 1) -> list[int]:
    """The tp sizes from 1 to the model's query head count (64 for a model without one) at which `check_plan` finds
    no problem, every constraint counted: what to suggest for a size that does not work."""
    def check(size: int) -> ResolvedPlan:
        return check_plan(model, tp_plan, size, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                          ep_size=ep_size)

    optional = {n for rules in contract.optional_plans(model).values() for glob in rules
                for n, _ in model.named_modules() if n and _glob_regex(glob).match(n)}  # whole where they don't split
    split = _split_attention_heads(model, {n: s for n, s in check(1).objects.items() if n not in optional})
    limit = max((counts[0] for counts in split if counts[0]), default=None) \
        or contract.attention_heads(model.config) or 64
    # The head counts rule out most sizes by arithmetic alone: each check of a large model's plan takes ~0.2 s.
    candidates = [size for size in range(1, limit + 1)
                  if not any(head_problems(model.config, size, counts=counts) for counts in split)]
    return [size for size in candidates if not check(size).problems]


def _experts(objects: Mapping[str, ParallelStyle]) -> list[str]:
    """The modules planned as stacked experts (any expert style)."""
    return [name for name, style in objects.items() if style.stacked_experts]


def ep_problems(model: nn.Module, objects: Mapping[str, ParallelStyle], ep_size: int) -> list[str]:
    """What stops the experts from splitting by expert over an ep axis of `ep_size` ranks. A model without experts
    is refused by the rule table (nothing to split); the rest are plan problems (each experts module's style and
    its own expert count)."""
    experts = _experts(objects)  # none: the rule table's ep_dense
    check("ep_dense", dp_shard=ep_size, ep=ep_size, name=type(model).__name__, model_type=model.config.model_type,
          experts=len(experts))
    problems = []
    for name in experts:
        module, style = model.get_submodule(name), objects[name]
        if not style.ep_axis:
            axis = [n for n, s in STYLES.items() if s.ep_axis and s.stacked_experts]
            problems.append(f"{_generic(name)} has style {style.name!r}, but with ep_size the experts are split by "
                            f"expert over ep and each expert over tp (style {' or '.join(map(repr, axis))}); drop "
                            f"the override (or drop ep_size)")
        experts = getattr(module, "num_experts", None)
        if not contract.routed_experts(module):
            problems.append(f"{_generic(name)} ({type(module).__name__}) is not a stacked-experts module routed by "
                            f"expert ids (num_experts and forward(x, expert_ids, weights); on the transformers "
                            f"backend, transformers' experts with @use_experts_implementation), so ep_size cannot "
                            f"split it by expert and dispatch its tokens; drop ep_size")
        elif experts % ep_size:
            problems.append(f"{_generic(name)}: num_experts={experts} is not divisible by "
                            f"ep_size={ep_size}: every ep rank holds the same number of whole experts; use an ep_size "
                            f"that divides {experts}")
    return sorted(set(problems))


def _output_head(model: nn.Module) -> str | None:
    """Module name of the model's output head (`get_output_embeddings()`, as in transformers)."""
    head = contract.output_head(model)
    return next((name for name, m in model.named_modules() if m is head), None) if head is not None else None


def _layout_specs(model: nn.Module, objects: Mapping[str, ParallelStyle], tp_size: int
                  ) -> tuple[dict[str, ShardSpec], list[str]]:
    """ShardSpec for every parameter the plan touches (full names), and every divisibility problem."""
    specs: dict[str, ShardSpec] = {}
    problems: list[str] = _attention_head_problems(model, objects, tp_size)
    for name, style in objects.items():
        module = model.get_submodule(name)
        if not isinstance(module, style.module_types):
            problems.append(f"module {name!r} is a {type(module).__name__}, but style {style.name!r} supports "
                            f"only {', '.join(t.__name__ for t in style.module_types)}")
            continue
        if contract.segments(module) and style.splits_output and not style.fused:
            problems.append(f"module {name!r} packs {len(contract.segments(module))} projections in its rows, so style "
                            f"{style.name!r} would hand a rank rows of the wrong ones; use 'fused_colwise'")
            continue
        for pname, spec in style.param_specs(module).items():
            shape = tuple(getattr(module, pname).shape)
            for _, size, part in spec.parts():  # each fused segment is split on its own
                size = shape[spec.dim] if size is None and spec.dim is not None else size
                chunks = part.num_chunks(tp_size)
                if spec.dim is not None and size % chunks:
                    what = f"dim {spec.dim} (size {size})" if not spec.segments else f"a fused segment of {size} rows"
                    problems.append(f"{_generic(name)}.{pname} has shape {shape}: {what} cannot be split into "
                                    f"{chunks} equal shards for style {style.name!r} at tp_size={tp_size}; "
                                    f"{_fix_hint(model.config, size, chunks)}")
            specs[f"{name}.{pname}"] = spec
    return specs, problems


def _pair_problems(model: nn.Module, objects: Mapping[str, ParallelStyle], sequence_parallel: bool) -> list[str]:
    """Producer -> consumer pairs whose local shapes cannot meet. Each module declares its pairs as data,
    `tp_pairs = {consumer: (producers...)}` (attention: q/k/v -> o_proj); a split output must feed a
    module that wants a split input, and the other way round."""
    problems = []
    for owner, module in model.named_modules():
        for consumer, producers in contract.pairs(module).items():
            names = [f"{owner}.{p}" for p in producers if hasattr(module, p)]
            if not hasattr(module, consumer) or not names:
                continue
            consumer = f"{owner}.{consumer}"

            def style(n: str) -> str:
                return repr(objects[n].name) if n in objects else "no rule (replicated)"

            wants = objects[consumer].needs_split_input if consumer in objects else False
            bad = [n for n in names if (objects[n].splits_output if n in objects else False) != wants]
            inputs = ", ".join(f"{_generic(n)} ({style(n)})" for n in names)
            if bad and wants:
                problems.append(f"{_generic(consumer)} ({style(consumer)}) expects its input split over the tp ranks, "
                                f"but it reads {inputs}, which produce the whole width; make "
                                f"{', '.join(_generic(n) for n in bad)} 'colwise', or remove the rule of "
                                f"{_generic(consumer)} too")
            elif bad:
                problems.append(f"{inputs} split their output over the tp ranks, but {_generic(consumer)} "
                                f"({style(consumer)}) reads the whole width, so the local shapes cannot meet; make "
                                f"{_generic(consumer)} 'rowwise', or remove the rules of "
                                f"{', '.join(_generic(n) for n in bad)} too")
            elif sequence_parallel and not wants and (whole := [n for n in names if n not in objects]):
                problems.append(f"{', '.join(map(_generic, whole))} (no rule (replicated)) before "
                                f"{_generic(consumer)} ({style(consumer)}) reads a sequence shard under sequence "
                                f"parallelism, so its weight gradient is this rank's tokens' only and nothing sums it; "
                                f"give it the 'sequence_parallel' style (as the model's base_model_sp_plan does), or "
                                f"disable sequence parallelism")
    return problems
