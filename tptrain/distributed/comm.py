"""Every collective tptrain issues, and the only file that talks to c10d: the process group's start and
end, the activation collectives, and the object gathers and barriers that keep the ranks in step.

The activation collectives are the Megatron "conjugate" pairs, tiny autograd functions (one shared
by the pairs along a tensor dim); each entry point's docstring says its forward / backward in one line.
They take the process group as an argument. `start_all_reduce` / `start_all_gather` / `start_reduce_scatter`
start a collective without waiting (`Pending.wait()`), so a backward can compute while it runs; the blocking
ones are those, waited for at once.
`CommTracker` records what passes through here (op, shape, bytes) for the communication report and
for the tests that assert the Megatron minimum.
"""
from __future__ import annotations

import atexit
import gc
import os
import pickle
import weakref
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

ProcessGroup = dist.ProcessGroup
RENDEZVOUS_TIMEOUT_ENV = "TPTRAIN_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0  # seconds every rank waits for the others to join
PG_TIMEOUT_ENV = "TPTRAIN_PG_TIMEOUT"
DEFAULT_PG_TIMEOUT = 600.0  # seconds a collective waits for a rank that is alive but does not join it (torch: 1800)

# torch >= 2.13 renamed the single-tensor collectives; older releases still have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommRecord:
    op: str  # "all_reduce", "all_gather", "reduce_scatter"
    shape: tuple[int, ...]
    bytes: int  # payload of this rank's input tensor
    # "forward" / "backward" (autograd), "grad_sync" (partial parameter gradients), "gather" (saving), or what a
    # training-step reduction is: "token_count", "loss", "grad_norm"; "setup" for errors, seeds, barriers.
    phase: str
    ranks: int = 1  # size of the group it ran over (e.g. the dp ranks for "token_count", not the world)


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


def _record(op: str, t: torch.Tensor, phase: str, group: ProcessGroup | None) -> None:
    for tracker in _TRACKERS:
        tracker.records.append(CommRecord(op, tuple(t.shape), t.numel() * t.element_size(), phase,
                                          dist.get_world_size(group)))


def _record_object(op: str, obj: object, group: ProcessGroup | None) -> None:
    for tracker in _TRACKERS:
        tracker.records.append(CommRecord(op, (), len(pickle.dumps(obj)), "setup", dist.get_world_size(group)))


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class Pending:
    """A collective in flight (`async_op=True`): `wait()` blocks until it is done and returns its result. On
    gloo the work runs on the process group's own threads; on NCCL on the group's own CUDA stream (the side
    stream, which waits for the current stream at launch), and `wait()` makes the current stream wait for it.
    Either way the caller computes something else meanwhile (`parallel/colwise_block.py`)."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._finish()


def start_all_reduce(t: torch.Tensor, group: ProcessGroup, *, op=dist.ReduceOp.SUM,
                     phase: str | None = None) -> Pending:
    """`all_reduce`, started: recorded now, as the blocking one is; its `wait()` returns `t`, summed in place."""
    t = t.contiguous()
    _record("all_reduce", t, phase or _phase(), group)
    return Pending(dist.all_reduce(t, op=op, group=group, async_op=True), lambda: t)


def start_all_gather(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None) -> Pending:
    """`all_gather`, started: recorded now; its `wait()` returns the gathered tensor."""
    world = dist.get_world_size(group)
    t = t.movedim(dim, 0).contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    _record("all_gather", t, phase or _phase(), group)
    # Contiguous, so the consumers (q/k/v, gate/up) fold it into their matmuls without one copy
    # each, and sequence_parallel.py can recognise the views autograd saves of it.
    return Pending(_all_gather_single(out, t, group=group, async_op=True), lambda: out.movedim(0, dim).contiguous())


def start_reduce_scatter(t: torch.Tensor, group: ProcessGroup, *, dim: int, phase: str | None = None) -> Pending:
    """`reduce_scatter`, started: recorded now; its `wait()` returns this rank's chunk of the sum."""
    world = dist.get_world_size(group)
    t = t.movedim(dim, 0).contiguous()
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: size {t.shape[0]} of dim {dim} is not divisible by {world} ranks")
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    _record("reduce_scatter", t, phase or _phase(), group)
    # Contiguous, as the custom op's result is: a strided view would change the reduction order of what reads it
    # (a norm's weight gradient sums over its tokens), and the overlapped and unfused paths must agree bit for bit.
    return Pending(_reduce_scatter_single(out, t, group=group, async_op=True),
                   lambda: out.movedim(0, dim).contiguous())


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
    t = t.contiguous()
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    _record("all_to_all", t, phase or _phase(), group)
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


