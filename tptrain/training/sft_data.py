"""Instruction data for supervised fine-tuning: TRL's record formats, label masks, document-masked packing.

    records = read_records("chat.jsonl")                          # None: plain text (training/data.py packs it)
    dataset = build_sft_dataset(records, tokenizer, seq_len=512, chat_template=load_chat_template(model_dir))
    batch = collate([dataset[i] for i in indices], pad_id=tokenizer.eos_token_id)
    model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])

Each record is one sample, detected from its keys (as TRL names them):
  {"text": ...}                              loss on every token (eos appended)
  {"messages": [{"role", "content"}, ...]}   rendered with the chat template; loss on assistant turns only
                                             (assistant_only_loss=False: on every token)
  {"prompt": ..., "completion": ...}         strings (eos appended) or message lists; loss on the completion
A sample's first token is never a target (nothing precedes it), so packing samples side by side changes no
target. Packed rows (`packing=True`) hold whole samples one after another, `seq_len` tokens, position ids
restarting at 0 at each sample (the decoder turns that into block-diagonal causal attention), the tail
padded as a sample of its own with labels -100. Without packing each sample is a row, padded per batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tptrain.losses import IGNORE_INDEX
from tptrain.io import jsonl_records
from tptrain.text import ROLES, ChatTemplate, load_chat_template
from tptrain.training.data import build_dataset, packed_dataset
from tptrain.training.streaming import StreamingText, TextStream, as_stream
from tptrain.training.token_cache import Store, open_or_build
from tptrain.training.token_stream import text_documents
from tptrain.training.vision_data import TEXT_KEYS, collate_vision
from tptrain.training.vision_records import has_images

TRUNCATION = ("truncate", "error")
_STRUCTURED_KEYS = ("messages", "prompt", "completion")


def read_records(source: Any) -> tuple[str, list[dict[str, Any]]] | None:
    """(name, records) when `source` holds instruction records (a .jsonl file, a list of dicts or a
    `datasets.Dataset` with a messages/prompt/completion field); None for plain text sources."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.suffix != ".jsonl" or not path.is_file():
            return None
        records, name = [record for _, record in jsonl_records(path)], str(path)
    elif isinstance(source, (list, tuple)) and any(isinstance(r, dict) for r in source):
        records, name = list(source), f"(list of {len(source)} records)"
    elif type(source).__module__.split(".")[0] == "datasets":
        if not set(_STRUCTURED_KEYS) & set(getattr(source, "column_names", None) or ()):
            return None
        records, name = [dict(row) for row in source], f"({type(source).__name__})"
    else:
        return None
    if not any(isinstance(r, dict) and set(_STRUCTURED_KEYS) & set(r) for r in records) and \
            all(isinstance(r, dict) and "text" in r for r in records) and records:
        return None  # {"text"} lines only: language-model blocks, as before
    if not records:
        raise ValueError(f"dataset {name} is empty: it has no records to train on")
    return name, records


def scan_data_file(path: Path) -> bool:
    """Read and parse a .txt / .jsonl file piece by piece, without tokenizing, raising what building it would
    (a bad line, an unknown record, no text); whether a record is a chat (so a chat template is needed)."""
    def ignore(nbytes: int) -> None:
        pass

    if path.suffix != ".jsonl":
        if next(text_documents(path, ignore), None) is None:
            raise ValueError(f"dataset {path} is empty: it has no text to train on")
        return False
    chat, count = False, 0
    for count, (line, record) in enumerate(jsonl_records(path, ignore), start=1):
        if has_images(record):
            raise images_error(f"{path} line {line}")
        fmt = record_format(record, count - 1, str(path))
        chat |= fmt == "messages" or isinstance(record.get("prompt"), list)
    if not count:
        raise ValueError(f"dataset {path} is empty: it has no records to train on")
    return chat


