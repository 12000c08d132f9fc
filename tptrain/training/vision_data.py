"""Image-text training rows for a vision-language model: records (training/vision_records.py) through the checkpoint's
processor (hf/processing.py), one record per row, and the micro-batch collator of such rows.

    encoder = vision_encoder(model_dir)                        # the checkpoint's processor and chat template
    dataset = build_vision_data("vlm.jsonl", encoder, seq_len=1024, config=model.config)
    batch = collate_vision([dataset[i] for i in indices], pad_id=encoder.eos_token_id)
    model(batch.pop("input_ids"), **batch).loss                # labels, attention_mask, pixel_values, image_grid_thw...

Building the dataset runs every record through the processor once, images decoded, on every rank alike: whatever a
record gets wrong (an image that does not exist or decode, placeholders and images that do not pair up, an image
whose tokens do not fit seq_len) is raised before training starts, naming the file and line. The rows themselves are
made again when a batch asks for them (pixel values are not kept: they are the bulk of a dataset's memory). A row
longer than seq_len loses its tail (counted in num_truncated) only when no image token is cut; truncation="error"
refuses it. Rows are never packed: see `packing_refusal`.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.utils.data import Dataset

from tptrain.distributed.state import ROWS
from tptrain.io import resolve_checkpoint
from tptrain.losses import IGNORE_INDEX
from tptrain.training.vision_records import ImageChat, ImageRecords, image_records, open_image

TEXT_KEYS = ("input_ids", "labels", "position_ids")  # a text row's keys: anything else is a vision row's input


def takes_images(model: Any) -> bool:
    """Whether `model` (or the model a PeftModel wraps) is a vision-language model (an image-text-to-text class)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "auto_class", None) == "AutoModelForImageTextToText"


def vision_encoder(model_dir: str | os.PathLike, *, chat_template: str | os.PathLike | None = None,
                   assistant_only_loss: bool = True) -> Any:
    """The checkpoint's processor as a row encoder (hf/processing.py: transformers' processor, on the backend)."""
    from tptrain.hf.processing import ProcessorEncoder

    return ProcessorEncoder.from_checkpoint(model_dir, chat_template=chat_template,
                                            assistant_only_loss=assistant_only_loss)


