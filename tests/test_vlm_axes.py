"""Context and pipeline parallelism of vision-language models (tptrain.AutoModelForImageTextToText): the tower and
projector run on the whole batch's images, their features are placed into the whole sequence, the multimodal position
ids (Qwen2.5-VL's rows for time, height and width) are computed on it, and only then is the sequence split over cp, at
the text decoder's entry; a pipeline's first stage holds the tower and projector beside the embedding, each
microbatch taking its own samples' images. Against transformers on one process (fp64): the loss, every gradient (the
tower's included) and 3 AdamW steps at cp 2 and tp 2 x cp 2; the Trainer (image-text records through the
checkpoint's processor) at cp 2, pp 2 and (slow) tp 2 x cp 2 x pp 2; what cannot compose refused before any worker.

    .venv-vision/bin/python -m pytest tests/test_vlm_axes.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.vlm_utils import F64, IMAGE, batch, equivalence, transformers_model, write_checkpoint

pytestmark = pytest.mark.vision
CP_TYPES = ("qwen2_5_vl", "llava", "gemma3")


def cp_batch(model_type: str, hf, multiple: int = 4) -> dict[str, torch.Tensor]:
    """vlm_utils' batch with text appended up to a multiple of `multiple` tokens (2 x cp chunks), and Qwen's
    mm_token_type_ids (what its processor returns: transformers then computes the multimodal RoPE positions)."""
    inputs = batch(model_type, hf)
    ids = inputs["input_ids"]
    extra = -ids.shape[1] % multiple + multiple
    more = torch.randint(3, IMAGE, (ids.shape[0], extra), generator=torch.Generator().manual_seed(5))
    for key, tail in (("input_ids", more), ("labels", more), ("attention_mask", torch.ones_like(more))):
        inputs[key] = torch.cat([inputs[key], tail], dim=1)
    if "token_type_ids" in inputs:
        inputs["token_type_ids"] = (inputs["input_ids"] == IMAGE).long()
    if model_type == "qwen2_5_vl":
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE).int()
    return inputs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in CP_TYPES:
        path, hf = write_checkpoint(tmp_path_factory, model_type)
        out[model_type] = (path, cp_batch(model_type, hf))
    return out


def _cp_worker(checkpoints: dict, layout: dict) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    for model_type, (path, inputs) in checkpoints.items():
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=F64, distributed_config=DistributedConfig(**layout)).train()
        assert model.parallel.cp is not None and model.parallel.cp.entry
        equivalence(model, transformers_model(path), inputs)


@pytest.mark.distributed
def test_cp2_matches_transformers(checkpoints):
    run_distributed(_cp_worker, 2, checkpoints, dict(cp_size=2, tp_size=1), timeout=600)


@pytest.mark.distributed
def test_tp2_cp2_matches_transformers(checkpoints):
    run_distributed(_cp_worker, 4, {t: checkpoints[t] for t in ("qwen2_5_vl", "gemma3")}, dict(cp_size=2, tp_size=2),
                    timeout=600)
