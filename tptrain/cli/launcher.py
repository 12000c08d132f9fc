"""`tptrain train`'s (and `tptrain generate`'s) launcher: torch's elastic agent for this node's workers, and what it
reports.

    launch(args, nproc, worker)     # worker(args, error_dir) runs in each of the nproc processes

One node: a private c10d rendezvous on 127.0.0.1 (a free port). Several (--nnodes): the c10d (or static)
rendezvous at --rdzv-endpoint, the same command on every node, as torchrun. --max-restarts N: when a
worker dies (a signal, an exception) the agent stops the others and restarts the group, which resumes
from the latest complete checkpoint (dirs.resume_after_restart).

Workers and launcher share a temporary `error_dir`: each worker writes `rank<R>.pid` when it starts
and `rank<R>.txt` (its error) when it fails, so a rank that died without a word is named by its signal.

Signals: the agent's own handlers would turn SIGTERM / SIGINT into an exception that stops the agent
from ever collecting its workers' results (they then wait to be killed). The launcher handles them
itself instead: it forwards the signal to its workers, which finish their step, checkpoint and return
(preemption.py), and the agent then ends as usual, with exit code 0. A second signal gives up waiting:
the agent's shutdown (SIGTERM, then SIGKILL) runs at once.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tptrain.training.watchdog import HANG_EXIT_CODE

FORWARDED = (signal.SIGTERM, signal.SIGINT)
STOP_FILE = "stop"  # the signal the launcher received, for workers that start after it


def launch(args: argparse.Namespace, nproc: int, worker: Callable[[argparse.Namespace, str], int], *,
           command: str = "train") -> int:
    """Run `worker` in `nproc` processes on this node under the elastic agent; the exit code: 0, 1 (a
    worker failed, reported once), or 128 + the signal when a second signal cut the stop short. `command`: the
    tptrain command its messages name."""
    for logger in ("torch.distributed.elastic", "torch.multiprocessing"):  # failures are reported below, once
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="tptrain-errors-") as error_dir, _Forwarder(Path(error_dir)):
        try:
            elastic_launch(_config(args, nproc), worker)(args, error_dir)
        except ChildFailedError as exc:
            _print_worker_errors(Path(error_dir), {rank: f.exitcode for rank, f in exc.failures.items()}, command)
            return 1
        except SignalException as exc:
            print(f"tptrain {command}: error: a second {exc.sigval.name}: the workers were stopped without waiting "
                  "for their checkpoint", file=sys.stderr)
            return 128 + exc.sigval
    return 0


def _config(args: argparse.Namespace, nproc: int) -> LaunchConfig:
    if args.nnodes == 1:  # a job of its own
        where = dict(run_id=f"tptrain-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                     rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1")  # port 0: the store binds one itself
    else:  # as torchrun: --node-rank is the node's rank only for the static backend, c10d assigns them
        where = dict(run_id=args.rdzv_id, rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint,
                     rdzv_configs={"rank": args.node_rank} if args.rdzv_backend == "static" else {})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // nproc)))
    return LaunchConfig(min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=nproc,
                        max_restarts=args.max_restarts, monitor_interval=0.2, start_method="spawn",
                        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM / SIGINT: _Forwarder
                        shutdown_timeout=math.ceil(args.preemption_grace) + 10, **where)


class _Forwarder:
    """While active: the first SIGTERM / SIGINT goes on to every worker of this node that has started
    (the pids in error_dir); a second raises the agent's SignalException, whose handler shuts down."""

    def __init__(self, error_dir: Path) -> None:
        self.error_dir, self.received, self._previous = error_dir, False, {}

    def __enter__(self) -> "_Forwarder":
        self._previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, frame) -> None:
        if self.received:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.received = True
        # For workers not started yet: written before the pids are read, and read by a worker after it
        # wrote its pid, so every worker gets the signal once at least (a second one is ignored).
        (self.error_dir / STOP_FILE).write_text(str(signum))
        for path in self.error_dir.glob("rank*.pid"):
            try:
                os.kill(int(path.read_text()), signum)
            except (ValueError, ProcessLookupError):  # half-written, or already gone
                pass


def worker_started(error_dir: str | None) -> None:
    """In a worker, once it handles stop signals: drop what an earlier attempt of this rank left (a
    restart), record this pid, and take a signal the launcher received before."""
    rank = os.environ.get("RANK", "0")
    if error_dir is not None:
        for stale in Path(error_dir).glob(f"rank{rank}.*"):
            stale.unlink()
        Path(error_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
        stop = Path(error_dir, STOP_FILE)
        if stop.is_file():
            os.kill(os.getpid(), int(stop.read_text() or signal.SIGTERM))


def cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _print_worker_errors(error_dir: Path, exitcodes: dict[int, int], command: str = "train") -> None:
    """A rank that died without reporting an error (a signal, e.g. the OOM killer's SIGKILL) is the cause:
    it is named first, and what the others then reported (usually gloo's "Connection closed by peer") is
    only a note. Otherwise ranks usually fail with the same message (inputs are validated on every rank):
    say it once, naming the ranks. `exitcodes`: {global rank: exit code} of the failed workers."""
    reported = {int(p.stem[4:]): p.read_text() for p in error_dir.glob("rank*.txt")}
    dead = sorted(rank for rank in exitcodes if rank not in reported)
    for rank in dead:
        print(f"tptrain {command}: error: rank {rank} {_exit_description(exitcodes[rank])}", file=sys.stderr)
    by_message: dict[str, list[str]] = {}
    for rank in sorted(reported):
        by_message.setdefault(reported[rank], []).append(str(rank))
    for message, ranks in by_message.items():
        which = f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}"
        if dead:
            print(f"tptrain {command}: note: {which} then failed too, most likely because of that: "
                  f"{message.strip().splitlines()[-1]}", file=sys.stderr)
        else:
            print(f"tptrain {command}: error on {which}: {message}", file=sys.stderr)


def _exit_description(exitcode: int) -> str:
    if exitcode == HANG_EXIT_CODE:
        return ("was ended by the hang watchdog: a step ran past the hang timeout (--hang-timeout); its report and "
                "Python stack are above")
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        why = " (killed: out of memory, or by a user or scheduler?)" if -exitcode == signal.SIGKILL else ""
        return f"exited with signal {-exitcode} ({name}){why}"
    return f"exited with code {exitcode} without reporting an error"
