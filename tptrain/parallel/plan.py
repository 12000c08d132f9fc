"""Resolve a `{module-glob: style}` plan against a model and find every layout problem up front.

Everything here is pure: no process group, no collectives. That is what lets `tptrain plan` run as
a dry run, and lets `from_pretrained` raise the same clear error on every rank before any collective
could hang.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

from torch import nn

from tptrain.parallel.styles import STYLES, ParallelStyle, ShardSpec, make_style

# Projections whose output rows are KV heads: when tp_size > num_key_value_heads they are replicated.
KV_PROJECTIONS = ("k_proj", "v_proj")

# Norms that sit on the residual stream between TP regions: sharded along the sequence under SP.
SEQUENCE_PARALLEL_RULES = {
    "norm": "sequence_parallel",
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.post_attention_layernorm": "sequence_parallel",
}


def model_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, str]:
    """The model's own plan in full module names: the config's base plan under the base-model
    prefix, plus the head's class-level `_tp_plan`."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if sequence_parallel and base:
        base.update(SEQUENCE_PARALLEL_RULES)
    plan = {f"{prefix}.{glob}": style for glob, style in base.items()}
    plan.update(getattr(type(model), "_tp_plan", {}) or {})
    return plan


def merge_overrides(model: nn.Module, plan: dict[str, str], overrides: Mapping[str, Any]) -> dict:
    """User overrides replace rules with the same glob and add new ones; a value of None removes a
    rule. Keys may be spelled as in `base_model_tp_plan` (relative to the base model) or in full."""
    prefix = getattr(model, "base_model_prefix", "model")
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
                 sequence_parallel: bool = False) -> tuple[dict[str, str], list[str]]:
    """Return ({module name: style name}, problems). Later rules win over earlier ones."""
    plan = model_plan(model, sequence_parallel=sequence_parallel)
    if isinstance(tp_plan, Mapping):
        plan = merge_overrides(model, plan, tp_plan)
    elif tp_plan not in (None, "auto"):
        raise ValueError(f"tp_plan must be 'auto' or a dict of {{module-glob: style}} overrides, got {tp_plan!r}")
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    problems: list[str] = []
    for glob, style in plan.items():
        if style not in STYLES:
            problems.append(f"tp_plan rule {glob!r}: unknown style {style!r}; known styles: "
                            f"{', '.join(sorted(STYLES))}")
            continue
        rx = _glob_regex(glob)
        hits = [n for n in names if rx.match(n)]
        if not hits:
            generic = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names)  # layers.0 -> layers.*
            near = difflib.get_close_matches(glob, generic, n=1) or [names[min(3, len(names) - 1)]]
            problems.append(f"tp_plan rule {glob!r} matches no module of {type(model).__name__} "
                            f"(closest module name: {near[0]!r}); fix or remove the rule")
        resolved.update({n: style for n in hits})
    return resolved, problems


def kv_replicas(config: Any, tp_size: int) -> int:
    n_kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    return tp_size // n_kv if tp_size > n_kv and tp_size % n_kv == 0 else 1


def head_problems(config: Any, tp_size: int) -> list[str]:
    heads = getattr(config, "num_attention_heads", None)
    n_kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        return []
    out = []
    if heads % tp_size:
        out.append(f"num_attention_heads={heads} is not divisible by tp_size={tp_size}: every rank must hold "
                   f"whole attention heads; use a tp_size that divides {heads}")
    if tp_size <= n_kv and n_kv % tp_size:
        out.append(f"num_key_value_heads={n_kv} is not divisible by tp_size={tp_size}; use a tp_size that "
                   f"divides {n_kv}, or a multiple of it (KV heads are then replicated)")
    if tp_size > n_kv and tp_size % n_kv:
        out.append(f"tp_size={tp_size} exceeds num_key_value_heads={n_kv} and is not a multiple of it, so KV "
                   f"heads cannot be replicated evenly; use a tp_size that divides {n_kv} or is a multiple of it")
    return out


def _fix_hint(name: str, config: Any, chunks: int) -> str:
    """The config field behind a dim that does not split, and what to do about it."""
    if "embed_tokens" in name or "lm_head" in name:
        return (f"vocab_size={getattr(config, 'vocab_size', '?')} must be a multiple of {chunks}. tptrain does not "
                f"pad the vocabulary for you: pad it (embed_tokens and lm_head rows, then vocab_size in "
                f"config.json) to a multiple of {chunks}, or choose a tp_size that divides it")
    if ".mlp." in name:
        return (f"intermediate_size={getattr(config, 'intermediate_size', '?')} must be a multiple of {chunks}; "
                f"choose a tp_size that divides it")
    return "choose a tp_size that divides it"


def make_styles(model: nn.Module, resolved: Mapping[str, str], tp_size: int) -> dict[str, ParallelStyle]:
    """{module name: style object} of a resolved plan; KV projections get their replica count."""
    replicas = kv_replicas(model.config, tp_size)
    is_kv = {name: name.rsplit(".", 1)[-1] in KV_PROJECTIONS for name in resolved}
    return {name: make_style(style, where=name, kv_replicas=replicas if is_kv[name] else 1)
            for name, style in resolved.items()}


def layout_specs(model: nn.Module, resolved: Mapping[str, str], tp_size: int
                 ) -> tuple[dict[str, ShardSpec], list[str]]:
    """ShardSpec for every parameter the plan touches (full names), and every divisibility problem."""
    specs: dict[str, ShardSpec] = {}
    problems: list[str] = []
    if any(".self_attn." in name and style != "replicated_with_grad_allreduce" for name, style in resolved.items()):
        problems += head_problems(model.config, tp_size)
    for name, style in make_styles(model, resolved, tp_size).items():
        module, style_name = model.get_submodule(name), style.name
        if not isinstance(module, style.module_types):
            problems.append(f"module {name!r} is a {type(module).__name__}, but style {style_name!r} supports "
                            f"only {', '.join(t.__name__ for t in style.module_types)}")
            continue
        for pname, spec in style.param_specs(module).items():
            shape = tuple(getattr(module, pname).shape)
            chunks = spec.num_chunks(tp_size)
            if spec.dim is not None and shape[spec.dim] % chunks:
                layers = re.sub(r"\.\d+\.", ".*.", name)  # one line for all layers, not one per layer
                problems.append(f"{layers}.{pname} has shape {shape}: dim {spec.dim} (size {shape[spec.dim]}) "
                                f"cannot be split into {chunks} equal shards for style {style_name!r} at "
                                f"tp_size={tp_size}; {_fix_hint(name, model.config, chunks)}")
            specs[f"{name}.{pname}"] = spec
    return specs, list(dict.fromkeys(problems))
