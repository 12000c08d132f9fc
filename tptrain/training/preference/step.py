"""A preference-tuning step: the Trainer's TrainStep with the objective's loss of per-sequence log-probabilities.

    step = PreferenceStep(model, args=args, mesh=mesh, device=device, pipeline=None, fsdp=fsdp,
                          objective=args.objective(), reference=reference, aux_coef=0.0)
    loss, grad_norm = step(micro_batches, optimizer, scheduler)      # step.metrics: TRL's rewards/* and logps/*

Each micro-batch is one forward of its chosen and rejected rows together (`per_sequence`: each row's summed token
loss, whole on every rank whatever the layout), the reference's log-probabilities first (no graph); the objective's
loss is its pairs' share of the global batch (objectives.Totals, counted in one all-reduce over dp), so the
gradients summed over dp, cp and the pipeline's microbatches are one process's. Clipping, the grad sync and the
optimizer step are TrainStep's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.state import state_of
from tptrain.distributed.topology import dp_mesh
from tptrain.losses import IGNORE_INDEX, shift_labels
from tptrain.training.preference.objectives import ObjectiveConfig, Pairs, Totals, objective_loss, rewards
from tptrain.training.step import TrainStep

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def row_counts(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's completion tokens and predicted tokens, from its labels (rows, seq; whole sequences)."""
    return (labels != IGNORE_INDEX).sum(dim=-1), (shift_labels(labels) != IGNORE_INDEX).sum(dim=-1)


def pairs_of(logps: torch.Tensor, ref: torch.Tensor | None, counts: tuple[torch.Tensor, torch.Tensor], *,
             blocks: int = 2) -> Pairs:
    """The pairs of one forward's rows (every chosen row, then every rejected row; with `blocks` 3, ORPO's, every
    chosen row again labelled on every token): their log-probabilities (rows,), the reference's (rows,) or None, and
    each row's completion and predicted tokens (`row_counts`)."""
    tokens, targets = (c.to(logps.dtype) for c in counts)
    logps, tokens, targets = logps.chunk(blocks), tokens.chunk(blocks), targets.chunk(blocks)
    ref = (None, None) if ref is None else ref.to(logps[0].dtype).chunk(blocks)[:2]
    whole = -logps[2] if blocks == 3 else None
    return Pairs(*logps[:2], *ref, *tokens[:2], *targets[:2], chosen_nll=whole)


def pair_metric_sums(pairs: Pairs, objective: ObjectiveConfig) -> torch.Tensor:
    """(len(METRICS),) the sums over the pairs of what TRL logs per pair (divided by the global pairs later)."""
    chosen, rejected = rewards(pairs, objective)
    # SimPO's and ORPO's trainers log the mean log-probability per token, DPO's the sum
    logps = pairs.averages() if objective.reference_free_objective else (pairs.chosen, pairs.rejected)
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).to(chosen.dtype).sum(),
                        (chosen - rejected).sum(), logps[0].detach().sum(),
                        logps[1].detach().sum()]).to(torch.float64)


