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

Nothing a user saved is lost, whenever the process dies:
* a checkpoint is written in a hidden `.checkpoint-<step>.tmp`, every file fsynced, then the manifest
  (the `complete` marker, written last) and one rename into place; a failed save removes its `.tmp`;
* a checkpoint is deleted (pruned, or replaced by the same step) by renaming it to a hidden
  `.checkpoint-<step>.deleting` first, so no instant shows a partial directory as complete; a kill
  between that rename and the next leaves the new checkpoint complete in its `.tmp`, which
  `resolve_resume(True)` puts in place;
* pruning removes only checkpoints with this run's run id (kept across resumes);
* resuming checks every file against the manifest first (each rank a share of the files), so a
  truncated or corrupt file is named before DCP reads anything; `resume_from_checkpoint=True` then
  falls back to the previous valid checkpoint, with a warning.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tptrain.checkpoint.safetensors_io import _fsync
from tptrain.distributed import raise_on_any_rank
from tptrain.parallel.styles import ShardSpec
from tptrain.parallel.tensor_parallel import gather_full

PREFIX = "checkpoint-"
MARKER = "complete"
STATE_FILE = "trainer_state.json"
RUN_FILES = ("final", "metrics.jsonl", "loss.png")  # what else an earlier run leaves in output_dir
_CHECKPOINT_ENTRY = re.compile(rf"\.?{PREFIX}\d+(\.tmp|\.deleting)?")  # visible, or left by a killed process
_HIDDEN = re.compile(rf"\.{PREFIX}\d+\.(tmp|deleting)")


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match the manifest written when it was saved."""


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ------------------------------------------------------------------ output directory


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """checkpoint-<step> directories holding the completion marker, oldest first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in root.glob(f"{PREFIX}*") if (m := re.fullmatch(rf"{PREFIX}(\d+)", p.name))
             and (p / MARKER).is_file()] if root.is_dir() else []
    return [p for _, p in sorted(found)]


def earlier_run_error(output_dir: str | os.PathLike, *, resume: Any, overwrite: bool) -> str | None:
    """Why a run may not start in `output_dir` as told, or None. Reads the filesystem only."""
    if overwrite and (resume is True or resume not in (None, False)
                      and Path(resume).resolve().parent == Path(output_dir).resolve()):
        return (f"resume_from_checkpoint={resume!r} (--resume) continues from a checkpoint in {output_dir}, which "
                "overwrite_output_dir=True (--overwrite-output-dir) would delete: pass only one of them")
    found = _earlier_run_entries(Path(output_dir))
    if not found or overwrite or resume not in (None, False):
        return None
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    return (f"output_dir {output_dir} holds an earlier run ({shown}): continue it with resume_from_checkpoint=True "
            "(--resume), replace it with overwrite_output_dir=True (--overwrite-output-dir), or choose another "
            "output_dir")


def _earlier_run_entries(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name in RUN_FILES or _CHECKPOINT_ENTRY.fullmatch(p.name))


def clear_earlier_run(output_dir: str | os.PathLike) -> None:
    """overwrite_output_dir: delete an earlier run's checkpoints and metrics. Its final/ stays until this
    run's final model replaces it (atomically), so a usable model is there at every instant."""
    root = Path(output_dir)
    for name in _earlier_run_entries(root):
        path = root / name
        if name == "final":
            continue
        if not path.is_dir():
            path.unlink()
        elif name.startswith("."):
            shutil.rmtree(path)
        else:
            discard(path)


def discard(checkpoint: Path) -> None:
    """Delete a checkpoint directory: renamed to a hidden name first (then synced), so a kill midway
    through the deletion never leaves a visible checkpoint that is marked complete but missing files."""
    aside = checkpoint.parent / f".{checkpoint.name}.deleting"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(checkpoint, aside)
    _fsync(checkpoint.parent)
    shutil.rmtree(aside)


