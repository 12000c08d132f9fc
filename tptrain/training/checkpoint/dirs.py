"""The directory protocol of resumable checkpoints: names, lineage, publishing, pruning, the manifest.

Nothing a user saved is lost, whenever the process dies:
* a checkpoint is written only when its tensors fit on the device (`prepare_save`), in a hidden
  `.checkpoint-<step>.tmp`, every file fsynced, then the manifest
  (the `complete` marker, written last) and one rename into place; a failed save removes its `.tmp`;
* a checkpoint is deleted (pruned, or replaced by the same step) by renaming it to a hidden
  `.checkpoint-<step>.deleting` first, so no instant shows a partial directory as complete; a kill
  between that rename and the next leaves the new checkpoint complete in its `.tmp`, which
  `resolve_resume(True)` puts in place;
* pruning removes only checkpoints with this run's run id (kept across resumes);
* resuming checks every file against the manifest first (each rank a share of the files), so a
  truncated or corrupt file is named before DCP reads anything; `resume_from_checkpoint=True` then
  falls back to the previous valid checkpoint, with a warning naming both.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tptrain.io import fsync_path, space_error
from tptrain.distributed import raise_on_any_rank

PREFIX = "checkpoint-"
MARKER = "complete"
STATE_FILE = "trainer_state.json"
RUN_FILES = ("final", "metrics.jsonl", "loss.png")  # what else an earlier run leaves in output_dir
_CHECKPOINT_ENTRY = re.compile(rf"\.?{PREFIX}\d+(\.tmp|\.deleting)?")  # visible, or left by a killed process
_HIDDEN = re.compile(rf"\.{PREFIX}\d+\.(tmp|deleting)")


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match the manifest written when it was saved."""


def rank_world() -> tuple[int, int]:
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
    fsync_path(checkpoint.parent)
    shutil.rmtree(aside)


def finish_interrupted_saves(output_dir: str | os.PathLike) -> None:
    """Complete what a killed save left: a `.tmp` holding its marker is renamed into place (it is
    complete: the marker is written last), any other `.tmp` or `.deleting` is removed. Rank 0 only."""
    root = Path(output_dir)
    hidden = [p for p in root.iterdir() if _HIDDEN.fullmatch(p.name)] if root.is_dir() else []
    # Each .tmp first: a .deleting may be the old copy it replaces.
    for path in sorted(hidden, key=lambda p: not p.name.endswith(".tmp")):
        if path.name.endswith(".tmp") and (path / MARKER).is_file():
            publish(path, root / path.name[1:-len(".tmp")])
        elif path.exists():
            shutil.rmtree(path)


def prepare_save(tmp: Path, final: Path, run_id: str, needed: int) -> str | None:
    """Why checkpoint `final` cannot be written (another run's is there; `needed` bytes of tensors will not fit on
    the device), or None with an empty `tmp` made. Rank 0."""
    if final.exists() and (other := run_id_of(final)) not in (None, run_id):
        return (f"{final} belongs to another run (run id {other}) and would be replaced: choose another "
                "output_dir, or pass overwrite_output_dir=True to delete that run's checkpoints")
    room = space_error(final.parent, needed, what=f"checkpoint {final}")
    if room:  # the earlier checkpoints stay until this one is complete; only then does save_total_limit prune
        return (f"cannot write checkpoint {final}: {room}; free some space, lower save_total_limit "
                "(--save-total-limit: the earlier checkpoints stay until a new one is complete), or choose another "
                "output_dir")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier save
        tmp.mkdir(parents=True)
    except OSError as exc:
        return f"cannot write checkpoint {final}: {exc}"
    return None


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` to `final`; an existing `final` (the same step, from an abandoned branch
    of this run) is discarded first. Between the two, `tmp` is the complete checkpoint of this step."""
    fsync_path(tmp)
    if final.exists():
        discard(final)
    os.rename(tmp, final)
    fsync_path(final.parent)


def run_id_of(checkpoint: Path) -> str | None:
    """The run id in a checkpoint's trainer state; None if it cannot be read (never pruned then)."""
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune(output_dir: str | os.PathLike, run_id: str, keep: int) -> None:
    """Remove the oldest checkpoints of this run beyond `keep`; other runs' checkpoints are never touched."""
    ours = [p for p in complete_checkpoints(output_dir) if run_id_of(p) == run_id]
    for old in ours[:-keep]:
        discard(old)


# ------------------------------------------------------------------ manifest


def _file_record(path: Path) -> dict[str, int]:
    """Size and crc32 of `path`, read through one reused 4 MiB buffer (a save's memory stays flat); the
    file is fsynced on the way."""
    crc, size, buffer = 0, 0, bytearray(1 << 22)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            crc, size = zlib.crc32(memoryview(buffer)[:n], crc), size + n
        os.fsync(f.fileno())
    return {"size": size, "crc32": crc}


def write_manifest(directory: Path, *, world_size: int) -> None:
    """Write the `complete` marker: the world size and every file's size and crc32 (all ranks' files
    must exist). Written last and synced, so a directory holding it is a complete checkpoint."""
    files = {p.name: _file_record(p) for p in sorted(directory.iterdir()) if p.name != MARKER}
    marker = directory / MARKER
    marker.write_text(json.dumps({"world_size": world_size, "files": files}, indent=1) + "\n")
    fsync_path(marker)
    fsync_path(directory)


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
    rank, world = rank_world()
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


RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's elastic agent in every worker


def resume_after_restart(resume: bool | str | os.PathLike | None, overwrite: bool,
                         output_dir: str | os.PathLike) -> tuple[bool | str | os.PathLike | None, bool]:
    """(resume, overwrite) for this attempt. A group the elastic agent restarted (after a rank died)
    continues from the latest complete checkpoint in output_dir, whatever the first attempt was told;
    with none yet, it starts as that attempt did, replacing what it left (its metrics, partial saves).
    The first attempt's arguments are returned unchanged. Reads the filesystem only: the same on every rank."""
    if int(os.environ.get(RESTART_COUNT_ENV, "0")) == 0:
        return resume, overwrite
    root = Path(output_dir)
    # The hidden .tmp first: rank 0 may be putting a complete one in place right now (finish_interrupted_saves).
    complete_tmp = root.is_dir() and any(_HIDDEN.fullmatch(p.name) and p.name.endswith(".tmp")
                                         and (p / MARKER).is_file() for p in root.iterdir())
    if complete_tmp or complete_checkpoints(root):
        return True, False
    return resume, overwrite or resume in (None, False)


def _latest_valid(output_dir: Path) -> Path:
    rank, _ = rank_world()
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
    skipped = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as exc:
            skipped.append(f"{path} ({exc})")
            continue
        if skipped and rank == 0:  # one warning naming what was passed over and why, and what is used instead
            warnings.warn(f"not resuming from {'; nor from '.join(skipped)}: falling back to {path}, the latest "
                          "intact checkpoint", stacklevel=3)
        return path
    raise CorruptCheckpointError(f"no checkpoint in {output_dir} is intact: {'; '.join(skipped)}; train without "
                                 "resuming")


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


# ------------------------------------------------------------------ state
