"""A vision-language model trained on what its checkpoint's processor returns (transformers' names: input_ids,
attention_mask, pixel_values, image_grid_thw, ...), at tp 2 against transformers on one process; the processor files
saved beside the checkpoint and loaded from there; a checkpoint without a processor refused, naming the fix. Needs
torchvision (the processor's video processor): .venv-vision.

    .venv-vision/bin/python -m pytest tests/test_vlm_processor.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.vlm import F64, IMAGE, VisionCheckpoints, equivalence, qwen_processor, transformers_model
from tptrain.hf.vlm import load_processor

pytestmark = pytest.mark.vision
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"  # the processor widens the pad to the image's tokens
PROMPTS = [f"{IMAGE_SLOT} w5 w6 w7 w8 w9", f"w3 {IMAGE_SLOT} w11 w12"]


def _with_processor(model_type, path, hf):
    qwen_processor().save_pretrained(path)
    return path


CHECKPOINTS = VisionCheckpoints(("qwen2_5_vl",), _with_processor)  # its processor's files beside the weights


def _inputs(processor) -> dict:
    """Two rows, an image each (16 x 16 random pixels), padded; labels on the text only."""
    from PIL import Image
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")) for _ in PROMPTS]
    inputs = dict(processor(text=PROMPTS, images=images, padding=True, return_tensors="pt"))
    labels = inputs["input_ids"].clone()
    labels[(labels >= IMAGE) | (inputs["attention_mask"] == 0)] = -100
    return {**{k: v.to(F64) if v.is_floating_point() else v for k, v in inputs.items()}, "labels": labels}


def _worker(path, save_to) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    inputs = _inputs(load_processor(path))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=F64,
                                                        distributed_config=DistributedConfig(tp_size=2)).train()
    equivalence(model, transformers_model(path), inputs, steps=1)
    model.save_pretrained(save_to)


@pytest.mark.distributed
def test_trains_on_the_processors_output_and_saves_the_processor(checkpoint, tmp_path):
    processor = load_processor(checkpoint)
    inputs = _inputs(processor)
    assert {"pixel_values", "image_grid_thw", "attention_mask"} <= set(inputs) and (inputs["input_ids"] == IMAGE).sum()
    run_distributed(_worker, 2, checkpoint, tmp_path / "saved", timeout=300)
    again = _inputs(load_processor(tmp_path / "saved"))  # the processor files were written beside the weights
    assert inputs.keys() == again.keys() and all(torch.equal(inputs[k], again[k]) for k in inputs)


def test_a_checkpoint_without_processor_is_refused(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    with pytest.raises(ValueError, match=r"holds no processor.*processor.save_pretrained"):
        load_processor(bare)
