"""Room on the device a checkpoint is written to: checked before writing when its size is known (`space_error`), and
a write that failed on a full device said as such (`full_device_error`) instead of the writer's own words (torch's
zip writer: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"; safetensors: "I/O error").
Both writers use them: the Hugging Face export (writer.py) and the resumable checkpoints (training/checkpoint/). No
torch."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# Besides the tensors: configs, indexes, manifests, DCP's metadata, the RNG states. A device left with less than this
# after a failed write is full.
MARGIN = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes this process may still write on the filesystem holding `path` (or its nearest existing ancestor)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def space_error(directory: str | os.PathLike, needed: int, *, what: str) -> str | None:
    """Why `what` (`needed` bytes of tensors, about to be written in `directory`) will not fit, or None (the caller
    adds what to do)."""
    free = free_bytes(directory)
    if needed + needed // 100 + MARGIN <= free:
        return None
    return (f"not enough space on the device for {what}: it needs {size_text(needed)} and the filesystem holding "
            f"{directory} has {size_text(free)} free; nothing was written and what is already there is intact")


def full_device_error(exc: BaseException, directory: str | os.PathLike, *, what: str,
                      needed: int | None = None) -> str | None:
    """`exc` (a failed write in `directory`) restated when the device is full: ENOSPC / EDQUOT anywhere in its chain,
    its words, or less than MARGIN left now (torch's zip writer gives no errno). None for any other failure."""
    free = free_bytes(directory)
    if not (_says_full(exc) or free < MARGIN):
        return None
    first = (str(exc).splitlines() or [""])[0]
    need = f", which needs {size_text(needed)} in all" if needed else ""
    state = (f"is full ({size_text(free)} free)" if free < MARGIN else
             f"has no space left for this process though {size_text(free)} are free (out of inodes, or over a quota)")
    return (f"the device holding {directory} {state} while writing {what}{need}: the partial copy is removed and what "
            f"was there before is intact; free some space or write elsewhere (the write failed with "
            f"{type(exc).__name__}: {first})")


def _says_full(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in _FULL_ERRNOS or any(w in str(exc) for w in _FULL_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def size_text(n: int) -> str:
    """`n` bytes in binary units, e.g. "50.4 MiB"."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
