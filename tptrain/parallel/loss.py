"""Vocab-parallel cross-entropy: the loss straight from vocabulary-sharded logits.

No rank ever holds the full (batch, seq, vocab) logits. The loss needs two all-reduces of per-token scalars: the
max logit (tokens,), then the target logit and the sum of exponentials together (2 * tokens,), as Megatron batches
them. In training the head and the loss are fused (`make_vocab_parallel_head_loss`): the local (tokens, vocab / tp)
logits never exist whole either, and each chunk of tokens takes the same two all-reduces over its tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from tptrain.losses import (IGNORE_INDEX, chunked_token_losses, fused_linear_cross_entropy, loss_denominator,
                            shift_labels)
from tptrain.distributed import comm
from tptrain.parallel.styles import TPContext, vocab_shard_ids


class _VocabParallelCrossEntropy(Function):
    """per-token CE from local logits (tokens, vocab/tp); 2 all-reduces fwd (max, [target, sum-exp]) / none bwd."""

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half -> fp32, as single-device
        max_logit = comm.all_reduce(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)
        local_target, outside = vocab_shard_ids(target, rank=dist.get_rank(group), local_vocab=logits.shape[-1])
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # reuse the buffer: saved below as the softmax numerator
        # One all-reduce for both, as Megatron batches them: (2 * tokens,)
        target_logit, sum_exp = comm.all_reduce(torch.cat([target_logit, exp.sum(dim=-1)]), group).chunk(2)
        loss = torch.log(sum_exp) - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target); modified in place (used once)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss (tokens,) from (tokens, vocab/tp) logits; positions with IGNORE_INDEX give 0."""
    ignored = target == IGNORE_INDEX
    loss = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(ignored, 0), group)
    return loss.masked_fill(ignored, 0.0)


def make_vocab_parallel_causal_lm_loss(ctx: TPContext):
    """The TP replacement for a model's `loss_function(logits, labels, num_items_in_batch)` over `ctx`'s group:
    same shift, ignore index and normalisation as the single-device loss."""

    def loss_function(logits, labels, num_items_in_batch=None, *, shifted=False, per_sequence=False):
        labels = labels if shifted else shift_labels(labels)
        target = labels.reshape(-1).to(logits.device)
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ctx.group)
        if per_sequence:  # (batch,) each row's summed token loss
            return per_token.view(labels.shape).sum(dim=-1)
        return per_token.sum() / loss_denominator(target, num_items_in_batch)

    return loss_function


def make_vocab_parallel_head_loss(ctx: TPContext):
    """The TP replacement for a model's `head_loss_function(h, weight, labels, num_items_in_batch, transform=)`:
    the head's input boundary (as its colwise style would cross it; its backward sums the input gradient over the
    group), then the fused linear cross-entropy over this rank's vocabulary rows, which computes the gradients in
    forward chunk by chunk with two all-reduces per chunk: the max (chunk,), then [target logit, sum-exp]
    (2 * chunk,). At tp 1 it takes none. `per_sequence`: each row's summed token loss (batch,), the same two
    all-reduces per chunk in forward and the chunk's logits computed again in backward (`chunked_token_losses`)."""

    def head_loss(h, weight, labels, num_items_in_batch=None, *, transform, shifted=False, per_sequence=False):
        x = ctx.enter(h)  # (batch, seq, hidden): the whole sequence under sequence parallelism too
        labels = labels if shifted else shift_labels(labels)
        target = labels.reshape(-1).to(x.device)
        if per_sequence:
            return chunked_token_losses(x.reshape(-1, x.shape[-1]), weight, target, transform=transform,
                                        vocab_start=ctx.rank * weight.shape[0],
                                        **_reducers(ctx)).view(labels.shape).sum(dim=-1)
        return fused_linear_cross_entropy(x.reshape(-1, x.shape[-1]), weight, target,
                                          loss_denominator(target, num_items_in_batch), transform=transform,
                                          vocab_start=ctx.rank * weight.shape[0], **_reducers(ctx))

    return head_loss


def _reducers(ctx: TPContext) -> dict:
    """The fused loss's reductions over `ctx`'s group; none at tp 1, where the rank holds the whole vocabulary."""
    if ctx.size == 1:
        return {}
    return dict(reduce_max=lambda t: comm.all_reduce(t, ctx.group, op=dist.ReduceOp.MAX),
                reduce_sum=lambda t: comm.all_reduce(t, ctx.group))
