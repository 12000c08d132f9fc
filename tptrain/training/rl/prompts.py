"""GRPO's prompts: a .jsonl file, a list of records or a datasets.Dataset with a "prompt" (text, or chat messages
rendered with the checkpoint's chat template and its generation prompt, as TRL's); the row's other columns go to the
reward functions.

    data = build_prompts("prompts.jsonl", tokenizer, model_dir=ckpt, max_prompt_length=256)
    data[i]   # {"prompt": the record's prompt, "prompt_ids": [ids], "columns": {other fields}}

Every record is checked and tokenized up front (prompts are short), so a bad row, or one longer than
max_prompt_length (refused, not cut), is named before training.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from tptrain.io import jsonl_records
from tptrain.text import ROLES, load_chat_template


class PromptDataset(Dataset):
    """Prompt rows: item i is {"prompt", "prompt_ids", "columns"}; `conversational`: prompts are message lists."""

    def __init__(self, rows: list[dict[str, Any]], *, name: str, conversational: bool) -> None:
        self.rows, self.name, self.conversational = rows, name, conversational
        self.data_key = None  # not in the token cache: tokenized when built

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]

    @property
    def longest(self) -> int:
        return max(len(r["prompt_ids"]) for r in self.rows)


def build_prompts(source: Any, tokenizer: Any, *, model_dir: str | Path | None, chat_template: Any = None,
                  max_prompt_length: int | None = None) -> PromptDataset:
    if isinstance(source, PromptDataset):
        return source
    name, records = _records(source)
    kinds = {at: _kind(name, at, record) for at, record in records}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"dataset {name} mixes plain-text and conversational prompts; give every record's \"prompt\" "
                         "the same format (a string, or a list of messages)")
    conversational = "conversational" in kinds.values()
    template = _template(name, model_dir, chat_template) if conversational else None
    rows = []
    for at, record in records:
        prompt = record["prompt"]
        text = template.text(prompt, add_generation_prompt=True) if conversational else prompt
        ids = list(tokenizer.encode(text))
        if not ids:
            raise ValueError(f"dataset {name} {at}: the prompt is empty (no tokens); drop the row")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise ValueError(f"dataset {name} {at}: the prompt has {len(ids)} tokens, more than max_prompt_length="
                             f"{max_prompt_length} (--max-prompt-length); prompts are refused, not cut: shorten or "
                             "drop the row, or raise max_prompt_length")
        rows.append({"prompt": prompt, "prompt_ids": ids,
                     "columns": {k: v for k, v in record.items() if k not in ("prompt", "completion")}})
    return PromptDataset(rows, name=name, conversational=conversational)


def _records(source: Any) -> tuple[str, list[tuple[str, dict]]]:
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.suffix != ".jsonl" or not path.is_file():
            raise ValueError(f"GRPO prompts {source}: not a .jsonl file (one {{\"prompt\": ...}} record a line)")
        records, name = [(f"line {n}", r) for n, r in jsonl_records(path)], str(path)
    elif isinstance(source, (list, tuple)):
        records, name = [(f"record {i}", r) for i, r in enumerate(source)], f"(list of {len(source)} records)"
    elif type(source).__module__.split(".")[0] == "datasets":
        records, name = [(f"record {i}", dict(r)) for i, r in enumerate(source)], f"({type(source).__name__})"
    else:
        raise TypeError(f"GRPO prompts: give a .jsonl path, a list of {{\"prompt\": ...}} records or a "
                        f"datasets.Dataset, got {type(source).__name__}")
    if not records:
        raise ValueError(f"dataset {name} is empty: it has no prompts to train on")
    return name, records


def _kind(name: str, at: str, record: Any) -> str:
    if not isinstance(record, dict) or "prompt" not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"dataset {name} {at}: a GRPO record needs a \"prompt\" field (text or chat messages), "
                         f"got {keys}")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return "plain text"
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and m.get("role") in ROLES for m in prompt):
        return "conversational"
    raise ValueError(f"dataset {name} {at}: \"prompt\" must be a string or a non-empty list of messages with a role "
                     f"among {', '.join(ROLES)}, got {type(prompt).__name__}")


def _template(name: str, model_dir: Any, override: Any):
    try:
        return load_chat_template(model_dir, override)
    except ValueError as exc:
        raise ValueError(f"dataset {name} has conversational prompts but no chat template to render them: {exc}") \
            from None
