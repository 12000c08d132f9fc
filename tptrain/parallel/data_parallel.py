"""Data parallelism (FSDP2 / HSDP / DDP, all as `fully_shard`) and per-layer torch.compile: the last steps of the one
parallelize (parallelize.py), on a model already split over its other axes; the weights held gathered for a
generation (`held_unsharded`).

TP parameters are plain local tensors, so FSDP shards each rank's TP shard as an ordinary parameter.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tptrain.distributed.topology import dp_shard_cp_mesh, expert_dp_mesh
from tptrain.parallel import contract


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, each its own FSDP unit (one all-gather / reduce-scatter per layer)."""
    try:
        layers = model.get_submodule(contract.layers(model))
    except AttributeError:  # a model without a layer list: one unit
        return []
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)  # ModuleDict: a pipeline stage's


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh, *, bf16: bool, pipeline=None,
                        ep_split: Sequence[nn.Module] = ()) -> bool:
    """FSDP2 over dp_shard; HSDP over (dp_replicate, dp_shard) when dp_replicate > 1 (plain replicated
    DP when dp_shard is 1). Returns whether the model was wrapped (False when both dp degrees are 1).

    Gradients are SUMMED over data-parallel ranks, not averaged: the loss is already divided by the
    real-token count of the global batch, so FSDP's default 1/dp would count each token dp times too
    little.

    With an ep axis, the experts split over it (`ep_split`) are wrapped first, on their own, over the ranks holding the same
    experts (`expert_dp_mesh`: dp_shard_mod_ep, HSDP with dp_replicate), so their gradients are summed only there;
    everything else is sharded over dp_shard (ep included) as without it.

    With context parallelism FSDP2 shards over dp_shard x cp flattened (torchtitan's dp_shard_cp): the cp ranks'
    gradients are shares of one batch's, which its reduce-scatter sums.

    `pipeline`: under pipeline parallelism (parallel/pipeline_parallel.Pipeline), this rank's stage modules are each
    wrapped last in place of the model (it holds what no layer of the stage holds: the embedding, the final norm,
    the head; torchtitan's 3-D layout); a tied weight two of them share (a V schedule's first and last stage) is the
    last one's own copy while they are wrapped (`TiedWeights.own_copy`). torch's PipelineStage sees an FSDP module: it
    holds the gradient reduce-scatter back until the last microbatch and runs it at the end of the schedule's step.
    Parameters stay gathered from a microbatch's forward to the step's end (reshard_after_forward False,
    torchtitan's default under pp), instead of one all-gather per microbatch and layer."""
    rep, shards = mesh["dp_replicate"].size(), dp_shard_cp_mesh(mesh)
    if rep * shards.size() == 1:
        return False
    dp_mesh = mesh["dp_replicate", shards.mesh_dim_names[0]] if rep > 1 else shards
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                 else MixedPrecisionPolicy())
    reshard = pipeline is None  # each unit's reshard_after_forward
    roots = pipeline.modules if pipeline is not None else [model]
    with pipeline.ties.own_copy() if pipeline is not None else contextlib.nullcontext():
        for experts in ep_split:
            fully_shard(experts, mesh=expert_dp_mesh(mesh), mp_policy=mp_policy, reshard_after_forward=reshard)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        for root in roots:
            fully_shard(root, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    for module in (m for root in roots for m in root.modules()):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM everywhere: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_force_sum_reduction_for_comms(True)
    return True


@contextlib.contextmanager
def held_unsharded(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 module of `model` gathered once and held so until the block ends (no re-gather per forward, no
    reshard after one: a generation's forwards), then resharded with its reshard_after_forward as it was. Nothing
    when `model` holds no FSDP2 module. Collective over the data-parallel ranks: every one enters it."""
    held = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not held:
        yield
        return
    if isinstance(model, FSDPModule):  # which state is the root, settled now (torch does it at the first forward)
        model._get_fsdp_state()._lazy_init()
    before = [_reshard_setting(m) for m in held]
    for module in held:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module, setting in zip(held, before):
            module.reshard()
            _restore_reshard_setting(module, setting)


def _reshard_setting(module: FSDPModule) -> tuple:
    """What `set_reshard_after_forward` changes on `module` (torch has no getter): its state's flag and each
    parameter group's post-forward mesh."""
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_setting(module: FSDPModule, setting: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward, meshes = setting
    for group, mesh_info in zip(state._fsdp_param_groups, meshes):
        group.post_forward_mesh_info = mesh_info


def apply_compile(model: nn.Module, *, backend: str, before_layer: Callable[[], None] | None = None) -> None:
    """torch.compile each decoder layer on its own (torchtitan's per-block compile): the layers share one code, so
    compiling one block is compiling them all, and the TP styles' hooks and collectives inside a block are traced
    with it (comm.py's collectives are custom ops). The layer's `forward` is replaced in place, so parameter names,
    the layout table and checkpoints are unchanged, and hooks on the layer itself (FSDP2's, applied after this)
    run around the compiled call. Applied after activation checkpointing, which calls each (compiled) layer.
    `before_layer`: called before each layer's (compiled) call, in eager."""
    for layer in decoder_layers(model):
        if before_layer is not None:
            layer.register_forward_pre_hook(lambda module, args: before_layer())
        layer.forward = torch.compile(layer.forward, backend=backend)
