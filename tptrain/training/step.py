"""The Trainer's optimizer step: micro-batches in, (global-batch loss, grad norm) out.

    step = TrainStep(model, args=args, mesh=mesh, device=device, pipeline=pipeline, fsdp=fsdp)
    result = step(micro_batches, optimizer, scheduler)     # StepResult: loss, grad_norm, nonfinite

The real (non -100) target tokens of the GLOBAL batch are counted once (one all-reduce over dp), every
micro-batch's loss is its token sum divided by that count, and data-parallel gradients are summed, so the update
equals one step on the whole batch on one device. A step whose global loss or gradient norm is NaN or inf is not
applied (training/nonfinite.py).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.state import ROWS, state_of
from tptrain.distributed.topology import dp_mesh
from tptrain.losses import IGNORE_INDEX, shift_labels
from tptrain.training.args import TrainingArguments
from tptrain.training.input_reach import InputReach
from tptrain.training.nonfinite import StepResult, describe, is_finite
from tptrain.training.optim import clip_grad_norm_


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's inputs beyond the text's (ids, labels, positions): a vision-language model's attention_mask, pixel
    values, image_grid_thw, ... under the processor's names (training/vision_data.py; not their rows per sample,
    which a pipeline reads); none for text."""
    return {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids") and not k.endswith(ROWS)}


class TrainStep:
    """One optimizer step of `model` (a PeftModel runs forward; its base model's layout is synced and clipped) as
    parallelised by the Trainer's set-up: `pipeline` (pipeline parallelism, or None), `fsdp` (whether FSDP2 wraps it:
    its mixed precision casts instead of autocast)."""

    def __init__(self, model: nn.Module, *, args: TrainingArguments, mesh: Any, device: torch.device,
                 pipeline: Any, fsdp: bool) -> None:
        self.model, self.args, self.mesh, self.device = model, args, mesh, device
        self.pipeline, self.fsdp = pipeline, fsdp
        self.inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        state = state_of(self.inner)
        self.specs = state.tp.specs if state.laid_out else {}
        self.grad_sync = state.grad_sync
        self.metrics: dict[str, float] = {}  # what a workflow's step adds to the step's log line (TRL's names)
        dp = dp_mesh(mesh)  # a vision-language model's tower: reached by images only, kept in step over dp
        self.reach = InputReach.of(self.inner, dp.get_group(), dp.size()) if pipeline is None else None

    def __call__(self, micro: list[dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
                 scheduler: Any) -> StepResult:
        """Forward and backward of every micro-batch of this dp rank's share of the step, then the optimizer and
        schedule step, unless the global loss or gradient norm is NaN or inf: then neither runs (the weights, the
        optimizer state and the schedule stay as they were; with optim_in_backward the update happened in backward)
        and `StepResult.nonfinite` says what was not finite."""
        loss_sum = self.forward_backward(micro)
        if self.pipeline is not None:
            self.pipeline.ties.sync_grads()
        if self.reach is not None:
            self.reach.settle()
        # partial gradients (q/k norms, shared KV chunks) summed over TP; with optim_in_backward the only
        # gradients left: the optimizer held them back for this sum and steps them now
        if self.grad_sync is not None:
            self.grad_sync.sync_grads(self.inner)
        grad_norm = None  # optim_in_backward: most gradients were freed in backward, no norm exists
        if not self.args.optim_in_backward:
            exclude = self.pipeline.ties.norm_duplicates() if self.pipeline is not None else set()
            grad_norm = clip_grad_norm_(self.inner, self.args.max_grad_norm, specs=self.specs, mesh=self.mesh,
                                        exclude=exclude).item()
        local_loss, loss = loss_sum.item(), self.global_loss(loss_sum)
        result, finite = StepResult(loss, grad_norm), is_finite(loss, grad_norm)  # the same on every rank: global
        if finite or self.args.optim_in_backward:  # in backward: the rest (held-back partials) follows, as it must
            optimizer.step()
            scheduler.step()
        if not finite:
            result.nonfinite = describe(self.inner, local_loss=local_loss, loss=loss, grad_norm=grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return result

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss over every rank: every TP rank of a dp rank holds the same loss, the global one is the sum
        over the dp ranks (and, under pp, over the stages: only the ranks holding the last one have a loss)."""
        comm.all_reduce(loss_sum, dp_mesh(self.mesh).get_group(), phase="loss")
        if self.pipeline is not None:
            comm.all_reduce(loss_sum, self.mesh["pp"].get_group(), phase="loss")
        return loss_sum.item()

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch: this rank's share of the step's loss (fp64; the caller sums
        it over dp and pp). A workflow's loss (preference tuning) is this method of its own step."""
        num_items = self.token_count(micro)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro:
            with self.autocast():
                if self.pipeline is not None:  # forward and backward of every pipeline microbatch
                    loss_sum += self.pipeline.step(batch, num_items)
                    continue
                loss = self.model(batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                                  num_items_in_batch=num_items, **model_inputs(batch)).loss
            loss.backward()
            loss_sum += loss.detach().to(torch.float64)
        return loss_sum

    def token_count(self, micro: list[dict[str, torch.Tensor]]) -> int:
        """Real target tokens (labels != -100 after the shift) of the whole step over all dp ranks."""
        local = sum(int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum()) for batch in micro)
        count = torch.tensor([local], dtype=torch.int64, device=self.device)
        comm.all_reduce(count, dp_mesh(self.mesh).get_group(), phase="token_count")  # TP ranks share their dp rank's
        return int(count.item())

    def autocast(self):
        """bf16 autocast for `args.bf16` (evaluation runs under it too); under FSDP2 its MixedPrecisionPolicy casts
        instead."""
        if self.args.bf16 and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
