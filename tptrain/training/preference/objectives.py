"""The preference objectives: TRL's DPO loss types, SimPO and ORPO, each a loss of per-sequence log-probabilities.

    pairs = Pairs(chosen=logps[:n], rejected=logps[n:], ref_chosen=..., ref_rejected=..., chosen_tokens=...,
                  rejected_tokens=...)
    loss = objective_loss(pairs, config, totals=Totals(pairs=64, chosen_tokens=1830))   # this micro-batch's share

Every objective reads only each pair's summed log-probabilities (the policy's and the reference's) and its completions'
token counts, so one mechanism serves them all: the model returns each row's summed token loss (`per_sequence=True`),
whatever the layout. Each loss is a sum over the pairs of a micro-batch divided by the pairs of the whole global batch
(`Totals`), so micro-batches, data-parallel ranks and pipeline microbatches add up to one process's mean over the
batch, as TRL's DPOTrainer computes it on one device (one micro-batch per step). `sft` (the chosen completions'
negative log-likelihood, TRL's `rpo_alpha` term) is a token mean over the global batch's chosen completion tokens.

The formulas are TRL 1.16's (`trl/trainer/dpo_trainer.py`, `_compute_loss`; `trl/experimental/cpo` for "simpo",
`trl/experimental/orpo` for "orpo"), term for term.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tptrain.training.preference.names import LOSS_TYPES, REFERENCE_FREE_LOSS_TYPES

@dataclass(frozen=True)
class Pairs:
    """One micro-batch's pairs, each a (pairs,) tensor: the policy's summed log-probabilities of the chosen and
    rejected completions (differentiable), the reference's (None: reference-free), the completions' tokens (TRL's
    completion_mask summed: IPO's and sigmoid_norm's length) and their predicted tokens (the same less a row's first
    token, which nothing predicts: the log-probabilities' count, SimPO's and ORPO's mean)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_targets: torch.Tensor
    rejected_targets: torch.Tensor
    chosen_nll: torch.Tensor | None = None  # ORPO: the whole chosen sequence's summed NLL, prompt included

    def logratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi(y|x) - log pi_ref(y|x) of the chosen and the rejected completions (the log-probabilities
        themselves without a reference)."""
        if self.ref_chosen is None:
            return self.chosen, self.rejected
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def averages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's mean log-probability per completion token (SimPO's and ORPO's sequence score)."""
        return self.chosen / self.chosen_targets, self.rejected / self.rejected_targets


@dataclass(frozen=True)
class Totals:
    """What the global batch holds, counted over every micro-batch and data-parallel rank: the pairs, and the chosen
    completions' predicted tokens (the NLL term's token mean; ORPO's: the whole chosen sequences')."""

    pairs: int
    chosen_tokens: int


@dataclass(frozen=True)
class ObjectiveConfig:
    """The options the objectives read (DPOConfig's, TRL's names): see DPOConfig for each."""

    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_type)

    @property
    def whole_chosen_nll(self) -> bool:
        """ORPO: its NLL term is over the whole chosen sequence, prompt included (a third row per pair)."""
        return "orpo" in self.loss_type

    @property
    def reference_free_objective(self) -> bool:
        """SimPO or ORPO: the objective itself has no reference model."""
        return bool(set(self.loss_type) & set(REFERENCE_FREE_LOSS_TYPES))


def objective_loss(pairs: Pairs, config: ObjectiveConfig, *, totals: Totals) -> torch.Tensor:
    """This micro-batch's share of the step's loss: each loss type's per-pair losses summed over its pairs and divided
    by the global batch's pairs (the "sft" term: its chosen tokens' summed negative log-likelihood over the global
    batch's chosen tokens), weighted by `loss_weights` and added."""
    loss = pairs.chosen.new_zeros(())
    for loss_type, weight in zip(config.loss_type, config.weights):
        if loss_type in ("sft", "orpo", "simpo"):
            nll = (pairs.chosen_nll.sum() if loss_type == "orpo" else -pairs.chosen.sum()) / totals.chosen_tokens
            loss = loss + weight * (nll if loss_type != "simpo" else config.cpo_alpha * nll)
            if loss_type == "sft":
                continue
        loss = loss + weight * _PAIR_LOSSES[loss_type](pairs, config).sum() / totals.pairs
    return loss


