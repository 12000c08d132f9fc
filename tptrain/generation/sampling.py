"""The next token from vocab-parallel logits: each TP rank holds the logits of its slice of the vocabulary, and every
rank of the group picks the same token with as little as possible crossing the group.

    shard = VocabShard.of(model.parallel)                 # where this rank's logits sit in the vocabulary
    tokens = next_tokens(logits, settings, shard, uniforms)   # (batch,) the same on every rank of the group

transformers' processing, in its order: temperature, then top-k, top-p, min-p (each only when sampling), then a draw.
What crosses the group (per row):
- greedy: each rank's best (value, id), gathered; the group's best wins (ties: the lowest id, as argmax).
- top-k (with or without top-p / min-p after it): each rank's k best (values, ids), gathered, the group's k best kept;
  top-p and min-p then need only those k (transformers' later warpers see -inf everywhere else).
- top-p without top-k: the whole vocabulary's logits gathered (top-p's cut depends on every token's probability).
- plain sampling, and min-p alone: nothing gathered but each rank's maximum and its total weight (an exact draw from
  the whole distribution, in two steps: which rank's slice, then which token in it).
Every draw is the inverse of the cumulative distribution over the vocabulary in id order at one uniform per row (from
the generator every rank of the group shares), so a seed picks the same tokens whatever the tp size (up to rounding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tptrain.distributed import comm
from tptrain.distributed.state import ParallelState


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary's logits: rank `rank` of `size` equal slices over `group` (None: the whole
    vocabulary here)."""

    group: comm.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, state: ParallelState) -> "VocabShard":
        """Where a generation step's logits sit: vocab-sharded over tp when the head keeps them so for a loss (its
        style's `vocab_parallel_loss`; a generation step's batch asks for it), else whole on every rank."""
        layout = state.tp
        if layout is None or state.dims.tp == 1 or not layout.vocab_parallel_loss:
            return cls()
        return cls(layout.ctx.group, layout.ctx.size, layout.ctx.rank)

    def offset(self, local: int) -> int:
        return self.rank * local


def next_tokens(logits: torch.Tensor, settings, shard: VocabShard, uniforms: torch.Tensor | None) -> torch.Tensor:
    """(batch, local vocab) fp32 logits of the last position -> (batch,) token ids. `settings`: GenerationSettings;
    `uniforms` (batch,) in [0, 1), the same on every rank of the group (None when greedy)."""
    if not settings.do_sample:
        return _best(logits, shard)
    scores = logits / settings.temperature if settings.temperature != 1.0 else logits
    if settings.top_k:
        values, ids = _top_candidates(scores, settings.top_k, shard)
    elif settings.top_p < 1.0:
        values, ids = _whole_vocabulary(scores, shard)
    else:
        return _draw_over_ranks(scores, shard, uniforms, settings.min_p)
    values = _min_p(_top_p(values, settings.top_p), settings.min_p)
    return ids.gather(1, _inverse_cdf(values.softmax(-1), uniforms)[:, None])[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, shard: VocabShard) -> torch.Tensor:
    """(batch,) log_softmax(logits / temperature) at `tokens` over the whole vocabulary (before top-k / top-p /
    min-p: the distribution TRL's GRPO computes per-token log-probs from): two all-reduces of (batch,) values."""
    scores = logits / temperature
    top = _over_ranks(scores.amax(-1), shard, dist.ReduceOp.MAX)
    local = tokens - shard.offset(scores.shape[-1])
    held = (local >= 0) & (local < scores.shape[-1])
    picked = torch.where(held, scores.gather(1, local.clamp(0, scores.shape[-1] - 1)[:, None])[:, 0], 0.0)
    summed = _over_ranks(torch.stack([(scores - top[:, None]).exp().sum(-1), picked], -1), shard, dist.ReduceOp.SUM)
    return summed[:, 1] - top - summed[:, 0].log()


