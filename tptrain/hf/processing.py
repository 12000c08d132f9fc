"""A vision-language checkpoint's processor turning one image-text chat into a training row: transformers' processor
(image processor, tokenizer) and the chat template, tptrain's labels.

    encoder = ProcessorEncoder.from_checkpoint("path/to/qwen2.5-vl", assistant_only_loss=True)
    row = encoder.encode(messages, images)   # {"input_ids", "labels", "attention_mask", "pixel_values", ...}: 1 row

The text is the chat template's rendering (tptrain.text.ChatTemplate, transformers' environment); the ids and every
other input are what `processor(text=[text], images=[images])` returns, so they equal transformers'
`processor.apply_chat_template(messages, tokenize=True, return_dict=True)`. The assistant turns' character spans
(`{% generation %}` markers, or found turn by turn as for text chats) are moved past the image placeholders the
processor expanded before them (its `text_replacement_offsets`) and every token overlapping one is a target:
transformers' own rule for `return_assistant_tokens_mask`. The processor's multimodal tokens (image placeholders,
and the tokens around them it marks, `create_mm_token_type_ids`) are never targets, nor is a row's first token.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
from typing import Any

import torch

from tptrain.hf.vlm import load_processor
from tptrain.losses import IGNORE_INDEX
from tptrain.text import ChatTemplate, load_chat_template

PER_ROW = ("offset_mapping", "text_replacement_offsets")  # what the labels are made from: not model inputs


class ProcessorEncoder:
    """Rows of one checkpoint's processor. template: the chat template (the processor's, or an override)."""

    def __init__(self, processor: Any, template: ChatTemplate, *, assistant_only_loss: bool = True,
                 source: str = "(processor)") -> None:
        self.processor, self.template, self.source = processor, template, source
        self.assistant_only_loss = assistant_only_loss
        tokenizer = processor.tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.description = f"{source} ({type(processor).__name__}: image processor, tokenizer, chat template)"

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, *, chat_template: str | os.PathLike | None = None,
                        assistant_only_loss: bool = True) -> "ProcessorEncoder":
        """The processor saved in `directory` (ValueError naming what is missing) and its chat template, or the
        Jinja file `chat_template`."""
        try:
            processor = load_processor(directory)
        except ImportError as exc:  # transformers' message names the missing library (its video processor's)
            first = next((line for line in str(exc).splitlines() if line.strip()), str(exc)).strip()
            raise ValueError(f"the processor in {directory} cannot be loaded: {first.split('. ')[0].rstrip('.')}. "
                             f"Install the vision "
                             f"extra: pip install \"tptrain[vision]\" (bash scripts/setup.sh --vision builds "
                             f".venv-vision with a torch and torchvision that import together)") from None
        tokenizer = processor.tokenizer
        variables = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        if chat_template is not None:
            template = load_chat_template(directory, chat_template)
            template = ChatTemplate(template.source, name=template.name, variables=variables)
        else:
            source = processor.chat_template
            source = source.get("default") if isinstance(source, dict) else source
            if not isinstance(source, str):
                raise ValueError(f"the processor in {directory} has no chat template (no chat_template.jinja or "
                                 f"chat_template.json), so image-text chats cannot be rendered; pass one with "
                                 f"--chat-template FILE (TrainingArguments(chat_template=FILE))")
            template = ChatTemplate(source, name=f"{directory} (the processor's chat template)", variables=variables)
        return cls(processor, template, assistant_only_loss=assistant_only_loss, source=str(directory))

    def encode(self, messages: list[dict[str, Any]], images: list[Any]) -> dict[str, torch.Tensor]:
        """One row: input_ids, labels and every per-token input (attention_mask, token_type_ids, ...) as 1-D
        tensors of the row's length; the image inputs (pixel_values, image_grid_thw, image_sizes, ...) as the
        processor returns them for this one row. `images`: PIL images, one per image item of `messages`, in order."""
        text, spans = self.template.render(messages)
        if not self.assistant_only_loss:
            spans = [(0, len(text))]
        bos = self.processor.tokenizer.bos_token
        out = self.processor(text=[text], images=[images] if images else None, return_tensors="pt",
                             return_offsets_mapping=True, return_text_replacement_offsets=True,
                             add_special_tokens=not (bos is not None and text.startswith(bos)))
        offsets, replaced = out.pop("offset_mapping")[0].tolist(), out.pop("text_replacement_offsets", None)
        ids = out.pop("input_ids")[0]
        mask = _assistant_mask(offsets, spans, (replaced or [[]])[0])
        labels = torch.where(mask & ~self.multimodal_tokens(ids), ids, IGNORE_INDEX)
        labels[0] = IGNORE_INDEX
        row = {"input_ids": ids, "labels": labels}
        for key, value in out.items():
            if not torch.is_tensor(value):
                raise ValueError(f"the processor of {self.source} returned {key!r} as a {type(value).__name__}, not a "
                                 "tensor; tptrain batches the tensors a processor returns")
            row[key] = value[0] if value.dim() == 2 and value.shape[1] == ids.numel() and value.shape[0] == 1 else value
        return row

    def prompt(self, messages: list[dict[str, Any]], images: list[Any]) -> dict[str, torch.Tensor]:
        """The processor's inputs (batch of one) for `messages` rendered with the generation prompt: what the model
        continues with the assistant's reply."""
        text = self.template.text(messages, add_generation_prompt=True)
        bos = self.processor.tokenizer.bos_token
        return dict(self.processor(text=[text], images=[images] if images else None, return_tensors="pt",
                                   add_special_tokens=not (bos is not None and text.startswith(bos))))

    def decode(self, ids: list[int]) -> str:
        return self.processor.tokenizer.decode(ids)

    def multimodal_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(seq,) bool: the tokens the processor marks as an image's (or video's, audio's)."""
        return torch.tensor(self.processor.create_mm_token_type_ids([ids.tolist()])[0]) != 0

    def size_settings(self) -> str:
        """The image processor's settings that bound an image's size, hence its tokens (for error messages)."""
        image_processor = getattr(self.processor, "image_processor", None)
        found = []
        for name in ("size", "max_image_size", "max_pixels", "min_pixels", "max_patches", "crop_size"):
            value = getattr(image_processor, name, None)
            if dataclasses.is_dataclass(value):  # transformers' SizeDict
                value = dataclasses.asdict(value)
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if v is not None}
            if value not in (None, {}):
                found.append(f"{name}={value}")
        return (f"{type(image_processor).__name__}'s {', '.join(found) or 'settings'} (processor_config.json or "
                f"preprocessor_config.json in {self.source}; a Qwen2-VL processor's size.longest_edge is its "
                f"max_pixels)")


def _assistant_mask(offsets: list[list[int]], spans: list[tuple[int, int]],
                    replaced: list[dict[str, Any]]) -> torch.Tensor:
    """(seq,) bool: the tokens overlapping a character span of the rendered text, the spans moved past the
    placeholders the processor expanded before them (transformers' `_adjust_assistant_masks_indices`)."""
    ends = [r["span"][1] for r in replaced]  # in the rendered text; new_span: in the expanded one
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replaced]
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for span in spans:
        start, end = (c + gained[bisect.bisect_right(ends, c)] for c in span)
        for pos, (token_start, token_end) in enumerate(offsets):
            if token_start < end and token_end > start:
                mask[pos] = True
    return mask
