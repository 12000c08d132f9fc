"""The blocking collectives on plain tensors (not differentiable: ops.py wraps them for autograd), and the
process group's name, which is what objects that outlive a group keep of it."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tptrain.distributed.comm.handles import start_all_gather, start_all_reduce, start_reduce_scatter
from tptrain.distributed.comm.tracker import current_phase, record

ProcessGroup = dist.ProcessGroup


def all_reduce(t: torch.Tensor, group: ProcessGroup, *, op=dist.ReduceOp.SUM, phase: str | None = None):
    """In-place sum (or `op`) over `group`; returns `t`. Not differentiable: use the functions below."""
    return start_all_reduce(t, group, op=op, phase=phase).wait()


def all_gather(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None):
    """Concatenate every rank's `t` along `dim`."""
    return start_all_gather(t, group, dim=dim, phase=phase).wait()


def reduce_scatter(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None):
    """Sum over ranks, then keep this rank's chunk of `dim`."""
    return start_reduce_scatter(t, group, dim=dim, phase=phase).wait()


def split(t: torch.Tensor, group: ProcessGroup, *, dim: int) -> torch.Tensor:
    """This rank's chunk of `dim` (no communication)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return t.chunk(world, dim=dim)[rank].contiguous()


def all_to_all(t: torch.Tensor, group: ProcessGroup, *, send_splits: list[int], recv_splits: list[int],
               phase: str | None = None) -> torch.Tensor:
    """Rows `t[sum(send_splits[:r]):][:send_splits[r]]` go to rank r; returns the rows every rank sent here,
    concatenated by source rank (`recv_splits[r]` from rank r). Splits may be 0 (a rank that sends or
    receives nothing still takes part)."""
    if dist.get_world_size(group) == 1:  # every row stays here
        return t.clone(memory_format=torch.contiguous_format)
    t = t.contiguous()
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    record("all_to_all", t, phase or current_phase(), group)
    dist.all_to_all_single(out, t, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


def group_name(group: ProcessGroup) -> str:
    """What to keep of a process group: its name. Objects that outlive the group (a model, an autograd graph the
    user still holds) must not keep the group itself alive: it would then be destroyed only during interpreter
    finalisation, where gloo aborts the process."""
    return group.group_name


def resolve_group(name: str) -> ProcessGroup:
    """The live process group called `name` (see `group_name`)."""
    return _resolve_process_group(name)


