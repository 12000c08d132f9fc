"""`tptrain plan` on vision-language models: the vision tower's split and parameters, and under --train its
activations, an image's tokens counted per microbatch (tptrain/diagnostics: TowerShape, `tower_activations`).

The tower term against a measured forward of the tower (transformers' `get_image_features`, fp32, one image of 256
patches): the tensor bytes it leaves alive (LiveTensorBytes, as benchmarks/bench_plan.py measures) are what the
planner counts, within 5%, for Qwen2.5-VL (RMSNorm, fused qkv, rotary positions, gated MLP, a patch merger), LLaVA
(CLIP: LayerNorm, a class token, quick_gelu) and Gemma 3 (SigLIP).

    .venv-vision/bin/python -m pytest tests/test_vlm_plan.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tptrain.cli import main

pytestmark = pytest.mark.vision
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
TOWER = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4)  # 224 px in patches of 14: 256 of them
CONFIGS = {
    "qwen2_5_vl": lambda: dict(text_config=dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                           mrope_section=[1, 1, 2])),
                               vision_config=dict(depth=2, hidden_size=64, intermediate_size=160, num_heads=4,
                                                  out_hidden_size=32, patch_size=14, window_size=112,
                                                  fullatt_block_indexes=[1])),
    "llava": lambda: dict(text_config=dict(TEXT, model_type="llama"), vision_config=dict(
        TOWER, model_type="clip_vision_model", num_hidden_layers=2, image_size=224, patch_size=14)),
    "gemma3": lambda: dict(text_config=TEXT, mm_tokens_per_image=64, vision_config=dict(
        TOWER, num_hidden_layers=2, image_size=224, patch_size=14, vision_use_head=False)),
}


def _config(model_type: str):
    import transformers
    return transformers.CONFIG_MAPPING[model_type](**CONFIGS[model_type]())


def _pixels(model_type: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if model_type == "qwen2_5_vl":  # 16 x 16 patches of 3 x 2 x 14 x 14 values
        return {"pixel_values": torch.randn(256, 3 * 2 * 14 * 14, generator=gen),
                "image_grid_thw": torch.tensor([[1, 16, 16]])}
    return {"pixel_values": torch.randn(1, 3, 224, 224, generator=gen)}


def _features_bytes(features) -> int:
    """The bytes of the image features get_image_features returns (a model output's pooled features, else its last
    hidden state; the hidden states it may also hold are the layers' outputs, which the layers keep anyway)."""
    if hasattr(features, "last_hidden_state"):
        features = features.pooler_output if features.pooler_output is not None else features.last_hidden_state
    flat = features if isinstance(features, (list, tuple)) else [features]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat}.values())


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_tower_term_matches_a_measured_forward(model_type):
    import transformers

    from tptrain.diagnostics.activations import precision, tower_activations
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.tensor_meter import LiveTensorBytes

    config = _config(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).train()
    pixels = _pixels(model_type)
    with LiveTensorBytes([*model.parameters(), *model.buffers(), *pixels.values()]) as meter:
        before = meter.current
        features = model.model.get_image_features(**pixels)
    measured = meter.current - before - _features_bytes(features)
    tower = ModelShapes.of(config, dtype=torch.float32).tower
    assert tower.tokens(224) == 256 + (model_type == "llava")  # CLIP's class token
    predicted = sum(tower_activations(tower, tower.tokens(224), 1, precision(4, bf16=False, fsdp=False)).values())
    assert abs(predicted / measured - 1) < 0.05, (model_type, predicted, measured)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    _config("qwen2_5_vl").save_pretrained(path)
    return path


def _plan(path, capsys, *flags: str) -> dict:
    assert main(["plan", str(path), "--train", "--world", "2", "--batch-size", "2", "--seq-len", "1024",
                 "--layout", "tp=2", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["layouts"][0]


def test_plan_train_counts_the_tower(qwen_dir, capsys):
    """The tower's parameters are in the plan's (each split as the plan splits it), and each image of a microbatch
    adds the tower's term to the activations (2 sequences x 2 images); a tower of any size needs --image-size."""
    from tptrain.diagnostics.activations import precision, tower_activations
    from tptrain.diagnostics.model_shapes import ModelShapes

    shapes = ModelShapes.of(_config("qwen2_5_vl"), dtype=torch.float32)
    tower = shapes.tower
    assert (tower.root, tower.depth, tower.fused_qkv, tower.rotary, tower.act_tensors) == ("model.visual", 2, True,
                                                                                            True, 4)
    assert shapes.tower_tp(2, 1) == 2 and shapes.tower_tp(3, 1) == 1  # 4 heads: split at tp 2, whole at tp 3
    in_tower = [p for p in shapes.params(2, 1) if p.name.startswith("model.visual.")]
    assert {p.unit for p in in_tower} == {"first"}  # in the root's FSDP2 unit
    qkv = next(p for p in in_tower if p.name == "model.visual.blocks.0.attn.qkv.weight")
    assert qkv.shape == (96, 64)  # 3 x 64 rows, each part split over 2 ranks
    with_images = _plan(qwen_dir, capsys, "--image-size", "224", "--images-per-sample", "2")
    without = _plan(qwen_dir, capsys, "--images-per-sample", "0")
    term = tower_activations(tower, 2 * 2 * 256, 2, precision(4, bf16=False, fsdp=False))
    assert with_images["terms"]["tower_activations"] == term and not without["terms"]["tower_activations"]
    assert with_images["terms"]["peak_phase"] == without["terms"]["peak_phase"] == "backward of layer 1"
    assert with_images["terms"]["activations"] - without["terms"]["activations"] == sum(term.values())
    assert main(["plan", str(qwen_dir), "--train", "--world", "2", "--batch-size", "2", "--seq-len", "128"]) == 1
    assert "takes images of any size: give --image-size" in capsys.readouterr().err


def test_plan_shows_the_tower_split(qwen_dir, capsys):
    assert main(["plan", str(qwen_dir), "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "model.visual.blocks.[0-1].attn.qkv" in out and "fused along dim 0, each segment split" in out
    assert "model.language_model.layers.[0-1].self_attn.q_proj" in out and "layout OK" in out
