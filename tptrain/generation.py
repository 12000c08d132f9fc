"""Greedy continuation of a prompt: enough to see what a freshly trained model learned.

Works unchanged on a tensor-parallel model: every rank calls it with the same prompt, the model
all-gathers the full logits when no labels are given, so every rank picks the same token (under sequence or context
parallelism the context is padded to a length that splits). No KV
cache: each new token recomputes the whole (short) context.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tptrain.distributed.state import state_of
from tptrain.parallel.context_parallel import gather_sequence
from tptrain.text import Tokenizer


@torch.no_grad()
def greedy_generate(model: nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The `max_new_tokens` most likely next tokens after `prompt`, decoded (prompt not included);
    stops early at eos. Collective under TP: call it on every rank."""
    ids = tokenizer.encode(prompt) or [tokenizer.eos_token_id]  # an empty prompt starts a new document
    max_context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or len(ids) + max_new_tokens
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            context = torch.tensor([(ids + new)[-max_context:]], device=device)  # (1, seq)
            logits = _last_logits(model, context)  # (vocab,)
            token = int(logits.float().argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    finally:
        model.train(was_training)
    return tokenizer.decode(new)


def _last_logits(model: nn.Module, context: torch.Tensor) -> torch.Tensor:
    """The logits after the last token of `context` (1, seq). Under sequence or context parallelism the context is
    right-padded to a length that splits as the Trainer's batches do (causal: no real token sees a pad); under context
    parallelism every rank's tokens are then gathered."""
    state = state_of(model)
    cp = state.cp
    sp = state.dims.tp if state.sequence_parallel else 1
    cp_size = state.dims.cp
    length = context.shape[1]
    multiple = math.lcm(sp * cp_size, 2 * cp_size if cp is not None else 1)
    logits = model(F.pad(context, (0, -length % multiple))).logits  # (1, padded [/ cp], vocab)
    return (gather_sequence(logits, cp) if cp is not None else logits)[0, length - 1]
