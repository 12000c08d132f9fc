"""Resumable training checkpoints with torch.distributed.checkpoint (DCP), layout-independent.

    output_dir/checkpoint-<step>/   .metadata, __<rank>_0.distcp (model + AdamW state, resharded on load),
                                    trainer_state.json (step, run id, data order), rng_state_<rank>.pth,
                                    complete (marker and manifest: world size, each file's size and crc32)

Every parameter and optimizer-state tensor is saved by its GLOBAL shape: FSDP's data-parallel shards
are gathered to the rank's TP shard, which becomes a DTensor sharded over the TP sub-mesh (KV
projections that several TP ranks share are gathered to the full tensor). DCP's metadata then holds
global shapes, and loading into a different tp/dp layout reads exactly the slices each rank needs.
Peak memory while saving: this rank's TP shard of the parameters and both AdamW moments, unsharded
over data parallelism (FSDP's shards are gathered per tensor view, all held until DCP has written).

The directory protocol (atomic publishing, pruning, the manifest, the fall-back on resume) is in
checkpoint_dirs.py.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tptrain.distributed import raise_on_any_rank
from tptrain.training.checkpoint_dirs import (PREFIX, STATE_FILE, prune, publish, rank_world, read_manifest,
                                              read_trainer_state, run_id_of, write_manifest)
from tptrain.parallel.styles import ShardSpec
from tptrain.parallel.tensor_parallel import gather_full

class StateConverter:
    """Converts between the tensors a rank trains with and the global-shape views DCP saves."""

    def __init__(self, model: nn.Module) -> None:
        layout = getattr(model, "tp_layout", None)
        self.specs: dict[str, ShardSpec] = layout.specs if layout else {}
        self.global_shapes = layout.global_shapes if layout else {}
        self.ctx = layout.ctx if layout else None
        self.tp_mesh = model.device_mesh["tp"] if layout else None

    def _spec(self, name: str) -> ShardSpec:
        return self.specs.get(name, ShardSpec())

    def to_global(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (shaped like parameter `name`) as a tensor DCP can save by its global shape. Collective."""
        local = t.full_tensor() if isinstance(t, DTensor) else t.detach()  # (TP-local shape)
        spec = self._spec(name)
        if spec.dim is None or self.ctx is None or self.ctx.size == 1:
            return local
        if not spec.single_placement:  # KV replicas or packed segments: no TP Shard placement; save the full tensor
            return gather_full(local, spec, self.ctx)
        return self._tp_dtensor(name, local, spec.dim)

    def load_target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An empty global view of parameter `name` for DCP to load into (no communication)."""
        spec = self._spec(name)  # like.shape: the TP-local shape (a DTensor reports its unsharded shape)
        local = torch.empty(like.shape, dtype=like.dtype, device=local_device_of(like))
        if spec.dim is None or self.ctx is None or self.ctx.size == 1:
            return local
        if not spec.single_placement:
            return torch.empty(self.global_shapes[name], dtype=like.dtype, device=local.device)
        return self._tp_dtensor(name, local, spec.dim)

    def _tp_dtensor(self, name: str, local: torch.Tensor, dim: int) -> DTensor:
        shape = torch.Size(self.global_shapes[name])
        stride = torch.empty(shape, device="meta").stride()  # contiguous
        return DTensor.from_local(local.contiguous(), self.tp_mesh, [Shard(dim)], run_check=False,
                                  shape=shape, stride=stride)

    def copy_from_global(self, name: str, loaded: torch.Tensor, dest: torch.Tensor) -> None:
        """Write a loaded global view back into this rank's training tensor `dest` (in place)."""
        spec = self._spec(name)
        local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
        if not spec.single_placement and self.ctx is not None:
            local = spec.local_chunk(local, self.ctx.size, self.ctx.rank)
        if isinstance(dest, DTensor):  # keep only this rank's FSDP shard (a local slice: no communication)
            local = distribute_tensor(local, dest.device_mesh, dest.placements, src_data_rank=None).to_local()
            dest = dest.to_local()
        with torch.no_grad():
            dest.copy_(local)