def record_format(record: Any, index: int, name: str) -> str:
    """'messages', 'prompt/completion' or 'text'; ValueError naming the record when none matches, or when it holds
    images (a text-only model's data)."""
    if has_images(record):
        raise images_error(f"dataset {name} record {index}")
    if isinstance(record, dict):
        if "messages" in record:
            return "messages"
        if "prompt" in record and "completion" in record:
            return "prompt/completion"
        if "text" in record:
            return "text"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"dataset {name} record {index} ({keys}) matches no format: give each record a \"text\" string, "
                     "\"messages\" (a list of {\"role\", \"content\"}), or \"prompt\" and \"completion\"")


def images_error(where: str) -> ValueError:
    """A record with images, in a text-only model's data."""
    return ValueError(f"{where} holds images, but the model being trained reads text only (a causal LM: no vision "
                      "tower, no processor); train a vision-language checkpoint (tptrain.AutoModelForImageTextToText; "
                      "`tptrain train` picks it from its config.json), or drop the images")


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where the token is not a target


class SampleEncoder:
    """Turns records into token ids and labels. chat_template: needed only by message records."""

    def __init__(self, tokenizer: Any, *, chat_template: ChatTemplate | None = None,
                 assistant_only_loss: bool = True, name: str = "(records)") -> None:
        self.tokenizer, self.template, self.assistant_only_loss, self.name = \
            tokenizer, chat_template, assistant_only_loss, name

    def format(self, record: Any, index: int) -> str:
        return record_format(record, index, self.name)

    def __call__(self, record: dict[str, Any], index: int) -> Sample:
        fmt = self.format(record, index)
        eos = self.tokenizer.eos_token_id
        if fmt == "text":
            ids = self._encode(self._string(record, "text", index)) + [eos]
            return _first_not_target(Sample(ids, list(ids)))
        if fmt == "messages":
            messages = self._messages(record["messages"], index, "messages")
            text, spans = self._chat_template(index).render(messages)
            if not self.assistant_only_loss:
                spans = [(0, len(text))]
            return _first_not_target(self._masked(text, spans))
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt_ids, completion_ids = self._encode(prompt), self._encode(completion) + [eos]
            return _first_not_target(Sample(prompt_ids + completion_ids,
                                            [IGNORE_INDEX] * len(prompt_ids) + completion_ids))
        if isinstance(prompt, list) and isinstance(completion, list):
            template = self._chat_template(index)
            prompt_msgs = self._messages(prompt, index, "prompt")
            completion_msgs = self._messages(completion, index, "completion")
            before = template.text(prompt_msgs, add_generation_prompt=True)
            text = template.text(prompt_msgs + completion_msgs)
            if not text.startswith(before):
                raise ValueError(f"dataset {self.name} record {index}: the prompt rendered with the generation prompt "
                                 "is not a prefix of prompt + completion under chat template "
                                 f"{template.name}; the completion cannot be located")
            return _first_not_target(self._masked(text, [(len(before), len(text))]))
        raise ValueError(f"dataset {self.name} record {index}: \"prompt\" and \"completion\" must both be strings or "
                         f"both message lists, got {type(prompt).__name__} and {type(completion).__name__}")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _string(self, record: dict, key: str, index: int) -> str:
        if not isinstance(record[key], str):
            raise ValueError(f"dataset {self.name} record {index}: \"{key}\" is a {type(record[key]).__name__}, "
                             "not a string")
        return record[key]

    def _chat_template(self, index: int) -> ChatTemplate:
        if self.template is None:
            raise ValueError(f"dataset {self.name} record {index} is a chat (messages), but no chat template was "
                             "given; pass the checkpoint's (load_chat_template) or --chat-template FILE")
        return self.template

    def _messages(self, messages: Any, index: int, key: str) -> list[dict[str, Any]]:
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"dataset {self.name} record {index}: \"{key}\" must be a non-empty list of "
                             "{\"role\", \"content\"} messages")
        for j, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"dataset {self.name} record {index}: {key}[{j}] is not a message with a \"role\"")
            if message["role"] not in ROLES:
                raise ValueError(f"dataset {self.name} record {index}: {key}[{j}] has the unknown role "
                                 f"{message['role']!r}; roles are {', '.join(ROLES)}")
        return messages

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> Sample:
        """Tokens of `text`; targets the tokens of `spans` (character ranges) by transformers' rule for
        `return_assistant_tokens_mask`: from the token of a span's first character to that of its last."""
        encoding = self.tokenizer.encoding(text)
        ids = list(encoding.ids)
        mask = [False] * len(ids)
        for start, end in spans:
            if end <= start:
                continue
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None:
                break
            for t in range(first, len(ids) if last is None else last + 1):
                mask[t] = True
        return Sample(ids, [i if m else IGNORE_INDEX for i, m in zip(ids, mask)])