def _best(scores: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    value, index = scores.max(-1)
    return _gathered_best(value, index + shard.offset(scores.shape[-1]), shard)


def _gathered_best(value: torch.Tensor, ids: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The id of the largest value over the group (ties: the lowest rank's, i.e. the lowest id)."""
    if shard.size == 1:
        return ids
    pairs = _gather(torch.stack([value.double(), ids.double()], -1)[:, None], shard)  # (batch, ranks, 2)
    return pairs[..., 1].gather(1, pairs[..., 0].argmax(-1, keepdim=True))[:, 0].long()


def _top_candidates(scores: torch.Tensor, k: int, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's k largest (values, ids), each (batch, k), in id order: each rank's k largest, gathered."""
    values, index = scores.topk(min(k, scores.shape[-1]), dim=-1)
    ids = index + shard.offset(scores.shape[-1])
    if shard.size > 1:
        pairs = _gather(torch.stack([values.double(), ids.double()], -1), shard)  # (batch, ranks x k, 2)
        values, best = pairs[..., 0].topk(min(k, pairs.shape[1]), dim=-1)
        values, ids = values.to(scores.dtype), pairs[..., 1].gather(1, best).long()
    order = ids.argsort(-1)
    return values.gather(1, order), ids.gather(1, order)


def _whole_vocabulary(scores: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's (values, ids) on every rank: the slices gathered."""
    values = scores if shard.size == 1 else comm.all_gather(scores.contiguous(), shard.group, dim=1)
    return values, torch.arange(values.shape[-1], device=values.device).expand_as(values)


def _top_p(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper: the least likely tokens whose probabilities sum to at most 1 - top_p removed
    (the most likely always kept)."""
    if top_p >= 1.0:
        return values
    ordered, order = values.sort(-1)
    remove = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[..., -1] = False
    return values.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def _min_p(values: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """transformers' MinPLogitsWarper: tokens less likely than min_p x the most likely one removed."""
    if min_p is None:
        return values
    probs = values.softmax(-1)
    remove = probs < min_p * probs.amax(-1, keepdim=True)
    remove.scatter_(1, probs.argmax(-1, keepdim=True), False)
    return values.masked_fill(remove, float("-inf"))


def _draw_over_ranks(scores: torch.Tensor, shard: VocabShard, uniforms: torch.Tensor,
                     min_p: float | None) -> torch.Tensor:
    """A draw from softmax(scores) over the whole vocabulary (min-p applied: weights below min_p x the largest
    dropped) without gathering it: the group's maximum, each rank's total weight gathered; the uniform picks a rank's
    slice by the totals, then the token in that slice, the one that rank found (all gathered: one id per rank)."""
    top = _over_ranks(scores.amax(-1), shard, dist.ReduceOp.MAX)
    weights = (scores.double() - top[:, None]).exp()  # fp64: the same sums whatever the slices
    if min_p is not None:
        weights = weights.masked_fill(weights < min_p, 0.0)
    cumulative = weights.cumsum(-1)  # (batch, local vocab)
    totals = cumulative[:, -1:]
    if shard.size > 1:
        totals = _gather(totals, shard)  # (batch, ranks)
    ends = totals.cumsum(-1)
    target = uniforms.double() * ends[:, -1]
    rank = _last_positive_at_most(torch.searchsorted(ends, target[:, None], right=True)[:, 0], totals)
    local = target - (ends - totals)[:, shard.rank]
    index = _last_positive_at_most(torch.searchsorted(cumulative, local[:, None], right=True)[:, 0], weights)
    ids = (index + shard.offset(scores.shape[-1]))[:, None]
    if shard.size > 1:
        ids = _gather(ids, shard)  # (batch, ranks): each rank's token for its own slice
    return ids.gather(1, rank[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(batch,) index of the category the uniform falls in (batch, n) `probs` (zero-probability ones never)."""
    cumulative = probs.double().cumsum(-1)
    index = torch.searchsorted(cumulative, (uniforms.double() * cumulative[:, -1])[:, None], right=True)[:, 0]
    return _last_positive_at_most(index, probs)


def _last_positive_at_most(index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`index` (a search's result, possibly past the end by rounding) moved back onto the last positive weight."""
    positive = weights > 0
    last = weights.shape[-1] - 1 - positive.flip(-1).int().argmax(-1)
    return torch.minimum(index, last)


def _over_ranks(t: torch.Tensor, shard: VocabShard, op) -> torch.Tensor:
    return t if shard.size == 1 else comm.all_reduce(t.contiguous(), shard.group, op=op)


def _gather(t: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """(batch, n, ...) -> (batch, ranks x n, ...): every rank's rows side by side, in rank order."""
    return comm.all_gather(t.contiguous(), shard.group, dim=1)
