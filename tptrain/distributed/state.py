"""What the one parallelize made of a model, read through one attribute, and the one forward scope every path through
the model runs.

    model.parallel          # ParallelState; a model nobody laid out has the one-process state (every axis 1)
    model.parallel.dims     # the size of every axis (layout.ParallelDims)
    model.parallel.mesh     # its DeviceMesh (None: one process)
    model.parallel.tp       # the TP layout (tensor_parallel.TPLayout: the parameter table; its TPContext holds the tp,
                            # SP and ep groups), None when the model was never laid out
    model.parallel.cp       # the CP context (context_parallel.CPContext), None without cp
    model.parallel.pp       # this rank's pipeline stages (pipeline_parallel.PipelinePlan), None without pp
    model.parallel.scope    # ForwardScope: each axis's begin / end around a forward, in STEPS order

Each axis that acts around a forward (TP's fresh boundary and vocab-sharded logits, SP's saved-tensor hooks, CP's batch
split, positions and loss sum) adds one object with `begin(batch) -> batch` and `end(batch, output) -> output` to the
scope when it is applied. Every path through the model runs that scope: the model's forward (parallelize's hooks),
a pipeline stage's forward and a pipeline step (parallel/pipeline_parallel.py), so none of them repeats what an axis
does, and no axis reads another's state. A `Batch` says where it runs: "model" (a whole batch in, the model's modules
run on it), "step" (a whole batch entering a pipeline step: the schedule runs the stages) or "stage" (a pipeline
microbatch, already this rank's tokens); a generation step with a KV cache is a "model" batch of new tokens with their
positions given, run by the generation engine itself (tptrain/generation: its batch asks for the logits vocab-sharded,
`sampled`), inside which the model's own hooks add nothing (`ForwardScope.open`).

Imports nothing of tptrain.parallel (the model base class holds the one-process state): the axes' classes are named
here in comments only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tptrain.layout import ParallelDims

WHERE = ("model", "step", "stage")
FIELDS = ("input_ids", "labels", "attention_mask", "position_ids", "num_items_in_batch")
# A batch's `name + ROWS`: (batch,) how many rows of its input `name` each sample holds, for an input joined along dim 0
# from its samples (a vision-language model's images, Qwen2-VL's patches): what lets a pipeline give each microbatch
# its own samples' rows. (No model input is named so: processors' names are identifiers.)
ROWS = ":rows"


@dataclass(frozen=True)
class Batch:
    """What enters a forward, as the axes see it. input_ids (batch, seq): token ids (None on a pipeline stage fed the
    stage before's hidden states); labels, attention_mask (batch, seq); position_ids (batch or 1, seq): under a
    pipeline stage the whole sequences' (the input may be a shard of them); num_items_in_batch: the real-token count
    the loss divides by. `loss`: whether a loss is computed from this forward's logits. `sampled`: whether the next
    tokens are sampled from them where they lie (the generation engine's vocab-parallel sampler): like a loss, it reads
    the logits vocab-sharded."""

    where: str
    input_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    num_items_in_batch: int | torch.Tensor | None = None
    loss: bool = False
    sampled: bool = False

    def __post_init__(self) -> None:
        assert self.where in WHERE, self.where

    @property
    def whole(self) -> bool:
        """The batch as its caller gave it (every rank of a token-sharding group holds all of it), not yet split."""
        return self.where != "stage"

    @property
    def runs(self) -> bool:
        """Whether modules run on this batch inside the scope (not a pipeline step, whose schedule runs the stages)."""
        return self.where != "step"

    def replace(self, **changes: Any) -> "Batch":
        return dataclasses.replace(self, **changes)

    @classmethod
    def of_arguments(cls, arguments: dict[str, Any]) -> "Batch":
        """The model's forward's bound arguments (`inspect.BoundArguments.arguments`) as a "model" batch."""
        given = {name: arguments.get(name) for name in FIELDS}
        return cls("model", **given, loss=given["labels"] is not None)

    def write_to(self, arguments: dict[str, Any], parameters) -> None:
        """Put what the axes changed back into bound `arguments` of a forward taking `parameters`."""
        for name in FIELDS:
            value = getattr(self, name)
            if name in parameters and value is not arguments.get(name):
                arguments[name] = value


class ForwardScope:
    """The axes' begin / end pairs around a forward, in the order the axes were applied (STEPS): `begin` runs each
    axis's begin in that order, `end` each end in reverse. Open scopes nest (a pipeline step's around its stages')."""

    def __init__(self) -> None:
        self.axes: list[Any] = []  # objects with begin(batch) -> batch and end(batch, output) -> output
        self._open: list[list[tuple[Any, Batch]]] = []

    def add(self, axis: Any) -> None:
        self.axes.append(axis)

    @property
    def open(self) -> bool:
        """Whether a scope is open: a caller runs it around what runs now (a pipeline step, a generation step)."""
        return bool(self._open)

    def begin(self, batch: Batch) -> Batch:
        """Every axis's begin, in order; should one raise, the axes begun are ended (no output) and it is re-raised."""
        begun: list[tuple[Any, Batch]] = []
        try:
            for axis in self.axes:
                begun.append((axis, batch))
                batch = axis.begin(batch)
        except BaseException:
            self._end(begun[:-1], None)
            raise
        self._open.append(begun)
        return batch

    def end(self, output: Any = None) -> Any:
        """Every axis's end of the innermost open scope, in reverse order (`output` None: the forward failed)."""
        return self._end(self._open.pop(), output)

    @staticmethod
    def _end(begun: list[tuple[Any, Batch]], output: Any) -> Any:
        for axis, batch in reversed(begun):
            output = axis.end(batch, output)
        return output

    def run(self, batch: Batch, forward: Callable[[Batch], Any]) -> Any:
        """`forward(batch as the axes left it)` inside the scope: its output as the axes' ends leave it."""
        batch = self.begin(batch)
        try:
            output = forward(batch)
        except BaseException:
            self.end(None)
            raise
        return self.end(output)


@dataclass
class ParallelState:
    """What the one parallelize made of one model (parallel/parallelize.py): the sizes, the mesh, each axis's own
    object (None where the axis is not there) and the forward scope. The default is one process: every size 1, no
    mesh, nothing installed. `grad_sync` (parallel/grad_sync.GradSync): the sum of the gradients that are per-rank
    shares (TP's partial ones; every one under cp), None when nothing is laid out."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    mesh: Any = None
    tp: Any = None
    cp: Any = None
    pp: Any = None
    grad_sync: Any = None
    scope: ForwardScope = field(default_factory=ForwardScope)
    config: Any = None  # the DistributedConfig the model was laid out from (a reference copy is loaded the same way)

    @property
    def laid_out(self) -> bool:
        """Whether the one parallelize laid the model out (its parameter table recorded, at any size)."""
        return self.tp is not None

    @property
    def sequence_parallel(self) -> bool:
        return self.tp is not None and self.tp.ctx.sequence_parallel

    def token_shard_groups(self) -> list[str]:
        """The groups (by name, as they are now: the Trainer may move the model onto its mesh) whose ranks hold
        different tokens of one batch: tp under sequence parallelism, then cp."""
        groups = [self.tp.ctx.group_name] if self.sequence_parallel else []
        return groups + ([self.cp.group_name] if self.cp is not None else [])


def state_of(model: Any) -> ParallelState:
    """`model.parallel`, or the one-process state of a module nobody laid out (a plain nn.Module)."""
    state = getattr(model, "parallel", None)
    return state if isinstance(state, ParallelState) else ParallelState()
