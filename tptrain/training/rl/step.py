"""A GRPO step: the Trainer's TrainStep with GRPO's loss of per-token log-probabilities (objective.py).

    step = GRPOStep(model, args=args, mesh=mesh, device=device, pipeline=None, fsdp=fsdp)
    result = step(rollout.micro, optimizer, scheduler)        # step.metrics: TRL's kl, clip_ratio/*

Each micro-batch is one forward of its rows (prompt + completion) asking for each position's loss (`per_token`) of
logits / temperature, from the chunked vocab-parallel head (no rank holds the whole vocabulary's logits); the
log-probabilities are those losses negated. The global batch's completions, completion tokens and micro-batches are
counted in one all-reduce over dp, so each micro-batch's loss is its share and the gradients summed over dp are one
process's. Clipping, the grad sync and the optimizer step are TrainStep's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.topology import dp_mesh
from tptrain.losses import IGNORE_INDEX, shift_labels
from tptrain.training.preference.reference import token_log_probs
from tptrain.training.rl.objective import METRICS, BatchCounts, Objective, loss_share, metric_sums, token_terms
from tptrain.training.step import TrainStep


class GRPOStep(TrainStep):
    """One optimizer step of GRPO's objective (`args`: a GRPOConfig; `aux_coef`: the router aux loss's weight)."""

    def __init__(self, model: nn.Module, *, args: Any, mesh: Any, device: torch.device, pipeline: Any, fsdp: bool,
                 aux_coef: float = 0.0) -> None:
        super().__init__(model, args=args, mesh=mesh, device=device, pipeline=pipeline, fsdp=fsdp)
        self.objective = Objective(loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
                                   epsilon_high=args.upper_epsilon, max_completion_length=args.max_completion_length,
                                   use_bias_correction_kl=args.use_bias_correction_kl)
        self.aux_coef = aux_coef

    def token_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.autocast():
            return token_log_probs(self.model, batch, self.args.temperature)

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        totals = self.totals(micro)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=self.device)
        for batch in micro:
            with self.autocast():
                out = self.model(batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                                 per_token=True, temperature=self.args.temperature)
            mask = shift_labels(batch["labels"]) != IGNORE_INDEX
            terms = token_terms(-out.loss, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                self.objective)
            loss = loss_share(terms.loss, mask, self.objective, totals)
            if self.aux_coef and out.aux_loss is not None:  # TRL: the aux loss once per micro-batch, over them all
                loss = loss + self.aux_coef * out.aux_loss.to(loss.dtype) / totals.micro_batches
            loss.backward()
            loss_sum += loss.detach().to(torch.float64)
            sums += metric_sums(terms, batch["advantages"], mask, self.objective)
        comm.all_reduce(sums, dp_mesh(self.mesh).get_group(), phase="loss")
        means = (sums / max(totals.tokens, 1)).tolist()
        shown = {"kl"} if self.objective.beta else set()
        shown |= {"cispo_clip_ratio"} if self.objective.loss_type == "cispo" else {m for m in METRICS if "/" in m}
        self.metrics = {name: v for name, v in zip(METRICS, means) if name in shown}
        return loss_sum

    def totals(self, micro: list[dict[str, torch.Tensor]]) -> BatchCounts:
        """The global batch's completions, counted completion tokens and micro-batches: one all-reduce over dp (the
        TP ranks of a dp rank hold the same rows)."""
        local = torch.zeros(3, dtype=torch.int64, device=self.device)
        for batch in micro:
            counted = (shift_labels(batch["labels"]) != IGNORE_INDEX).sum()
            local += torch.stack([counted.new_tensor(batch["input_ids"].shape[0]), counted, counted.new_tensor(1)])
        comm.all_reduce(local, dp_mesh(self.mesh).get_group(), phase="token_count")
        completions, tokens, micro_batches = (int(v) for v in local.tolist())
        return BatchCounts(completions=completions, tokens=tokens, micro_batches=micro_batches)
