"""When a sequence is finished: an end-of-sequence token, or one of the stop strings (transformers' `stop_strings`),
each decided from the tokens alone, so every rank of a TP group decides the same."""
from __future__ import annotations

from typing import Any, Sequence

import torch


class StopCriteria:
    """`eos_token_ids` and `stop_strings` (decoded with `tokenizer`: anything with `decode(list of ids) -> str`, a
    transformers tokenizer or tptrain's) over the sequences generated so far."""

    def __init__(self, eos_token_ids: Sequence[int], stop_strings: Sequence[str], tokenizer: Any,
                 device: torch.device) -> None:
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
        self.stop_strings, self.tokenizer = tuple(stop_strings), tokenizer
        # enough tokens to spell the longest stop string and one token more (a token spells at least one character)
        self.window = max(map(len, self.stop_strings), default=0) + 2

    def finished(self, new: torch.Tensor, rows: list[list[int]] | None) -> torch.Tensor:
        """(batch,) bool: whether `new` (batch,) ends each row. `rows` (with stop strings): each row's real tokens so
        far (the prompt's and the new ones, `new` last)."""
        done = torch.isin(new, self.eos) if self.eos.numel() else torch.zeros_like(new, dtype=torch.bool)
        if self.stop_strings:
            hits = [self._stop_string_ends(row) for row in rows]
            done |= torch.tensor(hits, dtype=torch.bool, device=new.device)
        return done

    def _stop_string_ends(self, row: list[int]) -> bool:
        """transformers' StopStringCriteria: a stop string appears in the text and overlaps the last token's (not
        one that was already complete before it)."""
        tail = row[-self.window:]
        text, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
        return any(s in text[max(0, len(before) - len(s) + 1):] for s in self.stop_strings)
