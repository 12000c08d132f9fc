"""What the vision-language data tests share: a tiny checkpoint of a family with its processor, both written by
transformers (the bundled BPE tokenizer plus the family's special tokens, a small image processor, the family's chat
template), a few small PNG images and image-text chat records pointing at them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.helpers.chat import BUNDLED
from tests.helpers.checkpoints import randomize
from tests.helpers.vlm import TEXT, VISION

VOCAB = 4160  # the bundled tokenizer's 4096 ids and the special tokens added below, rounded up

# Qwen2-VL / Qwen2.5-VL's chat template (no generation markers: assistant turns are found turn by turn).
QWEN_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

# LLaVA 1.5's chat template, with its {% generation %} markers (transformers' assistant mask reads them).
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _tokenizer(special: tuple[str, ...], eos: str):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>")


def _qwen2_5_vl(directory: Path):
    import transformers

    tokenizer = _tokenizer(QWEN_TOKENS, "<|im_end|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=VOCAB, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                      mrope_section=[1, 1, 2])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    # images of 16 to 32 pixels a side: 4 x 4 to 8 x 8 patches of 4 x 4, merged 2 x 2 into 4 to 16 tokens
    images = transformers.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                min_pixels=16 * 16, max_pixels=32 * 32)
    videos = transformers.Qwen2VLVideoProcessor(patch_size=4, merge_size=2, temporal_patch_size=2)
    return config, transformers.Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer,
                                                    video_processor=videos, chat_template=QWEN_VL)


def _llava(directory: Path):
    import transformers

    tokenizer = _tokenizer(("<image>",), "<|endoftext|>")
    config = transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama", vocab_size=VOCAB),
        vision_config=dict(VISION, model_type="clip_vision_model", image_size=16, patch_size=4),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    # 16 x 16 pixels in 4 x 4 patches: 16 tokens per image (CLIP's class token dropped: the "default" strategy)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return config, transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                               chat_template=LLAVA)


FAMILIES = {"qwen2_5_vl": _qwen2_5_vl, "llava": _llava}


def vision_checkpoint(directory: Path, model_type: str, *, processor: bool = True) -> Path:
    """A tiny random checkpoint of `model_type` written by transformers, its processor saved beside (processor=False:
    none)."""
    import transformers

    config, proc = FAMILIES[model_type](directory)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    randomize(model)
    model.save_pretrained(directory)
    if processor:
        proc.save_pretrained(directory)
    return directory


def write_images(directory: Path, sizes=((16, 16), (32, 24), (24, 16))) -> list[Path]:
    """PNG files of random pixels, (width, height) each."""
    from PIL import Image

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (w, h) in enumerate(sizes):
        path = directory / f"image{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def chat_records(images: list[str]) -> list[dict]:
    """Image-text chats in each accepted form, a text-only one and one with two images, over `images` (paths)."""
    a, b, c = images[:3]
    ask = {"type": "text", "text": "What is in the picture?"}
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": a}, ask]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A cat, sitting."}]}]},
        {"images": [b], "messages": [{"role": "user", "content": [{"type": "image"}, ask]},
                                     {"role": "assistant", "content": [{"type": "text", "text": "Noise, mostly."}]}]},
        {"images": [c], "messages": [{"role": "user", "content": "Describe it."},
                                     {"role": "assistant", "content": "Stripes of colour."}]},
        {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there."}]},
        {"images": [a, c], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Two pictures."}]},
            {"role": "user", "content": [{"type": "text", "text": "Which is larger?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The second."}]}]},
    ]