# The collectives the autograd functions below issue, as custom ops: torch.compile cannot trace a ProcessGroup call
# (nor resolve a group by name), so each is one opaque node of the compiled graph instead of a graph break. An op
# still runs this file's Python at every call, compiled or not, so CommTracker counts a compiled step as an eager
# one, and `_phase()` tells backward from forward at run time (recomputed forwards included). The ops return new
# contiguous tensors (never a view of their input, as custom ops must); the fakes give torch.compile their shapes.


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


def dispatch_to_ranks(x: torch.Tensor, group: ProcessGroup | str, send_splits: list[int],
                      recv_splits: list[int]) -> torch.Tensor:
    """all-to-all fwd / the reverse all-to-all bwd (expert parallelism: rows to the ranks owning their experts,
    and, with the splits swapped, the results back)."""
    return _AllToAll.apply(x, _name(group), list(send_splits), list(recv_splits))


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    """(ranks * n,) int64 counts, n for each rank -> the (ranks * n,) counts every rank sent here (no gradient)."""
    name = _name(group)
    world = _world(name)
    n = counts.numel() // world
    return _all_to_all_op(counts, name, [n] * world, [n] * world)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    return _CopyToTP.apply(x, _name(group))


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    return _ReduceFromTP.apply(x, _name(group))


def sum_over_tp(x: torch.Tensor, group: ProcessGroup | str) -> torch.Tensor:
    """all-reduce fwd / all-reduce bwd (a statistic over features split across the ranks, e.g. a norm's sum of
    squares)."""
    return _SumOverTP.apply(x, _name(group))


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | str, dim: int = -1) -> torch.Tensor:
    """all-gather fwd / split bwd (un-shard an output, e.g. logits along the vocabulary)."""
    return _AlongDim.apply(x, _name(group), dim % x.dim(), "all_gather", "split")


def split_to_tp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 0) -> torch.Tensor:
    """split fwd / all-gather bwd (a replicated tensor's share for this rank to work on alone)."""
    return _AlongDim.apply(x, _name(group), dim % x.dim(), "split", "all_gather")


def gather_to_sp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 1) -> torch.Tensor:
    """all-gather fwd / reduce-scatter bwd (sequence-parallel -> tensor-parallel region)."""
    return _AlongDim.apply(x, _name(group), dim % x.dim(), "all_gather", "reduce_scatter")


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | str, dim: int = 1) -> torch.Tensor:
    """reduce-scatter fwd / all-gather bwd (tensor-parallel -> sequence-parallel region)."""
    return _AlongDim.apply(x, _name(group), dim % x.dim(), "reduce_scatter", "all_gather")


# -------------------------------------------------------------------- the process group's life, and keeping in step


def init_process_group(backend: str, **kwargs) -> None:
    """Start the default process group: under a launcher (RANK set) through torchrun's env:// rendezvous,
    bounded by `rendezvous_timeout()`, else as a one-process world. It is closed at interpreter exit, so a
    script can simply end. Without that, gloo aborted about 1 run in 6 (SIGABRT, "terminate called without an
    active exception"): a group still referenced when the interpreter shuts down is destroyed during
    finalisation, too late. tptrain's own objects keep group names (`group_name`), and the meshes it builds are
    emptied of their groups at exit (`track_mesh`), so closing frees every group while Python still runs."""
    if "RANK" in os.environ:
        store, rank, world = _rendezvous()
        timeout = timedelta(seconds=process_group_timeout())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
        store.set_timeout(timeout)  # the rendezvous bound held only while joining
    else:  # a plain `python script.py`: no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    atexit.register(destroy_process_group)