def _first_not_target(sample: Sample) -> Sample:
    if sample.labels:
        sample.labels[0] = IGNORE_INDEX
    return sample


@dataclass
class SampleTable:
    """Encoded samples side by side: sample i is ids[offsets[i]:offsets[i + 1]], a target where `targets` is
    True (a label is always its token or -100, so a flag keeps it). Arrays in memory, or the token cache's
    read-only memory maps (training/token_cache.py): rows are cut from them as they are asked for."""

    ids: np.ndarray  # (num_tokens,) any integer dtype
    targets: np.ndarray  # (num_tokens,) bool
    offsets: np.ndarray  # (num_samples + 1,) int64

    @classmethod
    def of(cls, samples: list[Sample]) -> SampleTable:
        ids = np.fromiter((t for s in samples for t in s.input_ids), dtype=np.int64)
        targets = np.fromiter((label != IGNORE_INDEX for s in samples for label in s.labels), dtype=bool)
        return cls(ids, targets, np.cumsum([0] + [len(s.input_ids) for s in samples], dtype=np.int64))


class SFTDataset(Dataset):
    """Rows of {"input_ids", "labels", "position_ids"} (1-D LongTensors): packed rows of exactly `seq_len`
    tokens (padded with `pad_id`), or one sample per row (`packing=False`), built from `table` on access.
    Samples longer than seq_len are cut (num_truncated counts them) or, with truncation="error", refused."""

    def __init__(self, table: SampleTable, *, seq_len: int, packing: bool, truncation: str, pad_id: int,
                 name: str, data_key: str | None = None) -> None:
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation={truncation!r} is not one of {TRUNCATION}")
        lengths = np.diff(table.offsets)
        if lengths.size == 0:
            raise ValueError(f"dataset {name} is empty: it has no records to train on")
        assert lengths.min() >= 1, "every sample ends with at least one token"
        too_long = np.flatnonzero(lengths > seq_len)
        if too_long.size and truncation == "error":
            index = int(too_long[0])
            raise ValueError(f"dataset {name} record {index} has {int(lengths[index])} tokens, more than "
                             f"seq_len={seq_len}; raise seq_len, shorten or drop the record, or truncate "
                             "(--truncation truncate)")
        self.table, self.seq_len, self.packing, self.pad_id, self.name = table, seq_len, packing, pad_id, name
        self.data_key = data_key  # the token cache key (None: not cached); DataOrder records it for resumes
        self.kept = np.minimum(lengths, seq_len)  # (num_samples,) tokens of each sample that train
        self.num_samples, self.num_truncated = int(lengths.size), int(too_long.size)
        self.num_tokens = _target_count(table, self.kept, too_long)  # target tokens
        if not self.num_tokens:
            raise ValueError(f"dataset {name} has no target token at all (no assistant turn or completion survives "
                             "truncation); check the records, raise seq_len, or use --no-assistant-only-loss")
        self.row_starts = _pack(self.kept.tolist(), seq_len) if packing else list(range(self.num_samples + 1))

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        first, last = self.row_starts[index], self.row_starts[index + 1]  # IndexError past the end
        starts, kept = self.table.offsets[first:last], self.kept[first:last]
        ids = np.concatenate([self.table.ids[s:s + k] for s, k in zip(starts, kept)]).astype(np.int64)
        targets = np.concatenate([self.table.targets[s:s + k] for s, k in zip(starts, kept)])
        positions = np.concatenate([np.arange(k) for k in kept])
        pad = self.seq_len - ids.size if self.packing else 0  # the tail: a sample of its own, no target
        return {"input_ids": torch.from_numpy(np.concatenate([ids, np.full(pad, self.pad_id)])),
                "labels": torch.from_numpy(np.concatenate([np.where(targets, ids, IGNORE_INDEX),
                                                           np.full(pad, IGNORE_INDEX)])),
                "position_ids": torch.from_numpy(np.concatenate([positions, np.arange(pad)]))}

    @property
    def rows(self) -> list[dict[str, torch.Tensor]]:
        """Every row, built (for inspecting small sets)."""
        return [self[i] for i in range(len(self))]


