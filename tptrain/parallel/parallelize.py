"""The one parallelize: every parallel axis applied to a model from outside it, each a small step, in one order.

    resolved = check(model, DistributedConfig(tp_size=2, pp_size=2))        # the rule table, then the plan
    parallelize(model, mesh, ParallelOptions(plan=resolved, load=fill), device=device)  # from_pretrained
    parallelize(model, mesh, ParallelOptions(train=True, bf16=True), device=device)     # the Trainer

The steps, in order (STEPS): pipeline cut -> tensor parallel (+ sequence parallel, + expert parallel: the plan's
expert styles, over tp or over the ep axis) -> context parallel -> the router aux loss over the token shards -> the
forward scope -> load (this rank's slices) -> activation checkpointing -> compile -> pipeline schedule -> FSDP2 /
HSDP / DDP. This is torchtitan's parallelize_llama (TP -> CP -> AC -> compile -> FSDP) with the pipeline cut first, as
its pipeline_llama cuts the model before it parallelizes each stage: on the meta model, so the TP plan, its layout
table and the load see only this rank's stages, and a rank reads only its stages' tensors. The structural steps, up
to the load, run where a `plan` is given (`from_pretrained`, `model.parallelize`); the last four are the training
run's (`train`: the Trainer, on the model as it was loaded). Every step is a no-op when its options ask nothing of it.

What the steps make is one `ParallelState` on the model (`model.parallel`, tptrain/distributed/state.py): the sizes
and mesh, each axis's own object (the TP layout, the CP context, the pipeline plan), the gradient sync, and the forward
scope: each axis acting around a forward adds its begin / end to it in its step, and every path through the model
(its forward, through the hooks the scope step installs; a pipeline stage's forward and a pipeline step) runs it.

A new axis is one step here (its module, its begin / end in the scope), the rows of the rule table (tptrain/layout)
that say what it composes with, and its term in the planner (tptrain/diagnostics).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from tptrain.distributed.state import Batch, ForwardScope, ParallelState, state_of
from tptrain.layout import LIBRARY, Case, ParallelDims, Spelling, validate
from tptrain.parallel import pipeline_parallel
from tptrain.parallel.context_parallel import apply_context_parallel
from tptrain.parallel.data_parallel import apply_compile, apply_data_parallel
from tptrain.parallel.expert_parallel import router_aux_over_token_shards
from tptrain.parallel.facts import laid_out, model_facts
from tptrain.parallel.grad_sync import GradSync
from tptrain.parallel.plan import ResolvedPlan, check_plan
from tptrain.parallel.sequence_parallel import SequenceParallelSaver
from tptrain.parallel.tensor_parallel import TPForward, apply_tensor_parallel

__all__ = ["STEPS", "ParallelOptions", "Parallelized", "adopt_mesh", "check", "laid_out", "model_facts", "parallelize"]


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
    """What the steps made: the model's ParallelState (the one-process state of a model never laid out, which the
    training steps only read), the plan as applied (restricted to this rank's stages), whether FSDP2 wraps the
    model, and the pipeline (this rank's stages and torch's schedule; None without pp)."""

    state: ParallelState = field(default_factory=ParallelState)
    plan: ResolvedPlan | None = None
    fsdp: bool = False
    pipeline: pipeline_parallel.Pipeline | None = None


def cut_pipeline(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Keep only this rank's stages of the (meta) model (`state.pp`); the plan restricted to them."""
    state = done.state
    if options.plan is not None and state.dims.pp > 1:
        pp = mesh["pp"]
        state.pp, done.plan = pipeline_parallel.cut_for_rank(model, options.plan, pp=pp.size(),
                                                             pp_rank=pp.get_local_rank(), schedule=options.pp_schedule,
                                                             layers=options.pp_layers)


def tensor_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """The plan's styles over the tp axis (sequence parallelism is part of the plan; the expert styles split the
    experts over tp, or by expert over the ep axis): `state.tp`, the layout table; TP's and SP's begin / end in the
    forward scope (over one tp rank nothing acts around a forward)."""
    state = done.state
    if options.plan is None:
        return
    plan = done.plan
    ep_group = mesh["ep"].get_group() if plan.ep_size > 1 else None
    state.tp = apply_tensor_parallel(model, plan, tp_group=mesh["tp"].get_group(), ep_group=ep_group)
    state.grad_sync = GradSync(state)
    if plan.tp_size > 1:
        state.scope.add(TPForward(state.tp))
        if plan.sequence_parallel:
            state.scope.add(SequenceParallelSaver(state.tp.ctx, type(model).__name__))


def context_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Each sequence split over the cp axis (after TP: it wraps the loss functions TP installed); `state.cp`, which
    joins the forward scope."""
    state = done.state
    if options.plan is not None:
        state.cp = apply_context_parallel(model, mesh)
        if state.cp is not None:
            state.scope.add(state.cp)


def router_aux(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """The router aux loss's token counts summed over the axes holding one batch's tokens (tp under SP, cp)."""
    state = done.state
    if options.plan is not None:
        router_aux_over_token_shards(model, state)


def forward_scope(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """The model's forward runs the scope: a pre-hook begins it on the forward's arguments (what the axes change, a
    cp rank's tokens say, written back), a hook (always called) ends it on the output; inside a scope a caller opened
    (a generation step's) they add nothing."""
    state = done.state
    if options.plan is not None and state.scope.axes:
        _run_scope_around_forward(model, state.scope)


def load(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """This rank's slice of each of its parameters (`options.load`), or the model moved to `device`; the gradient
    sync attached to the parameters as they now are."""
    state = done.state
    if options.load is not None:
        options.load(model)
    elif any(p.device != device for p in model.parameters()):  # a model built or loaded elsewhere
        model.to(device)
    if options.plan is not None:
        state.grad_sync.attach(model)


def activation_checkpointing(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    if options.train and options.gradient_checkpointing:
        model.gradient_checkpointing_enable()


def compile_layers(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Each decoder layer compiled; over tp > 1 each starts without the last one's shared TP boundary (in eager,
    before the compiled call: it spares dynamo a second graph guarded on it being set)."""
    state = done.state
    if options.train and options.compile_backend is not None:
        reset = state.tp.ctx.reset if state.tp is not None and state.dims.tp > 1 else None
        apply_compile(model, backend=options.compile_backend, before_layer=reset)


def pipeline_schedule(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """Torch's stages and schedule over this rank's stage modules (views of the model as it is now: after AC and
    compile, before FSDP2, which wraps each stage module). The schedules run backward in pieces (zero-bubble: input
    and weight gradients apart): the gradient sync sums once per step, by whoever owns the loop; under cp every
    gradient is a cp rank's share, summed by FSDP2's reduce-scatter over dp_shard x cp (the Trainer always wraps
    the stages then)."""
    state = done.state
    if options.train and state.pp is not None:
        if state.grad_sync is not None:
            state.grad_sync.set_mode("step")
        n_microbatches = options.pp_microbatches or state.pp.pp
        done.pipeline = pipeline_parallel.Pipeline(model, mesh, n_microbatches=n_microbatches,
                                                   device=device, on_forward=options.on_forward)


def data_parallel(model: nn.Module, mesh, options: ParallelOptions, device, done: Parallelized) -> None:
    """FSDP2 / HSDP / DDP over the data-parallel axes (each stage module under pp; the experts split over an ep
    axis on their own). The gradient sync switches to once per optimizer step first (its hooks would sit on the
    parameter objects FSDP2 replaces): the Trainer calls it after the last micro-batch."""
    state = done.state
    if not options.train:
        return
    assert state.dims.tp == mesh["tp"].size(), (state.dims, mesh)
    if state.grad_sync is not None:
        state.grad_sync.set_mode("step")
    experts = [] if state.tp is None else state.tp.ep_split_modules(model)
    done.fsdp = apply_data_parallel(model, mesh, bf16=options.bf16, pipeline=done.pipeline,
                                    ep_split=experts)


STEPS = (cut_pipeline, tensor_parallel, context_parallel, router_aux, forward_scope, load, activation_checkpointing,
         compile_layers, pipeline_schedule, data_parallel)


def parallelize(model: nn.Module, mesh, options: ParallelOptions, *, device: torch.device) -> Parallelized:
    """Apply every step of STEPS to `model` on `mesh` (this rank's device `device`), in order. With a `plan` (the
    structure) the model gets its ParallelState first (`model.parallel`); the training steps read the one it has."""
    if options.plan is not None:
        model.parallel = ParallelState(dims=ParallelDims.of(mesh), mesh=mesh)
    done = Parallelized(state=state_of(model), plan=options.plan)
    for step in STEPS:
        step(model, mesh, options, device, done)
    return done


def _run_scope_around_forward(model: nn.Module, scope: ForwardScope) -> None:
    signature = inspect.signature(model.forward)
    began: list[bool] = []  # per call in flight: whether its begin completed (the hook is always called)

    def begin(module, args, kwargs):
        if scope.open:  # the caller runs the scope around this forward (the generation engine, with its own batch)
            began.append(False)
            return None
        bound = signature.bind(*args, **kwargs)
        try:
            batch = scope.begin(Batch.of_arguments(bound.arguments))
        except BaseException:
            began.append(False)
            raise
        began.append(True)
        batch.write_to(bound.arguments, signature.parameters)
        return bound.args, bound.kwargs

    def end(module, args, output):
        return scope.end(output) if began.pop() else output

    model.register_forward_pre_hook(begin, with_kwargs=True)
    model.register_forward_hook(end, always_call=True)


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
    data-parallel sizes). Each axis adopts it on its own."""
    state = model.parallel
    state.tp.adopt(mesh)
    if state.cp is not None:
        state.cp.adopt(mesh)
    state.mesh, state.dims = mesh, ParallelDims.of(mesh)
