"""Causal-LM loss helpers shared by the models and the tensor-parallel loss (a leaf: imports torch only).

    loss = causal_lm_loss(logits, labels)                  # mean over real target tokens
    loss = causal_lm_loss(logits, labels, num_items)       # sum / num_items (gradient accumulation)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position: position t predicts token t + 1; the last predicts nothing (IGNORE_INDEX).
    Padding the labels instead of slicing the logits avoids a copy of the logits."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32. Labels are shifted here; IGNORE_INDEX positions don't count.

    With `num_items_in_batch` (real tokens over all micro-batches of a step) the loss is
    sum / num_items_in_batch, so gradient accumulation matches one large batch; else a token mean.
    """
    labels = shift_labels(labels)
    # Upcast half precision to fp32 (as transformers does); fp32/fp64 stay as they are.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits, labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `transform(h @ weight.T)` computed `chunk` tokens at a time: the
    (tokens, vocab) logits never exist whole and nothing of their size is saved; backward recomputes each
    chunk's logits from `h`. Over a vocab-sharded `weight` (rows `vocab_start` onwards), `reduce_max` /
    `reduce_sum` combine the per-token statistics of every shard once, after the last chunk: three
    (tokens,) reductions in forward however many chunks, none in backward."""

    @staticmethod
    def forward(ctx, h, weight, target, transform, chunk, vocab_start, reduce_max, reduce_sum):
        # h (tokens, hidden), weight (local vocab, hidden), target (tokens,) global ids, all valid
        local_vocab = weight.shape[0]
        local_target = target - vocab_start
        inside = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.clamp(0, local_vocab - 1)
        stats = []  # per chunk: (local max, sum of exp(logit - local max), target logit or 0)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _chunk_logits(h[rows], weight, transform)
            local_max = z.max(dim=-1).values
            sum_exp = (z - local_max.unsqueeze(-1)).exp_().sum(dim=-1)
            target_logit = z.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1).masked_fill(~inside[rows], 0.0)
            stats.append(torch.stack([local_max, sum_exp, target_logit]))
        local_max, sum_exp, target_logit = torch.cat(stats, dim=1)
        max_logit = reduce_max(local_max.clone())
        sum_exp = reduce_sum(sum_exp * (local_max - max_logit).exp())
        target_logit = reduce_sum(target_logit)
        ctx.save_for_backward(h, weight, local_target, inside, max_logit, sum_exp)
        ctx.transform, ctx.chunk = transform, chunk
        return sum_exp.log() + max_logit - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, local_target, inside, max_logit, sum_exp = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        for start in range(0, h.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            hc = h[rows]
            raw = F.linear(hc, weight)  # (chunk, local vocab) recomputed; `transform` is element-wise
            with torch.enable_grad():
                z = _transformed(raw.requires_grad_(), ctx.transform)
            # d loss / d logits = softmax - onehot(target), times each token's incoming gradient
            grad = (z.detach() - max_logit[rows].unsqueeze(-1)).exp_().div_(sum_exp[rows].unsqueeze(-1))
            n = torch.arange(grad.shape[0], device=grad.device)
            grad[n, local_target[rows]] -= inside[rows].to(grad.dtype)
            grad.mul_(grad_loss[rows].unsqueeze(-1))
            grad_raw = grad.to(raw.dtype) if z is raw else torch.autograd.grad(z, raw, grad)[0]
            if want_h:
                torch.mm(grad_raw, weight, out=grad_h[rows])
            if want_w:  # in place: no (vocab, hidden) temporary per chunk
                grad_w.addmm_(grad_raw.t(), hc)
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, transform) -> torch.Tensor:
    """One chunk's logits as the unfused path computes them: in the weights' dtype, transformed, then fp32."""
    return _transformed(F.linear(h, weight), transform)


def _transformed(raw: torch.Tensor, transform) -> torch.Tensor:
    z = transform(raw)
    return z.to(torch.promote_types(z.dtype, torch.float32))


# One chunk's logits: about 64M floats (256 MiB in fp32). Each chunk adds its (vocab, hidden) weight gradient
# in place, so much smaller chunks cost memory traffic (on CPU, ~2x the step at 8M on a 152k vocabulary).
CHUNK_FLOATS = 1 << 26


def chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about CHUNK_FLOATS floats."""
    return max(1, CHUNK_FLOATS // local_vocab)


def chunked_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, transform,
                               chunk: int | None = None, vocab_start: int = 0, reduce_max=_no_reduce,
                               reduce_sum=_no_reduce) -> torch.Tensor:
    """Per-token loss (tokens,) of the head `weight` on hidden states `h` (tokens, hidden) against `target`
    (tokens,); IGNORE_INDEX positions give 0. See _ChunkedHeadCrossEntropy."""
    ignored = target == IGNORE_INDEX
    chunk = chunk or chunk_tokens(weight.shape[0])
    loss = _ChunkedHeadCrossEntropy.apply(h, weight, target.masked_fill(ignored, 0), transform, chunk, vocab_start,
                                          reduce_max, reduce_sum)
    return loss.masked_fill(ignored, 0.0)


def chunked_causal_lm_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           num_items_in_batch: int | torch.Tensor | None = None, *, transform,
                           chunk: int | None = None) -> torch.Tensor:
    """`causal_lm_loss(transform(h @ weight.T), labels, num_items_in_batch)` without the whole logits."""
    target = shift_labels(labels).reshape(-1).to(h.device)
    per_token = chunked_head_cross_entropy(h.reshape(-1, h.shape[-1]), weight, target, transform=transform,
                                           chunk=chunk)
    denom = num_items_in_batch if num_items_in_batch is not None else (target != IGNORE_INDEX).sum()
    return per_token.sum() / denom
