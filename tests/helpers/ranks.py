"""Run a function on N CPU/gloo ranks under pytest: workers started by a fork server, with a deadline.

The rendezvous is the parent's: a TCPStore server on a port the OS picks (port 0), served for as long as the
workers run. Every rank joins it as a client, as under torchrun (TORCHELASTIC_USE_AGENT_STORE=True: torch's
env:// rendezvous then makes no rank host a store of its own). No port is picked, released and bound again
later, so no other process can take it in between.

A worker's exception (with its traceback) fails the test; a hang fails it after `timeout` seconds
instead of blocking CI. A test that starts processes must carry the `distributed` marker (tests/conftest.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set by tests/conftest.py while a test runs: whether it carries the `distributed` marker. None outside a test
# (a benchmark, a worker process): nothing is checked then.
current_test_is_distributed: bool | None = None


def require_distributed_marker(what: str) -> None:
    """Fail a test without the `distributed` marker that is about to start processes (`what` does)."""
    if current_test_is_distributed is False:
        raise RuntimeError(f"{what}: this test starts several processes, so it must be marked @pytest.mark.distributed "
                           f"(or its module: pytestmark), which keeps it out of the fast tier (-m 'not distributed')")


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port for a server that a child process starts (rank 0 of ranks started by hand, a launcher's c10d
    rendezvous), reserved until the block ends: bound here with SO_REUSEADDR, never listening. The OS then hands
    it to no other bind to port 0 and to no outgoing connection, while the child's server (torch's TCPStore sets
    SO_REUSEADDR too) can still bind and listen on it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        yield s.getsockname()[1]


# Ranks start from a fork server that imported torch, tptrain's models and the test helpers once (their import is
# ~4 CPU-seconds per process on this machine: a fresh interpreter per rank, as "spawn" starts, was a third of the
# suite). The server imports neither transformers nor huggingface_hub, whose settings are read from the
# environment at import: a rank imports those itself, under the environment its test set. TPTRAIN_TEST_START=spawn
# restores fresh interpreters (e.g. to rule the fork server out while debugging).
_START_METHOD = os.environ.get("TPTRAIN_TEST_START", "forkserver")
_PRELOAD = [f"tests.helpers.{name}" for name in ("backend", "batches", "chat", "checkpoints", "compare", "configs",
                                                 "launch", "lora", "memory", "pipeline", "references", "trainer")]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple, errors, env: dict[str, str],
            cwd: str) -> None:
    # A fork server's child inherits the server's environment and directory, not the test's: take the test's.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # the parent serves the store: every rank a client
    torch.set_num_threads(1)
    try:
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> None:
    """Call `fn(*args)` on `world_size` ranks (env set as torchrun would); `fn` must be picklable."""
    require_distributed_marker("run_distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # served until the ranks end
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the session's first call)
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(fn, world_size, store.port, args, errors, dict(os.environ),
                                              os.getcwd()), nprocs=world_size, join=False, start_method=_START_METHOD)
    deadline = time.monotonic() + timeout
    try:
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish within {timeout}s (a collective hung?)")
    except Exception as exc:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        for p in procs.processes:
            if p.is_alive():
                p.kill()
        raise AssertionError(f"{exc}\n" + "\n".join(details)) from None
    finally:
        del store
