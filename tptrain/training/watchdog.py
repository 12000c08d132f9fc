"""The hang watchdog: a training step that runs far past the usual step time ends the job, naming the ranks that
stalled, with every live rank's Python stack.

    with HangWatchdog(args.hang_timeout) as watchdog:      # "auto", seconds, or None (off)
        for n in steps:
            with watchdog.step(n):
                train_one_step()

A rank stalled outside the step's collectives (stopped by SIGSTOP or a debugger, stuck in a driver call or on a dead
file system) leaves the others waiting in the next collective, which torch ends only after the process group's
timeout (TPTRAIN_PG_TIMEOUT, 600 s) with a bare "Timed out waiting ... for recv" naming no rank. Here a thread on
every rank:
* publishes a heartbeat every `interval` seconds to the process group's store, on a connection of its own
  (`comm.side_store`): a counter, the step, and where the main thread is (its innermost tptrain frame);
* once the process has run WARMUP_STEPS steps (compilation, first allocations), compares the running step's time
  with the limit: the hang_timeout given, or "auto": AUTO_FACTOR x the median of the recent steps, at least
  AUTO_FLOOR seconds (and only over more than one rank);
* past it, or once another rank has announced a hang in the store, reads every rank's heartbeat twice, STALE_BEATS
  intervals apart: a rank whose counter did not move has stopped responding (a stopped process runs no thread);
  among the live ones, those not where most are sit elsewhere (a live rank stuck outside the collective). The lowest
  live rank prints that, every live rank prints its Python stack (faulthandler), and each exits with
  HANG_EXIT_CODE; the elastic agent then ends the others (a stopped process by SIGKILL, after its shutdown wait)
  or restarts the group (--max-restarts), which resumes from the latest complete checkpoint.
Only the steps are watched: an evaluation or a checkpoint save is bounded by the process group's timeout.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from typing import Iterator

import torch.distributed as dist

from tptrain.distributed import comm

HANG_EXIT_CODE = 124  # what timeout(1) exits with
WARMUP_STEPS = 3
AUTO_FACTOR, AUTO_FLOOR = 10, 60.0
RECENT_STEPS = 50  # the median's window
STALE_BEATS = 4  # heartbeats a rank may miss before it counts as stopped
HANG_KEY = "tptrain_hang"  # the first rank to find a hang writes what it found here; the others then report too


class HangWatchdog:
    """Times the steps run inside `step(n)` and ends the process when one runs past the limit (see the module)."""

    def __init__(self, hang_timeout: float | str | None) -> None:
        self.hang_timeout = hang_timeout
        fixed = hang_timeout not in (None, "auto")
        self.interval = min(2.0, max(0.25, hang_timeout / 4)) if fixed else 2.0
        self.durations: deque[float] = deque(maxlen=RECENT_STEPS)
        self.completed, self.last = 0, None  # steps this process ran; the last one's number
        self.current: tuple[int, float] | None = None  # (step, start) while one runs
        self.rank, self.world, self.store = 0, 1, None
        self._beats, self._done, self._thread = 0, threading.Event(), None

    def __enter__(self) -> "HangWatchdog":
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.hang_timeout is None or (self.hang_timeout == "auto" and self.world == 1):
            return self
        self.store = comm.side_store(timeout=max(5.0, 2 * self.interval))
        self._publish()
        self._thread = threading.Thread(target=self._watch, name="tptrain-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.store = None

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Watch optimizer step `n` (1-based) while the block runs."""
        self.current = (n, time.monotonic())
        yield
        self.durations.append(time.monotonic() - self.current[1])
        self.current, self.completed, self.last = None, self.completed + 1, n

    def limit(self) -> float | None:
        """Seconds a step may run before it counts as hung; None during the warm-up."""
        if self.completed < WARMUP_STEPS:
            return None
        if self.hang_timeout != "auto":
            return float(self.hang_timeout)
        return max(AUTO_FACTOR * statistics.median(self.durations), AUTO_FLOOR)

    def describe_limit(self) -> str:
        if self.hang_timeout != "auto":
            return f"the hang timeout of {self.limit():g} s (--hang-timeout / TrainingArguments.hang_timeout)"
        return (f"the hang timeout of {self.limit():.0f} s (hang_timeout 'auto': {AUTO_FACTOR} x the median step time "
                f"{statistics.median(self.durations):.3g} s, at least {AUTO_FLOOR:g} s; --hang-timeout sets it)")

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            self._publish()
            current, limit = self.current, self.limit()
            overrun = current is not None and limit is not None and time.monotonic() - current[1] > limit
            announced = self._store("get", HANG_KEY) if self._store("check", [HANG_KEY]) else None
            if overrun or announced:
                self._end(current, announced.decode() if announced else None)

    def _publish(self) -> None:
        self._beats += 1
        running = self.current
        beat = {"beat": self._beats, "step": running[0] if running else self.last, "running": bool(running),
                "where": where(), "host": socket.gethostname(), "pid": os.getpid()}
        self._store("set", f"tptrain_beat/{self.rank}", json.dumps(beat))

    def _store(self, call: str, *args):
        """The store's `call`, or None when it does not answer in time: the watchdog goes on with what it knows."""
        if self.store is None:
            return None
        try:
            return getattr(self.store, call)(*args)
        except (dist.DistError, RuntimeError):
            return None

    def _end(self, current: tuple[int, float] | None, announced: str | None) -> None:
        """Find the stalled ranks, say it, print this rank's stack, exit."""
        if announced is None:
            n, start = current
            found = (f"step {n} has run {time.monotonic() - start:.0f} s on rank {self.rank}, past "
                     f"{self.describe_limit()}")
            announced = (self._store("compare_set", HANG_KEY, "", found) or found.encode()).decode()
        first = self._beats_of_all()
        for _ in range(STALE_BEATS):  # still beating meanwhile: the others are reading this rank's counter too
            time.sleep(self.interval)
            self._publish()
        second = self._beats_of_all()
        stale = [r for r in range(self.world) if r != self.rank and self.rank in second
                 and first.get(r, {}).get("beat") == second.get(r, {}).get("beat")]
        live = [r for r in range(self.world) if r not in stale]
        out = _stderr()
        if self.rank == min(live, default=self.rank):
            print(hang_report(announced, stale, second, STALE_BEATS * self.interval), file=out, flush=True)
        time.sleep(min(0.3, 5.0 / max(1, len(live))) * (live.index(self.rank) if self.rank in live else 0))
        print(f"tptrain: rank {self.rank}'s Python stack (most recent call first):", file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        sys.stdout.flush()
        self._wait_for_stacks(live)
        os._exit(HANG_EXIT_CODE)

    def _wait_for_stacks(self, live: list[int]) -> None:
        """Until every live rank has printed its stack (bounded): the first to exit makes the agent end the others."""
        self._store("set", f"tptrain_stack/{self.rank}", "1")
        deadline = time.monotonic() + 2 * STALE_BEATS * self.interval + 5.0
        while time.monotonic() < deadline and not self._store("check", [f"tptrain_stack/{r}" for r in live]):
            time.sleep(0.1)

    def _beats_of_all(self) -> dict[int, dict]:
        keys = [f"tptrain_beat/{r}" for r in range(self.world)]
        present = [r for r, key in enumerate(keys) if self._store("check", [key])]
        values = self._store("multi_get", [keys[r] for r in present]) or []
        return {r: json.loads(v) for r, v in zip(present, values)}


def hang_report(announced: str, stale: list[int], beats: dict[int, dict], quiet: float) -> str:
    """The lowest live rank's summary: what ran past the limit, which ranks stopped responding (or sit elsewhere),
    where each live rank is."""
    lines = [f"tptrain: error: {announced}."]
    if not beats:
        lines.append("The store holding the ranks' heartbeats did not answer (or there is one rank): which rank "
                     "stalled is unknown.")
    if stale:
        last = "; ".join(f"rank {r}'s last (pid {beats[r]['pid']} on {beats[r]['host']}) was {_step(beats[r])}, at "
                         f"{beats[r]['where']}" if r in beats else f"rank {r} never sent one" for r in stale)
        lines.append(f"{_ranks(stale).capitalize()} never reached the collective the others wait in: no heartbeat for "
                     f"{quiet:.0f} s (a stopped process: SIGSTOP, a debugger; stuck in native code; or a dead host); "
                     f"{last}.")
    places: dict[tuple, list[int]] = {}
    for r in sorted(set(beats) - set(stale)):
        places.setdefault((_step(beats[r]), beats[r]["where"]), []).append(r)
    if not stale and len(places) > 1:
        most = max(places.values(), key=len)
        odd = [r for ranks in places.values() if ranks is not most for r in ranks]
        lines.append(f"Every rank is alive; {_ranks(odd)} not where the others are (never reached their "
                     "collective).")
    elif not stale:
        lines.append("Every rank is alive and at the same place: a collective that never completes (a network fault, "
                     "or ranks calling different collectives).")
    lines.extend(f"  live: {_ranks(ranks)} {step}, at {at}" for (step, at), ranks in places.items())
    lines.append(f"Each live rank's Python stack follows; they exit with code {HANG_EXIT_CODE} (the launcher ends the "
                 "job, or restarts it under --max-restarts).")
    return "\n".join(lines)


def _step(beat: dict) -> str:
    if beat["running"]:
        return f"in step {beat['step']}"
    return f"after step {beat['step']}" if beat["step"] is not None else "before its first step"


def where() -> str:
    """Where the main thread is: its innermost tptrain frame, and the innermost frame when that is elsewhere (this
    module's own frames left out: a heartbeat sent from the main thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    innermost, ours = frame, None
    while frame is not None and ours is None:
        ours = frame if f"{os.sep}tptrain{os.sep}" in frame.f_code.co_filename else None
        frame = frame.f_back
    if innermost is None:
        return "unknown"
    inside = f" (in {_frame(innermost)})" if ours is not None and ours is not innermost else ""
    return _frame(ours or innermost) + inside


def _frame(frame) -> str:
    path = frame.f_code.co_filename
    for marker in (f"site-packages{os.sep}", f"{os.sep}tptrain{os.sep}"):
        if marker in path:
            path = path.split(marker)[-1] if marker.startswith("site") else "tptrain" + os.sep + path.split(marker)[-1]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _stderr():
    """sys.stderr, or the process's own when it was replaced by an object without a file descriptor (a notebook's),
    which faulthandler cannot write to."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
