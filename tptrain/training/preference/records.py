"""Preference records in TRL's formats, checked and encoded into a chosen and a rejected sample each.

    name, located = preference_source("prefs.jsonl")                   # None: not preference data
    chat, where = check_records(name, located, chat_template=load)      # every bad record named, before any worker
    chosen, rejected = PreferenceEncoder(tokenizer, chat_template=template, name=name)(record, 0)

The formats (TRL's): {"prompt", "chosen", "rejected"} as strings (plain text) or as message lists (conversational:
rendered with the checkpoint's chat template), or {"chosen", "rejected"} only, the prompt implicit (their longest
common prefix, as TRL's `extract_prompt`). A plain completion ends with eos (added when it does not), a conversational
one ends as its template writes it. The prompt and each completion are tokenized together, as TRL 1.16's DPOTrainer
does: the completion starts where the tokenized prompt and the tokenized prompt + completion first differ (the same
point for chosen and rejected), and its tokens are the sample's targets (labels); the prompt's are not.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tptrain.io import jsonl_records
from tptrain.losses import IGNORE_INDEX
from tptrain.text import ROLES, ChatTemplate
from tptrain.training.sft_data import Sample

PREFERENCE_KEYS = ("chosen", "rejected")


class _JsonlRecords:
    """("line N", record) of each record of a .jsonl file, read again on each iteration (no copy kept)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((f"line {n}", record) for n, record in jsonl_records(self.path))


def preference_source(source: Any) -> tuple[str, Iterable[tuple[str, Any]]] | None:
    """(name, its records as ("line N" or "record i", record), re-iterable) when `source` holds preference records
    (a .jsonl file whose first record has "chosen" or "rejected", a list of dicts or a `datasets.Dataset` with such
    a field); None otherwise."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.suffix != ".jsonl" or not path.is_file():
            return None
        located: Iterable[tuple[str, Any]] = _JsonlRecords(path)
        name = str(path)
    elif isinstance(source, (list, tuple)) and source and all(isinstance(r, dict) for r in source):
        located, name = [(f"record {i}", r) for i, r in enumerate(source)], f"(list of {len(source)} records)"
    elif type(source).__module__.split(".")[0] == "datasets":
        if not set(PREFERENCE_KEYS) & set(getattr(source, "column_names", None) or ()):
            return None
        located, name = [(f"record {i}", dict(r)) for i, r in enumerate(source)], f"({type(source).__name__})"
    else:
        return None
    first = next(iter(located), None)
    if first is None or not (isinstance(first[1], dict) and set(PREFERENCE_KEYS) & set(first[1])):
        return None
    return name, located


def is_conversational(record: dict[str, Any]) -> bool:
    """Whether a preference record is conversational (its fields message lists), as TRL's is_conversational."""
    value = next((record[k] for k in ("prompt", "chosen", "rejected") if k in record), None)
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_records(name: str, located: Iterable[tuple[str, Any]], *,
                  chat_template: Callable[[], ChatTemplate | None]) -> tuple[bool, list[str]]:
    """(whether the records are conversational, where each one is), after checking every record: ValueError naming
    the dataset, the record's line and the field, for the first that cannot be a preference pair (chosen or rejected
    missing, a field of the wrong type, chosen identical to rejected, plain and conversational records mixed, a
    conversational record without a chat template: `chat_template()` loads it, or raises why there is none). No
    record is kept, so a file is read once, line by line."""
    first_kind, first_at, where = None, None, []
    for at, record in located:
        where.append(at)
        kind = check_record(name, at, record)
        if first_kind is None:
            first_kind, first_at = kind, at
            if kind == "conversational":
                try:
                    chat_template()
                except ValueError as exc:
                    raise ValueError(f"dataset {name} {at} is conversational (message lists) but cannot be rendered: "
                                     f"{exc}") from None
        elif kind != first_kind:
            raise ValueError(f"dataset {name} mixes plain-text and conversational records: {first_at} is {first_kind}, "
                             f"{at} is {kind}; give every record the same format (strings, or message lists)")
    if not where:
        raise ValueError(f"dataset {name} is empty: it has no preference records to train on")
    return first_kind == "conversational", where