def _target_count(table: SampleTable, kept: np.ndarray, too_long: np.ndarray) -> int:
    """Target tokens of the kept part of every sample: whole-sample sums, less the cut tails."""
    whole = int(np.add.reduceat(table.targets, table.offsets[:-1], dtype=np.int64).sum())
    cut = sum(int(np.count_nonzero(table.targets[table.offsets[i] + kept[i]:table.offsets[i + 1]])) for i in too_long)
    return whole - cut


def build_sft_dataset(records: tuple[str, list[dict[str, Any]]], tokenizer: Any, seq_len: int, *,
                      chat_template: ChatTemplate | None = None, assistant_only_loss: bool = True,
                      packing: bool = True, truncation: str = "truncate") -> SFTDataset:
    """Encode every record (see the module docstring), cut samples longer than `seq_len` (or, with
    truncation="error", refuse them naming the record) and pack or keep them one per row."""
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation={truncation!r} is not one of {TRUNCATION}")
    name, items = records
    encode = SampleEncoder(tokenizer, chat_template=chat_template, assistant_only_loss=assistant_only_loss, name=name)
    table = SampleTable.of([encode(record, index) for index, record in enumerate(items)])
    return SFTDataset(table, seq_len=seq_len, packing=packing, truncation=truncation,
                      pad_id=tokenizer.eos_token_id, name=name)


def _pack(lengths: list[int], seq_len: int) -> list[int]:
    """The first sample of each row, and the end: whole samples, in order, into rows of `seq_len` tokens (a
    sample that does not fit starts the next row)."""
    starts, used = [0], 0
    for index, length in enumerate(lengths):
        if used and used + length > seq_len:
            starts.append(index)
            used = 0
        used += length
    return starts + [len(lengths)]


