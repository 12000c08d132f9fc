"""DistributedConfig: process-group start-up and the named device mesh.

The mesh is always 3-D, `("dp_replicate", "dp_shard", "tp")`, TP innermost so a TP group is a block
of consecutive ranks (one node's GPUs under torchrun). Unused axes have size 1.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("dp_replicate", "dp_shard", "tp")
RENDEZVOUS_TIMEOUT_ENV = "TPTRAIN_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0  # seconds every rank waits for the others to join


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
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        store, rank, world = _rendezvous()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        store.set_timeout(default_pg_timeout)  # bounded only while joining: a later long save must not time out
    else:  # a plain `python script.py`: a one-process world, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def rendezvous_timeout() -> float:
    """Seconds a rank waits for all WORLD_SIZE ranks to join: $TPTRAIN_RENDEZVOUS_TIMEOUT, default 300."""
    value = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, str(DEFAULT_RENDEZVOUS_TIMEOUT))
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{RENDEZVOUS_TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return seconds


def _rendezvous() -> tuple[dist.Store, int, int]:
    """torchrun's env:// rendezvous, bounded by rendezvous_timeout(): a rank that is never started (or dies
    before joining) makes the others fail with a TimeoutError naming the world, instead of a 30-minute wait.
    The bound also covers the process group's own connection set-up; collectives keep torch's default timeout."""
    rank, world, seconds = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1")), rendezvous_timeout()
    try:
        return next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=seconds)))
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise TimeoutError(
            f"rank {rank} waited {seconds:g} s for WORLD_SIZE={world} processes at {where}; are all ranks started "
            f"(and did none fail before joining)? Start every rank with the same MASTER_ADDR/MASTER_PORT, or "
            f"raise {RENDEZVOUS_TIMEOUT_ENV}={seconds:g}. ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """{axis name: size} of a named mesh, comparable with `DistributedConfig.sizes()`."""
    return dict(zip(mesh.mesh_dim_names, mesh.shape))


def raise_on_any_rank(error: str | Exception | None, *, exc_type: type[Exception] = OSError,
                      collective: bool = True) -> None:
    """If any rank has an error, raise the first one on every rank, so no rank is left waiting in a later
    collective. `error` is a message (raised as `exc_type`) or an exception (raised again as its own type).
    Where only some ranks failed, the message names them ("(on rank 1 of 2)"). Collective (all ranks must
    call it) when `collective` and a multi-rank group is up."""
    local = (type(error), str(error)) if isinstance(error, Exception) else (exc_type, error) if error else None
    errors = [local]
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, local)
    failed = [rank for rank, e in enumerate(errors) if e]
    if not failed:
        return
    kind, message = errors[failed[0]]
    same = [rank for rank in failed if errors[rank] == errors[failed[0]]]
    if len(same) < len(errors):  # not every rank hit it: say where it happened
        message += f" (on rank{'s' * (len(same) > 1)} {', '.join(map(str, same))} of {len(errors)})"
    cause = error if isinstance(error, Exception) and local == errors[failed[0]] else None
    raise _exception(kind, message, exc_type) from cause


def _exception(kind: type[Exception], message: str, fallback: type[Exception]) -> Exception:
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 - a type whose constructor wants more than a message
        return fallback(message)


@dataclass
class DistributedConfig:
    """How a model is spread over the processes of the job.

    tp_size: tensor-parallel degree; None infers WORLD_SIZE // (dp_replicate_size * dp_shard_size).
    tp_plan: "auto" (the model's own `base_model_tp_plan`) or a dict of {module-glob: style}
        overrides of it (a value of None removes a rule). A rule that matches no module is an error.
    enable_sequence_parallel: shard norms and the residual stream along the sequence between TP regions.
    dp_replicate_size: replicated data-parallel degree (DDP, or the replica axis of HSDP).
    dp_shard_size: sharded data-parallel degree (FSDP2); None: whatever WORLD_SIZE leaves over.
    """

    tp_size: int | None = None
    tp_plan: str | Mapping[str, Any] = "auto"
    enable_sequence_parallel: bool = False
    dp_replicate_size: int = 1
    dp_shard_size: int | None = None
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def sizes(self, world_size: int | None = None, *, described: str | None = None) -> dict[str, int]:
        """Resolve every mesh axis against the world size; ValueError (same on every rank) if impossible.
        `described`: how the error names these sizes (default: this DistributedConfig)."""
        world = env_world_size() if world_size is None else world_size
        for name in ("tp_size", "dp_replicate_size", "dp_shard_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"DistributedConfig.{name} must be a positive int, got {value!r}")
        rep, shard, tp = self.dp_replicate_size, self.dp_shard_size, self.tp_size
        if tp is None:
            tp = world // (rep * (shard or 1))
        if shard is None:
            shard = world // (rep * tp) if tp and world % (rep * tp) == 0 else 0
        if tp < 1 or shard < 1 or rep * shard * tp != world:
            raise ValueError(self._layout_error(world, described))
        return {"dp_replicate": rep, "dp_shard": shard, "tp": tp}

    def _layout_error(self, world: int, described: str | None) -> str:
        """What the sizes need and what the world size is, e.g. "... needs 2 x 2 x 1 = 4 processes"."""
        sizes = {"tp_size": self.tp_size, "dp_shard_size": self.dp_shard_size,
                 "dp_replicate_size": self.dp_replicate_size}
        name = described or "DistributedConfig(" + ", ".join(f"{k}={v or 'auto'}" for k, v in sizes.items()) + ")"
        given = {k: v for k, v in sizes.items() if v is not None}
        product = math.prod(given.values())
        if len(given) == len(sizes):
            return (f"{name} needs {' x '.join(map(str, given.values()))} = {product} process"
                    f"{'es' * (product > 1)} (tp x dp_shard x dp_replicate), but the world size is {world}; launch "
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
        sizes = self.sizes()  # validate before the rendezvous, so a bad layout fails fast everywhere
        device = init_distributed()
        if self._mesh is None or mesh_sizes(self._mesh) != sizes:
            self._mesh = init_device_mesh(device.type, tuple(sizes[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
        return self._mesh, device
