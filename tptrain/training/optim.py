"""AdamW, the learning-rate schedule, and global gradient-norm clipping over every shard.

Parameters may be TP shards (plain local tensors) wrapped by FSDP2 (DTensors sharded over the
data-parallel axes). AdamW and weight decay are element-wise, so they act on whatever piece a rank
holds; only the gradient norm needs the whole picture, and `clip_grad_norm_` counts every element
of every parameter exactly once.

Every element is stepped, every step: AdamW has no exact row-sparse step. Rows of an embedding that no token
of the batch used still move (weight decay shrinks every row; the moments of rows seen earlier keep the update
m / sqrt(v) non-zero), and a tied head's gradient touches every row anyway. What makes the step fast is the
kernel: `adamw_kernels` picks torch's fused one.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _default_to_fused_or_foreach

from tptrain.distributed import comm
from tptrain.distributed.topology import dp_placements, dp_shard_cp_mesh
from tptrain.parallel.grad_sync import local_tensor
from tptrain.parallel.styles import ShardSpec
from tptrain.training.args import TrainingArguments
from tptrain.training.checkpoint.fused_shards import fsdp_segment_pieces


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and undecayed norms and biases (every 1-D parameter)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kernels(optim: str, params: Iterable[torch.Tensor]) -> dict[str, bool | None]:
    """torch.optim.AdamW's `fused` / `foreach` arguments for `params`. "adamw_torch_fused": torch's fastest kernel
    for the devices they live on, by torch's own rule: fused (one pass over each tensor, no temporaries: on CPU
    ~5x the per-tensor loop, and the step's peak memory without the loop's two parameter-sized temporaries) where
    every parameter's device has it, as CPU and CUDA do for every float dtype and DTensor (FSDP2's shards); else
    foreach where the device has foreach kernels; else the loop. "adamw_torch": torch's default (foreach on CUDA,
    the loop on CPU), as transformers' name means. The same update up to rounding (fp64: 1e-12, tested)."""
    if optim != "adamw_torch_fused":
        return {"fused": None, "foreach": None}
    fused, foreach = _default_to_fused_or_foreach(list(params), differentiable=False, use_fused=True)
    return {"fused": fused, "foreach": foreach}


def build_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.AdamW:
    groups = param_groups(model, args.weight_decay)
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, **adamw_kernels(args.optim, (p for g in groups for p in g["params"])))


def lr_multiplier(kind: str, *, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Factor of the peak learning rate for optimizer step `step` (0-based), as transformers'
    get_{linear,cosine,constant}_schedule_with_warmup: linear warmup from 0, then the decay to 0 at
    `total_steps`."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, *,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`args`' schedule, decaying to 0 at `total_steps`: the run's max_steps (num_train_epochs may set it)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(
        args.lr_scheduler_type, warmup_steps=args.warmup_steps, total_steps=total_steps))


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, *, specs: Mapping[str, ShardSpec],
                    mesh: DeviceMesh | None, exclude: set[str] = frozenset()) -> torch.Tensor:
    """Global L2 norm of all gradients (over TP, dp_shard and dp_replicate), then scale them so it is
    at most `max_norm` (0: measure only; a NaN or inf norm: left unscaled). Same formula as
    torch.nn.utils.clip_grad_norm_. Collective.

    Each piece is counted once, over the axis it is split along: the squares of TP-sharded tensors are
    summed over the TP group (a KV chunk held by `replicas` ranks counts on the first of them); tensors
    whole on every TP rank count once; then everything is summed over dp_shard, where FSDP's shards are
    disjoint. dp_replicate copies are identical and need no reduction. With a pp axis the stages' sums are
    summed over it; `exclude` names gradients another stage counts (a tied copy), scaled but not counted.
    """
    tp_rank = mesh["tp"].get_local_rank() if mesh is not None else 0
    tp_size = mesh["tp"].size() if mesh is not None else 1
    grads, sharded, whole = [], [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad)
        grads.append(g)
        if name in exclude:
            continue
        spec = specs.get(name, ShardSpec())
        if spec.segments and isinstance(p.grad, DTensor):  # FSDP's piece of a fused TP shard
            fsdp = "dp_shard" in dp_placements(p.grad)
            shards = dp_shard_cp_mesh(mesh)
            parts = fsdp_segment_pieces(g, spec, tp_size, tp_rank, shards.get_local_rank() if fsdp else 0,
                                        shards.size() if fsdp else 1)
        else:
            parts = spec.local_parts(g, tp_size)
        for part, piece in parts:  # a fused tensor part by part
            if part.dim is None:
                whole.append(piece)
            elif tp_rank % part.replicas == 0:
                sharded.append(piece)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    device = grads[0].device if grads else torch.device("cpu")

    def squares(gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((g.to(dtype).pow(2).sum() for g in gs), torch.zeros((), dtype=dtype, device=device))

    total = squares(sharded)
    if mesh is not None and mesh["tp"].size() > 1:
        comm.all_reduce(total, mesh["tp"].get_group(), phase="grad_norm")
    total += squares(whole)
    if mesh is not None and dp_shard_cp_mesh(mesh).size() > 1:  # FSDP's shards (over dp_shard x cp under cp)
        comm.all_reduce(total, dp_shard_cp_mesh(mesh).get_group(), phase="grad_norm")
    if mesh is not None and "pp" in mesh.mesh_dim_names:
        comm.all_reduce(total, mesh["pp"].get_group(), phase="grad_norm")
    norm = total.sqrt()
    if max_norm > 0:
        # A non-finite norm scales nothing (no host sync to ask): the gradients stay as they were, so the step
        # that refuses them (training/nonfinite.py) can name the first non-finite one.
        scale = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm
