"""The run's device mesh and the parallelisms applied to the model, in the fixed order
tensor parallel -> activation checkpointing -> torch.compile (per decoder layer) -> FSDP2 / HSDP / DDP.

Tensor parallelism is applied when the model is loaded (`from_pretrained(distributed_config=...)` or
`model.parallelize(...)`); this module checks that the training layout agrees with it, then wraps
the TP-sharded model (under pipeline parallelism: each stage module) in FSDP2 over the data-parallel axes.
TP parameters are plain local tensors, so FSDP shards each rank's TP shard as an ordinary parameter.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tptrain.distributed import ParallelDims, init_distributed
from tptrain.distributed.topology import dp_shard_cp_mesh, expert_dp_mesh
from tptrain.parallel import contract, pipeline_parallel
from tptrain.training.args import ParallelismConfig


def resolve_parallelism(model: nn.Module, config: ParallelismConfig | None,
                        world_size: int | None = None) -> ParallelDims:
    """The run's layout: `config` checked against the model's tp_size and the world size, or, without
    one, the model's tp_size with the remaining ranks as FSDP2 shards. Raises the same ValueError on
    every rank (no collective is involved)."""
    model_tp = getattr(model, "tp_size", 1)
    layout = getattr(model, "tp_layout", None)
    model_ep = layout.ctx.ep_size if layout is not None else 1
    tp_note = " (the model's)" if config is None or config.tp_size is None else ""
    config = config or ParallelismConfig()
    if config.tp_size is not None and config.tp_size != model_tp:
        raise ValueError(f"ParallelismConfig(tp_size={config.tp_size}) disagrees with the model, which is sharded "
                         f"over tp_size={model_tp}; load the model with DistributedConfig(tp_size={config.tp_size}) "
                         f"or set ParallelismConfig(tp_size={model_tp})")
    if (config.ep_size or model_ep) != model_ep:
        raise ValueError(f"ParallelismConfig(ep_size={config.ep_size}) disagrees with the model, whose experts are "
                         f"split over ep_size={model_ep}; load the model with DistributedConfig(ep_size="
                         f"{config.ep_size}) (its experts are sharded when it is loaded) or set "
                         f"ParallelismConfig(ep_size={model_ep})")
    context = getattr(model, "cp_context", None)
    model_cp = context.size if context is not None else 1
    if (config.cp_size or model_cp) != model_cp:
        raise ValueError(f"ParallelismConfig(cp_size={config.cp_size}) disagrees with the model, which splits its "
                         f"sequences over cp_size={model_cp}; load the model with DistributedConfig(cp_size="
                         f"{config.cp_size}) or set ParallelismConfig(cp_size={model_cp})")
    config = dataclasses.replace(config, tp_size=model_tp, ep_size=model_ep if model_ep > 1 else None,
                                 cp_size=model_cp, **_pipeline(model, config))
    dims = config.parallel_dims(world_size, tp_note=tp_note)
    check_tied_stages(model, dims)
    return dims


def _pipeline(model: nn.Module, config: ParallelismConfig) -> dict:
    """The model's pp_size and pp_schedule, which `config` must agree with (as tp_size): a model is cut into its
    stages when it is loaded."""
    plan = getattr(model, "pp_plan", None)
    pp, schedule = (plan.pp, plan.schedule) if plan is not None else (1, "1F1B")
    wanted = (config.pp_size or pp, pipeline_parallel.schedule_name(config.pp_schedule or schedule))
    if wanted != (pp, schedule):
        raise ValueError(f"ParallelismConfig(pp_size={config.pp_size}, pp_schedule={config.pp_schedule!r}) disagrees "
                         f"with the model, cut into stages for pp_size={pp}, pp_schedule={schedule!r}; load it with "
                         f"DistributedConfig(pp_size={wanted[0]}, pp_schedule={wanted[1]!r}) or leave them None")
    return dict(pp_size=pp, pp_schedule=schedule)


def check_tied_stages(model: nn.Module, dims: ParallelDims) -> None:
    """A V schedule puts the first and the last stage on one rank, where a tied embedding and head are one parameter
    of two stage modules: FSDP2 (DDP and HSDP too: all are fully_shard here) cannot wrap one parameter in two."""
    plan = getattr(model, "pp_plan", None)
    if plan is None or not plan.tied or dims.dp == 1 or plan.stage_rank(0) != plan.stage_rank(plan.n_stages - 1):
        return
    raise ValueError(f"pp_schedule={plan.schedule!r} puts the first and the last stage on one rank, where the tied "
                     f"embedding and head ({plan.tied[0][0]} = {plan.tied[0][1]}) are one parameter of two stage "
                     f"modules, and data parallelism (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}) "
                     f"cannot wrap one parameter in two FSDP2 modules; use a looped schedule (1F1B, Interleaved1F1B, "
                     f"InterleavedZeroBubble) with data parallelism, or pp x tp ranks only (dp_shard_size=1)")


def training_mesh(model: nn.Module, dims: ParallelDims) -> tuple[DeviceMesh, torch.device]:
    """The run's one mesh: the model's own when its sizes are `dims`. Otherwise (a model loaded with other
    data-parallel sizes, or not sharded at all) a mesh of `dims` is built and a TP model moves onto it, so
    no second mesh lives beside the model's. TP is innermost in both, so its TP group holds the same ranks."""
    mesh = getattr(model, "device_mesh", None)
    device = init_distributed()
    if mesh is not None and ParallelDims.of(mesh) == dims:
        return mesh, device
    mesh = dims.build_mesh(device.type)
    if getattr(model, "tp_layout", None) is not None:
        model.adopt_mesh(mesh)
    return mesh, device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, each its own FSDP unit (one all-gather / reduce-scatter per layer)."""
    base = getattr(model, contract.prefix(model), None)
    layers = getattr(base, "layers", [])
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)  # ModuleDict: a pipeline stage's


def ep_split_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose parameters the layout splits over the ep axis (the stacked experts), as the layout says."""
    layout = getattr(model, "tp_layout", None)
    if layout is None:
        return []
    names = dict.fromkeys(name.rpartition(".")[0] for name, spec in layout.specs.items() if spec.ep_split)
    return [model.get_submodule(name) for name in names]


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh, *, bf16: bool,
                        stages: Sequence[nn.Module] | None = None) -> bool:
    """FSDP2 over dp_shard; HSDP over (dp_replicate, dp_shard) when dp_replicate > 1 (plain replicated
    DP when dp_shard is 1). Returns whether the model was wrapped (False when both dp degrees are 1).

    Gradients are SUMMED over data-parallel ranks, not averaged: the loss is already divided by the
    real-token count of the global batch, so FSDP's default 1/dp would count each token dp times too
    little.

    With an ep axis, the experts split over it are wrapped first, on their own, over the ranks holding the same
    experts (`expert_dp_mesh`: dp_shard_mod_ep, HSDP with dp_replicate), so their gradients are summed only there;
    everything else is sharded over dp_shard (ep included) as without it.

    With context parallelism FSDP2 shards over dp_shard x cp flattened (torchtitan's dp_shard_cp): the cp ranks'
    gradients are shares of one batch's, which its reduce-scatter sums.

    `stages`: under pipeline parallelism, this rank's stage modules, each wrapped last in place of the model (it
    holds what no layer of the stage holds: the embedding, the final norm, the head; torchtitan's 3-D layout).
    torch's PipelineStage sees an FSDP module: it holds the gradient reduce-scatter back until the last microbatch
    and runs it at the end of the schedule's step. Parameters stay gathered from a microbatch's forward to the
    step's end (reshard_after_forward False, torchtitan's default under pp), instead of one all-gather per
    microbatch and layer."""
    rep, shards = mesh["dp_replicate"].size(), dp_shard_cp_mesh(mesh)
    if rep * shards.size() == 1:
        return False
    dp_mesh = mesh["dp_replicate", shards.mesh_dim_names[0]] if rep > 1 else shards
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                 else MixedPrecisionPolicy())
    reshard = stages is None  # each unit's reshard_after_forward
    for experts in ep_split_modules(model):
        fully_shard(experts, mesh=expert_dp_mesh(mesh), mp_policy=mp_policy, reshard_after_forward=reshard)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    for root in stages or (model,):
        fully_shard(root, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    for module in (m for root in stages or (model,) for m in root.modules()):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM everywhere: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_force_sum_reduction_for_comms(True)
    return True


def compile_error(backend: str, device: torch.device) -> str | None:
    """Why torch.compile with `backend` cannot run on `device` here (None: it can): inductor needs a C++ compiler
    for CPU code and Triton for CUDA code. Found before any collective, so every rank refuses alike."""
    if backend != "inductor":
        return None
    fix = ("or train without torch_compile (--compile), or pick another backend with "
           "TrainingArguments(torch_compile_backend='aot_eager')")
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else f"torch_compile=True (inductor) on CUDA needs Triton: pip install triton, {fix}"
    from torch._inductor import config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = ", ".join(c for c in config.cpp.cxx if c)
        return (f"torch_compile=True (inductor) on CPU needs a working C++ compiler, and none was found (tried: "
                f"{tried}); install one (apt-get install g++) or point CXX at it (CXX=/usr/bin/clang++), {fix}")
    return None


def apply_compile(model: nn.Module, *, backend: str) -> None:
    """torch.compile each decoder layer on its own (torchtitan's per-block compile): the layers share one code, so
    compiling one block is compiling them all, and the TP styles' hooks and collectives inside a block are traced
    with it (comm.py's collectives are custom ops). The layer's `forward` is replaced in place, so parameter names,
    the layout table and checkpoints are unchanged, and hooks on the layer itself (FSDP2's, applied after this)
    run around the compiled call. Applied after activation checkpointing, which calls each (compiled) layer."""
    layout = getattr(model, "tp_layout", None)
    for layer in decoder_layers(model):
        if layout is not None and layout.ctx.size > 1:  # a block never reuses the last block's shared TP boundary: starting each without
            # it (in eager, before the compiled call) spares dynamo a second graph guarded on it being set
            layer.register_forward_pre_hook(lambda module, args: layout.ctx.reset())
        layer.forward = torch.compile(layer.forward, backend=backend)


def prepare_for_training(model: nn.Module, mesh: DeviceMesh, *, gradient_checkpointing: bool,
                         compile_backend: str | None = None) -> None:
    """TP (already applied) -> activation checkpointing -> torch.compile per layer (`compile_backend`, None: not
    compiled); FSDP2/HSDP/DDP (`apply_data_parallel`) comes next, after a pipeline's stage modules are built
    (they are views of the model as it is then).

    The TP engine's partial-gradient sum switches to once per optimizer step (its hooks would sit on
    the parameter objects FSDP replaces): the Trainer calls it after the last micro-batch."""
    model_tp = getattr(model, "tp_size", 1)
    assert model_tp == mesh["tp"].size(), (model_tp, mesh)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if compile_backend is not None:
        apply_compile(model, backend=compile_backend)
    if getattr(model, "tp_layout", None) is not None:
        model.tp_layout.grad_sync.set_mode("step")
