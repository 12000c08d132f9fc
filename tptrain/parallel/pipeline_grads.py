"""A pipeline's gradients beyond torch's schedule: when each stage's are complete, and the tied weight's copies.

    when_complete(pipeline.stages, optimizer.step_complete)   # optim_in_backward: each stage stepped once it is done
    with pipeline.ties.own_copy(): ...wrap the stage modules with FSDP2...
    pipeline.ties.sync_grads()                                 # after the schedule: the tied copies' gradients summed

Tied embeddings: the first stage's embedding and the last stage's head are one weight. When two ranks hold them, each
keeps a copy and their gradients are summed over a group of those two ranks, so the copies stay equal. A V schedule
puts both stages on one rank, where they are one parameter of two stage modules; FSDP2 wraps a parameter in one
module only, so under data parallelism that rank's last stage module gets its own copy (`own_copy`), as a last stage
on another rank has: its gradient is added to the model's weight and it takes the weight's values before each step.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm, raise_on_any_rank
from tptrain.parallel.grad_sync import local_tensor


def when_complete(stages, callback: Callable[[list[nn.Parameter]], None]) -> None:
    """Call `callback` with a stage's parameters once their gradients are complete for the step: torch's schedules end
    each stage's backward of a step with its `perform_reduce_grad` (every microbatch's input and weight gradients in,
    and FSDP2's reduce-scatter done when it wraps the stage module); a parameter another stage module of this rank
    adds to (a V schedule's one tied weight) comes with the later of the two. `stages`: torch's PipelineStages."""
    reduced: set[int] = set()

    def then_done(stage, reduce: Callable[[int], None]) -> Callable[[int], None]:
        def perform_reduce_grad(grad_scale_factor: int) -> None:
            reduce(grad_scale_factor)
            reduced.add(stage.stage_index)
            pending = {id(p) for s in stages if s.stage_index not in reduced for p in s.submod.parameters()}
            if len(reduced) == len(stages):  # the step's last stage: the next step starts afresh
                reduced.clear()
            callback([p for p in stage.submod.parameters() if id(p) not in pending])
        return perform_reduce_grad

    for stage in stages:
        stage.perform_reduce_grad = then_done(stage, stage.perform_reduce_grad)


def tie_group(mesh, plan) -> dist.ProcessGroup | None:
    """The group of the two ranks (same dp and tp coordinates) holding the first and the last stage, when those
    differ and the model ties a weight between them; None otherwise. Collective over the whole mesh."""
    first, last = plan.stage_rank(0), plan.stage_rank(plan.n_stages - 1)
    if not plan.tied or first == last:
        return None
    if plan.pp == 2:
        return mesh["pp"].get_group()
    columns = mesh.mesh.reshape(plan.pp, -1).T.tolist()  # each: the pp ranks of one (dp, tp) coordinate
    return comm.subgroup([[column[first], column[last]] for column in columns])


class TiedWeights:
    """This rank's part of the weights a pipeline's first and last stage share (`plan.tied`: (first-stage name,
    last-stage name) pairs): their copies' gradients summed, counted once in the norm. Built with the Pipeline, on every
    rank of the mesh (collective); `stages`: this rank's PipelineStages."""

    def __init__(self, model: nn.Module, mesh, plan, stages) -> None:
        self.model, self.plan, self.stages = model, plan, stages
        self.group = tie_group(mesh, plan)
        self.trainable = self._check()
        self.copies: tuple[tuple[str, str], ...] = ()  # the ones this rank's last stage module holds its own copy of

    @contextlib.contextmanager
    def own_copy(self) -> Iterator[None]:
        """Around FSDP2's wrapping of the stage modules: where this rank holds the first and the last stage (a V
        schedule), the last stage module gets its own copy of each tied weight; the model's alias of it outside the
        stage modules (its head's) is pointed at the wrapped parameter afterwards."""
        last = self._last_stage()
        self.copies = self.plan.tied if last is not None and self.plan.holds(0) else ()
        for _, name in self.copies:
            last.own_parameter(name)
        yield
        for first, name in self.copies:
            path, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(path), attr, self.model.get_parameter(first))

    def _last_stage(self) -> nn.Module | None:
        return next((s.submod for s in self.stages if s.stage_index == self.plan.n_stages - 1), None)

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(the model's weight, the last stage module's copy) of each of `copies`, as they are now (FSDP2's sharded
        parameters between steps: both the same rows of the weight, the same mesh and placements)."""
        last = self._last_stage()
        return [(self.model.get_parameter(first), last.view.get_parameter(name)) for first, name in self.copies]

    @torch.no_grad()
    def refresh(self) -> None:
        """Before each step: the copies take their weight's values (stepped, or loaded from a checkpoint, since)."""
        for weight, copy_ in self._pairs():
            local_tensor(copy_).copy_(local_tensor(weight))

    def sync_grads(self) -> None:
        """After the schedule: sum the gradients of the tied copies (first stage's embedding, last stage's head) over
        their two ranks, so both take the same optimizer step and stay equal (under FSDP2 each holds its dp shard of
        the weight, the same rows on both stages: the shards are summed); a copy of this rank's adds its own to the
        weight's."""
        for weight, copy_ in self._pairs():
            if weight.grad is not None and copy_.grad is not None:
                local_tensor(weight.grad).add_(local_tensor(copy_.grad))
            copy_.grad = None
        if self.group is None or not self.trainable:
            return
        params = dict(self.model.named_parameters())
        for names in self.plan.tied:
            p = next(params[n] for n in names if n in params)
            comm.all_reduce(local_tensor(p.grad), self.group, phase="tied_grad")

    def summed_after(self) -> set[str]:
        """Names of this rank's parameters whose gradient `sync_grads` completes after the schedule."""
        return {n for names in self.plan.tied for n in names} if self.group is not None or self.copies else set()

    def norm_duplicates(self) -> set[str]:
        """Names of tied copies another rank counts in the gradient norm (the last stage's, when two ranks hold
        the tied weight)."""
        return {last for _, last in self.plan.tied} if self.group is not None and not self.plan.holds(0) else set()

    def _check(self) -> bool:
        """Whether the tied copies train (a LoRA run freezes both); a ValueError on every rank when only one of
        them does. Collective."""
        plan = self.plan
        if not plan.tied or plan.stage_rank(0) == plan.stage_rank(plan.n_stages - 1):
            return False
        error, flags = None, []
        if self.group is not None:  # this rank holds a copy
            params = dict(self.model.named_parameters())
            # A copy no longer under its name is the base of an adapter's wrapper (LoRA on the embedding): frozen.
            mine = [next((params[n].requires_grad for n in names if n in params), False) for names in plan.tied]
            flags = comm.all_gather_object(mine, self.group)
            if flags[0] != flags[1]:
                error = (f"only one pipeline stage's copy of the tied weight(s) {list(plan.tied)} trains (e.g. a "
                         f"LoRA modules_to_save naming one of them); with pp_size={plan.pp} train both or neither: "
                         f"drop it from modules_to_save, or untie them (tie_word_embeddings=False)")
        raise_on_any_rank(error, exc_type=ValueError)
        return any(flags[0]) if flags else False
