"""save_pretrained and a LoRA adapter from a model cut into pipeline stages (parallel/pipeline_parallel.py).

    model.save_pretrained("out/")   # collective: each stage writes its own shard files, rank 0 the index last

A checkpoint is written in parts, one per pp rank: that rank's stages' tensors, gathered over its TP group one at a
time, go into its own `model-0000K-of-0000N.safetensors` files (numbered over every part, as transformers numbers
them), written by the rank of its stage whose other mesh coordinates are all 0 (the pp ranks of global rank 0), in a
staging directory global rank 0 made beside the target. Once every part's files are fsynced, rank 0 writes the one
index and config.json and swaps the directory into place (io/writer.py's atomic save): until then the target holds
the old checkpoint or nothing. So no rank holds more than one shard plus one tensor, and no tensor crosses the pp
axis; the writers must see one filesystem (as DCP's resumable checkpoints need). A tied weight (the first stage's
embedding, the last stage's head) is written once, by the first stage.

An adapter is small: each stage's tensors go to global rank 0, which writes the one adapter_model.safetensors.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm, raise_on_any_rank
from tptrain.io import plan_files, publish, staging_directory, writable_error, write_index, write_shards


def save_stages(model: nn.Module, sizes: dict[str, int], tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                directory: str | os.PathLike, *, max_shard_size: int | str,
                extra_files: dict[str, str | bytes]) -> None:
    """Write the whole model's checkpoint from every stage (module docstring). `sizes`: this rank's {checkpoint
    name: bytes}, in the order `tensors()` gathers and yields them. Collective over every rank of the mesh; any
    failure is raised on every rank, and the staging directory is removed."""
    pp = model.parallel.mesh["pp"]
    group = pp.get_group()
    writer = dist.get_process_group_ranks(group)[0] == 0  # this pp column writes: it holds global rank 0
    first = dist.get_rank() == 0
    tmp, error = None, None
    if first:
        try:
            error = writable_error(Path(directory))
            tmp = None if error else staging_directory(directory)
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            error = exc
    raise_on_any_rank(error)
    try:
        per_rank = comm.all_gather_object((list(sizes.items()), tmp and str(tmp)), group)
        tmp = Path(per_rank[0][1]) if writer else None
        parts = _owned([items for items, _ in per_rank])
        files = plan_files(parts, max_shard_size)
        me = pp.get_local_rank()
        mine = (item for item in tensors() if item[0] in parts[me])  # every rank gathers; writers keep their own
        error = _write_part(tmp, files[me], mine, directory) if writer else None
        for _ in mine:  # the gathers a failed writer did not consume: every rank of its TP group takes part
            pass
        raise_on_any_rank(error)  # every part is durable, or every rank raises
        if first:
            try:
                all_files = [f for part in files for f in part]
                write_index(tmp, all_files, sum(sum(part.values()) for part in parts), extra_files=extra_files)
                publish(tmp, directory)
            except Exception as exc:  # noqa: BLE001 - raised below on every rank
                error = f"saving to {directory} failed: {type(exc).__name__}: {exc}"
        raise_on_any_rank(error)
    finally:
        if first and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after publish; what a failure left otherwise


def _owned(per_rank: list[list[tuple[str, int]]]) -> list[dict[str, int]]:
    """Each pp rank's part: {name: bytes} of the tensors it writes, a name held by several (a tied copy) by the
    first."""
    seen: set[str] = set()
    parts = []
    for items in per_rank:
        parts.append({name: nbytes for name, nbytes in items if name not in seen})
        seen.update(parts[-1])
    return parts


def _write_part(tmp: Path, files, tensors, directory) -> str | None:
    """Write this part's shard files into the shared staging directory `tmp`; the error as a message, or None."""
    try:
        if not tmp.is_dir():
            raise FileNotFoundError(f"the staging directory {tmp} that global rank 0 made is not visible on this "
                                    f"rank: every pipeline stage writes its own files, so save to a directory on a "
                                    f"filesystem all ranks share (as resumable checkpoints need)")
        write_shards(tmp, files, tensors)
        return None
    except Exception as exc:  # noqa: BLE001 - raised by the caller on every rank
        return f"saving to {directory} failed on this stage: {type(exc).__name__}: {exc}"


def gather_stages(model: nn.Module, state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Every stage's `state` (a LoRA adapter's tensors, on its TP rank 0; None elsewhere) merged, in stage rank
    order, a name two stages hold (a tied weight) from the first; on the pp ranks of global rank 0 (the writer's),
    None elsewhere. Collective over the pp group."""
    group = model.parallel.mesh["pp"].get_group()
    parts = comm.all_gather_object(state, group)
    if dist.get_process_group_ranks(group)[0] != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update({name: t for name, t in (part or {}).items() if name not in merged})
    return merged if state is not None else None
