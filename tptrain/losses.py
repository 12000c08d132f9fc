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