def local_device_of(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def _optimizer_items(model: nn.Module, optimizer: torch.optim.Optimizer):
    """(param name, param, its AdamW state dict) in a fixed order; state created empty if missing."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, p, optimizer.state[p]


def build_state(model: nn.Module, optimizer: torch.optim.Optimizer, conv: StateConverter, *,
                for_load: bool) -> dict[str, Any]:
    """The DCP state dict {"model": {name: view}, "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}}.
    Only trained parameters are in it: frozen ones (a LoRA run's base weights) come from the model as loaded."""
    view = (lambda name, t: conv.load_target(name, t)) if for_load else conv.to_global
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for name, p in model.named_parameters():
        if p.requires_grad:
            state["model"][name] = view(name, p)
    for name, p, st in _optimizer_items(model, optimizer):
        if not for_load and "exp_avg" not in st:
            raise ValueError(f"no optimizer state for {name}: checkpoints are written after an optimizer step")
        state["optim"][name] = {"exp_avg": view(name, st.get("exp_avg", p)),
                                "exp_avg_sq": view(name, st.get("exp_avg_sq", p)),
                                "step": st["step"].clone() if "step" in st else torch.zeros((), dtype=torch.float32)}
    return state


def save_checkpoint(output_dir: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, conv: StateConverter, trainer_state: dict[str, Any],
                    save_total_limit: int | None) -> Path:
    """Write checkpoint-<step> atomically (collective), then prune this run's oldest beyond the limit.
    A failed write removes its temporary directory and leaves every earlier checkpoint as it was."""
    rank, _ = rank_world()
    final = Path(output_dir) / f"{PREFIX}{step}"
    tmp = Path(output_dir) / f".{PREFIX}{step}.tmp"
    raise_on_any_rank(_prepare(tmp, final, trainer_state["run_id"]) if rank == 0 else None)
    try:
        _write(tmp, final, model=model, optimizer=optimizer, conv=conv, trainer_state=trainer_state)
    except BaseException:
        if rank == 0:  # a full disk must not stay full of a checkpoint that will never be used
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if rank == 0:  # on failure the complete tmp stays: resolve_resume(True) puts it in place
        try:
            publish(tmp, final)
            if save_total_limit is not None:
                prune(output_dir, trainer_state["run_id"], save_total_limit)
        except OSError as exc:
            error = f"cannot finish checkpoint {final}: {exc}"
    raise_on_any_rank(error)
    return final


def _prepare(tmp: Path, final: Path, run_id: str) -> str | None:
    """Why checkpoint `final` cannot be written, or None with an empty `tmp` made. Rank 0."""
    if final.exists() and (other := run_id_of(final)) not in (None, run_id):
        return (f"{final} belongs to another run (run id {other}) and would be replaced: choose another "
                "output_dir, or pass overwrite_output_dir=True to delete that run's checkpoints")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier save
        tmp.mkdir(parents=True)
    except OSError as exc:
        return f"cannot write checkpoint {final}: {exc}"
    return None


def _write(tmp: Path, final: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, conv: StateConverter,
           trainer_state: dict[str, Any]) -> None:
    """Every rank's files, then (rank 0, once all exist) the trainer state and the manifest. Collective."""
    rank, world = rank_world()
    _dcp(dcp.save, build_state(model, optimizer, conv, for_load=False), tmp, f"cannot write checkpoint {final}")
    error = None
    try:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / f"rng_state_{rank}.pth")
    except OSError as exc:
        error = f"cannot write checkpoint {final} (the RNG state of rank {rank}): {exc}"
    raise_on_any_rank(error)
    if rank == 0:
        try:
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
            write_manifest(tmp, world_size=world)
        except OSError as exc:
            error = f"cannot write checkpoint {final}: {exc}"
    raise_on_any_rank(error)


def _dcp(call: Callable[..., Any], state: dict[str, Any], path: Path, what: str) -> None:
    """dcp.save / dcp.load. Their CheckpointException is a BaseException (it would escape `except
    Exception` handlers): it becomes an OSError naming `what` and the first failing rank's own error
    (e.g. "No space left on device"; its first line), raised on every rank."""
    error = None
    try:
        call(state, checkpoint_id=str(path))
    except CheckpointException as exc:
        rank, (cause, _) = min(exc.failures.items())
        first_line = (str(cause).splitlines() or [""])[0]
        error = f"{what}: {type(cause).__name__}: {first_line} (rank {rank})"
    raise_on_any_rank(error)


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
    for name, p in model.named_parameters():
        if name in state["model"]:
            conv.copy_from_global(name, state["model"][name], p)
    for name, p, st in _optimizer_items(model, optimizer):
        loaded = state["optim"][name]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            conv.copy_from_global(name, loaded[key], st[key])
        st["step"] = loaded["step"].clone()
    rank, _ = rank_world()
    saved_ranks = read_manifest(path)["world_size"]
    # A rank the saving run did not have (resumed on more ranks) continues from rank 0's stream.
    rng = torch.load(path / f"rng_state_{rank if rank < saved_ranks else 0}.pth", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return read_trainer_state(path)
