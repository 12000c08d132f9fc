"""Preference pairs as training rows: the dataset, its truncation (TRL's), the token cache, and the micro-batch collator.

    data = build_preference_data("prefs.jsonl", tokenizer, model_dir=ckpt, max_length=1024)   # a .jsonl: the cache
    batch = collate_pairs([data[i] for i in indices], pad_id=tokenizer.eos_token_id, groups=1)
    out = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], per_sequence=True)

Each pair is two samples side by side in a SampleTable (sft_data's: ids, target flags, offsets), chosen then rejected,
so a .jsonl file is tokenized once per node by the token cache and mapped by every rank, as SFT data is. Rows are cut
when read: the prompt to its last `max_prompt_length` tokens (older TRL's rule), then the sequence to `max_length`
(TRL's `truncation_mode`: "keep_start", or the deprecated "keep_end"). A prompt leaving no completion token within
max_length is refused, naming its record (TRL drops it silently).

The collator puts every chosen row of a micro-batch before its rejected rows, as TRL concatenates them, so the model
runs both in one forward and every collective is issued once; `groups` > 1 (pipeline microbatches) repeats that
within each group of pairs, so a microbatch always holds whole pairs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tptrain.losses import IGNORE_INDEX
from tptrain.text import load_chat_template
from tptrain.training.preference.names import TRUNCATION_MODES
from tptrain.training.preference.records import PreferenceEncoder, check_records, preference_source
from tptrain.training.sft_data import SampleTable
from tptrain.training.token_cache import open_or_build



class PreferenceDataset(Dataset):
    """Pairs over `table` (sample 2i: pair i's prompt + chosen, 2i + 1: its prompt + rejected): item i is
    {"chosen": {"input_ids", "labels"}, "rejected": {...}, "pair": i} (1-D LongTensors, cut as the module docstring
    says), with "ref_logps" (chosen, rejected) once `ref_logps` are set (precompute_ref_log_probs)."""

    def __init__(self, table: SampleTable, *, max_length: int | None, max_prompt_length: int | None = None,
                 truncation_mode: str = "keep_start", name: str, where: list[str] | None = None,
                 data_key: str | None = None) -> None:
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode={truncation_mode!r} is not one of {TRUNCATION_MODES}")
        self.table, self.name, self.data_key = table, name, data_key
        self.max_length, self.max_prompt_length, self.truncation_mode = max_length, max_prompt_length, truncation_mode
        self.num_pairs = (len(table.offsets) - 1) // 2
        assert 2 * self.num_pairs == len(table.offsets) - 1, "two samples per pair"
        self.prompt_lengths = _prompt_lengths(table)  # (samples,) tokens before the first target
        self.where = where or [f"record {i}" for i in range(self.num_pairs)]
        self.ref_logps: np.ndarray | None = None  # (pairs, 2) float64, when precomputed
        self.num_truncated = 0
        self._check_lengths()

    def __len__(self) -> int:
        return self.num_pairs

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_pairs:
            raise IndexError(f"pair {index} of {self.num_pairs}")
        item = {"chosen": self._row(2 * index), "rejected": self._row(2 * index + 1), "pair": index}
        if self.ref_logps is not None:
            item["ref_logps"] = torch.from_numpy(self.ref_logps[index].copy())
        return item

    def _row(self, sample: int) -> dict[str, torch.Tensor]:
        start, stop = int(self.table.offsets[sample]), int(self.table.offsets[sample + 1])
        prompt = int(self.prompt_lengths[sample])
        if self.max_prompt_length is not None and prompt > self.max_prompt_length:
            start += prompt - self.max_prompt_length  # the prompt's last max_prompt_length tokens
        ids = self.table.ids[start:stop].astype(np.int64)
        targets = self.table.targets[start:stop]
        if self.max_length is not None and ids.size > self.max_length:
            cut = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
            ids, targets = ids[cut], targets[cut]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(np.where(targets, ids, IGNORE_INDEX))}

    def _check_lengths(self) -> None:
        """A prompt filling max_length (keep_start) would leave no completion token: refused, naming the record."""
        prompts = self.prompt_lengths
        if self.max_prompt_length is not None:
            prompts = np.minimum(prompts, self.max_prompt_length)
        lengths = np.diff(self.table.offsets) - (self.prompt_lengths - prompts)
        if self.max_length is None:
            return
        self.num_truncated = int(np.count_nonzero((lengths > self.max_length).reshape(-1, 2).any(axis=1)))
        if self.truncation_mode != "keep_start":
            return
        full = np.flatnonzero(prompts >= self.max_length)
        if full.size:
            pair = int(full[0]) // 2
            raise ValueError(f"dataset {self.name} {self.where[pair]}: its prompt has {int(prompts[full[0]])} tokens, "
                             f"max_length={self.max_length} leaves no completion token; raise max_length (--max-length),"
                             " set max_prompt_length (--max-prompt-length) below it, or drop the record")


def _prompt_lengths(table: SampleTable) -> np.ndarray:
    """(samples,) each sample's tokens before its first target (its prompt)."""
    out = np.empty(len(table.offsets) - 1, dtype=np.int64)
    for i, (start, stop) in enumerate(zip(table.offsets[:-1], table.offsets[1:])):
        flags = table.targets[start:stop]
        out[i] = int(np.argmax(flags)) if flags.any() else stop - start
    return out


def collate_pairs(items: list[dict[str, Any]], *, pad_id: int, multiple: int = 1, groups: int = 1,
                  length: int | None = None, whole_chosen: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch of pairs: (2 x pairs, seq) input_ids, labels and position_ids, right-padded to the longest
    row (or `length`) rounded up to `multiple`, labels -100 and positions running on there; within each of `groups`
    equal groups of pairs, every chosen row, then every rejected row (`whole_chosen`, ORPO's: then every chosen row
    again, labelled on every real token, prompt included). "lengths": (2 x pairs,) each row's real
    tokens; "pairs": (pairs,) each pair's index in the dataset; "ref_logps": (2 x pairs,) in the rows' order, when the items carry them."""
    if len(items) % groups:
        raise ValueError(f"{len(items)} pairs do not split into {groups} equal groups (pipeline microbatches)")
    size = len(items) // groups
    keys = ("chosen", "rejected", "whole") if whole_chosen else ("chosen", "rejected")
    order = [_whole(item["chosen"]) if key == "whole" else item[key]
             for g in range(groups) for key in keys for item in items[g * size:(g + 1) * size]]
    longest = max(row["input_ids"].numel() for row in order) if length is None else length
    longest = -(-longest // multiple) * multiple
    batch: dict[str, Any] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in order:
        pad = longest - row["input_ids"].numel()
        batch["input_ids"].append(torch.nn.functional.pad(row["input_ids"], (0, pad), value=pad_id))
        batch["labels"].append(torch.nn.functional.pad(row["labels"], (0, pad), value=IGNORE_INDEX))
        batch["position_ids"].append(torch.arange(longest))
    out = {k: torch.stack(v) for k, v in batch.items()}
    out["lengths"] = torch.tensor([row["input_ids"].numel() for row in order])
    out["pairs"] = torch.tensor([item["pair"] for item in items])
    if "ref_logps" in items[0]:
        out["ref_logps"] = torch.cat([torch.stack([item["ref_logps"][k] for item in items[g * size:(g + 1) * size]])
                                      for g in range(groups) for k in (0, 1)])
    return out


def _whole(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A row labelled on every token (ORPO's NLL reads the prompt too)."""
    return {"input_ids": row["input_ids"], "labels": row["input_ids"]}


def build_preference_data(source: Any, tokenizer: Any, *, model_dir: str | Path | None = None,
                          chat_template: str | Path | None = None, max_length: int | None = 1024,
                          max_prompt_length: int | None = None, truncation_mode: str = "keep_start",
                          cache_dir: str | Path | None = None, vocab_size: int | None = None) -> PreferenceDataset:
    """A PreferenceDataset of `source` (a .jsonl file: through the token cache; a list of records or a
    datasets.Dataset: in memory), every record checked first (records.check_records); a PreferenceDataset as it is."""
    if isinstance(source, PreferenceDataset):
        return source
    found = preference_source(source)
    if found is None:
        raise ValueError(f"{_describe(source)} holds no preference records: give a .jsonl file, a list of dicts or a "
                         "datasets.Dataset whose records have \"chosen\" and \"rejected\" (and optionally \"prompt\")")
    name, located = found
    templates: list[Any] = []

    def template():
        if not templates:
            templates.append(load_chat_template(model_dir, chat_template))
        return templates[0]

    conversational, where = check_records(name, located, chat_template=template)
    encoder = PreferenceEncoder(tokenizer, chat_template=template() if conversational else None, name=name)
    options = dict(max_length=max_length, max_prompt_length=max_prompt_length, truncation_mode=truncation_mode,
                   name=name, where=where)
    if isinstance(source, (str, Path)):
        store = open_or_build(Path(source).expanduser(), tokenizer, cache_dir=cache_dir, encoder=encoder,
                              options={"preference": True, "chat_template": encoder.template and encoder.template.source},
                              vocab_size=vocab_size)
        if store is not None:
            table = SampleTable(store.tokens, store.targets, store.offsets)
            return PreferenceDataset(table, data_key=store.key, **options)
    samples = [sample for i, (_, record) in enumerate(located) for sample in encoder(record, i)]
    return PreferenceDataset(SampleTable.of(samples), **options)


def _describe(source: Any) -> str:
    return f"the data {source}" if isinstance(source, (str, Path)) else f"the data ({type(source).__name__})"