def rewards(pairs: Pairs, config: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit rewards TRL logs (rewards/chosen, rewards/rejected): beta times the log-ratio to the reference, or
    for SimPO and ORPO beta times the mean log-probability per token."""
    scores = pairs.averages() if config.reference_free_objective else pairs.logratios()
    return config.beta * scores[0].detach(), config.beta * scores[1].detach()


def _scores(pairs: Pairs, config: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected scores of the f-divergence regulariser (f-DPO): f'(pi / pi_ref) in log-ratios."""
    chosen, rejected = pairs.logratios()
    kind = config.f_divergence_type
    if kind == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-chosen), 1 - torch.exp(-rejected)
    if kind == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(chosen), math.log(2) + F.logsigmoid(rejected)
    if kind == "alpha_divergence" and abs(config.f_alpha_divergence_coef - 1.0) >= 1e-6:
        alpha = config.f_alpha_divergence_coef  # f'(t) = (t^(alpha-1) - 1) / (alpha - 1), exp clamped as TRL does
        limit = 11.0 if chosen.dtype == torch.float16 else 80.0
        return tuple((torch.exp(torch.clamp(((alpha - 1.0) * r).float(), max=limit)) - 1.0).to(r.dtype) / (alpha - 1.0)
                     for r in (chosen, rejected))
    return chosen, rejected


def _delta(pairs: Pairs, config: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = _scores(pairs, config)
    return chosen - rejected


def _normalised_delta(pairs: Pairs, config: ObjectiveConfig) -> torch.Tensor:
    """The score difference per completion token (IPO's and sigmoid_norm's)."""
    chosen, rejected = _scores(pairs, config)
    return chosen / pairs.chosen_tokens.clamp(min=1) - rejected / pairs.rejected_tokens.clamp(min=1)


def _sigmoid(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    return -F.logsigmoid(c.beta * _delta(p, c))


def _hinge(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    return torch.relu(1 - c.beta * _delta(p, c))


def _ipo(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    return (_normalised_delta(p, c) - 1 / (2 * c.beta)) ** 2


def _exo_pair(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    z = c.beta * _delta(p, c)
    eps = torch.tensor(c.label_smoothing, dtype=z.dtype, device=z.device)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps)))


def _nca_pair(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = (c.beta * r for r in p.logratios())
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _robust(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    z, ls = c.beta * _delta(p, c), c.label_smoothing
    return (-(1 - ls) * F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1 - 2 * ls)


def _bco_pair(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = (c.beta * r for r in p.logratios())
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def _sppo_hard(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = p.logratios()
    return (chosen - 0.5 / c.beta) ** 2 + (rejected + 0.5 / c.beta) ** 2


def _apo_zero(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = p.logratios()
    return 1 - torch.sigmoid(c.beta * chosen) + torch.sigmoid(c.beta * rejected)


def _apo_down(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    chosen, rejected = p.logratios()
    return torch.sigmoid(c.beta * chosen) + 1 - torch.sigmoid(c.beta * (chosen - rejected))


def _discopop(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    z = c.beta * _delta(p, c)
    modulation = torch.sigmoid(z / c.discopop_tau)
    return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation


def _sigmoid_norm(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    return -F.logsigmoid(c.beta * _normalised_delta(p, c))


def _simpo(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    """CPO's "simpo": the mean log-probabilities' difference less the target margin gamma / beta, no reference."""
    chosen, rejected = p.averages()
    z = c.beta * (chosen - rejected - c.simpo_gamma / c.beta)
    return -F.logsigmoid(z) * (1 - c.label_smoothing) - F.logsigmoid(-z) * c.label_smoothing


def _orpo(p: Pairs, c: ObjectiveConfig) -> torch.Tensor:
    """ORPO's odds-ratio term (its NLL term is objective_loss's): -beta log sigmoid(log odds(chosen) - log odds
    (rejected)) of the mean log-probabilities."""
    chosen, rejected = p.averages()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -c.beta * F.logsigmoid(log_odds)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branching at -log 2 against cancellation (as trl.experimental.orpo)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


_PAIR_LOSSES = {"sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "exo_pair": _exo_pair, "nca_pair": _nca_pair,
                "robust": _robust, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard, "apo_zero": _apo_zero,
                "apo_down": _apo_down, "discopop": _discopop, "sigmoid_norm": _sigmoid_norm, "simpo": _simpo,
                "orpo": _orpo}
assert set(_PAIR_LOSSES) | {"sft"} == set(LOSS_TYPES)
