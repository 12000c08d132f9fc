"""The process group's life: start (torchrun's env:// rendezvous, bounded), the timeouts every collective is
bounded by, and the end at interpreter exit (meshes emptied of their groups first)."""
from __future__ import annotations

import atexit
import gc
import os
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

RENDEZVOUS_TIMEOUT_ENV = "TPTRAIN_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0  # seconds every rank waits for the others to join
PG_TIMEOUT_ENV = "TPTRAIN_PG_TIMEOUT"
DEFAULT_PG_TIMEOUT = 600.0  # seconds a collective waits for a rank that is alive but does not join it (torch: 1800)


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


def side_store(timeout: float) -> dist.Store | None:
    """The default process group's key-value store (this attempt's keys) on a connection of its own, whose calls
    wait at most `timeout` seconds: a watchdog thread's (training/watchdog.py), which then neither waits behind the
    process group's use of the store nor holds it up. None without a process group of more than one rank, or when the
    store cannot be cloned."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store().clone()
    except (RuntimeError, NotImplementedError):  # a store that cannot open a second connection (a FileStore)
        return None
    store.set_timeout(timedelta(seconds=timeout))
    return store


def track_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Remember `mesh` (weakly) so that `destroy_process_group` can drop the groups it holds."""
    _MESHES.add(mesh)
    return mesh


def shared_mesh(key: tuple, build: Callable[[], DeviceMesh]) -> DeviceMesh:
    """The mesh `build` makes for `key` (its device type and axes), built once per default process group and then
    shared: a mesh's process groups hold sockets and threads until the default group is closed, so a process that
    loads several models (a script comparing two, a survey of many) would otherwise gather groups without end.
    Collective on a miss only; every rank makes the same calls in the same order, so all hit or all miss."""
    world = dist.group.WORLD
    hit = _SHARED.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    mesh = track_mesh(build())
    _SHARED[key] = (world, mesh)
    return mesh


# Meshes to release at exit: weak references only, the owner (a model, the Trainer) keeps each mesh alive.
_MESHES: weakref.WeakSet = weakref.WeakSet()
_SHARED: dict[tuple, tuple[object, DeviceMesh]] = {}  # shared_mesh's: key -> (the default group, the mesh)


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
    _SHARED.clear()
    gc.collect()  # groups held only by reference cycles (autograd graphs) go now, not during finalisation
