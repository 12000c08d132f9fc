"""Saving a laid-out model: its parameters gathered one at a time, and the one save protocol (global rank 0 checks the
target and writes, every rank takes part in every gather, any failure raised on every rank). The model base class's
`save_pretrained` reaches it at call time; a LoRA adapter's save (tptrain/peft) uses the same protocol."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tptrain.distributed import raise_on_any_rank
from tptrain.distributed.state import state_of
from tptrain.io import save_streamed, writable_error
from tptrain.parallel import pipeline_checkpoint
from tptrain.parallel.shards import gather_full


def save_model(model: nn.Module, sizes: dict[str, int], tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
               directory: str | os.PathLike, *, max_shard_size: int | str, extra_files: dict[str, str]) -> None:
    """Write `model`'s checkpoint: `sizes` ({checkpoint name: bytes}, in writing order) and `tensors()` (the iterator
    gathering them, in that order) streamed into shard files by global rank 0 through the save protocol; cut into
    pipeline stages, each stage writes its own files and rank 0 the one index (parallel/pipeline_checkpoint.py)."""
    if state_of(model).pp is not None:
        pipeline_checkpoint.save_stages(model, sizes, tensors, directory, max_shard_size=max_shard_size,
                                        extra_files=extra_files)
        return
    save_once(directory, collective=is_sharded(model), gather=tensors,
              write=lambda gathered: save_streamed(sizes, gathered, directory, max_shard_size=max_shard_size,
                                                   extra_files=extra_files))


def gathered_parameters(model: nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the parameter at full shape on the CPU) for each of `names`, gathered when the caller asks for
    it: FSDP2 shards first, then TP shards. Collective (each step) over the TP group and FSDP's; the
    tensors are complete on TP rank 0."""
    layout = state_of(model).tp
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        t = params[name].detach()
        if isinstance(t, DTensor):  # FSDP2-sharded over data parallelism: gather this rank's TP shard
            t = t.full_tensor()
        yield name, (t if layout is None else gather_full(t, layout.specs[name], layout.ctx)).cpu()


def gather_parameters(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The parameters `names` of `model` at full shape, on the CPU, all at once (`gathered_parameters`).
    Collective over the TP group (and FSDP's); returns the dict on TP rank 0 and None elsewhere."""
    layout = state_of(model).tp
    out = dict(gathered_parameters(model, names))
    return out if layout is None or layout.ctx.rank == 0 else None


def is_sharded(model: nn.Module) -> bool:
    """Sharded over TP, or over data parallelism by FSDP2 (DTensor parameters): saving is then collective."""
    return dist.is_initialized() and (state_of(model).laid_out
                                      or any(isinstance(p, DTensor) for p in model.parameters()))


def save_once(target: str | os.PathLike, *, collective: bool, gather: Callable[[], Any],
              write: Callable[[Any], None]) -> None:
    """The save protocol: global rank 0 checks `target`, every rank takes part in `gather()`, rank 0
    calls `write(gathered)`. Any failure is raised on every rank, so none waits in a later collective.
    `gather()` may return an iterator that gathers as it is consumed (streaming): every rank then runs
    it to the end after `write` (the writer too, should its write fail half-way)."""
    # Global rank 0 writes even for an unsharded model that every rank saves: one writer per directory.
    writer = not dist.is_initialized() or dist.get_rank() == 0
    raise_on_any_rank(writable_error(Path(target)) if writer else None, collective=collective)
    gathered = gather()
    error = None
    if writer:
        try:
            write(gathered)
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            error = f"saving to {target} failed: {type(exc).__name__}: {exc}"
    if isinstance(gathered, Iterator):
        for _ in gathered:  # the gathers the writer did not consume: every rank takes part in each
            pass
    raise_on_any_rank(error, collective=collective)
