"""GRPO's loss from per-token log-probabilities, as TRL 1.16's GRPOTrainer._compute_loss computes it per loss_type,
written as each rank's share of the global batch's loss so that the shares summed over data-parallel ranks (and
micro-batches) are one process's loss.

    parts = token_terms(logps, rollout, objective)             # (rows, seq) per-token loss, ratios, KL
    loss = loss_share(parts.loss, mask, objective, totals)       # this micro-batch's share of the step's loss

Every tensor is on the micro-batch's (rows, seq) grid: position t holds the log-probability of token t + 1 (the
shifted labels), `mask` the completion tokens that count. The advantages are one per row (completion).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")


@dataclass(frozen=True)
class Objective:
    """The options the loss reads (GRPOConfig's)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True


@dataclass(frozen=True)
class BatchCounts:
    """The global batch's counts the loss types divide by: completions, completion tokens (mask), micro-batches."""

    completions: int
    tokens: int
    micro_batches: int


@dataclass
class TokenTerms:
    loss: torch.Tensor  # (rows, seq) per-token loss, before masking
    ratio: torch.Tensor  # (rows, seq) exp(logps - old logps)
    kl: torch.Tensor | None  # (rows, seq) the k3 estimate of KL(policy || reference), with beta > 0


def token_terms(logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, advantages: torch.Tensor,
                objective: Objective) -> TokenTerms:
    """TRL's per-token loss: the clipped surrogate (cispo: the clipped, detached ratio times the log-probability)
    of the ratio to `old` (None: the policy itself, detached: num_iterations 1), plus beta x the k3 KL to `ref`
    (times the ratio with use_bias_correction_kl, TRL's default: the KL's importance-sampling correction)."""
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    adv = advantages.to(logps.dtype).unsqueeze(-1)  # (rows, 1)
    if objective.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=objective.epsilon_high).detach() * adv * logps
    else:
        clipped = torch.clamp(ratio, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
        loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if objective.beta != 0.0:
        delta = ref.to(logps.dtype) - logps
        kl = torch.exp(delta) - delta - 1
        if objective.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + objective.beta * kl
    return TokenTerms(loss, ratio, kl)


def loss_share(loss: torch.Tensor, mask: torch.Tensor, objective: Objective, totals: BatchCounts) -> torch.Tensor:
    """This micro-batch's share of the global loss: "grpo" each completion's token mean over the global
    completions; "bnpo" this micro-batch's token mean over the global micro-batches (TRL's, per micro-batch);
    "dr_grpo" the token sum over completions x max_completion_length; "dapo" / "cispo" the token sum over the
    global batch's completion tokens."""
    mask = mask.to(loss.dtype)
    masked = loss * mask
    kind = objective.loss_type
    if kind == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / totals.completions
    if kind == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / totals.micro_batches
    if kind == "dr_grpo":
        return masked.sum() / (totals.completions * objective.max_completion_length)
    return masked.sum() / max(totals.tokens, 1)


def metric_sums(terms: TokenTerms, advantages: torch.Tensor, mask: torch.Tensor,
                objective: Objective) -> torch.Tensor:
    """(len(METRICS),) sums over the counted tokens of what TRL logs as token means (divided by the global token
    count later): the KL, and which ratios were clipped (low, high, either; cispo: its own)."""
    mask = mask.to(torch.bool)
    adv = advantages.unsqueeze(-1)
    ratio = terms.ratio.detach()
    low = (ratio < 1 - objective.epsilon_low) & (adv < 0)
    high = (ratio > 1 + objective.epsilon_high) & (adv > 0)
    cispo = (ratio > objective.epsilon_high) & (adv > 0)
    kl = torch.zeros_like(ratio) if terms.kl is None else terms.kl.detach()
    values = [kl, low, high, low | high, cispo]
    return torch.stack([(v.to(torch.float64) * mask).sum() for v in values])
