"""DistributedConfig: how a model is spread over the job's processes, and this rank's device.

The sizes resolve to one `ParallelDims` (topology.py: axes dp_replicate, dp_shard, cp, tp, TP innermost)
and its DeviceMesh; every c10d call, process-group start-up included, is in comm.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tptrain.backends import BACKENDS
from tptrain.distributed import comm
from tptrain.distributed.comm import raise_on_any_rank
from tptrain.distributed.topology import MESH_AXES, ParallelDims

__all__ = ["BACKENDS", "MESH_AXES", "DistributedConfig", "ParallelDims", "comm", "init_distributed", "local_device",
           "raise_on_any_rank"]


def env_world_size() -> int:
    """World size of the job: the live process group's, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed() -> torch.device:
    """Start the default process group if needed (nccl for CUDA, gloo for CPU); return this rank's device."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    if device.type == "cuda":
        comm.init_process_group("nccl", device_id=device)
    else:
        comm.init_process_group("gloo")
    return device


@dataclass
class DistributedConfig:
    """How a model is spread over the processes of the job.

    tp_size: tensor-parallel degree; None infers WORLD_SIZE // (dp_replicate_size * dp_shard_size * cp_size)
        (dp_shard_size unset: ep_size, else 1).
    cp_size: context-parallel degree (parallel/context_parallel.py): every rank of a cp group is given the same
        whole batch and computes 1/cp_size of each sequence's tokens (attention gathers the keys and values);
        the sequence length must be a multiple of 2 * cp_size. Not with ep_size.
    tp_plan: "auto" (the model's own `base_model_tp_plan`) or a dict of {module-glob: style}
        overrides of it (a value of None removes a rule). A rule that matches no module is an error.
    enable_sequence_parallel: shard norms and the residual stream along the sequence between TP regions.
    enable_expert_parallel: a mixture-of-experts model's experts are split by expert over the TP group
        (ep_size = tp_size, transformers' spelling); False: each expert is split like a dense MLP.
    ep_size: expert parallelism on an axis of its own (None or 1: none), taken from the data-parallel ranks: the
        experts are split by expert over `ep_size` of the dp_shard ranks and each expert over tp as a dense MLP
        (expert tensor parallelism), while attention and every dense layer stay TP over tp and data-parallel over
        dp_shard (ep included). Must divide dp_shard (and the model's num_experts); not with
        enable_expert_parallel (that splits the experts over the TP group instead).
    dp_replicate_size: replicated data-parallel degree (DDP, or the replica axis of HSDP).
    dp_shard_size: sharded data-parallel degree (FSDP2); None: whatever WORLD_SIZE leaves over.
    pp_size: pipeline-parallel degree (the outermost axis): the decoder layers are cut into stages, each rank builds
        only its stage(s) and reads only their tensors (parallel/pipeline_parallel.py); the other sizes divide
        WORLD_SIZE // pp_size. Not with device_map.
    pp_schedule: the torch.distributed.pipelining schedule the stages are cut for ("1F1B", "GPipe",
        "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", ...): the multi-stage ones give each rank
        two stages.
    pp_layers: the decoder layers of each stage, e.g. [[0, 1, 2], [3, 4, 5, 6, 7]] (consecutive, each once; the
        embedding goes with the first stage, the final norm and head with the last); None: an even split counting
        the embedding and the head as one layer each (torchtitan's rule).
    backend: "auto" (tptrain's own model code for its model types, transformers' otherwise), "native", or
        "transformers" (transformers' modeling code under tptrain's engine, `pip install "tptrain[hf]"`; forces it
        for a native type too, to compare the two).
    """

    tp_size: int | None = None
    cp_size: int = 1
    tp_plan: str | Mapping[str, Any] = "auto"
    enable_sequence_parallel: bool = False
    enable_expert_parallel: bool = False
    ep_size: int | None = None
    dp_replicate_size: int = 1
    dp_shard_size: int | None = None
    backend: str = "auto"
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_layers: list[list[int]] | None = None
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def sizes(self, world_size: int | None = None, *, described: str | None = None) -> dict[str, int]:
        """{axis: size} of `parallel_dims()`."""
        return self.parallel_dims(world_size, described=described).sizes()

    def parallel_dims(self, world_size: int | None = None, *, described: str | None = None) -> ParallelDims:
        """Resolve every mesh axis against the world size; ValueError (same on every rank) if impossible.
        `described`: how the error names these sizes (default: this DistributedConfig)."""
        world = env_world_size() if world_size is None else world_size
        if self.backend not in BACKENDS:
            raise ValueError(f"DistributedConfig.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("tp_size", "cp_size", "ep_size", "dp_replicate_size", "dp_shard_size", "pp_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"DistributedConfig.{name} must be a positive int, got {value!r}")
        pp = self.pp_size
        if world % pp:
            raise ValueError(f"{described or 'DistributedConfig'}: pp_size={pp} must divide the world size {world} "
                             f"(each of the {pp} pipeline stages gets world_size / pp_size ranks); launch a multiple "
                             f"of {pp} processes or pick a pp_size that divides {world}")
        world //= pp  # the other axes lay out each stage's ranks
        rep, shard, tp, cp = self.dp_replicate_size, self.dp_shard_size, self.tp_size, self.cp_size or 1
        if tp is None:  # tp takes the rest (with ep_size alone: of dp_shard = ep_size)
            tp = world // (rep * cp * (shard or self.ep_size or 1))
        if shard is None:
            shard = world // (rep * cp * tp) if tp and world % (rep * cp * tp) == 0 else 0
        if tp < 1 or shard < 1 or rep * shard * cp * tp != world:
            raise ValueError(self._layout_error(world, described))
        if cp > 1 and (self.ep_size or 1) > 1:
            raise ValueError(f"{described or 'DistributedConfig'}: cp_size={cp} cannot be combined with ep_size="
                             f"{self.ep_size} (an ep axis of its own) yet; use enable_expert_parallel (experts split "
                             f"over the TP group) or plain expert tensor parallelism with cp_size")
        return ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, ep=self._ep(shard, tp, world, described), cp=cp, pp=pp)

    def _ep(self, shard: int, tp: int, world: int, described: str | None) -> int:
        """The ep axis's size: a divisor of dp_shard (the experts' owners are data-parallel ranks)."""
        ep = self.ep_size or 1
        name = described or "DistributedConfig"
        if ep > 1 and self.enable_expert_parallel:
            raise ValueError(f"{name}: ep_size={ep} and enable_expert_parallel=True both split the experts by "
                             f"expert (over an ep axis of data-parallel ranks, or over the TP group, ep_size = "
                             f"tp_size); pass one of them")
        if shard % ep:
            unit = ep * tp * self.dp_replicate_size
            raise ValueError(f"{name}: ep_size={ep} must divide the data-parallel shard degree dp_shard={shard} "
                             f"(world size {world} = dp_replicate {self.dp_replicate_size} x dp_shard {shard} x tp "
                             f"{tp}): the experts' owners are dp_shard ranks; launch a multiple of {unit} processes "
                             f"(ep x tp x dp_replicate), or use an ep_size that divides {shard}")
        return ep

    def _layout_error(self, world: int, described: str | None) -> str:
        """What the sizes need and what the world size is, e.g. "... needs 2 x 2 x 1 = 4 processes"."""
        sizes = {"tp_size": self.tp_size, "dp_shard_size": self.dp_shard_size,
                 "dp_replicate_size": self.dp_replicate_size}
        if (self.cp_size or 1) > 1:  # named only when used, so the messages without cp read as before
            sizes["cp_size"] = self.cp_size
        name = described or "DistributedConfig(" + ", ".join(f"{k}={v or 'auto'}" for k, v in sizes.items()) + ")"
        given = {k: v for k, v in sizes.items() if v is not None}
        product = math.prod(given.values())
        if len(given) == len(sizes):
            return (f"{name} needs {' x '.join(map(str, given.values()))} = {product} process"
                    f"{'es' * (product > 1)} ({' x '.join(k[:-5] for k in sizes)}), but the world size is {world}; launch "
                    f"{product} (`torchrun --nproc-per-node {product}`), or change the sizes so that their product "
                    f"is {world}")
        auto = [k for k in sizes if k not in given]
        terms = " x ".join(f"{k}={v}" for k, v in given.items()) + (f" = {product}" if len(given) > 1 else "")
        return (f"{name} needs a world size that is a multiple of {terms} ({' and '.join(auto)} "
                f"take{'s' * (len(auto) == 1)} the rest), but the world size is {world}; launch a multiple of "
                f"{product} processes, or change the sizes")

    def device_mesh(self) -> tuple[DeviceMesh, torch.device]:
        """Start the process group (if needed) and build the named mesh; cached on this config while its
        sizes stay the same (a new mesh creates new process groups, a collective)."""
        dims = self.parallel_dims()  # validate before the rendezvous, so a bad layout fails fast everywhere
        device = init_distributed()
        if self._mesh is None or ParallelDims.of(self._mesh) != dims:
            self._mesh = dims.build_mesh(device.type)
        return self._mesh, device
