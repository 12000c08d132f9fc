"""Text in, text out: prompts tokenized and left-padded, generated, the continuations decoded (`tptrain generate`,
the end-of-run sample of `tptrain train`).

    texts = complete(model, tokenizer, ["To be, or not to be", "Once"], max_new_tokens=40)   # every rank
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from tptrain.generation.loop import generate
from tptrain.generation.settings import ARGUMENTS, resolve_settings


def complete(model: Any, tokenizer: Any, prompts: Sequence[str], **settings: Any) -> list[str]:
    """Each prompt's continuation (the prompt not included, cut before its end-of-sequence token). `tokenizer`:
    tptrain's (`tptrain.text.load_tokenizer`) or anything with encode / decode / eos_token_id; an empty prompt starts
    a new document (its eos token). `settings`: `generate`'s keyword arguments. Collective: every rank calls it."""
    encoded = [tokenizer.encode(p) or [tokenizer.eos_token_id] for p in prompts]
    longest = max(map(len, encoded))
    given = {name: settings.get(name) for name in ARGUMENTS}
    resolved = resolve_settings(model, longest, given, tokenizer=tokenizer)
    if not resolved.eos_token_ids:  # neither the arguments nor the checkpoint name one: the tokenizer's
        settings["eos_token_id"] = given["eos_token_id"] = tokenizer.eos_token_id
        resolved = resolve_settings(model, longest, given, tokenizer=tokenizer)
    pad = resolved.pad_token_id
    ids = torch.tensor([[pad] * (longest - len(e)) + e for e in encoded])  # left-padded
    mask = torch.tensor([[0] * (longest - len(e)) + [1] * len(e) for e in encoded])
    out = generate(model, ids, mask, tokenizer=tokenizer, **{**settings, "pad_token_id": pad})
    ends = {*resolved.eos_token_ids, pad}  # after a finished sequence: padding
    texts = []
    for row in out[:, longest:].tolist():
        cut = next((i for i, t in enumerate(row) if t in ends), len(row))
        texts.append(tokenizer.decode(row[:cut]))
    return texts
