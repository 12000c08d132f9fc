"""The training run's layout and its one mesh: the model's axes (fixed when it was loaded) with the data-parallel
sizes of the run, checked by the rule table (tptrain/layout); whether inductor can run here.

The parallelisms themselves are applied by the one parallelize (tptrain/parallel/parallelize.py): its structural
steps when the model is loaded (`from_pretrained(distributed_config=...)` or `model.parallelize(...)`), its training
steps (activation checkpointing -> compile -> the pipeline's schedule -> FSDP2/HSDP/DDP) by the Trainer's set-up
(training/setup.py `apply_training_steps`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tptrain.distributed import ParallelDims, init_distributed
from tptrain.layout import Case, Features, schedules, validate
from tptrain.distributed.state import state_of
from tptrain.parallel.parallelize import adopt_mesh, laid_out, model_facts
from tptrain.training.args import ParallelismConfig, TrainingArguments


def resolve_parallelism(model: nn.Module, config: ParallelismConfig | None, world_size: int | None = None, *,
                        args: TrainingArguments | None = None) -> ParallelDims:
    """The run's layout: the model's tp, ep, cp and pipeline (fixed when it was loaded: `laid_out`) with `config`'s
    data-parallel sizes (None: the remaining ranks as FSDP2 shards), resolved against the world size and checked by
    the rule table, with what `args` brings (the batch, its microbatches). A size `config` gives
    that is not the model's is the table's `model_layout` rule. Raises the same ValueError on every rank (no
    collective is involved)."""
    fixed = laid_out(model)
    tp_note = " (the model's)" if config is None or config.tp_size is None else ""
    config = config or ParallelismConfig()
    asked = (("tp_size", config.tp_size), ("ep_size", config.ep_size), ("cp_size", config.cp_size),
             ("pp_size", config.pp_size), ("pp_schedule", _schedule(config.pp_schedule)))
    validate(Case(model_axes=tuple(fixed.items()), config_axes=asked))
    ep = fixed["ep_size"]
    run = dataclasses.replace(config, tp_size=fixed["tp_size"], ep_size=ep if ep > 1 else None,
                              cp_size=fixed["cp_size"], pp_size=fixed["pp_size"], pp_schedule=fixed["pp_schedule"])
    dims = run.parallel_dims(world_size, tp_note=tp_note)
    training = {} if args is None else dict(batch_size=args.per_device_train_batch_size)
    features = Features(sequence_parallel=fixed["sequence_parallel"], pp_schedule=fixed["pp_schedule"],
                        pp_microbatches=config.pp_microbatches, **training)
    validate(Case(dims=dims, features=features, facts=model_facts(model)))
    return dims


def _schedule(name: str | None) -> str | None:
    """A schedule as the model's is spelled (torch's case), so that "interleaved1f1b" is not a disagreement."""
    return None if name is None else schedules.canonical(name) or name


def training_mesh(model: nn.Module, dims: ParallelDims) -> tuple[DeviceMesh, torch.device]:
    """The run's one mesh: the model's own when its sizes are `dims`. Otherwise (a model loaded with other
    data-parallel sizes, or not sharded at all) a mesh of `dims` is built and a TP model moves onto it, so
    no second mesh lives beside the model's. TP is innermost in both, so its TP group holds the same ranks."""
    state = state_of(model)
    device = init_distributed()
    if state.mesh is not None and ParallelDims.of(state.mesh) == dims:
        return state.mesh, device
    mesh = dims.build_mesh(device.type)
    if state.laid_out:
        adopt_mesh(model, mesh)
    return mesh, device


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
