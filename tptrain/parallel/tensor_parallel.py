"""Apply a resolved plan to a model: shard parameters, install communication, swap in the TP loss.

Works on a model built on the meta device (from_pretrained then fills each local shard from the
checkpoint) and on a materialised model (each full parameter is sliced in memory).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm
from tptrain.parallel.grad_sync import PartialGradSync
from tptrain.parallel.loss import make_vocab_parallel_causal_lm_loss
from tptrain.parallel.plan import layout_specs, make_styles, resolve_plan
from tptrain.parallel.sequence_parallel import install_sequence_parallel
from tptrain.parallel.styles import ShardSpec, TPContext


@dataclass
class TPLayout:
    """What the engine did to one model: enough to load, gather, save or reshard it."""

    plan: dict[str, str]  # module name -> style name
    specs: dict[str, ShardSpec]  # parameter name (every alias of a tied weight) -> spec
    global_shapes: dict[str, tuple[int, ...]]  # parameter name -> unsharded shape
    ctx: TPContext
    grad_sync: PartialGradSync


def check_plan(model: nn.Module, tp_plan: str | Mapping[str, Any] | None, tp_size: int, *,
               sequence_parallel: bool = False) -> tuple[dict[str, str], dict[str, ShardSpec], list[str]]:
    """Resolve and validate without touching the model or any process group."""
    resolved, problems = resolve_plan(model, tp_plan, sequence_parallel=sequence_parallel)
    user_rules = isinstance(tp_plan, Mapping) and any(style is not None for style in tp_plan.values())
    if tp_size > 1 and not problems and not getattr(model.config, "base_model_tp_plan", None) and not user_rules:
        # The head's own plan alone would split only lm_head: that is not tensor parallelism of the model.
        problems.append(f"{type(model).__name__}'s config declares no base_model_tp_plan, so tptrain does not know "
                        f"how to shard it at tp_size={tp_size}; pass DistributedConfig(tp_plan={{module-glob: style}}) "
                        f"rules, or use tp_size=1")
    elif tp_size > 1 and not problems and not resolved:
        problems.append(f"the tensor-parallel plan of {type(model).__name__} is empty (the tp_plan overrides removed "
                        f"every rule), so tp_size={tp_size} has nothing to shard; keep some rules or use tp_size=1")
    specs, layout_problems = layout_specs(model, resolved, tp_size)
    return resolved, specs, problems + layout_problems


def raise_plan_problems(model: nn.Module, tp_size: int, problems: list[str]) -> None:
    """One ValueError listing every problem `check_plan` found (identical on every rank)."""
    if problems:
        raise ValueError(f"cannot shard {type(model).__name__} over tp_size={tp_size}:\n  - "
                         + "\n  - ".join(problems))


def _shard_parameters(model: nn.Module, specs: dict[str, ShardSpec], ctx: TPContext) -> dict[str, ShardSpec]:
    """Replace every planned parameter by its local shard; tied parameters stay one object.
    Returns the spec of every parameter name (aliases of tied weights included)."""
    old = dict(model.named_parameters(remove_duplicate=False))  # keeps old objects alive: ids stay unique
    aliases: dict[int, list[str]] = {}
    for name, p in old.items():
        aliases.setdefault(id(p), []).append(name)
    out = {name: ShardSpec() for name in old}
    new: dict[int, nn.Parameter] = {}
    for full, spec in specs.items():
        p = old[full]
        for alias in aliases[id(p)]:
            if alias in specs and specs[alias] != spec:
                raise ValueError(f"tied parameters {full!r} and {alias!r} are given different layouts "
                                 f"({spec} vs {specs[alias]}); give both modules the same split")
            out[alias] = spec
        if id(p) not in new:
            # A copy, so the full tensor can be freed (on meta it is a shape only).
            local = p.data if spec.dim is None else spec.local_chunk(p.data, ctx.size, ctx.rank).clone()
            new[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
    for name, p in old.items():
        if id(p) in new:
            mod_name, _, pname = name.rpartition(".")
            setattr(model.get_submodule(mod_name), pname, new[id(p)])
    return out


def gather_full(t: torch.Tensor, spec: ShardSpec, ctx: TPContext) -> torch.Tensor:
    """The unsharded tensor from every rank's local `t` (a parameter or its gradient). Collective."""
    if spec.dim is None:
        return t
    full = comm.all_gather(t.contiguous(), ctx.group, dim=spec.dim, phase="gather")
    if spec.replicas > 1:  # consecutive ranks hold the same chunk: keep one of each
        full = torch.cat(full.chunk(ctx.size, dim=spec.dim)[::spec.replicas], dim=spec.dim)
    return full


def _labels_given(forward) -> Callable[[tuple, dict], bool]:
    sig = inspect.signature(forward)

    def given(args, kwargs) -> bool:
        return sig.bind_partial(*args, **kwargs).arguments.get("labels") is not None

    return given


def apply_tensor_parallel(model: nn.Module, tp_plan: str | Mapping[str, Any] | None, *, tp_group,
                          sequence_parallel: bool = False) -> TPLayout:
    """Shard `model` in place over `tp_group` following `tp_plan` ("auto" or overrides)."""
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    plan, specs, problems = check_plan(model, tp_plan, tp_size, sequence_parallel=sequence_parallel)
    raise_plan_problems(model, tp_size, problems)
    global_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    ctx = TPContext(tp_group, tp_size, tp_rank, sequence_parallel=sequence_parallel)
    all_specs = _shard_parameters(model, specs, ctx)
    for name, style in make_styles(model, plan, tp_size).items():
        style.install(model.get_submodule(name), ctx)

    if plan.get("lm_head") == "colwise_gather_output":
        # Logits stay vocab-sharded whenever a loss is computed: the loss is vocab-parallel.
        model.loss_function = make_vocab_parallel_causal_lm_loss(tp_group)
        labels_given = _labels_given(model.forward)

        def before(module, args, kwargs):
            ctx.reset()
            ctx.keep_logits_sharded = labels_given(args, kwargs)

        model.register_forward_pre_hook(before, with_kwargs=True)
    else:
        model.register_forward_pre_hook(lambda module, args: ctx.reset())
    model.register_forward_hook(lambda module, args, out: ctx.reset())
    if sequence_parallel:
        install_sequence_parallel(model, ctx)
    grad_sync = PartialGradSync(all_specs, ctx)
    return TPLayout(plan, all_specs, global_shapes, ctx, grad_sync)
