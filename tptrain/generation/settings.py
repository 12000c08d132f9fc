"""What one `generate` call does, resolved as transformers resolves it, and its inputs checked.

An argument not given (None) takes the checkpoint's generation_config.json value (`model.generation_config`), else
the model config's (eos_token_id, pad_token_id), else transformers' global default (do_sample False, temperature 1.0,
top_k 50, top_p 1.0, max_length 20). Every problem is a ValueError naming the argument and the fix, raised before
anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# transformers' GenerationConfig._get_default_generation_params (the ones generate reads here)
DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "max_length": 20}
ARGUMENTS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
             "pad_token_id", "stop_strings")


@dataclass(frozen=True)
class GenerationSettings:
    """One call's settings, resolved: top_k 0 and top_p 1.0 switch those off; eos_token_ids may be empty (then only
    max_new_tokens and stop_strings end a sequence)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    stop_strings: tuple[str, ...]


def resolve_settings(model: Any, prompt_length: int, given: dict[str, Any], *, tokenizer: Any) -> GenerationSettings:
    """`given`: generate's arguments of ARGUMENTS (None: not given)."""
    saved = dict(getattr(model, "generation_config", None) or {})

    def pick(name: str) -> Any:
        for source in (given, saved):
            if source.get(name) is not None:
                return source[name]
        return getattr(model.config, name, None) if name in ("eos_token_id", "pad_token_id") else DEFAULTS.get(name)

    eos = pick("eos_token_id")
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    pad = pick("pad_token_id")
    pad = eos[0] if pad is None and eos else pad
    stop = pick("stop_strings")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    settings = GenerationSettings(
        max_new_tokens=_max_new_tokens(given, saved, prompt_length), do_sample=bool(pick("do_sample")),
        temperature=float(pick("temperature")), top_k=int(pick("top_k") or 0), top_p=float(pick("top_p")),
        min_p=pick("min_p"), eos_token_ids=eos, pad_token_id=pad, stop_strings=stop)
    _check(settings, tokenizer)
    _check_positions(model, prompt_length, settings.max_new_tokens)
    return settings


def _max_new_tokens(given: dict, saved: dict, prompt_length: int) -> int:
    """max_new_tokens, else max_length (prompt included) - the prompt, given first, then the checkpoint's."""
    for source in (given, saved):
        if source.get("max_new_tokens") is not None:
            return source["max_new_tokens"]
        if source.get("max_length") is not None:
            return source["max_length"] - prompt_length
    return DEFAULTS["max_length"] - prompt_length


def _check(s: GenerationSettings, tokenizer: Any) -> None:
    if not isinstance(s.max_new_tokens, int) or s.max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive integer, got {s.max_new_tokens} (with "
                         f"max_length: the prompt is at least as long); pass max_new_tokens=N")
    if s.stop_strings and tokenizer is None:
        raise ValueError(f"generate: stop_strings={list(s.stop_strings)} need the model's tokenizer to spell the "
                         f"tokens: pass tokenizer= (as transformers' generate asks)")
    if s.eos_token_ids and s.pad_token_id is None:
        raise ValueError("generate: a finished sequence is padded with pad_token_id, which neither the arguments nor "
                         "the model's configs give: pass pad_token_id=")
    if s.do_sample:
        if not s.temperature > 0:
            raise ValueError(f"generate: temperature must be > 0 when sampling, got {s.temperature}; for the most "
                             f"likely tokens use do_sample=False")
        if s.top_k < 0 or not 0 < s.top_p <= 1 or (s.min_p is not None and not 0 <= s.min_p <= 1):
            raise ValueError(f"generate: top_k must be >= 0 (0: off), top_p in (0, 1] (1: off) and min_p in [0, 1]; "
                             f"got top_k={s.top_k}, top_p={s.top_p}, min_p={s.min_p}")


def _check_positions(model: Any, prompt_length: int, max_new_tokens: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(f"generate: prompts of {prompt_length} tokens (padding included) and max_new_tokens="
                         f"{max_new_tokens} reach {prompt_length + max_new_tokens} positions, past "
                         f"{type(model).__name__}'s max_position_embeddings={limit}; lower max_new_tokens to "
                         f"{limit - prompt_length} or shorten the prompts" if prompt_length < limit else
                         f"generate: prompts of {prompt_length} tokens (padding included) already fill "
                         f"{type(model).__name__}'s max_position_embeddings={limit}; shorten the prompts")


def check_input_ids(input_ids: Any) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise TypeError(f"generate: input_ids must be a (batch, seq) tensor of token ids, got "
                        f"{_described(input_ids)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: no prompt, or an empty one (input_ids of shape {tuple(input_ids.shape)}); give "
                         f"each prompt at least one token (e.g. the tokenizer's bos or eos)")


def prompt_mask(input_ids: torch.Tensor, attention_mask: Any, pad_token_id: int | None) -> torch.Tensor | None:
    """The prompts' mask, None when no row is padded. transformers expects decoder-only prompts of different lengths
    left-padded (its tokenizers' padding_side="left") with the tokenizer's attention_mask."""
    if attention_mask is None:
        if input_ids.shape[0] > 1 and pad_token_id is not None and bool((input_ids == pad_token_id).any()):
            raise ValueError(f"generate: input_ids hold the pad token {pad_token_id} but no attention_mask was given; "
                             f"pass the tokenizer's attention_mask (prompts left-padded, padding_side='left', as "
                             f"transformers expects for decoder-only models)")
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"generate: attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{_described(attention_mask)}")
    mask = attention_mask.to(torch.long)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("generate: attention_mask must hold 1 (a token) and 0 (padding) only")
    late = (mask[:, 1:] < mask[:, :-1]).any(-1) | (mask[:, -1] == 0)  # padding after a token, or no token
    if bool(late.any()):
        row = int(late.nonzero()[0])
        raise ValueError(f"generate: prompt {row} is not left-padded (its attention_mask {mask[row].tolist()} ends in "
                         f"padding); transformers expects decoder-only prompts padded on the left, each with at least "
                         f"one token: tokenize with padding_side='left'")
    return None if bool(mask.all()) else mask


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
