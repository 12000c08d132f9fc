"""Resumable training checkpoints with torch.distributed.checkpoint (DCP), layout-independent.

    output_dir/checkpoint-<step>/   .metadata, __<rank>_0.distcp (model + AdamW state, resharded on load),
                                    trainer_state.json (step, data order, scheduler), rng_state_<rank>.pth,
                                    complete (marker)

Every parameter and optimizer-state tensor is saved by its GLOBAL shape: FSDP's data-parallel shards
are gathered to the rank's TP shard, which becomes a DTensor sharded over the TP sub-mesh (KV
projections that several TP ranks share are gathered to the full tensor). DCP's metadata then holds
global shapes, and loading into a different tp/dp layout reads exactly the slices each rank needs.
A checkpoint is written in a hidden temporary directory and renamed into place once complete.
Peak memory while saving: this rank's TP shard of the parameters and both AdamW moments, unsharded
over data parallelism (FSDP's shards are gathered per tensor view, all held until DCP has written).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tptrain.distributed import raise_on_any_rank
from tptrain.parallel.styles import ShardSpec
from tptrain.parallel.tensor_parallel import gather_full

PREFIX = "checkpoint-"
MARKER = "complete"
STATE_FILE = "trainer_state.json"


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """checkpoint-<step> directories holding the completion marker, oldest first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in root.glob(f"{PREFIX}*") if (m := re.fullmatch(rf"{PREFIX}(\d+)", p.name))
             and (p / MARKER).is_file()] if root.is_dir() else []
    return [p for _, p in sorted(found)]


def resolve_resume(resume: bool | str | os.PathLike | None, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from (same answer on every rank: it only reads the filesystem)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        found = complete_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} holds no complete "
                                    f"{PREFIX}<step> directory; train without resuming, or pass a checkpoint path")
        return found[-1]
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={str(resume)!r} does not exist; pass a "
                                f"{PREFIX}<step> directory written by a previous run, or True for the latest")
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete training checkpoint (no '{MARKER}' marker): it was "
                         "interrupted while being written, or is not a tptrain checkpoint")
    return path


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
        if spec.replicas > 1:  # not expressible as a TP Shard placement: save the full tensor
            return gather_full(local, spec, self.ctx)
        return self._tp_dtensor(name, local, spec.dim)

    def load_target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An empty global view of parameter `name` for DCP to load into (no communication)."""
        spec = self._spec(name)  # like.shape: the TP-local shape (a DTensor reports its unsharded shape)
        local = torch.empty(like.shape, dtype=like.dtype, device=local_device_of(like))
        if spec.dim is None or self.ctx is None or self.ctx.size == 1:
            return local
        if spec.replicas > 1:
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
        if spec.dim is not None and spec.replicas > 1 and self.ctx is not None:
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
    """The DCP state dict {"model": {name: view}, "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}}."""
    view = (lambda name, t: conv.load_target(name, t)) if for_load else conv.to_global
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for name, p in model.named_parameters():
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
    """Write checkpoint-<step> atomically (collective), then prune the oldest beyond the limit."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(output_dir) / f"{PREFIX}{step}"
    tmp = Path(output_dir) / f".{PREFIX}{step}.tmp"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier save
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = f"cannot write checkpoint {tmp}: {exc}"
    raise_on_any_rank(error)
    state = build_state(model, optimizer, conv, for_load=False)
    dcp.save(state, checkpoint_id=str(tmp))
    try:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / f"rng_state_{rank}.pth")
    except OSError as exc:
        error = f"cannot write the RNG state of rank {rank} to {tmp}: {exc}"
    raise_on_any_rank(error)
    if rank == 0:
        try:
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
            (tmp / MARKER).write_text("")
            if final.exists():  # an earlier run's checkpoint of the same step: replaced
                shutil.rmtree(final)
            os.replace(tmp, final)
            if save_total_limit is not None:
                for old in complete_checkpoints(output_dir)[:-save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            error = f"cannot finish checkpoint {final}: {exc}"
    raise_on_any_rank(error)
    return final


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
    """Load model and AdamW state (resharded to this run's layout) and this rank's RNG; return the
    trainer state (step, data order, scheduler). Collective."""
    state = build_state(model, optimizer, conv, for_load=True)
    check_compatible(path, state)
    dcp.load(state, checkpoint_id=str(path))
    for name, p in model.named_parameters():
        conv.copy_from_global(name, state["model"][name], p)
    for name, p, st in _optimizer_items(model, optimizer):
        loaded = state["optim"][name]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            conv.copy_from_global(name, loaded[key], st[key])
        st["step"] = loaded["step"].clone()
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_state_{rank}.pth"
    if not rng_file.is_file():  # resumed on more ranks than saved: continue from rank 0's stream
        rng_file = path / "rng_state_0.pth"
    rng = torch.load(rng_file, weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / STATE_FILE).read_text())
