"""The reference model's log-probabilities, from whichever reference the run has.

    reference = reference_for(model, args, ref_model=None, ...)      # adapters off / a frozen copy / precomputed / none
    ref = reference.log_probs(batch)                                # (rows,) in the batch's order, no graph; or None

- a LoRA run (a PeftModel): the base model, the adapters switched off for one forward (no second copy);
- a full fine-tune: a frozen copy laid out like the policy (loaded from the policy's checkpoint with its layout, on
  the Trainer's mesh, sharded by FSDP2 like the policy; no gradients, no optimizer state), or `ref_model` given;
- `precompute_ref_log_probs`: every pair's log-probabilities computed once before training (`precompute`), with the
  reference above or the policy before its first step, kept with the data (and stored beside its cache) so no
  reference is held while training;
- reference-free objectives: none.

Every forward is a `per_sequence` one of the same model code the policy runs (the chunked, vocab-parallel head; the
cp ranks' shares summed by the model's forward scope), under no_grad.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn


def sequence_log_probs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(rows,) each row's summed log-probability of its targets (the negated per-sequence token loss)."""
    out = model(batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"), per_sequence=True)
    return -out.loss


class ModelReference:
    """A reference that runs a forward per micro-batch: `model` (a frozen copy) or the policy itself inside
    `context()` (a PeftModel's `disable_adapter`: the base). `pipeline`: the reference's pipeline under pp (then
    `run_pipeline(pipeline, batch)` is its forward)."""

    def __init__(self, model: nn.Module, *, context: Callable[[], Any] = contextlib.nullcontext,
                 autocast: Callable[[], Any] = contextlib.nullcontext, pipeline: Any = None,
                 run_pipeline: Callable[[Any, dict], torch.Tensor] | None = None) -> None:
        self.model, self.context, self.autocast = model, context, autocast
        self.pipeline, self.run_pipeline = pipeline, run_pipeline

    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), self.context(), self.autocast():
            if self.pipeline is not None:
                return self.run_pipeline(self.pipeline, batch)
            return sequence_log_probs(self.model, batch)


class PrecomputedReference:
    """The reference's log-probabilities carried by the batch ("ref_logps": the dataset's, precomputed)."""

    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["ref_logps"]


class NoReference:
    """Reference-free objectives (SimPO, ORPO, reference_free)."""

    def log_probs(self, batch: dict[str, torch.Tensor]) -> None:
        return None
