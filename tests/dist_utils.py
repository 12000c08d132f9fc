"""Run a function on N CPU/gloo ranks under pytest: spawned workers on a free port, with a deadline.

A worker's exception (with its traceback) fails the test; a hang fails it after `timeout` seconds
instead of blocking CI. A test that starts processes must carry the `distributed` marker (tests/conftest.py).
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
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
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(fn, world_size, free_port(), args, errors),
                               nprocs=world_size, join=False, start_method="spawn")
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