def rendezvous_timeout() -> float:
    """Seconds a rank waits for all WORLD_SIZE ranks to join: $TPTRAIN_RENDEZVOUS_TIMEOUT, default 300."""
    return _seconds(RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT)


def process_group_timeout() -> float:
    """Seconds any collective (a checkpoint's barrier included) waits for the other ranks before it raises:
    $TPTRAIN_PG_TIMEOUT, default 600. A rank that dies closes its connections and the others fail at once;
    this bounds the wait for one that hangs (a stuck disk, a stopped process), so no rank sits in a
    collective for torch's default 30 minutes and the elastic agent can restart the group."""
    return _seconds(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT)


def _seconds(env: str, default: float) -> float:
    value = os.environ.get(env, str(default))
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{env}={value!r} must be a positive number of seconds")
    return seconds


def _rendezvous() -> tuple[dist.Store, int, int]:
    """torchrun's env:// rendezvous, bounded by rendezvous_timeout(): a rank that is never started (or dies
    before joining) makes the others fail with a TimeoutError naming the world, instead of a 30-minute wait.
    The bound also covers the process group's own connection set-up; later collectives are bounded by
    process_group_timeout()."""
    rank, world, seconds = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1")), rendezvous_timeout()
    try:
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=seconds)))
        # The elastic agent's store outlives a restart (torch shares one TCPStore server across rounds): without
        # a prefix per attempt, a restarted rank can read a dead peer's address and fail to connect.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"tptrain/attempt_{attempt}", store), rank, world
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise TimeoutError(
            f"rank {rank} waited {seconds:g} s for WORLD_SIZE={world} processes at {where}; are all ranks started "
            f"(and did none fail before joining)? Start every rank with the same MASTER_ADDR/MASTER_PORT, or "
            f"raise {RENDEZVOUS_TIMEOUT_ENV}={seconds:g}. ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None


def track_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Remember `mesh` (weakly) so that `destroy_process_group` can drop the groups it holds."""
    _MESHES.add(mesh)
    return mesh


# Meshes to release at exit: weak references only, the owner (a model, the Trainer) keeps each mesh alive.
_MESHES: weakref.WeakSet = weakref.WeakSet()


def destroy_process_group() -> None:
    """Close the default process group and every group made from it, if one is up (idempotent), and drop the
    references the meshes tptrain built hold to them, so the groups are freed now."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for mesh in list(_MESHES):
        # DeviceMesh keeps its groups in a private registry (torch 2.13); without it, it re-resolves them by
        # name, which fails once they are destroyed, as any use after destruction must.
        getattr(mesh._get_root_mesh(), "_pg_registry", {}).clear()
    _MESHES.clear()
    gc.collect()  # groups held only by reference cycles (autograd graphs) go now, not during finalisation


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list:
    """Every rank's picklable `obj`, in rank order."""
    out: list = [None] * dist.get_world_size(group)
    _record_object("all_gather_object", obj, group)
    dist.all_gather_object(out, obj, group=group)
    return out


def side_group() -> ProcessGroup:
    """A gloo group over every rank for collectives that run off the main thread (DCP's async save), so
    they never interleave with the training step's on the same group. Collective: every rank, once."""
    return dist.new_group(backend="gloo")


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` is here."""
    _record_object("barrier", None, group)
    dist.barrier(group=group)


def any_rank(flag: bool, group: ProcessGroup | None = None, *, phase: str) -> bool:
    """True on every rank if `flag` is True on any rank of `group` (default: the world): one all-reduce
    of one int."""
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
