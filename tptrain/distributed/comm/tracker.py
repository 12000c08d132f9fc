"""CommTracker: what passes through the comm package (op, shape, bytes, phase, group size), and the facts of an
exchange only the code that ran it knows (`note`), for the communication report and the tests that assert the
Megatron minimum. A debugging aid, not communication state."""
from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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
class CommNote:
    """A fact of an exchange that its bytes do not say and only the code that ran it knows: "rows_received", the
    rows an expert dispatch brought to this rank's experts (the other ranks' routing decides them)."""

    what: str
    value: int
    group: str  # the name of the process group the exchange ran over
    phase: str  # as CommRecord's: "backward" for a forward recomputed in backward


@dataclass
class CommTracker:
    """Records every collective issued through this module while active (`with CommTracker() as t`), and the
    notes of its exchanges."""

    records: list[CommRecord] = field(default_factory=list)
    notes: list[CommNote] = field(default_factory=list)

    def __enter__(self) -> "CommTracker":
        _TRACKERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TRACKERS.remove(self)

    def counts(self, phase: str | None = None) -> Counter:
        return Counter(r.op for r in self.records if phase is None or r.phase == phase)

    def total_bytes(self, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.records if phase is None or r.phase == phase)

    def noted(self, what: str, group: str, phase: str = "forward") -> int:
        """The sum of the `what` notes of exchanges over `group` in `phase`."""
        return sum(n.value for n in self.notes if (n.what, n.group, n.phase) == (what, group, phase))


# Trackers are a debugging aid, not communication state: process groups are always passed explicitly.
_TRACKERS: list[CommTracker] = []


def record(op: str, t: torch.Tensor, phase: str, group: dist.ProcessGroup | None) -> None:
    """Record a collective on `t` over `group` in every active tracker."""
    for tracker in _TRACKERS:
        tracker.records.append(CommRecord(op, tuple(t.shape), t.numel() * t.element_size(), phase,
                                          dist.get_world_size(group)))


def record_object(op: str, obj: object, group: dist.ProcessGroup | None) -> None:
    """Record an object collective (its pickled size) in every active tracker, as "setup"."""
    for tracker in _TRACKERS:
        tracker.records.append(CommRecord(op, (), len(pickle.dumps(obj)), "setup", dist.get_world_size(group)))


def note(what: str, value: int, group: str) -> None:
    """Note a fact of an exchange over the group named `group` (see CommNote) in every active tracker."""
    for tracker in _TRACKERS:
        tracker.notes.append(CommNote(what, int(value), group, current_phase()))


def current_phase() -> str:
    """"backward" inside autograd's backward pass (recomputed forwards included), else "forward"."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"
