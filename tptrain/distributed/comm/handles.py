"""Collectives started without waiting: `start_*` returns a `Pending` whose `wait()` gives the result, so a
backward can compute while the collective runs (parallel/colwise_block.py). The blocking collectives
(collectives.py) are these, waited for at once. Over a group of one rank a collective is its own result: nothing is
issued or recorded, and the result is what the collective would give (a new tensor where it makes one)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tptrain.distributed.comm.tracker import current_phase, record

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the single-tensor collectives; older releases still have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight (`async_op=True`): `wait()` blocks until it is done and returns its result. On
    gloo the work runs on the process group's own threads; on NCCL on the group's own CUDA stream (the side
    stream, which waits for the current stream at launch), and `wait()` makes the current stream wait for it.
    Either way the caller computes something else meanwhile (`parallel/colwise_block.py`)."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish  # work None: nothing was issued (a group of one rank)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def start_all_reduce(t: torch.Tensor, group: ProcessGroup, *, op=dist.ReduceOp.SUM,
                     phase: str | None = None) -> Pending:
    """`all_reduce`, started: recorded now, as the blocking one is; its `wait()` returns `t`, summed in place."""
    t = t.contiguous()
    if dist.get_world_size(group) == 1:
        return Pending(None, lambda: t)
    record("all_reduce", t, phase or current_phase(), group)
    return Pending(dist.all_reduce(t, op=op, group=group, async_op=True), lambda: t)


def start_all_gather(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None) -> Pending:
    """`all_gather`, started: recorded now; its `wait()` returns the gathered tensor."""
    world = dist.get_world_size(group)
    if world == 1:
        return _alone(t)
    t = t.movedim(dim, 0).contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    record("all_gather", t, phase or current_phase(), group)
    # Contiguous, so the consumers (q/k/v, gate/up) fold it into their matmuls without one copy
    # each, and sequence_parallel.py can recognise the views autograd saves of it.
    return Pending(_all_gather_single(out, t, group=group, async_op=True), lambda: out.movedim(0, dim).contiguous())


def start_reduce_scatter(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None) -> Pending:
    """`reduce_scatter`, started: recorded now; its `wait()` returns this rank's chunk of the sum."""
    world = dist.get_world_size(group)
    if world == 1:
        return _alone(t)
    t = t.movedim(dim, 0).contiguous()
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: size {t.shape[0]} of dim {dim} is not divisible by {world} ranks")
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    record("reduce_scatter", t, phase or current_phase(), group)
    # Contiguous, as the custom op's result is: a strided view would change the reduction order of what reads it
    # (a norm's weight gradient sums over its tokens), and the overlapped and unfused paths must agree bit for bit.
    return Pending(_reduce_scatter_single(out, t, group=group, async_op=True),
                   lambda: out.movedim(0, dim).contiguous())


def _alone(t: torch.Tensor) -> Pending:
    """A gather or scatter over one rank: a contiguous copy of `t`, never `t` itself (the custom ops over these
    must not return a view of their input)."""
    return Pending(None, lambda: t.clone(memory_format=torch.contiguous_format))
