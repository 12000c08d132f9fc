"""A vision-language model's greedy reply (the end-of-run sample of a vision-language `tptrain train`): no KV cache,
each new token recomputes the whole (short) context with the processor's inputs (images, per-token ones) beside it,
which `generate` does not take. Every rank calls it with the same prompt; under sequence or context parallelism the
context is padded to a length that splits.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tptrain.distributed.state import state_of
from tptrain.parallel.context_parallel import gather_sequence


@torch.no_grad()
def greedy_ids(model: nn.Module, ids: list[int], max_new_tokens: int, *, eos_token_id: int,
               inputs: dict[str, torch.Tensor] | None = None) -> list[int]:
    """The ids of the most likely continuation of `ids` (stopped at eos). inputs: a vision-language model's other inputs for
    `ids` (its processor's, batch of one): each per-token one, (1, len(ids)), continued with its last value (the
    prompt ends in text), the image ones passed as they are; the context is then never cut."""
    max_context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or len(ids) + max_new_tokens
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in (inputs or {}).items()}
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            context = torch.tensor([(ids + new)[-max_context:] if not inputs else ids + new], device=device)
            logits = _last_logits(model, context, _continued(inputs, len(ids), len(new)))  # (vocab,)
            token = int(logits.float().argmax())
            if token == eos_token_id:
                break
            new.append(token)
    finally:
        model.train(was_training)
    return new


def _continued(inputs: dict[str, torch.Tensor], length: int, more: int) -> dict[str, torch.Tensor]:
    """`inputs` for `length` + `more` tokens: the per-token ones, (1, length), continued with their last value."""
    return {k: torch.cat([v, v[:, -1:].expand(1, more)], dim=1) if v.dim() == 2 and v.shape == (1, length) else v
            for k, v in inputs.items()}


def _last_logits(model: nn.Module, context: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits after the last token of `context` (1, seq). Under sequence or context parallelism the context is
    right-padded to a length that splits as the Trainer's batches do (causal: no real token sees a pad; per-token
    `inputs` padded with zeros); under context parallelism every rank's tokens are then gathered."""
    state = state_of(model)
    cp = state.cp
    sp = state.dims.tp if state.sequence_parallel else 1
    cp_size = state.dims.cp
    length = context.shape[1]
    multiple = math.lcm(sp * cp_size, 2 * cp_size if cp is not None else 1)
    inputs = {k: F.pad(v, (0, -length % multiple)) if v.dim() == 2 and v.shape == context.shape else v
              for k, v in inputs.items()}
    logits = model(F.pad(context, (0, -length % multiple)), **inputs).logits  # (1, padded [/ cp], vocab)
    return (gather_sequence(logits, cp) if cp is not None else logits)[0, length - 1]