def packing_refusal(config: Any) -> str:
    """Why image-text rows are not packed for this model (`config`: its transformers config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    model_type = getattr(config, "model_type", "?")
    if isinstance(rope, dict) and "mrope_section" in rope:
        return (f"{model_type} computes its multimodal rotary positions (temporal, height, width) from a whole row's "
                f"input_ids and image_grid_thw, with no restart: the samples after the first of a packed row would "
                f"get positions continuing the first's, and attend to it, which is not the model's computation of "
                f"them")
    return (f"{model_type}'s forward takes one sample per row (its image features placed by the row's placeholders, "
            f"its masks from the row's attention_mask and token types); a packed row is not implemented for it")


class VisionDataset(Dataset):
    """Rows of an image-text record each: {"input_ids", "labels", per-token inputs (1-D), image inputs}, made on
    access. Checked and measured once when built (see the module docstring)."""

    packing = False
    data_key = None  # not in the token cache

    def __init__(self, records: ImageRecords, encoder: Any, *, seq_len: int, truncation: str = "truncate") -> None:
        if truncation not in ("truncate", "error"):
            raise ValueError(f"truncation={truncation!r} is not one of ('truncate', 'error')")
        if not len(records):
            raise ValueError(f"dataset {records.name} is empty: it has no records to train on")
        self.records, self.encoder, self.seq_len, self.truncation = records, encoder, seq_len, truncation
        self.name, self.num_samples = records.name, len(records)
        self.kept: list[int] = []  # tokens of each row that train
        self.num_tokens = self.num_truncated = self.num_images = 0
        for index in range(len(records)):
            chat = records[index]
            row, images = self._encode(chat)
            self.kept.append(self._kept(row, chat, images))
            self.num_tokens += int((row["labels"][:self.kept[-1]] != IGNORE_INDEX).sum())
            self.num_truncated += self.kept[-1] < row["input_ids"].numel()
            self.num_images += len(images)
        if not self.num_tokens:
            raise ValueError(f"dataset {self.name} has no target token at all (no assistant turn survives truncation); "
                             "check the records, raise seq_len, or use --no-assistant-only-loss")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chat = self.records[index]
        row, _ = self._encode(chat)
        length, kept = row["input_ids"].numel(), self.kept[index]
        if length < kept:  # the same record, encoded again, is the same row unless its files changed
            raise ValueError(f"{chat.where} changed since the dataset was built ({length} tokens, {kept} before)")
        return {k: v[:kept] if _per_token(v, length) else v for k, v in row.items()}

    @property
    def rows(self) -> list[dict[str, torch.Tensor]]:
        """Every row, built (for inspecting small sets)."""
        return [self[i] for i in range(len(self))]

    def _encode(self, chat: ImageChat) -> tuple[dict[str, torch.Tensor], list[Any]]:
        images = [open_image(image, chat.where) for image in chat.images]
        try:
            return self.encoder.encode(chat.messages, images), images
        except Exception as exc:  # noqa: BLE001 - the processor's own checks: named by the record they failed on
            raise ValueError(f"{chat.where}: the processor of {self.encoder.source} could not turn it into a row "
                             f"({type(exc).__name__}: {exc})") from None

    def _kept(self, row: dict[str, torch.Tensor], chat: ImageChat, images: list[Any]) -> int:
        """The tokens of `row` that train: all, or the first seq_len when the cut leaves every image token."""
        ids = row["input_ids"]
        if ids.numel() <= self.seq_len:
            return ids.numel()
        if self.truncation == "error":
            raise ValueError(f"{chat.where} has {ids.numel()} tokens, more than seq_len={self.seq_len}; raise seq_len, "
                             "shorten or drop the record, or truncate (--truncation truncate)")
        image_tokens = self.encoder.multimodal_tokens(ids)
        if image_tokens[self.seq_len:].any():
            sizes = ", ".join(f"{w}x{h}" for w, h in (image.size for image in images))
            raise ValueError(f"{chat.where} has {ids.numel()} tokens, {int(image_tokens.sum())} of them for its "
                             f"{len(images)} image(s) ({sizes} pixels) at the processor's size limits, "
                             f"{self.encoder.size_settings()}: seq_len={self.seq_len} would cut an image's tokens. "
                             f"Lower that limit (e.g. max_pixels), raise seq_len, or drop the record")
        return self.seq_len


def build_vision_data(source: Any, encoder: Any, *, seq_len: int, config: Any, packing: bool | None = None,
                      truncation: str = "truncate") -> VisionDataset:
    """The rows of `source` (a .jsonl path, a list of records, a datasets.Dataset, or a VisionDataset as it is).
    packing=True is refused (`packing_refusal`); None (the default) and False: one record per row."""
    if packing:
        raise ValueError(f"packing (--packing) is not available for image-text rows: {packing_refusal(config)}. "
                         "Leave packing unset (one record per row, padded per micro-batch)")
    if isinstance(source, VisionDataset):
        return source
    return VisionDataset(image_records(source), encoder, seq_len=seq_len, truncation=truncation)


def vision_rows(source: Any, encoder: Any, args: Any, *, model: Any) -> tuple[Any, VisionDataset]:
    """(encoder, rows): what a Trainer trains a vision-language `model` on, its TrainingArguments `args` applied;
    `encoder` (None: the processor of the checkpoint `model` was loaded from) is loaded once, by the first call."""
    if encoder is None and not isinstance(source, VisionDataset):
        name = getattr(model, "name_or_path", None)
        model_dir = resolve_checkpoint(name) if name is not None else None
        if model_dir is None:
            raise ValueError("a vision-language model's data goes through its checkpoint's processor, but this model "
                             "was not loaded from a checkpoint directory; pass a VisionDataset")
        encoder = vision_encoder(model_dir, chat_template=args.chat_template,
                                 assistant_only_loss=args.assistant_only_loss)
    return encoder, build_vision_data(source, encoder, seq_len=args.seq_len, config=model.config,
                                      packing=args.packing, truncation=args.truncation)


def _per_token(value: torch.Tensor, length: int) -> bool:
    return value.dim() == 1 and value.numel() == length


def collate_vision(items: list[dict[str, torch.Tensor]], *, pad_id: int, multiple: int = 1, length: int = 0,
                   rows: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch of vision rows: input_ids, labels and every per-token input right-padded to the longest row
    (rounded up to `multiple`; at least `length`; pad_id, -100, 0: a padded position is masked out by attention_mask);
    every image input concatenated in row order (the model places image i at the i-th run of placeholders of the
    flattened batch), each padded with zeros to the largest of the batch where their shapes differ (a processor that
    pads its images reads the padding as such: image_sizes, pixel_attention_mask); with `rows`, how many of its rows
    each sample holds under its name + ROWS (what a pipeline reads to give each microbatch its own samples' images;
    not a model input)."""
    length = max(length, math.ceil(max(item["input_ids"].numel() for item in items) / multiple) * multiple)
    keys = list(dict.fromkeys(k for item in items for k in item))
    batch = {}
    for key in keys:
        values = [item[key] for item in items if key in item]
        if len(values) == len(items) and all(_per_token(v, item["input_ids"].numel()) for v, item in zip(values, items)):
            fill = pad_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            batch[key] = torch.stack([torch.nn.functional.pad(v, (0, length - v.numel()), value=fill) for v in values])
        else:
            batch[key] = _concatenated(values, key)
            if rows:
                batch[key + ROWS] = torch.tensor([item[key].shape[0] if key in item else 0 for item in items])
    return batch


def _concatenated(values: list[torch.Tensor], key: str) -> torch.Tensor:
    """The tensors joined along dim 0, each zero-padded at the end of every other dim to the batch's largest."""
    if any(v.dim() != values[0].dim() or v.dim() == 0 for v in values):
        raise ValueError(f"the processor's {key!r} has shapes {[tuple(v.shape) for v in values]} in one batch; "
                         "they cannot be joined along the first dim")
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        pad = [p for d in reversed(range(1, v.dim())) for p in (0, shape[d - 1] - v.shape[d])]
        padded.append(torch.nn.functional.pad(v, pad) if any(pad) else v)
    return torch.cat(padded)
