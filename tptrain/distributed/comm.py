"""Every collective tptrain issues, and the only file that talks to c10d.

The activation collectives are the Megatron "conjugate" pairs, tiny autograd functions (one shared
by the pairs along a tensor dim); each entry point's docstring says its forward / backward in one line.
They take the process group as an argument.
`CommTracker` records what passes through here (op, shape, bytes) for the communication report and
for the tests that assert the Megatron minimum.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Function

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 renamed the single-tensor collectives; older releases still have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommRecord:
    op: str  # "all_reduce", "all_gather", "reduce_scatter"
    shape: tuple[int, ...]
    bytes: int  # payload of this rank's input tensor
    phase: str  # "forward" or "backward" (autograd) / "grad_sync" (parameter gradients)


@dataclass
class CommTracker:
    """Records every collective issued through this module while active (`with CommTracker() as t`)."""

    records: list[CommRecord] = field(default_factory=list)

    def __enter__(self) -> "CommTracker":
        _TRACKERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TRACKERS.remove(self)

    def counts(self, phase: str | None = None) -> Counter:
        return Counter(r.op for r in self.records if phase is None or r.phase == phase)

    def total_bytes(self, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.records if phase is None or r.phase == phase)


# Trackers are a debugging aid, not communication state: process groups are always passed explicitly.
_TRACKERS: list[CommTracker] = []


def _record(op: str, t: torch.Tensor, phase: str) -> None:
    for tracker in _TRACKERS:
        tracker.records.append(CommRecord(op, tuple(t.shape), t.numel() * t.element_size(), phase))


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def all_reduce(t: torch.Tensor, group: ProcessGroup, *, op=dist.ReduceOp.SUM, phase: str | None = None):
    """In-place sum (or `op`) over `group`; returns `t`. Not differentiable: use the functions below."""
    t = t.contiguous()
    _record("all_reduce", t, phase or _phase())
    dist.all_reduce(t, op=op, group=group)
    return t


def all_gather(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None):
    """Concatenate every rank's `t` along `dim`."""
    world = dist.get_world_size(group)
    t = t.movedim(dim, 0).contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    _record("all_gather", t, phase or _phase())
    _all_gather_single(out, t, group=group)
    # Contiguous, so the consumers (q/k/v, gate/up) fold it into their matmuls without one copy
    # each, and sequence_parallel.py can recognise the views autograd saves of it.
    return out.movedim(0, dim).contiguous()


def reduce_scatter(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None):
    """Sum over ranks, then keep this rank's chunk of `dim`."""
    world = dist.get_world_size(group)
    t = t.movedim(dim, 0).contiguous()
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: size {t.shape[0]} of dim {dim} is not divisible by {world} ranks")
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    _record("reduce_scatter", t, phase or _phase())
    _reduce_scatter_single(out, t, group=group)
    return out.movedim(0, dim)


def split(t: torch.Tensor, group: ProcessGroup, *, dim: int) -> torch.Tensor:
    """This rank's chunk of `dim` (no communication)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return t.chunk(world, dim=dim)[rank].contiguous()


class _CopyToTP(Function):
    """identity fwd / all-reduce bwd (Megatron's f: entering a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(Function):
    """all-reduce fwd / identity bwd (Megatron's g: leaving a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AlongDim(Function):
    """A collective along tensor dim `dim` in forward and its conjugate in backward (the functions below)."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, dim=ctx.dim), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """all-gather fwd / split bwd (un-shard an output, e.g. logits along the vocabulary)."""
    return _AlongDim.apply(x, group, dim % x.dim(), all_gather, split)


def gather_to_sp(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """all-gather fwd / reduce-scatter bwd (sequence-parallel -> tensor-parallel region)."""
    return _AlongDim.apply(x, group, dim % x.dim(), all_gather, reduce_scatter)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """reduce-scatter fwd / all-gather bwd (tensor-parallel -> sequence-parallel region)."""
    return _AlongDim.apply(x, group, dim % x.dim(), reduce_scatter, all_gather)
