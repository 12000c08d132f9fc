"""Non-finite steps: a loss or global gradient norm that is NaN or inf, caught on every step, never applied.

    guard = NonFiniteGuard(on_nonfinite="stop", max_skips=5)     # TrainingArguments.on_nonfinite, max_nonfinite_skips
    result = step(micro, optimizer, scheduler)                    # a StepResult; .nonfinite: what was not finite
    verdict = guard.verdict(global_step, result.nonfinite)        # skip (and say so) or stop (NonFiniteStepError)

The check costs no collective: TrainStep reads the two values every rank already agrees on, the global loss
(all-reduced over dp and pp) and the global gradient norm (over every shard: a NaN anywhere makes it NaN on every
rank), before the optimizer step. A non-finite step then leaves the weights, the optimizer state and the schedule as
they were; only then do the ranks gather what each saw (`describe`: one object gather, on that step alone), so the
message names the ranks and the first non-finite gradient in backward order (the parameter nearest the loss whose
gradient is NaN or inf: where backward first produced one), or the loss. `first_nonfinite` also guards the saves: no
checkpoint or final model is written from non-finite weights (training/saving.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

from tptrain.distributed import comm
from tptrain.parallel.grad_sync import local_tensor
from tptrain.training.checkpoint.dirs import complete_checkpoints

FIX = ("lower the learning rate (--lr / learning_rate) or raise the warmup (--warmup-steps), check the data, or "
       "skip such steps with on_nonfinite='skip' (--on-nonfinite skip)")


class NonFiniteStepError(FloatingPointError):
    """A step's loss or gradient norm was NaN or inf (on_nonfinite="stop", or more skips in a row than allowed)."""


@dataclass
class StepResult:
    """One optimizer step: the global-batch loss, the global gradient norm (None with optim_in_backward), and what
    was not finite (the same sentence on every rank; None: the step updated the weights)."""

    loss: float
    grad_norm: float | None
    nonfinite: str | None = None


def is_finite(loss: float, grad_norm: float | None) -> bool:
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor | None]]) -> tuple[str, int, int] | None:
    """(the first name whose tensor holds a NaN or inf, how many do, how many there are) over `tensors` (this rank's
    pieces; None entries skipped), or None when all are finite."""
    first, bad, total = None, 0, 0
    for name, t in tensors:
        if t is None:
            continue
        total += 1
        if not bool(torch.isfinite(local_tensor(t)).all()):
            bad += 1
            first = first or name
    return (first, bad, total) if first is not None else None


def describe(model: torch.nn.Module, *, local_loss: float, loss: float, grad_norm: float | None) -> str:
    """What was not finite in this step, the same sentence on every rank. Collective (one object gather): every
    rank calls it on a non-finite step, which they all agree on. `local_loss`: this rank's share before the sum."""
    backward_order = reversed([(n, p.grad) for n, p in model.named_parameters()])
    report = (math.isfinite(local_loss), first_nonfinite(backward_order) if grad_norm is not None else None)
    reports = comm.all_gather_object(report) if torch.distributed.is_initialized() else [report]
    parts = []
    if not math.isfinite(loss):
        ranks = [r for r, (finite, _) in enumerate(reports) if not finite]
        parts.append(f"the loss is {loss}" + (f" (from the batches of {_ranks(ranks)})" if len(reports) > 1 and ranks
                                              else ""))
    if grad_norm is not None and not math.isfinite(grad_norm):
        parts.append(f"the gradient norm is {grad_norm}" + _gradients(reports))
    return "; ".join(parts)


def _gradients(reports: list[tuple[bool, tuple[str, int, int] | None]]) -> str:
    """Where the non-finite gradients are: the first in backward order on each rank that has one."""
    by_name: dict[str, list[int]] = {}
    for rank, (_, grads) in enumerate(reports):
        if grads is not None:
            by_name.setdefault(grads[0], []).append(rank)
    if not by_name:
        return (": every gradient is finite, the sum of their squares overflowed (gradients of 1e19 and more: the "
                "weights have diverged)")
    where = []
    for name, ranks in by_name.items():
        _, bad, total = reports[ranks[0]][1]
        on = f" on {_ranks(ranks)}" if len(reports) > 1 else ""
        where.append(f"{name}{on} ({bad} of the {total} gradients{' there' if on else ''} are NaN or inf)")
    return "; first non-finite gradient in backward order: " + ", ".join(where)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


@dataclass
class Verdict:
    """What to say after a non-finite step, and whether to stop; a stop's message ends with the latest checkpoint in
    `output_dir` as it is when the message is read (an async save of an earlier step published by then)."""

    text: str
    stop: bool
    output_dir: str | os.PathLike | None = None

    @property
    def message(self) -> str:
        latest = complete_checkpoints(self.output_dir) if self.stop else []
        return self.text + (f" {latest[-1]} is the latest checkpoint: continue from it with --resume "
                            "(resume_from_checkpoint) and a lower learning rate." if latest else "")


@dataclass
class NonFiniteGuard:
    """What a run does after a non-finite step: stop, or skip up to `max_skips` in a row. `skipped`: the steps
    skipped so far (kept in checkpoints: the schedule advanced only on the others). `in_backward`: the steps are
    applied during backward (optim_in_backward), before the loss is known."""

    on_nonfinite: str = "stop"
    max_skips: int = 5
    in_backward: bool = False
    skipped: list[int] = field(default_factory=list)
    in_a_row: int = 0

    def verdict(self, step: int, what: str | None, *, output_dir: str | os.PathLike) -> Verdict | None:
        """None after a finite step; else the message (every rank's the same) and whether to stop."""
        if what is None:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.on_nonfinite == "skip" and self.in_a_row <= self.max_skips:
            self.skipped.append(step)
            return Verdict(f"step {step} skipped: {what}; its update was not applied (the weights, the optimizer "
                           f"state and the learning-rate schedule are still {_weights_of(step - self.in_a_row)}); "
                           f"{self.in_a_row} of at most {self.max_skips} skips in a row (max_nonfinite_skips)", False)
        skipping = self.on_nonfinite == "skip"
        why = (f"{self.in_a_row} steps in a row were not finite, more than max_nonfinite_skips={self.max_skips} "
               f"(--max-nonfinite-skips) allows" if skipping else "on_nonfinite='stop'")
        fix = FIX.replace("skip such steps with on_nonfinite='skip' (--on-nonfinite skip)",
                          "allow more skips in a row") if skipping else FIX
        weights = (f"without applying it: the weights are {_weights_of(step - self.in_a_row)}" if not self.in_backward
                   else "after its update, which optim_in_backward applied during backward: the weights may hold NaN "
                        "or inf")
        return Verdict(f"step {step} is not finite: {what}. Training stopped ({why}) {weights}, and no checkpoint or "
                       f"final model is written from it; {fix}.", True, output_dir)


def _weights_of(step: int) -> str:
    return f"those of step {step}" if step > 0 else "those training started from"