def collate(items: list[Any], *, pad_id: int, multiple: int = 1, length: int = 0,
            rows: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch: (batch, seq) input_ids, labels and (for SFT rows) position_ids. Rows of different
    lengths are right-padded to the longest (rounded up to `multiple`, e.g. the TP degree under sequence
    parallelism; at least `length`: a pipeline's one shape), labels -100 there; positions run on, so padding needs
    no mask (causal attention never lets a real token see a later pad). Plain blocks (LongTensors) are their own
    labels. Vision rows: collate_vision (`rows`: their images' rows per sample)."""
    if all(isinstance(item, torch.Tensor) for item in items):
        ids = torch.stack(items)
        return {"input_ids": ids, "labels": ids}
    if set(items[0]) - set(TEXT_KEYS):  # a vision-language model's rows: the processor's inputs besides
        return collate_vision(items, pad_id=pad_id, multiple=multiple, length=length, rows=rows)
    length = max(length, -(-max(item["input_ids"].numel() for item in items) // multiple) * multiple)
    batch = {"input_ids": [], "labels": [], "position_ids": []}
    for item in items:
        pad = length - item["input_ids"].numel()
        batch["input_ids"].append(torch.nn.functional.pad(item["input_ids"], (0, pad), value=pad_id))
        batch["labels"].append(torch.nn.functional.pad(item["labels"], (0, pad), value=IGNORE_INDEX))
        positions = item.get("position_ids")
        if positions is None:
            positions = torch.arange(item["input_ids"].numel())
        last = int(positions[-1]) + 1
        batch["position_ids"].append(torch.cat([positions, torch.arange(last, last + pad)]))
    return {k: torch.stack(v) for k, v in batch.items()}


def build_training_data(source: Any, tokenizer: Any, seq_len: int, *, model_dir: str | Path | None = None,
                        chat_template: str | Path | None = None, packing: bool | None = True,
                        assistant_only_loss: bool = True, truncation: str = "truncate",
                        cache_dir: str | Path | None = None, vocab_size: int | None = None) -> Any:
    """What a Trainer trains or evaluates on: instruction records -> an SFTDataset (the chat template from
    `chat_template` or the checkpoint in `model_dir`, loaded only when a record is a chat); plain text
    (and a PackedDataset) -> `training/data.py`'s blocks; an SFTDataset as it is; a StreamingText -> its
    TextStream (training/streaming.py: read while training), a TextStream as it is. A .txt / .jsonl file goes
    through the token cache (training/token_cache.py, under `cache_dir`): tokenized once, then mapped;
    `vocab_size` (the model's) is checked against the largest id there. packing None: True."""
    packing = packing is not False
    if isinstance(source, SFTDataset):
        return source
    if isinstance(source, (StreamingText, TextStream)):
        return as_stream(source, tokenizer, seq_len)
    if isinstance(source, (str, Path)) and Path(source).expanduser().is_file():
        store = cache_store(Path(source).expanduser(), tokenizer, model_dir=model_dir, chat_template=chat_template,
                            assistant_only_loss=assistant_only_loss, cache_dir=cache_dir, vocab_size=vocab_size)
        if store is not None:
            return _from_store(store, seq_len, packing=packing, truncation=truncation, pad_id=tokenizer.eos_token_id)
    records = read_records(source)
    if records is None:
        return build_dataset(source, tokenizer, seq_len)
    chat = any(isinstance(r, dict) and ("messages" in r or isinstance(r.get("prompt"), list)) for r in records[1])
    template = load_chat_template(model_dir, chat_template) if chat else None
    return build_sft_dataset(records, tokenizer, seq_len, chat_template=template, packing=packing,
                             assistant_only_loss=assistant_only_loss, truncation=truncation)


def cache_store(path: Path, tokenizer: Any, *, model_dir: str | Path | None, chat_template: str | Path | None,
                assistant_only_loss: bool, cache_dir: str | Path | None, vocab_size: int | None) -> Store | None:
    """The token cache's store of a data file (None: not cached). A .jsonl file may hold chats, so its key
    covers the chat template's text (the checkpoint's, if any) and assistant_only_loss."""
    encoder, options = None, {}
    if path.suffix == ".jsonl":
        try:
            template = load_chat_template(model_dir, chat_template)
        except ValueError:  # no template: a chat record then fails in the encoder, naming the fix
            template = None
        encoder = SampleEncoder(tokenizer, chat_template=template, assistant_only_loss=assistant_only_loss,
                                name=str(path))
        options = {"chat_template": template and template.source, "assistant_only_loss": assistant_only_loss}
    return open_or_build(path, tokenizer, cache_dir=cache_dir, options=options, encoder=encoder,
                         vocab_size=vocab_size)


def _from_store(store: Store, seq_len: int, *, packing: bool, truncation: str, pad_id: int) -> Any:
    """Blocks (plain text) or rows (records) over the store's memory maps."""
    name = store.meta["source"]
    if store.meta["kind"] == "text":
        return packed_dataset(store.tokens, seq_len, name=name, data_key=store.key)
    return SFTDataset(SampleTable(store.tokens, store.targets, store.offsets), seq_len=seq_len, packing=packing,
                      truncation=truncation, pad_id=pad_id, name=name, data_key=store.key)
