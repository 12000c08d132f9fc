"""Keeping the ranks in step: object gathers, barriers, and agreement on a flag or an error, so that a failure
on one rank is raised on every rank before any of them waits in a later collective."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tptrain.distributed.comm.collectives import all_reduce
from tptrain.distributed.comm.tracker import record_object

ProcessGroup = dist.ProcessGroup


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list:
    """Every rank's picklable `obj`, in rank order (over one rank: `[obj]`, nothing sent)."""
    out: list = [None] * dist.get_world_size(group)
    if len(out) == 1:
        return [obj]
    record_object("all_gather_object", obj, group)
    dist.all_gather_object(out, obj, group=group)
    return out


def side_group() -> ProcessGroup:
    """A gloo group over every rank for collectives that run off the main thread (DCP's async save), so
    they never interleave with the training step's on the same group. Collective: every rank, once."""
    return dist.new_group(backend="gloo")


def subgroup(rank_lists: list[list[int]]) -> ProcessGroup | None:
    """This rank's group among the disjoint `rank_lists` (None when it is in none). Collective: every rank calls it
    with the same lists (a pipeline's first and last stage ranks, which hold the tied embedding)."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` is here."""
    if dist.get_world_size(group) == 1:
        return
    record_object("barrier", None, group)
    dist.barrier(group=group)


def any_rank(flag: bool, group: ProcessGroup | None = None, *, phase: str) -> bool:
    """True on every rank if `flag` is True on any rank of `group` (default: the world): one all-reduce
    of one int (none over one rank)."""
    if dist.get_world_size(group) == 1:
        return bool(flag)
    t = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    return bool(all_reduce(t, group, op=dist.ReduceOp.MAX, phase=phase).item())


def raise_on_any_rank(error: str | Exception | None, *, exc_type: type[Exception] = OSError,
                      collective: bool = True) -> None:
    """If any rank has an error, raise the first one on every rank, so no rank is left waiting in a later
    collective. `error` is a message (raised as `exc_type`) or an exception (raised again as its own type).
    Where only some ranks failed, the message names them ("(on rank 1 of 2)"). Collective (all ranks must
    call it) when `collective` and a multi-rank group is up."""
    local = (type(error), str(error)) if isinstance(error, Exception) else (exc_type, error) if error else None
    errors = [local]
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        errors = all_gather_object(local)
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
