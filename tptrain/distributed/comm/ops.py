"""The activation collectives: the Megatron "conjugate" pairs as tiny autograd functions (one shared by the pairs
along a tensor dim) over custom ops. Each entry point's docstring says its forward / backward in one line;
each takes the process group or its name."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from tptrain.distributed.comm.collectives import (all_gather, all_reduce, all_to_all, group_name, reduce_scatter,
                                                  resolve_group, split)

ProcessGroup = dist.ProcessGroup

# The collectives the autograd functions below issue, as custom ops: torch.compile cannot trace a ProcessGroup call
# (nor resolve a group by name), so each is one opaque node of the compiled graph instead of a graph break. An op
# still runs this package's Python at every call, compiled or not, so CommTracker counts a compiled step as an eager
# one, and `current_phase()` (tracker.py) tells backward from forward at run time (recomputed forwards included).
# The ops return new contiguous tensors (never a view of their input, as custom ops must); the fakes give
# torch.compile their shapes.


@torch.library.custom_op("tptrain::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return all_reduce(x.clone(memory_format=torch.contiguous_format), resolve_group(group))


@torch.library.custom_op("tptrain::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return all_gather(x, resolve_group(group), dim=dim)


@torch.library.custom_op("tptrain::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return reduce_scatter(x, resolve_group(group), dim=dim).contiguous()


@torch.library.custom_op("tptrain::split", mutates_args=())
def _split_op(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return split(x, resolve_group(group), dim=dim).clone()


@torch.library.custom_op("tptrain::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, group: str, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    return all_to_all(x, resolve_group(group), send_splits=send_splits, recv_splits=recv_splits)


def _resized(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:dim], size, *x.shape[dim + 1:]))


_all_reduce_op.register_fake(lambda x, group: x.new_empty(x.shape))
_all_gather_op.register_fake(lambda x, group, dim: _resized(x, dim, x.shape[dim] * _world(group)))
_reduce_scatter_op.register_fake(lambda x, group, dim: _resized(x, dim, x.shape[dim] // _world(group)))
_split_op.register_fake(lambda x, group, dim: _resized(x, dim, x.shape[dim] // _world(group)))
_all_to_all_op.register_fake(lambda x, group, send_splits, recv_splits: _resized(x, 0, sum(recv_splits)))


def _world(group: str) -> int:
    return dist.get_world_size(resolve_group(group))


def _name(group: ProcessGroup | str) -> str:
    """The entry points below take a group or its name (pass the name in code torch.compile traces)."""
    return group if isinstance(group, str) else group_name(group)


def _alone(group: str) -> bool:
    """Whether group `group` (a name) has one rank, in eager code: the entry points below then return their input,
    with no autograd function and nothing issued. Traced code keeps the function (looking a group up would break
    the graph), whose collectives over one rank issue nothing either (handles.py)."""
    return not torch.compiler.is_compiling() and _world(group) == 1


class _CopyToTP(Function):
    """identity fwd / all-reduce bwd (Megatron's f: entering a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_op(grad, ctx.group), None


class _ReduceFromTP(Function):
    """all-reduce fwd / identity bwd (Megatron's g: leaving a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTP(Function):
    """all-reduce fwd / all-reduce bwd (a sum every rank goes on to use: each rank's output depends on every
    rank's input, so each input's gradient is the sum of every rank's output gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_op(grad, ctx.group), None


_ALONG_DIM = {"all_gather": _all_gather_op, "reduce_scatter": _reduce_scatter_op, "split": _split_op}


class _AlongDim(Function):
    """A collective along tensor dim `dim` in forward and its conjugate in backward (the functions below),
    named as in `_ALONG_DIM`."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _ALONG_DIM[fwd](x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _ALONG_DIM[ctx.bwd](grad, ctx.group, ctx.dim), None, None, None, None


class _AllToAll(Function):
    """all-to-all fwd (send_splits -> recv_splits) / all-to-all bwd (the same exchange reversed)."""

    @staticmethod
    def forward(ctx, x, group, send_splits, recv_splits):
        ctx.group, ctx.splits = group, (send_splits, recv_splits)
        return _all_to_all_op(x, group, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _all_to_all_op(grad, ctx.group, recv, send), None, None, None


def _along_dim(x: torch.Tensor, group: ProcessGroup | str, dim: int, fwd: str, bwd: str) -> torch.Tensor:
    name = _name(group)
    return x if _alone(name) else _AlongDim.apply(x, name, dim % x.dim(), fwd, bwd)


def dispatch_to_ranks(x: torch.Tensor, group: ProcessGroup | str, send_splits: list[int],
                      recv_splits: list[int]) -> torch.Tensor:
    """all-to-all fwd / the reverse all-to-all bwd (expert parallelism: rows to the ranks owning their experts,
    and, with the splits swapped, the results back)."""
    name = _name(group)
    return x if _alone(name) else _AllToAll.apply(x, name, list(send_splits), list(recv_splits))


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    """(ranks * n,) int64 counts, n for each rank -> the (ranks * n,) counts every rank sent here (no gradient)."""
    name = _name(group)
    if _alone(name):
        return counts
    world = _world(name)
    n = counts.numel() // world
    return _all_to_all_op(counts, name, [n] * world, [n] * world)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    name = _name(group)
    return x if _alone(name) else _CopyToTP.apply(x, name)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    name = _name(group)
    return x if _alone(name) else _ReduceFromTP.apply(x, name)


def sum_over_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    """all-reduce fwd / all-reduce bwd (a statistic over features split across the ranks, e.g. a norm's sum of
    squares)."""
    name = _name(group)
    return x if _alone(name) else _SumOverTP.apply(x, name)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | str, dim: int = -1) -> torch.Tensor:
    """all-gather fwd / split bwd (un-shard an output, e.g. logits along the vocabulary)."""
    return _along_dim(x, group, dim, "all_gather", "split")


def split_to_tp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 0) -> torch.Tensor:
    """split fwd / all-gather bwd (a replicated tensor's share for this rank to work on alone)."""
    return _along_dim(x, group, dim, "split", "all_gather")


def gather_to_sp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 1) -> torch.Tensor:
    """all-gather fwd / reduce-scatter bwd (sequence-parallel -> tensor-parallel region)."""
    return _along_dim(x, group, dim, "all_gather", "reduce_scatter")


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 1) -> torch.Tensor:
    """reduce-scatter fwd / all-gather bwd (tensor-parallel -> sequence-parallel region)."""
    return _along_dim(x, group, dim, "reduce_scatter", "all_gather")


class _OnGathered(Function):
    """fn(x all-gathered along dim, *args): all-gather, fn fwd / all-gather again, fn recomputed and its bwd,
    reduce-scatter bwd. Saved for backward: x (this rank's shard) and args, not the gathered x nor anything fn's
    own backward would keep. fn is a function of its inputs (no parameters, no random numbers); autocast as in the
    forward."""

    @staticmethod
    def forward(ctx, fn, group, dim, x, *args):
        device = x.device.type
        ctx.fn, ctx.group, ctx.dim = fn, group, dim
        ctx.autocast = torch.autocast(device, dtype=torch.get_autocast_dtype(device),
                                      enabled=torch.is_autocast_enabled(device))
        ctx.save_for_backward(x, *args)
        return fn(_all_gather_op(x, group, dim), *args)

    @staticmethod
    def backward(ctx, grad):
        x, *args = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        # Leaves for fn's recomputed graph: the re-gathered x (grad mode is off here, so it has no history) and args.
        inputs = [_all_gather_op(x, ctx.group, ctx.dim), *(a if a is None else a.detach() for a in args)]
        for t, need in zip(inputs, needs):
            if t is not None:
                t.requires_grad_(need)
        with torch.enable_grad(), ctx.autocast:
            out = ctx.fn(*inputs)
        wanted = [t for t, need in zip(inputs, needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        found = [next(grads) if need else None for need in needs]
        if found[0] is not None:  # the gathered x's gradient, made by every rank's fn, summed back to its owner
            found[0] = _reduce_scatter_op(found[0], ctx.group, ctx.dim)
        return None, None, None, *found


def on_gathered_over_cp(fn, x: torch.Tensor, group: ProcessGroup | str, *args: torch.Tensor | None,
                        dim: int) -> torch.Tensor:
    """fn(all-gather of x along dim, *args), keeping only x and args for backward: all-gather, fn fwd / all-gather,
    fn recomputed and its bwd, reduce-scatter bwd (context parallelism: attention of this rank's queries against
    every rank's keys and values, whose gradients, made by every rank's queries, are summed back to their owner;
    backward re-gathers them instead of keeping the whole sequence's). Traced code gathers and calls fn as it is,
    the gathered x kept (the compiler picks what it saves)."""
    name = _name(group)
    if _alone(name):
        return fn(x, *args)
    if torch.compiler.is_compiling():
        return fn(_AlongDim.apply(x, name, dim % x.dim(), "all_gather", "reduce_scatter"), *args)
    return _OnGathered.apply(fn, name, dim % x.dim(), x, *args)


def sum_over_cp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    """all-reduce fwd / identity bwd (context parallelism: the loss as the sum of every rank's share; each rank's
    backward then runs through its own share only)."""
    name = _name(group)
    return x if _alone(name) else _ReduceFromTP.apply(x, name)