class PreferenceStep(TrainStep):
    """One optimizer step of a preference objective (`objective`, with `reference`'s log-probabilities; `aux_coef`:
    the router aux loss's weight, 0 for a dense model)."""

    def __init__(self, model: nn.Module, *, args: Any, mesh: Any, device: torch.device, pipeline: Any, fsdp: bool,
                 objective: ObjectiveConfig, reference: Any, aux_coef: float = 0.0) -> None:
        super().__init__(model, args=args, mesh=mesh, device=device, pipeline=pipeline, fsdp=fsdp)
        self.objective, self.reference, self.aux_coef = objective, reference, aux_coef
        self.blocks = 3 if objective.whole_chosen_nll else 2  # rows per pair (collate_pairs' whole_chosen)

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        totals, tokens = self.totals(micro)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=self.device)
        for batch in micro:
            if self.pipeline is not None:
                loss, batch_sums = self.pipeline_forward_backward(batch, totals)
            else:
                loss, batch_sums = self.forward_backward_batch(batch, totals)
            loss_sum += loss
            sums += batch_sums
        self.metrics = self.reduce_metrics(sums, totals, tokens)
        return loss_sum

    def forward_backward_batch(self, batch: dict[str, torch.Tensor], totals: Totals
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: the reference's log-probabilities, then the policy's forward and backward."""
        ref = self.reference.log_probs(batch)
        with self.autocast():
            out = self.model(batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                             per_sequence=True)
        pairs = pairs_of(-out.loss, ref, row_counts(batch["labels"]), blocks=self.blocks)
        loss = objective_loss(pairs, self.objective, totals=totals)
        if self.aux_coef and out.aux_loss is not None:
            loss = loss + self.aux_coef * out.aux_loss.to(loss.dtype)
        loss.backward()
        return loss.detach().to(torch.float64), pair_metric_sums(pairs, self.objective)

    def totals(self, micro: list[dict[str, torch.Tensor]]) -> tuple[Totals, int]:
        """The global batch's pairs and the predicted tokens of its chosen rows (the NLL term's count: ORPO's whole
        chosen rows, the last block), and its real tokens (the pairs' rows, for num_tokens), in one all-reduce over dp
        (the TP and cp ranks of a dp rank hold the same batch)."""
        local = torch.zeros(3, dtype=torch.int64, device=self.device)
        for batch in micro:
            groups = self.pipeline.n_microbatches if self.pipeline is not None else 1
            blocks = [g.chunk(self.blocks) for g in batch["labels"].chunk(groups)]
            chosen = torch.cat([b[-1] if self.blocks == 3 else b[0] for b in blocks])
            lengths = batch["lengths"].chunk(groups * self.blocks)
            real = sum(part.sum() for k, part in enumerate(lengths) if k % self.blocks < 2)
            local += torch.stack([batch["pairs"].new_tensor(batch["pairs"].numel()),
                                  (shift_labels(chosen) != IGNORE_INDEX).sum(), real]).to(local)
        comm.all_reduce(local, dp_mesh(self.mesh).get_group(), phase="token_count")
        pairs, chosen_tokens, tokens = (int(v) for v in local.tolist())
        return Totals(pairs=pairs, chosen_tokens=chosen_tokens), tokens

    def reduce_metrics(self, sums: torch.Tensor, totals: Totals, tokens: int) -> dict[str, float]:
        """TRL's per-pair means over the global batch (summed over dp, and over pp: only the last stage has them)."""
        comm.all_reduce(sums, dp_mesh(self.mesh).get_group(), phase="loss")
        if self.pipeline is not None:
            comm.all_reduce(sums, self.mesh["pp"].get_group(), phase="loss")
        means = (sums / totals.pairs).tolist()
        return {**dict(zip(METRICS, means)), "num_tokens": tokens}

    def pipeline_forward_backward(self, batch: dict[str, torch.Tensor], totals: Totals
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch through the pipeline: the objective is each microbatch's loss on the last stage (a
        microbatch holds whole pairs), the rows' reference log-probabilities and counts handed to it with the rows.
        Under cp each rank's loss is its 1/cp share of the objective of the sums over cp (summed over cp in forward
        and backward), so the pipeline's step sums the shares to the loss, as it sums a token loss's."""
        ref = self.reference.log_probs(batch)
        counts = row_counts(batch["labels"])
        rows = torch.stack([torch.zeros_like(counts[0]) if ref is None else ref, *counts], dim=-1).to(torch.float64)
        sums: list[torch.Tensor] = []
        cp = state_of(self.inner).cp

        def microbatch_loss(token_losses: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            logps = -token_losses if cp is None else comm.sum_over_tp(-token_losses, cp.group_name)
            values = values.to(logps.dtype)
            pairs = pairs_of(logps, None if ref is None else values[:, 0], (values[:, 1], values[:, 2]),
                             blocks=self.blocks)
            sums.append(pair_metric_sums(pairs, self.objective))
            return objective_loss(pairs, self.objective, totals=totals) / (1 if cp is None else cp.size)

        self.pipeline.loss.objective = microbatch_loss
        try:
            with self.autocast():
                loss = self.pipeline.step(batch, 0, rows=rows)
        finally:
            self.pipeline.loss.objective = None
        # torch's first training step also runs the loss once for its backward's metadata: the last microbatches count
        kept = sums[-self.pipeline.n_microbatches:] if sums else []
        return loss, sum(kept, torch.zeros(len(METRICS), dtype=torch.float64, device=self.device))
