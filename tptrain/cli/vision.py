"""`tptrain train` on a vision-language checkpoint: what differs from a text model, at the points cli/train.py calls in.

    tptrain train --model VLM_DIR --data vlm.jsonl --tp-size 2 --seq-len 1024

A checkpoint is a vision-language model's when its config.json has a `vision_config` and transformers has an
image-text-to-text class for its model type (`models.registry.vision_language`, read without importing torch). It
loads with AutoModelForImageTextToText; its data are image-text chat records (training/vision_records.py) through the
checkpoint's processor (training/vision_data.py), checked before any worker starts (the records, their image files,
the processor) and again, images decoded, by every rank before training; the sample at the end is the model's reply
to the first record's first user turn, its images included.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def is_vision(model_dir: Path) -> bool:
    from tptrain.models.configuration import load_config_dict
    from tptrain.models.registry import vision_language

    return vision_language(load_config_dict(model_dir))


def auto_class(vision: bool) -> Any:
    """The Auto class a checkpoint loads with."""
    from tptrain.models import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def config(model_dir: Path, vision: bool) -> Any:
    from tptrain.models import AutoConfig, AutoModelForImageTextToText

    return AutoModelForImageTextToText.config(model_dir) if vision else AutoConfig.from_pretrained(model_dir)


def preflight(args: argparse.Namespace, model_dir: Path) -> None:
    """Before any worker starts: the processor and its chat template load, the data files' records read (each image
    file found, placeholders and images paired), --packing refused; the images are decoded by the workers."""
    from tptrain.training.vision_data import packing_refusal, vision_encoder
    from tptrain.training.vision_records import image_records

    if args.streaming:
        raise ValueError("--streaming reads plain text; a vision-language model trains on image-text records (a "
                         ".jsonl file)")
    if args.packing:
        raise ValueError(f"--packing is not available for image-text rows: "
                         f"{packing_refusal(config(model_dir, True))}. Leave it unset")
    vision_encoder(model_dir, chat_template=args.chat_template)
    for path in (args.data, args.eval_data):
        if path is not None:
            records = image_records(path)
            for index in range(len(records)):
                records[index]  # noqa: B018 - reading a record checks it


def data(args: argparse.Namespace, model_dir: Path, model_config: Any) -> tuple[Any, Any, Any]:
    """(the processor's encoder, the training rows, the eval rows or None)."""
    from tptrain.training.vision_data import build_vision_data, vision_encoder

    encoder = vision_encoder(model_dir, chat_template=args.chat_template, assistant_only_loss=args.assistant_only_loss)

    def build(source):
        return build_vision_data(source, encoder, seq_len=args.seq_len, config=model_config, packing=args.packing,
                                 truncation=args.truncation)
    return encoder, build(args.data), None if args.eval_data is None else build(args.eval_data)


def sample(model: Any, encoder: Any, dataset: Any, max_new_tokens: int) -> tuple[str, str]:
    """(what was asked, the model's greedy reply): the first record with images (else the first), its messages up to
    its first assistant turn. Collective under TP: every rank calls it."""
    from tptrain.generation.vision import greedy_ids
    from tptrain.training.vision_records import open_image

    records = dataset.records
    chat = next((records[i] for i in range(len(records)) if records[i].images), records[0])
    turn = next((i for i, m in enumerate(chat.messages) if m["role"] == "assistant"), len(chat.messages))
    messages = chat.messages[:max(turn, 1)]
    shown = sum(item["type"] == "image" for m in messages for item in m["content"])
    inputs = encoder.prompt(messages, [open_image(image, chat.where) for image in chat.images[:shown]])
    ids = inputs.pop("input_ids")[0].tolist()
    reply = greedy_ids(model, ids, max_new_tokens, eos_token_id=encoder.eos_token_id, inputs=inputs)
    asked = " ".join(item.get("text", "<image>") for m in messages if m["role"] == "user" for item in m["content"])
    return f"{chat.where} ({shown} image(s)): {asked!r}", encoder.decode(reply)