def check_record(name: str, at: str, record: Any) -> str:
    """'plain text' or 'conversational'; ValueError naming the record (`at`) and its bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"dataset {name} {at}: a preference record is an object with \"chosen\" and \"rejected\", "
                         f"got {type(record).__name__}")
    for key in PREFERENCE_KEYS:
        if key not in record:
            raise ValueError(f"dataset {name} {at}: the record has no \"{key}\" field (keys {sorted(record)}); "
                             "each preference record needs \"chosen\" and \"rejected\" (and optionally \"prompt\")")
    kind = "conversational" if is_conversational(record) else "plain text"
    for key in ("prompt", *PREFERENCE_KEYS):
        if key in record:
            _check_field(name, at, key, record[key], conversational=kind == "conversational")
    if record["chosen"] == record["rejected"]:
        raise ValueError(f"dataset {name} {at}: \"chosen\" is identical to \"rejected\"; a preference pair needs two "
                         "different completions (drop the record)")
    return kind


def _check_field(name: str, at: str, key: str, value: Any, *, conversational: bool) -> None:
    if not conversational:
        if not isinstance(value, str):
            raise ValueError(f"dataset {name} {at}: \"{key}\" is a {type(value).__name__}; in a plain-text record "
                             "prompt, chosen and rejected are all strings")
        return
    if not isinstance(value, list) or not value:
        raise ValueError(f"dataset {name} {at}: \"{key}\" must be a non-empty list of {{\"role\", \"content\"}} "
                         f"messages in a conversational record, got {type(value).__name__}")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"dataset {name} {at}: {key}[{j}] is not a message with a role among {', '.join(ROLES)}")


def extract_prompt(record: dict[str, Any]) -> dict[str, Any]:
    """An implicit-prompt record's prompt: the longest common prefix of chosen and rejected (characters or
    messages; a space before the point they differ stays with the completions), exactly as TRL's extract_prompt."""
    if "prompt" in record:
        return record
    chosen, rejected = record["chosen"], record["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {**record, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PreferenceEncoder:
    """A preference record -> (chosen sample, rejected sample): prompt + completion ids, the completion's tokens
    as labels. chat_template: needed only by conversational records. The token cache calls it as it calls
    sft_data.SampleEncoder (`format`, then the record and its index)."""

    def __init__(self, tokenizer: Any, *, chat_template: ChatTemplate | None = None, name: str = "(records)") -> None:
        self.tokenizer, self.template, self.name = tokenizer, chat_template, name

    def format(self, record: Any, index: int) -> str:
        check_record(self.name, f"record {index}", record)
        return "preference"

    def __call__(self, record: dict[str, Any], index: int) -> tuple[Sample, Sample]:
        record = extract_prompt(record)
        if is_conversational(record):
            if self.template is None:
                raise ValueError(f"dataset {self.name} record {index} is conversational but no chat template was "
                                 "given; pass the checkpoint's (load_chat_template) or chat_template=FILE")
            prompt = self._encode(self.template.text(record["prompt"], add_generation_prompt=True))
            full = [self._encode(self.template.text(record["prompt"] + record[k])) for k in PREFERENCE_KEYS]
        else:
            eos = self.tokenizer.eos_token_id
            prompt = self._encode(record["prompt"])
            full = [self._encode(record["prompt"] + record[k]) for k in PREFERENCE_KEYS]
            full = [ids if ids and ids[-1] == eos else ids + [eos] for ids in full]
        start = min(_common_prefix(prompt, ids) for ids in full)
        return tuple(Sample(ids, [IGNORE_INDEX] * start + ids[start:]) for ids in full)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))