def finish_interrupted_saves(output_dir: str | os.PathLike) -> None:
    """Complete what a killed save left: a `.tmp` holding its marker is renamed into place (it is
    complete: the marker is written last), any other `.tmp` or `.deleting` is removed. Rank 0 only."""
    root = Path(output_dir)
    hidden = [p for p in root.iterdir() if _HIDDEN.fullmatch(p.name)] if root.is_dir() else []
    # Each .tmp first: a .deleting may be the old copy it replaces.
    for path in sorted(hidden, key=lambda p: not p.name.endswith(".tmp")):
        if path.name.endswith(".tmp") and (path / MARKER).is_file():
            _publish(path, root / path.name[1:-len(".tmp")])
        elif path.exists():
            shutil.rmtree(path)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` to `final`; an existing `final` (the same step, from an abandoned branch
    of this run) is discarded first. Between the two, `tmp` is the complete checkpoint of this step."""
    _fsync(tmp)
    if final.exists():
        discard(final)
    os.rename(tmp, final)
    _fsync(final.parent)


def run_id_of(checkpoint: Path) -> str | None:
    """The run id in a checkpoint's trainer state; None if it cannot be read (never pruned then)."""
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _prune(output_dir: str | os.PathLike, run_id: str, keep: int) -> None:
    """Remove the oldest checkpoints of this run beyond `keep`; other runs' checkpoints are never touched."""
    ours = [p for p in complete_checkpoints(output_dir) if run_id_of(p) == run_id]
    for old in ours[:-keep]:
        discard(old)


# ------------------------------------------------------------------ manifest


def _file_record(path: Path) -> dict[str, int]:
    """Size and crc32 of `path`, read in 16 MiB pieces; the file is fsynced on the way."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
        os.fsync(f.fileno())
    return {"size": size, "crc32": crc}


def write_manifest(directory: Path, *, world_size: int) -> None:
    """Write the `complete` marker: the world size and every file's size and crc32 (all ranks' files
    must exist). Written last and synced, so a directory holding it is a complete checkpoint."""
    files = {p.name: _file_record(p) for p in sorted(directory.iterdir()) if p.name != MARKER}
    marker = directory / MARKER
    marker.write_text(json.dumps({"world_size": world_size, "files": files}, indent=1) + "\n")
    _fsync(marker)
    _fsync(directory)


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((checkpoint / MARKER).read_text())
        if isinstance(manifest.get("files"), dict) and isinstance(manifest.get("world_size"), int):
            return manifest
    except (ValueError, AttributeError):
        pass
    raise CorruptCheckpointError(f"{checkpoint / MARKER} is not a tptrain manifest (world size and file checksums): "
                                 "the checkpoint was written by an older tptrain, or damaged")


def _file_error(checkpoint: Path, name: str, expected: dict[str, int]) -> str | None:
    path = checkpoint / name
    if not path.is_file():
        return f"{path} is missing (it was written when the checkpoint was saved)"
    actual = _file_record(path)
    if actual["size"] != expected["size"]:
        return f"{path} has {actual['size']} bytes but {expected['size']} were saved: it is truncated or was changed"
    if actual["crc32"] != expected["crc32"]:
        return f"{path} does not match the checksum recorded when it was saved: its contents are corrupt"
    return None


def verify_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Check every file of `checkpoint` against its manifest and return the manifest. Collective: each
    rank checks a share of the files, and the first mismatch is raised on every rank as a
    CorruptCheckpointError naming the file."""
    rank, world = _rank_world()
    try:
        manifest = read_manifest(checkpoint)
        mine = sorted(manifest["files"].items())[rank::world]
        error = next((e for name, rec in mine if (e := _file_error(checkpoint, name, rec))), None)
    except (OSError, CorruptCheckpointError) as exc:
        manifest, error = None, str(exc)
    raise_on_any_rank(error, exc_type=CorruptCheckpointError)
    return manifest


# ------------------------------------------------------------------ choosing the checkpoint to resume


def resolve_resume(resume: bool | str | os.PathLike | None, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from, verified against its manifest; the same answer on every rank.
    Collective. True: the latest valid checkpoint in output_dir (after finishing saves a kill
    interrupted), skipping damaged ones with a warning; a path: that checkpoint, or a clear error."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return _latest_valid(Path(output_dir))
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={str(resume)!r} does not exist; pass a "
                                f"{PREFIX}<step> directory written by a previous run, or True for the latest")
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete training checkpoint (no '{MARKER}' marker): it was "
                         "interrupted while being written, or is not a tptrain checkpoint")
    try:
        verify_checkpoint(path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"cannot resume from {path}: {exc}; resume from another checkpoint "
                                     "(resume_from_checkpoint=True takes the latest valid one)") from None
    return path


def _latest_valid(output_dir: Path) -> Path:
    rank, _ = _rank_world()
    error = None
    if rank == 0:
        try:
            finish_interrupted_saves(output_dir)
        except OSError as exc:
            error = f"cannot finish an interrupted checkpoint save in {output_dir}: {exc}"
    raise_on_any_rank(error)
    found = complete_checkpoints(output_dir)
    if not found:
        raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} holds no complete "
                                f"{PREFIX}<step> directory; train without resuming, or pass a checkpoint path")
    for path in reversed(found):
        try:
            verify_checkpoint(path)
            return path
        except CorruptCheckpointError as exc:
            if rank == 0:
                warnings.warn(f"not resuming from {path}: {exc}; trying the previous checkpoint", stacklevel=3)
    raise CorruptCheckpointError(f"no checkpoint in {output_dir} is intact ({', '.join(p.name for p in found)} all "
                                 "fail their manifest check, see the warnings); train without resuming")


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


# ------------------------------------------------------------------ state


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
    """Write checkpoint-<step> atomically (collective), then prune this run's oldest beyond the limit.
    A failed write removes its temporary directory and leaves every earlier checkpoint as it was."""
    rank, _ = _rank_world()
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
            _publish(tmp, final)
            if save_total_limit is not None:
                _prune(output_dir, trainer_state["run_id"], save_total_limit)
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
    rank, world = _rank_world()
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
        conv.copy_from_global(name, state["model"][name], p)
    for name, p, st in _optimizer_items(model, optimizer):
        loaded = state["optim"][name]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            conv.copy_from_global(name, loaded[key], st[key])
        st["step"] = loaded["step"].clone()
    rank, _ = _rank_world()
    saved_ranks = read_manifest(path)["world_size"]
    # A rank the saving run did not have (resumed on more ranks) continues from rank 0's stream.
    rng = torch.load(path / f"rng_state_{rank if rank < saved_ranks else 0}.pth", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return read_trainer_state(path)
