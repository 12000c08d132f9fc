"""Causal-LM loss helpers shared by the models and the tensor-parallel loss, and what a causal LM's forward returns
(CausalLMOutput, the same for tptrain's decoder and the transformers backend). A leaf: imports torch only.

    loss = causal_lm_loss(logits, labels)                  # mean over real target tokens
    loss = causal_lm_loss(logits, labels, num_items)       # sum / num_items (gradient accumulation)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclasses.dataclass
class CausalLMOutput:
    loss: torch.Tensor | None  # scalar (each row's summed token loss, (batch,), with per_sequence), None without labels
    logits: torch.Tensor  # (batch, seq, vocab) -- or the local vocab shard under TP
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss (config.output_router_logits), unweighted
    past_key_values: Any = None  # with use_cache: the KV cache these tokens were appended to (the model's own kind)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position: position t predicts token t + 1; the last predicts nothing (IGNORE_INDEX).
    Padding the labels instead of slicing the logits avoids a copy of the logits."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: int | torch.Tensor | None = None, *, shifted: bool = False,
                   per_sequence: bool = False) -> torch.Tensor:
    """Next-token cross-entropy in fp32. Labels are shifted here; IGNORE_INDEX positions don't count.

    With `num_items_in_batch` (real tokens over all micro-batches of a step) the loss is
    sum / num_items_in_batch, so gradient accumulation matches one large batch; else a token mean.
    `shifted`: `labels` are already each position's target (context parallelism shifts before it splits the
    sequence, so a shard's last token keeps its target); every loss function of this contract takes it.
    `per_sequence`: (batch,) each row's summed token loss instead (its targets' negative log-likelihood, what
    preference objectives read; `num_items_in_batch` unused); every loss function of this contract takes it too.
    """
    labels = labels if shifted else shift_labels(labels)
    # Upcast half precision to fp32 (as transformers does); fp32/fp64 stay as they are.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
    if per_sequence:
        return F.cross_entropy(logits, labels.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX,
                               reduction="none").view(labels.shape).sum(dim=-1)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits, labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def loss_denominator(target: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> int | torch.Tensor:
    """What the summed loss is divided by: `num_items_in_batch` (the step's real tokens over all micro-batches,
    so gradient accumulation matches one large batch) when given, else this batch's real target tokens."""
    return num_items_in_batch if num_items_in_batch is not None else (target != IGNORE_INDEX).sum()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger Kernel's fused linear cross-entropy: sum over tokens of the cross-entropy of `transform(h @ weight.T)`,
    divided by `denom`, computed at most `chunk` tokens at a time (`chunk_bounds`) together with its gradients
    w.r.t. `h` and `weight`. Each chunk's logits exist once, in one buffer the chunks share: they become their own
    gradient in place and feed two matmuls, so no logits are recomputed or kept; backward only scales the two
    gradients by the incoming one.

    Over a vocab-sharded `weight` (rows from `vocab_start`), each chunk combines its statistics over the shards
    before its softmax: `reduce_max` the max logit (chunk,), then `reduce_sum` [target logit, sum-exp]
    (2 * chunk,), as Megatron's fused vocab-parallel cross-entropy batches them. `grad_h` is then this shard's
    part of the input gradient: summing it over the shards is the caller's boundary's backward.

    Kept from forward to backward: grad_h (tokens, hidden) and grad_w (local vocab, hidden), each only if wanted
    (a frozen head computes no weight gradient). They are results, not activations, so they are held on `ctx`
    rather than saved: saved-tensor hooks (SP's shard keeping, offloading, SavedTensorMeter) are for what backward
    computes from, and the unfused path allocates the same two tensors at the start of its backward. Backward
    hands them over once; a second backward through a retained graph is refused."""

    @staticmethod
    def forward(ctx, h, weight, target, denom, grad_enabled, transform, chunk, vocab_start, reduce_max, reduce_sum):
        # h (tokens, hidden), weight (local vocab, hidden), target (tokens,) global ids or IGNORE_INDEX
        want_h, want_w = (grad_enabled and needs for needs in ctx.needs_input_grad[:2])
        dtype = _matmul_dtype(h, weight)
        w = weight.to(dtype)  # autocast's copy of the head, made once (no copy without autocast)
        grad_h = torch.empty_like(h) if want_h else None
        # Summed over chunks in the matmuls' dtype, then cast to the weight's, as the unfused backward makes it
        # (each chunk's matmul accumulates in fp32 inside): an fp32 sum for a half weight would double the buffer.
        # The first chunk's matmul writes it, the others add to it: no pass zeroing it first (no tokens: zeros).
        grad_w = torch.empty(weight.shape, dtype=dtype, device=weight.device) if want_w else None
        ignored = target == IGNORE_INDEX
        local_target = target.masked_fill(ignored, 0) - vocab_start
        inside = (local_target >= 0) & (local_target < weight.shape[0])
        local_target = local_target.clamp(0, weight.shape[0] - 1)
        per_token = torch.empty(h.shape[0], dtype=torch.promote_types(dtype, torch.float32), device=h.device)
        # d loss / d (per-token loss): 1 / denom for a counted token, 0 for an ignored one (0, not 0 / 0, when
        # denom is 0: the loss is then nan, as the unfused path's, but no gradient is)
        scale = torch.where(ignored, 0.0, 1.0 / torch.as_tensor(denom, dtype=per_token.dtype, device=h.device))
        bounds = chunk_bounds(h.shape[0], chunk)
        # One buffer holds every chunk's logits in turn: a fresh one per chunk would be faulted in anew each time.
        logits = torch.empty(bounds[0][1] if bounds else 0, weight.shape[0], dtype=dtype, device=h.device)
        for start, stop in bounds:
            rows = slice(start, stop)
            per_token[rows] = _fused_chunk(
                h[rows].to(dtype), w, local_target[rows], inside[rows], scale[rows], transform, reduce_max,
                reduce_sum, raw=logits[:stop - start], grad_h=grad_h[rows] if want_h else None, grad_w=grad_w,
                first=start == 0)
        if grad_w is not None and not bounds:
            grad_w.zero_()
        ctx.grads = grad_h, None if grad_w is None else grad_w.to(weight.dtype)
        return per_token.masked_fill_(ignored, 0.0).sum() / denom

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("backward through the fused linear cross-entropy ran twice: its gradients were made in "
                               "forward and handed over once; run the forward again (retain_graph cannot keep them)")
        (grad_h, grad_w), ctx.grads = ctx.grads, None
        return _scaled(grad_h, grad_loss), _scaled(grad_w, grad_loss), None, None, None, None, None, None, None, None


def _fused_chunk(h, weight, local_target, inside, scale, transform, reduce_max, reduce_sum, *, raw, grad_h, grad_w,
                 first):
    """One chunk's per-token losses (chunk,); its input gradient written into `grad_h` (chunk, hidden) and its
    weight gradient written (`first`) or added to `grad_w` (local vocab, hidden), each where given. `h` and `weight`
    are in the matmuls' dtype; `raw` (chunk, local vocab) is the buffer its logits are computed in; `local_target`
    (chunk,) indexes this shard's rows, valid where `inside`."""
    want = grad_h is not None or grad_w is not None
    torch.mm(h, weight.t(), out=raw)  # F.linear(h, weight), in the matmuls' dtype, as the unfused head computes it
    # The transform's derivative (soft-capping, a divisor) by autograd, as unfused. What it saves lives for this
    # chunk only: the identity hooks, innermost, keep outer ones (SP's shard keeping, meters) from seeing it.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        raw = raw.detach().requires_grad_(want)
        z = _transformed(raw, transform)
    logits = z.detach()  # fp32 (or fp64)
    max_logit = reduce_max(logits.amax(dim=-1))  # amax: max(dim) would find the indices too (3x the time)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    # In place: the transforms keep no logits-sized output for their derivative (autograd would refuse if one did)
    exp = logits.sub_(max_logit.unsqueeze(-1)).exp_()
    target_logit, sum_exp = reduce_sum(torch.cat([target_logit, exp.sum(dim=-1)])).chunk(2)
    loss = sum_exp.log() + max_logit - target_logit
    if not want:
        return loss
    # (softmax - onehot(target)) times each token's d loss / d its loss, in one pass over the logits
    grad = exp.mul_((scale / sum_exp).unsqueeze(-1))
    grad[torch.arange(grad.shape[0], device=grad.device), local_target] -= scale * inside.to(grad.dtype)
    grad_raw = grad.to(raw.dtype) if z is raw else torch.autograd.grad(z, raw, grad)[0]
    if grad_h is not None:  # copied: h's dtype need not be the matmul's under autocast
        grad_h.copy_(torch.mm(grad_raw, weight))
    if grad_w is not None and first:
        torch.mm(grad_raw.t(), h, out=grad_w)
    elif grad_w is not None:  # in place: no (local vocab, hidden) temporary per chunk
        grad_w.addmm_(grad_raw.t(), h)
    return loss


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(h, weight)` computes in: autocast's, which leaves fp64 alone, else the weight's."""
    device = h.device.type
    if torch.is_autocast_enabled(device) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _scaled(grad: torch.Tensor | None, grad_loss: torch.Tensor) -> torch.Tensor | None:
    """`grad` times the loss's incoming gradient, in place. A plain `loss.backward()` gives exactly 1, which the
    CPU skips; on an accelerator reading the value would stall the host, so the multiply (one pass over `grad`)
    is always done there."""
    if grad is None or (grad_loss.device.type == "cpu" and grad_loss.item() == 1.0):
        return grad
    return grad.mul_(grad_loss)


def _transformed(raw: torch.Tensor, transform) -> torch.Tensor:
    """One chunk's logits as the unfused path computes them: in the matmuls' dtype, transformed, then fp32."""
    z = transform(raw)
    return z.to(torch.promote_types(z.dtype, torch.float32))


# One chunk's logits in fp32: about 64M floats (256 MiB), their gradient computed in place in the same buffer.
# Each chunk adds its (local vocab, hidden) weight gradient in place (addmm_ reads and writes all of it), so much
# smaller chunks cost memory traffic (on CPU, ~2x the step at 8M on a 152k vocabulary). The hidden size does not
# enter: that per-chunk traffic and the chunk's three matmuls both scale with local vocab x hidden, so their ratio
# depends on the tokens per chunk alone; the budget bounds the one cost that grows with the vocabulary.
CHUNK_FLOATS = 1 << 26


def chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about CHUNK_FLOATS floats."""
    return max(1, CHUNK_FLOATS // local_vocab)


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk: as few chunks as at most `chunk` tokens each allows, all of the same size but
    the last (the rest): 512 tokens at 441 a chunk are 256 + 256, not 441 + 71, whose thin matmuls run ~30% slower
    per FLOP on CPU."""
    count = -(-tokens // chunk)
    size = -(-tokens // count) if count else 0
    return [(start, min(start + size, tokens)) for start in range(0, tokens, size or 1)]


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               denom: int | torch.Tensor, *, transform, chunk: int | None = None,
                               vocab_start: int = 0, reduce_max=_same, reduce_sum=_same) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of the head `weight` on hidden states `h` (tokens, hidden) against
    `target` (tokens,), divided by `denom`; IGNORE_INDEX positions count 0. See _FusedLinearCrossEntropy."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    return _FusedLinearCrossEntropy.apply(h, weight, target, denom, torch.is_grad_enabled(), transform, chunk,
                                          vocab_start, reduce_max, reduce_sum)


def chunked_causal_lm_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           num_items_in_batch: int | torch.Tensor | None = None, *, transform,
                           chunk: int | None = None, shifted: bool = False, per_sequence: bool = False) -> torch.Tensor:
    """`causal_lm_loss(transform(h @ weight.T), labels, num_items_in_batch, shifted=, per_sequence=)` without the
    whole logits."""
    labels = labels if shifted else shift_labels(labels)
    target = labels.reshape(-1).to(h.device)
    if per_sequence:
        return chunked_token_losses(h.reshape(-1, h.shape[-1]), weight, target, transform=transform,
                                    chunk=chunk).view(labels.shape).sum(dim=-1)
    return fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, target,
                                      loss_denominator(target, num_items_in_batch), transform=transform, chunk=chunk)


class _ChunkedTokenLosses(torch.autograd.Function):
    """Each token's cross-entropy of `transform(h @ weight.T)` against `target` (tokens,), 0 where ignored, computed
    at most `chunk` tokens at a time: the head of `_FusedLinearCrossEntropy`, for a loss that is not a weighted sum
    of token losses (a preference objective of per-sequence sums), whose weights forward cannot know. So the
    gradients are not made in forward: each chunk's logits are computed again in backward from the saved `h`, with
    the log-sum-exp forward found (tokens,), and turned into their gradient in place. One more head matmul than the
    fused loss, and still no whole logits. Over a vocab-sharded `weight` (rows from `vocab_start`) forward combines
    each chunk's statistics over the shards (`reduce_max`, then `reduce_sum` of [target logit, sum-exp]); backward
    needs no collective (each shard's softmax is its exp(z - lse)), and `grad_h` is this shard's part of the input
    gradient, summed over the shards by the caller's boundary."""

    @staticmethod
    def forward(ctx, h, weight, target, transform, chunk, vocab_start, reduce_max, reduce_sum):
        dtype = _matmul_dtype(h, weight)
        w = weight.to(dtype)
        ignored = target == IGNORE_INDEX
        local_target = target.masked_fill(ignored, 0) - vocab_start
        inside = (local_target >= 0) & (local_target < weight.shape[0])
        local_target = local_target.clamp(0, weight.shape[0] - 1)
        per_token = torch.zeros(h.shape[0], dtype=torch.promote_types(dtype, torch.float32), device=h.device)
        lse = torch.zeros_like(per_token)
        for start, stop in chunk_bounds(h.shape[0], chunk):
            rows = slice(start, stop)
            z = _transformed(torch.mm(h[rows].to(dtype), w.t()), transform)  # (chunk, local vocab) fp32 or fp64
            max_logit = reduce_max(z.amax(dim=-1))
            target_logit = z.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1).masked_fill(~inside[rows], 0.0)
            sum_exp = z.sub_(max_logit.unsqueeze(-1)).exp_().sum(dim=-1)
            target_logit, sum_exp = reduce_sum(torch.cat([target_logit, sum_exp])).chunk(2)
            lse[rows] = sum_exp.log() + max_logit
            per_token[rows] = lse[rows] - target_logit
        ctx.save_for_backward(h, weight, local_target, inside, ignored, lse)
        ctx.transform, ctx.chunk, ctx.dtype = transform, chunk, dtype  # backward recomputes in forward's dtype
        return per_token.masked_fill_(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad):
        h, weight, local_target, inside, ignored, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        dtype = ctx.dtype
        w = weight.to(dtype)
        scale = grad.to(lse.dtype).masked_fill(ignored, 0.0)  # d loss / d each token's loss
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_w else None
        for start, stop in chunk_bounds(h.shape[0], ctx.chunk):
            rows = slice(start, stop)
            x = h[rows].to(dtype)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                raw = torch.mm(x, w.t()).requires_grad_(True)
                z = _transformed(raw, ctx.transform)
            # (softmax - onehot(target)) times each token's d loss / d its loss
            g = z.detach().sub(lse[rows].unsqueeze(-1)).exp_().mul_(scale[rows].unsqueeze(-1))
            g[torch.arange(g.shape[0], device=g.device), local_target[rows]] -= scale[rows] * inside[rows].to(g.dtype)
            g = g.to(raw.dtype) if z is raw else torch.autograd.grad(z, raw, g)[0]
            if grad_h is not None:
                grad_h[rows] = torch.mm(g, w).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t(), x)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None)


def chunked_token_losses(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, transform,
                         chunk: int | None = None, vocab_start: int = 0, reduce_max=_same,
                         reduce_sum=_same) -> torch.Tensor:
    """(tokens,) each token's cross-entropy of the head `weight` on hidden states `h` (tokens, hidden) against
    `target` (tokens,), 0 where IGNORE_INDEX; differentiable, never holding the whole logits (_ChunkedTokenLosses)."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    return _ChunkedTokenLosses.apply(h, weight, target, transform, chunk, vocab_start, reduce_max, reduce_sum)
