"""Preemption: SIGTERM or SIGINT (Ctrl-C) stops training after the current optimizer step, on every rank.

    with StopOnSignal(grace=60) as stop:          # TrainingArguments.preemption_grace; None: signals untouched
        for step in ...:
            train_one_step()
            if stop.agreed():                    # one all-reduce of one int over the world, every step
                save_checkpoint(); break

A scheduler's SIGTERM (or a terminal's Ctrl-C, or the elastic agent forwarding either) can reach the
ranks at different steps, or reach only some of them: each rank only records it, and after every step
all ranks agree (a MAX over the world) whether any rank was signalled, so they all stop after the same
step and the checkpoint they then write together is consistent; no rank waits in a collective the
others never enter. From the first signal on, a watchdog bounds the stop: a rank that is still running
`grace` seconds later prints why and exits 1 (the last complete checkpoint is left intact by the save
protocol), before a scheduler's SIGKILL would hit it at a worse moment.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from tptrain.distributed import comm

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Records SIGTERM / SIGINT while active (a no-op with `grace=None`); `agreed()` asks every rank."""

    def __init__(self, grace: float | None) -> None:
        self.grace = grace
        self.signal: signal.Signals | None = None  # the first one received (on this rank)
        self.stopped: str | None = None  # once agreed: that signal's name, or "a signal on another rank"
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> "StopOnSignal":
        # Python delivers signals to the main thread only: elsewhere (a trainer in a thread) they stay as they are.
        if self.grace is not None and threading.current_thread() is threading.main_thread():
            outer = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            self._previous = {sig: signal.signal(sig, self._record) for sig in SIGNALS}
            if isinstance(outer, StopOnSignal) and outer.signal is not None:
                # Received while the run was starting (`tptrain train` guards its whole worker): this guard
                # stops after the first step; the outer one's watchdog keeps counting from the signal.
                self.signal, self.received_at = outer.signal, outer.received_at
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._watchdog is not None:
            self._watchdog.cancel()

    @property
    def enabled(self) -> bool:
        return bool(self._previous)

    def _record(self, signum: int, frame) -> None:
        if self.signal is not None:  # Ctrl-C reaches a worker twice (terminal, then the agent): one stop
            return
        self.signal, self.received_at = signal.Signals(signum), time.monotonic()
        self._watchdog = threading.Timer(self.grace, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        print(f"tptrain: error (rank {os.environ.get('RANK', '0')}): still running {self.grace:g} s after "
              f"{self.signal.name} (the preemption grace, --preemption-grace / TrainingArguments.preemption_grace): "
              "exiting without the preemption checkpoint; the last complete checkpoint is intact", file=sys.stderr,
              flush=True)
        os._exit(1)

    def agreed(self) -> bool:
        """Whether any rank has received a stop signal; the same answer on every rank. Collective while
        enabled (every rank calls it once per step), False without a collective otherwise."""
        if not self.enabled:
            return False
        if comm.any_rank(self.signal is not None, phase="stop"):
            self.stopped = self.signal.name if self.signal is not None else "a signal on another rank"
        return self.stopped is not None
