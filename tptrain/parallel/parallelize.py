"""The one parallelize: every parallel axis applied to a model from outside it, each a small step, in one order.

    resolved = check(model, DistributedConfig(tp_size=2, pp_size=2))        # the rule table, then the plan
    parallelize(model, mesh, ParallelOptions(plan=resolved, load=fill), device=device)  # from_pretrained
    parallelize(model, mesh, ParallelOptions(train=True, bf16=True), device=device)     # the Trainer

The steps, in order (STEPS): pipeline cut -> tensor parallel (+ sequence parallel, + expert parallel: the plan's
expert styles, over tp or over the ep axis) -> context parallel -> load (this rank's slices) -> activation
checkpointing -> compile -> pipeline schedule -> FSDP2 / HSDP / DDP. This is torchtitan's parallelize_llama (TP ->
CP -> AC -> compile -> FSDP) with the pipeline cut first, as its pipeline_llama cuts the model before it
parallelizes each stage: on the meta model, so the TP plan, its layout table and the load see only this rank's stages,
and a rank reads only its stages' tensors. The first four steps fix the model's structure (they run where a
`plan` is given: `from_pretrained`, `model.parallelize`); the last four are the training run's (`train`: the
Trainer, on the model as it was loaded). Every step is a no-op when its options ask nothing of it.

A new axis is one step here plus the rows of the rule table (tptrain/layout) that say what it composes with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm
from tptrain.layout import LIBRARY, Case, Spelling, validate
from tptrain.parallel import pipeline_checkpoint, pipeline_parallel
from tptrain.parallel.context_parallel import adopt_cp_mesh, apply_context_parallel
from tptrain.parallel.data_parallel import apply_compile, apply_data_parallel
from tptrain.parallel.facts import laid_out, model_facts
from tptrain.parallel.plan import ResolvedPlan, check_plan
from tptrain.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["STEPS", "ParallelOptions", "Parallelized", "adopt_mesh", "check", "laid_out", "model_facts", "parallelize",
           "save_stages"]


@dataclass(frozen=True)
class ParallelOptions:
    """What `parallelize` applies. The structure (a DistributedConfig's), applied when `plan` is given: the TP plan
    resolved and checked by `check`, the pipeline's schedule and layers, and `load` (fills the meta model's
    parameters with this rank's slices once they are laid out; None: the model is moved to the device). The training
    run's steps (TrainingArguments'), applied when `train`."""

    plan: ResolvedPlan | None = None
    pp_schedule: str = "1F1B"
    pp_layers: Sequence[Sequence[int]] | None = None
    load: Callable[[nn.Module], None] | None = None
    train: bool = False
    gradient_checkpointing: bool = False
    compile_backend: str | None = None  # None: not compiled
    bf16: bool = False
    pp_microbatches: int | None = None  # None: as many as pipeline ranks
    on_forward: Callable[[], None] | None = None  # before each stage's forward (a PeftModel's dropout count)


@dataclass
class Parallelized:
    """What the steps made: the plan as applied (restricted to this rank's stages), whether FSDP2 wraps the model,
    and the pipeline (this rank's stages and torch's schedule; None without pp)."""

    plan: ResolvedPlan | None = None
    fsdp: bool = False
    pipeline: pipeline_parallel.Pipeline | None = None


def cut_pipeline(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Keep only this rank's stages of the (meta) model; the plan restricted to them."""
    if options.plan is not None and "pp" in mesh.mesh_dim_names:
        pp = mesh["pp"]
        done.plan = pipeline_parallel.cut_for_rank(model, options.plan, pp=pp.size(), pp_rank=pp.get_local_rank(),
                                                   schedule=options.pp_schedule, layers=options.pp_layers)


def tensor_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """The plan's styles over the tp axis (sequence parallelism is part of the plan; the expert styles split the
    experts over tp, or by expert over the ep axis); the model records its layout table."""
    if options.plan is None:
        return
    plan = done.plan
    ep_group = mesh["ep"].get_group() if plan.ep_size > 1 else None
    layout = apply_tensor_parallel(model, plan, tp_group=mesh["tp"].get_group(), ep_group=ep_group)
    model.tp_size, model.tp_plan, model.device_mesh, model.tp_layout = plan.tp_size, layout.plan, mesh, layout


def context_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Each sequence split over the cp axis (after TP: it wraps the loss functions TP installed)."""
    if options.plan is not None:
        model.cp_context = apply_context_parallel(model, mesh)


def load(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """This rank's slice of each of its parameters (`options.load`), or the model moved to `device`; the TP
    gradient sync attached to the parameters as they now are."""
    if options.load is not None:
        options.load(model)
    elif any(p.device != device for p in model.parameters()):  # a model built or loaded elsewhere
        model.to(device)
    if options.plan is not None:
        model.tp_layout.grad_sync.attach(model)


def activation_checkpointing(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    if options.train and options.gradient_checkpointing:
        model.gradient_checkpointing_enable()


def compile_layers(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    if options.train and options.compile_backend is not None:
        apply_compile(model, backend=options.compile_backend)


def pipeline_schedule(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Torch's stages and schedule over this rank's stage modules (views of the model as it is now: after AC and
    compile, before FSDP2, which wraps each stage module)."""
    if options.train and getattr(model, "pp_plan", None) is not None:
        n_microbatches = options.pp_microbatches or model.pp_plan.pp
        done.pipeline = pipeline_parallel.Pipeline(model, mesh, n_microbatches=n_microbatches, device=device,
                                                   on_forward=options.on_forward)


def data_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """FSDP2 / HSDP / DDP over the data-parallel axes (each stage module under pp). The TP partial-gradient sum
    switches to once per optimizer step first (its hooks would sit on the parameter objects FSDP2 replaces): the
    Trainer calls it after the last micro-batch."""
    if not options.train:
        return
    layout = getattr(model, "tp_layout", None)
    assert getattr(model, "tp_size", 1) == mesh["tp"].size(), (getattr(model, "tp_size", 1), mesh)
    if layout is not None:
        layout.grad_sync.set_mode("step")
    done.fsdp = apply_data_parallel(model, mesh, bf16=options.bf16, pipeline=done.pipeline)


STEPS = (cut_pipeline, tensor_parallel, context_parallel, load, activation_checkpointing, compile_layers,
         pipeline_schedule, data_parallel)


def parallelize(model: nn.Module, mesh, options: ParallelOptions, *, device: torch.device) -> Parallelized:
    """Apply every step of STEPS to `model` on `mesh` (this rank's device `device`), in order."""
    done = Parallelized(plan=options.plan)
    for step in STEPS:
        step(model, mesh, options, device, done)
    return done


def check(model: nn.Module, config, *, world_size: int | None = None, device_map: bool = False,
          training: dict | None = None, spelling: Spelling = LIBRARY, plan_problems: bool = True) -> ResolvedPlan:
    """Every refusal of laying `model` (whole, unsharded: on meta) out as `config` (a DistributedConfig), before any
    collective: the rule table (the sizes; what composes with what and with this model; with `training`, the
    Features a training run brings), then (`plan_problems`) the plan's problems. Returns the resolved plan."""
    dims = config.parallel_dims(world_size, device_map=device_map)
    resolved = check_plan(model, config.tp_plan, dims.tp, sequence_parallel=config.enable_sequence_parallel,
                          expert_parallel=config.enable_expert_parallel, ep_size=dims.ep)
    validate(Case(dims=dims, features=config.features(device_map=device_map, **(training or {})),
                  facts=model_facts(model, resolved.objects), spelling=spelling))
    if plan_problems:
        resolved.raise_problems(model)
    return resolved


def adopt_mesh(model: nn.Module, mesh) -> None:
    """Make `mesh` (same tp, ep and cp sizes; TP innermost) `model`'s mesh: its TP, ep and cp groups hold the same
    ranks as those it was laid out over, so only the mesh and the groups' names change (the Trainer's mesh, of other
    data-parallel sizes)."""
    old, new = model.device_mesh["tp"].get_group(), mesh["tp"].get_group()
    assert dist.get_process_group_ranks(old) == dist.get_process_group_ranks(new), (old, new)
    model.device_mesh = mesh
    model.tp_layout.ctx.group_name = comm.group_name(new)
    if model.tp_layout.ctx.ep_size > 1:
        ep = mesh["ep"].get_group()
        old_ep = comm.resolve_group(model.tp_layout.ctx.ep_group_name)
        assert dist.get_process_group_ranks(old_ep) == dist.get_process_group_ranks(ep), (old_ep, ep)
        model.tp_layout.ctx.ep_group_name = comm.group_name(ep)
    adopt_cp_mesh(model, mesh)


def save_stages(model: nn.Module, *args, **kwargs) -> bool:
    """save_pretrained of a model cut into pipeline stages (each stage writes its own shard files, rank 0 the index
    last: parallel/pipeline_checkpoint.py). Returns False, having done nothing, for a model that is not cut."""
    if getattr(model, "pp_plan", None) is None:
        return False
    pipeline_checkpoint.save_stages(model, *args, **kwargs)
    return True

