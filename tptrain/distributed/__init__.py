"""DistributedConfig: how a model is spread over the job's processes, and this rank's device.

The sizes resolve to one `ParallelDims` (tptrain/layout: the sizes and the one rule table; axes dp_replicate, dp_shard,
cp, tp, TP innermost, pp outermost) and its DeviceMesh (topology.py); every c10d call, process-group start-up
included, is in comm.py. DistributedConfig is the library's (transformers') spelling of that layout, ParallelismConfig
(training/args.py) the Trainer's: two views of one ParallelDims.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tptrain.backends import BACKENDS
from tptrain.distributed import comm
from tptrain.distributed.comm import raise_on_any_rank
from tptrain.layout import MESH_AXES, Features, ParallelDims, Spelling, resolve

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

    def parallel_dims(self, world_size: int | None = None, *, described: str | None = None,
                      device_map: bool = False, owner: str = "DistributedConfig") -> ParallelDims:
        """Resolve every mesh axis against the world size (the rule table's size rows; `device_map`: with
        from_pretrained's device_map, which they refuse); ValueError (same on every rank) if impossible.
        `described` / `owner`: how the error names these sizes / one of them (default: this DistributedConfig)."""
        world = env_world_size() if world_size is None else world_size
        if self.backend not in BACKENDS:
            raise ValueError(f"DistributedConfig.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        return resolve(world, features=self.features(device_map=device_map),
                       spelling=Spelling(owner=owner, described=described),
                       tp_size=self.tp_size, cp_size=self.cp_size, ep_size=self.ep_size, pp_size=self.pp_size,
                       dp_replicate_size=self.dp_replicate_size, dp_shard_size=self.dp_shard_size)

    def features(self, **training) -> Features:
        """What this config asks of the axes beyond their sizes, as the rule table reads it (`training`: the
        Features only a training run knows, e.g. batch_size=)."""
        layers = tuple(map(tuple, self.pp_layers)) if self.pp_layers is not None else None
        return Features(sequence_parallel=self.enable_sequence_parallel, expert_parallel=self.enable_expert_parallel,
                        pp_schedule=self.pp_schedule, pp_layers=layers, **training)

    def device_mesh(self) -> tuple[DeviceMesh, torch.device]:
        """Start the process group (if needed) and build the named mesh; cached on this config while its
        sizes stay the same (a new mesh creates new process groups, a collective)."""
        dims = self.parallel_dims()  # validate before the rendezvous, so a bad layout fails fast everywhere
        device = init_distributed()
        if self._mesh is None or ParallelDims.of(self._mesh) != dims:
            self._mesh = dims.build_mesh(device.type)
        return self._mesh, device
