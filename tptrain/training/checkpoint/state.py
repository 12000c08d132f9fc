"""Resumable training checkpoints with torch.distributed.checkpoint (DCP), layout-independent.

    output_dir/checkpoint-<step>/   .metadata, __<rank>_0.distcp (model + AdamW state, resharded on load),
                                    trainer_state.json (step, run id, data order), rng_state_<rank>.pth,
                                    complete (marker and manifest: world size, each file's size and crc32)

Every parameter and optimizer-state tensor is saved by its GLOBAL shape, from each rank's own shard:
the tensor FSDP keeps (its dp shard of the rank's TP shard) is viewed as a DTensor with 2-D placements,
torchtitan's: FSDP's Shard(0) over dp_shard on top of TP's Shard over tp (a _StridedShard where both
split dim 0), Replicate over dp_replicate and over ranks sharing KV heads (DCP then writes such a chunk
once, from one rank). A fused tensor (fused q/k/v or gate/up rows), whose pieces no placement
describes, is saved as a ShardedTensor of its boxes (fused_shards.py). Nothing is gathered over data
parallelism or TP and nothing is copied, so the save costs what DCP's writer holds (one tensor's bytes
at a time) beyond training's memory; loading reads each rank's slices of any saved layout straight into
its training tensors (reshard on resume); a fused tensor is read whole, then cut (`copy_fused`).

Checkpoints of the earlier format (every tensor gathered to its TP shard or whole) hold the same keys and
global shapes: DCP reads them into this layout as they are.

The directory protocol (atomic publishing, pruning, the manifest, the fall-back on resume) is in
dirs.py.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from tptrain.distributed import ParallelDims, raise_on_any_rank
from tptrain.io.space import full_device_error
from tptrain.distributed.topology import dp_placements, rank_grid, stage_mesh
from tptrain.distributed.state import state_of
from tptrain.training.checkpoint.dirs import (PREFIX, STATE_FILE, prepare_save, prune, publish, rank_world,
                                              read_manifest, read_trainer_state, write_manifest)
from tptrain.parallel.styles import ShardSpec
from tptrain.training.checkpoint.fused_shards import fused_sharded_tensor

# The view mesh of a checkpoint tensor: the run's mesh with its TP axis split into (chunks, KV replicas).
VIEW_AXES = ("dp_replicate", "dp_shard", "tp_shard", "tp_replica")
# ... and of experts split over an ep axis: dp_shard x cp as (dp_shard_mod_ep, ep), no KV replicas.
EP_VIEW_AXES = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp_shard")


class StateConverter:
    """Views of the tensors a rank trains with as DTensors of their GLOBAL shape, for DCP to save and load.

    A view aliases the rank's own storage (FSDP's shard of its TP shard): nothing is gathered or copied.
    Its mesh is the run's mesh with the TP axis split in two, (dp_replicate, dp_shard, tp_shard, tp_replica),
    built without process groups (DCP only reads a rank's coordinates from it); tp_replica has the size of
    the spec's KV replicas, so ranks that share a KV chunk are Replicate there and DCP writes it once."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh | None = None) -> None:
        state = state_of(model)
        layout = state.tp
        self.specs: dict[str, ShardSpec] = layout.specs if layout else {}
        self.global_shapes = layout.global_shapes if layout else {}
        self.ctx = layout.ctx if layout else None
        self.mesh = mesh if mesh is not None else state.mesh
        self._meshes: dict[int, DeviceMesh] = {}  # KV replicas -> view mesh

    def _spec(self, name: str) -> ShardSpec:
        return self.specs.get(name, ShardSpec())

    def _view_mesh(self, replicas: int) -> DeviceMesh:
        if replicas not in self._meshes:
            ranks = rank_grid(self.mesh)  # (dp_replicate, dp_shard, tp)
            rep, shard, tp = ranks.shape
            self._meshes[replicas] = DeviceMesh(
                self.mesh.device_type, ranks.reshape(rep, shard, tp // replicas, replicas),
                mesh_dim_names=VIEW_AXES, _init_backend=False)
        return self._meshes[replicas]

    def _ep_view(self, name: str, local: torch.Tensor, t: torch.Tensor, shape: torch.Size) -> DTensor:
        """Experts split over the ep axis (`ShardSpec.ep_split`): dim 0 split over ep (outer) and again by FSDP
        over dp_shard_mod_ep (a strided split), the TP split on its own dim, Replicate over dp_replicate. The view
        mesh is this stage's ranks as (dp_replicate, dp_shard_mod_ep, ep, tp): ep is the flattened (dp_shard_in_ep,
        cp), consecutive in the mesh."""
        spec, dims = self._spec(name), ParallelDims.of(self.mesh)
        if "ep" not in self._meshes:
            ranks = stage_mesh(self.mesh).mesh.reshape(dims.dp_replicate, dims.ep_pool // dims.ep, dims.ep, dims.tp)
            self._meshes["ep"] = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=EP_VIEW_AXES,
                                            _init_backend=False)
        dp = dict(zip(t.device_mesh.mesh_dim_names, t.placements)) if isinstance(t, DTensor) else {}
        fsdp = dp.get("dp_shard_mod_ep", Replicate())
        assert fsdp in (Replicate(), Shard(0)), (name, dp)
        placements = [dp.get("dp_replicate", Replicate()),
                      _StridedShard(0, split_factor=dims.ep) if fsdp == Shard(0) else Replicate(), Shard(0),
                      Shard(spec.dim) if spec.dim is not None and dims.tp > 1 else Replicate()]
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self._meshes["ep"], placements, run_check=False, shape=shape, stride=stride)

    def view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (parameter `name` or a tensor laid out like it: an AdamW moment) as a tensor of the global
        shape that DCP saves from, and loads into, in place. No communication, except for a fused tensor."""
        spec = self._spec(name)
        if spec.segments:
            raise AssertionError(f"{name} is fused: use fused_view / fused_target")
        local = t.to_local() if isinstance(t, DTensor) else t.detach()  # FSDP's shard of the TP shard
        if self.mesh is None:
            return local
        shape = torch.Size(self.global_shapes.get(name, t.shape))
        if spec.ep_split:
            return self._ep_view(name, local, t, shape)
        tp_chunks = spec.num_chunks(self.mesh["tp"].size())
        dp = dp_placements(t)
        placements: list[Placement] = [dp.get(axis, Replicate()) for axis in ("dp_replicate", "dp_shard")]
        if spec.dim is not None and tp_chunks > 1:
            # FSDP splits the TP shard again: on the TP dim that is a strided split of the global dim.
            placements = [_StridedShard(spec.dim, split_factor=tp_chunks) if p == Shard(spec.dim) else p
                          for p in placements]
            placements += [Shard(spec.dim), Replicate()]
        else:
            placements += [Replicate(), Replicate()]
        stride = torch.empty(shape, device="meta").stride()  # contiguous
        return DTensor.from_local(local, self._view_mesh(spec.replicas if tp_chunks > 1 else 1), placements,
                                  run_check=False, shape=shape, stride=stride)

    def fused_view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A fused tensor (fused q/k/v, gate/up) to save: a rank holds a piece of each segment, cut again by
        FSDP, which no DTensor placement describes; a ShardedTensor of those pieces (fused_shards.py)
        does, without a gather (a copy only of a box across a later dim than FSDP's). Loaded into an empty
        global tensor (`fused_target`)."""
        dp, spec = dp_placements(t), self._spec(name)
        fsdp = dp.get("dp_shard_mod_ep" if spec.ep_split else "dp_shard")
        assert fsdp in (None, Shard(0), Replicate()), (name, dp)  # FSDP2 shards dim 0
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        return fused_sharded_tensor(local, spec, self.global_shapes[name], self.mesh, fsdp=fsdp == Shard(0),
                                    ep=self.ctx.ep_size if spec.ep_split else 1)

    def fused_target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(self.global_shapes[name], dtype=like.dtype, device=local_device_of(like))

    def copy_fused(self, name: str, loaded: torch.Tensor, dest: torch.Tensor) -> None:
        """Write this rank's shard of a loaded fused global tensor into its training tensor `dest`."""
        spec, ctx = self._spec(name), self.ctx
        local = spec.local_chunk(spec.ep_chunk(loaded, ctx.ep_size, ctx.ep_rank), ctx.size, ctx.rank)  # its experts
        if isinstance(dest, DTensor):  # keep only this rank's FSDP shard (a local slice: no communication)
            local = distribute_tensor(local, dest.device_mesh, dest.placements, src_data_rank=None).to_local()
            dest = dest.to_local()
        with torch.no_grad():
            dest.copy_(local)

    def is_fused(self, name: str) -> bool:
        return bool(self._spec(name).segments) and self.ctx is not None


def local_device_of(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def _optimizer_items(model: nn.Module, optimizer: torch.optim.Optimizer):
    """(param name, param, its AdamW state dict) in a fixed order; state created empty if missing."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, p, optimizer.state[p]


def _dcp_names(model: nn.Module) -> dict[str, str]:
    """{parameter name: its name in the checkpoint} where they differ: a pipeline's last stage holds its own copy of
    a tied weight, saved and loaded under the name one process gives it (the first stage's), so DCP writes it once
    and reshards it to any pp size."""
    plan = state_of(model).pp
    return {last: first for first, last in plan.tied} if plan is not None else {}


def build_state(model: nn.Module, optimizer: torch.optim.Optimizer, conv: StateConverter, *,
                for_load: bool) -> dict[str, Any]:
    """The DCP state dict {"model": {name: view}, "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}}: views
    of the training tensors themselves (DCP loads into them in place; missing AdamW moments are created as
    zeros first), except fused tensors (`StateConverter.fused_view`). Only trained parameters are in it:
    frozen ones (a LoRA run's base weights) come from the model as loaded."""
    def view(name: str, t: torch.Tensor) -> torch.Tensor:
        if conv.is_fused(name):
            return conv.fused_target(name, t) if for_load else conv.fused_view(name, t)
        return conv.view(name, t)

    key = _dcp_names(model)
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for name, p in model.named_parameters():
        if p.requires_grad:
            state["model"][key.get(name, name)] = view(name, p)
    for name, p, st in _optimizer_items(model, optimizer):
        if "exp_avg" not in st:
            if not for_load:
                raise ValueError(f"no optimizer state for {name}: checkpoints are written after an optimizer step")
            for moment in ("exp_avg", "exp_avg_sq"):
                st[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["optim"][key.get(name, name)] = {"exp_avg": view(name, st["exp_avg"]),
                                               "exp_avg_sq": view(name, st["exp_avg_sq"]),
                                "step": st["step"].clone() if "step" in st else torch.zeros((), dtype=torch.float32)}
    return state


def save_checkpoint(output_dir: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, conv: StateConverter, trainer_state: dict[str, Any],
                    save_total_limit: int | None, async_group: ProcessGroup | None = None) -> "PendingSave":
    """Write checkpoint-<step> atomically (collective), then prune this run's oldest beyond the limit.
    A failed write removes its temporary directory and leaves every earlier checkpoint as it was.

    Returns the save, finished (`.final` is in place) or, with `async_group` (a process group of its own
    for DCP's collectives, off the main thread), still being written by DCP's `async_save` from a copy of
    this rank's shards: training goes on, and `PendingSave.finish()` (collective) waits for it, then
    writes the manifest and publishes. Until then the directory is a hidden .tmp, never a checkpoint."""
    rank, _ = rank_world()
    final = Path(output_dir) / f"{PREFIX}{step}"
    state = build_state(model, optimizer, conv, for_load=False)
    pending = PendingSave(Path(output_dir) / f".{PREFIX}{step}.tmp", final, trainer_state, save_total_limit,
                          needed=checkpoint_bytes(state))
    raise_on_any_rank(prepare_save(pending.tmp, final, trainer_state["run_id"], pending.needed) if rank == 0 else None)
    what = f"cannot write checkpoint {final}"
    try:
        if async_group is None:
            _dcp(dcp.save, state, pending.tmp, what, needed=pending.needed)
        else:  # staged (copied) now, written by a background thread
            error = None
            try:
                pending.future = dcp.async_save(state, checkpoint_id=str(pending.tmp), process_group=async_group)
            except (CheckpointException, OSError, RuntimeError) as exc:
                error = _dcp_error(exc, what, pending.tmp, pending.needed)
            raise_on_any_rank(error)
        _write_rng(pending)  # the RNG of this step, whenever the tensors are written
    except BaseException:
        pending.abandon()
        raise
    return pending if pending.future is not None else pending.finish()


@dataclass
class PendingSave:
    """A checkpoint whose tensors are being (or have been) written to `tmp`; `finish()` completes it."""

    tmp: Path
    final: Path
    trainer_state: dict[str, Any]
    save_total_limit: int | None
    needed: int | None = None  # the bytes of its tensors
    future: Future | None = None

    def abandon(self) -> None:
        if self.future is not None:  # let the background write end before its directory goes
            self.future.exception()
            self.future = None
        if rank_world()[0] == 0:  # a full disk must not stay full of a checkpoint that will never be used
            shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self) -> "PendingSave":
        """Wait for the tensors (async), then rank 0 writes the trainer state and the manifest (once every
        rank's files exist) and renames the directory into place. Collective; a failure on any rank is
        raised on all, with the temporary directory removed."""
        rank, world = rank_world()
        error = None
        if self.future is not None:
            try:
                self.future.result()
            except (CheckpointException, OSError, RuntimeError) as exc:
                error = _dcp_error(exc, f"cannot write checkpoint {self.final}", self.tmp, self.needed)
            self.future = None
        try:
            raise_on_any_rank(error)
            if rank == 0:
                try:
                    (self.tmp / STATE_FILE).write_text(json.dumps(self.trainer_state, indent=2) + "\n")
                    write_manifest(self.tmp, world_size=world)
                except OSError as exc:
                    error = _write_error(exc, f"cannot write checkpoint {self.final}", self.tmp, self.needed)
            raise_on_any_rank(error)
        except BaseException:
            self.abandon()
            raise
        if rank == 0:  # on failure the complete tmp stays: resolve_resume(True) puts it in place
            try:
                publish(self.tmp, self.final)
                if self.save_total_limit is not None:
                    prune(self.final.parent, self.trainer_state["run_id"], self.save_total_limit)
            except OSError as exc:
                error = f"cannot finish checkpoint {self.final}: {exc}"
        raise_on_any_rank(error)
        return self


def _write_rng(pending: PendingSave) -> None:
    """This rank's RNG state into `pending.tmp`. Collective (a failure is raised on every rank)."""
    rank, _ = rank_world()
    error = None
    try:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, pending.tmp / f"rng_state_{rank}.pth")
    except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError on a full device
        error = _write_error(exc, f"cannot write checkpoint {pending.final} (the RNG state of rank {rank})",
                             pending.tmp, pending.needed)
    raise_on_any_rank(error)


def checkpoint_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors in a `build_state` dict, by their global shapes (a pipeline rank's: its stage's)."""
    tensors = [*state["model"].values(), *(t for moments in state["optim"].values() for t in moments.values())]
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors)


def _dcp(call: Callable[..., Any], state: dict[str, Any], path: Path, what: str, *, needed: int | None = None) -> None:
    """dcp.save / dcp.load, any failure raised on every rank (`_dcp_error`)."""
    error = None
    try:
        call(state, checkpoint_id=str(path))
    except CheckpointException as exc:
        error = _dcp_error(exc, what, path if needed is not None else None, needed)
    raise_on_any_rank(error)


def _dcp_error(exc: BaseException, what: str, written: Path | None = None, needed: int | None = None) -> str:
    """DCP's CheckpointException is a BaseException (it would escape `except Exception` handlers): it
    becomes a message naming `what` and the first failing rank's own error (its first line; a full device said as
    such when the save was `written` to a directory), for `raise_on_any_rank`."""
    rank, cause = None, exc
    if isinstance(exc, CheckpointException):
        rank, (cause, _) = min(exc.failures.items())
    where = f" (rank {rank})" if rank is not None else ""
    if written is not None:
        return _write_error(cause, what, written, needed) + where
    first_line = (str(cause).splitlines() or [""])[0]
    return f"{what}: {type(cause).__name__}: {first_line}{where}"


def _write_error(exc: BaseException, what: str, written: Path, needed: int | None) -> str:
    """`what`: why a write into `written` failed; a full device said as such, with its free space and `needed`."""
    full = full_device_error(exc, written.parent, what=f"checkpoint {written.parent / written.name[1:-4]}",
                             needed=needed)
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{what}: {full}" if full else f"{what}: {type(exc).__name__}: {first_line}"


def check_compatible(path: Path, state: dict[str, Any]) -> None:
    """Every tensor the run needs is in the checkpoint with the same global shape (checked on every
    rank from the metadata alone, so a mismatch raises everywhere before any collective)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for prefix, group in (("model", state["model"]), ("optim", state["optim"])):
        for name, value in group.items():
            for key, t in ([(f"model.{name}", value)] if prefix == "model" else
                           [(f"optim.{name}.{k}", v) for k, v in value.items()]):
                if key not in meta:
                    raise ValueError(f"checkpoint {path} has no tensor {key!r}: it was written for another model "
                                     "(different architecture or parameter names); resume from a checkpoint of "
                                     "this model")
                saved = tuple(meta[key].size)
                if saved != tuple(t.shape):
                    raise ValueError(f"checkpoint {path} holds {key!r} with shape {saved} but this model's is "
                                     f"{tuple(t.shape)}: it was written for another model config; resume from a "
                                     "checkpoint of this model")


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    conv: StateConverter) -> dict[str, Any]:
    """Load model and AdamW state (resharded to this run's layout) and this rank's RNG from a checkpoint
    `resolve_resume` verified; return the trainer state (step, run id, data order). Collective."""
    state = build_state(model, optimizer, conv, for_load=True)
    check_compatible(path, state)
    _dcp(dcp.load, state, path, f"cannot read checkpoint {path}")
    for name, p in model.named_parameters():  # all but fused tensors were loaded in place
        if conv.is_fused(name) and name in state["model"]:
            conv.copy_fused(name, state["model"][name], p)
    saved_as = _dcp_names(model)
    for name, p, st in _optimizer_items(model, optimizer):
        loaded = state["optim"][saved_as.get(name, name)]
        if conv.is_fused(name):
            for moment in ("exp_avg", "exp_avg_sq"):
                conv.copy_fused(name, loaded[moment], st[moment])
        st["step"] = loaded["step"].clone()
    rank, _ = rank_world()
    saved_ranks = read_manifest(path)["world_size"]
    # A rank the saving run did not have (resumed on more ranks) continues from rank 0's stream.
    rng = torch.load(path / f"rng_state_{rank if rank < saved_ranks else 0}.pth", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return read_trainer_state(path)
