"""The vision-language survey's per-type table (scripts/hf_vlm_survey.py): where the generic tiny config or batch
does not fit a model type, what that type needs, each with its reason. Config overrides go over the tiny config (a
sub-config's keys merged into its tiny values); a pixel builder makes the type's image inputs as its processor
returns them, for 2 images (one per row)."""
from __future__ import annotations

from typing import Callable

import torch

# {model_type: {config key: value, or sub-config key: {its keys}}}
OVERRIDES: dict[str, dict] = {
    **{t: dict(mm_tokens_per_image=16) for t in ("gemma3", "shieldgemma2")},  # 8 x 8 patches pooled to 4 x 4
    # a vision tower (the default config has none: text only)
    "gemma4": dict(vision_config={}),
    # ... its patch embedding alone (no encoder layers), at the text's width
    "gemma4_unified": dict(vision_config=dict(mm_embed_dim=64, output_proj_dims=64, mm_posemb_size=16, patch_size=4,
                                              pooling_kernel_size=2)),
    "diffusion_gemma": dict(text_config=dict(top_k_experts=2)),  # its MoE layers route to none by default
    # its adapter reads projector_input_dim / pixel_shuffle_ratio ** 2 features of the tower's output width
    "llama4": dict(vision_config=dict(intermediate_size=256, vision_output_dim=64, projector_input_dim=64,
                                      projector_output_dim=64)),
    # one grid pinpoint, the tiny tower's image size: one crop per image
    **{t: dict(image_grid_pinpoints=[[112, 112]]) for t in ("llava_next", "llava_next_video", "llava_onevision")},
    # its ViT merger after the one layer left
    **{t: dict(vision_config=dict(insert_layer_id=0)) for t in ("minicpm_ocr", "minicpmv4_6", "minicpmv4_7")},
    "vipllava": dict(vision_feature_layers=[-2, -1]),  # the tower's last two hidden states (of its one layer)
    # their attention: as many KV heads as query heads
    **{t: dict(text_config=dict(num_key_value_heads=4)) for t in ("glm5_next", "mistral_large4")},
    # one 2 x 2 window downsampling, one deepstack injection, its spatial groups into the 2 text layers
    "granite4_vision": dict(downsample_rate="1/2", deepstack_layer_map=[[1, 0]], spatial_target_layers=[0, 0, 1, 1],
                            image_grid_pinpoints=[[256, 256]], projector_dropout=0.0),
    # its indexed attention's token indexer (the default config leaves it unset): tiny, one key head
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                                       indexer_compress_ratio=2)),
    # its tower is timm's (TimmWrapper): a Perception Encoder ViT one block deep, 2 x 2 patches
    "perception_lm": dict(vision_config=dict(
        architecture="vit_pe_core_large_patch14_336", num_classes=0, global_pool="",
        model_args=dict(embed_dim=64, depth=1, num_heads=4, img_size=(28, 28), class_token=True,
                        init_values=0.1, ref_feat_shape=(2, 2))),
        projector_pooling_ratio=1),
    "muse_spark": dict(out_hidden_size=256, projector_hidden_size=128),  # its tower's output: 2 x 2 merged, 64 wide
    "aria": dict(projector_patch_to_query_dict={64: 16}),  # its projector's queries per patch count: 8 x 8 -> 16
    # its default text config names no layer's MLP kind (transformers' own default does not build)
    # ... and its SAM encoder's output must be as wide as the encoder reading it (transformers' own test sizes)
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"]), vision_config=dict(
        sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                        patch_size=2, window_size=4, global_attn_indexes=[1], downsample_channels=[32, 64]),
        encoder_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4))),
}


def square(size: int, *, frames: int | None = None) -> Callable:
    """Pixels of 2 square images `size` pixels wide: (2, 3, size, size), or with a frames / crops dimension."""
    def pixels(config, gen: torch.Generator) -> dict:
        shape = (2, *([frames] if frames else []), 3, size, size)
        return {"pixel_values": torch.randn(*shape, generator=gen)}
    return pixels


def _side(config) -> int:
    size = config.image_size
    return size[0] if isinstance(size, (list, tuple)) else size


def _two_resolutions(config, gen: torch.Generator) -> dict:
    """DeepSeek-VL hybrid's: each image at the low-resolution tower's size and at the high-resolution one's."""
    return {"pixel_values": torch.randn(2, 3, _side(config.vision_config), _side(config.vision_config), generator=gen),
            "high_res_pixel_values": torch.randn(2, 3, _side(config.high_res_vision_config),
                                                 _side(config.high_res_vision_config), generator=gen)}


def _positioned_patches(config, gen: torch.Generator) -> dict:
    """Gemma 4's: each image's patches flattened, their (x, y) positions beside them, padded with patches at
    (-1, -1) as its image processor pads to max_patches: 2 x 2 pooled tokens (Gemma 4 unified's: 4 x 4 patches of
    model_patch_size, one token each), then one token's worth of padding."""
    vision = config.vision_config
    unified = hasattr(vision, "model_patch_size")
    pool = 1 if unified else vision.pooling_kernel_size
    side, patch = (4, vision.model_patch_size) if unified else (2 * pool, vision.patch_size)
    x, y = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy")
    positions = torch.cat([torch.stack([x, y], dim=-1).reshape(-1, 2), torch.full((pool * pool, 2), -1)])
    return {"pixel_values": torch.randn(2, len(positions), 3 * patch * patch, generator=gen),
            "image_position_ids": positions.expand(2, -1, -1).clone()}


def _anyres(config, gen: torch.Generator) -> dict:
    """LLaVA-NeXT's: each image as its base view and one crop at the one grid pinpoint (ANYRES below), its size."""
    side = _side(config.vision_config)
    return {"pixel_values": torch.randn(2, 2, 3, side, side, generator=gen),
            "image_sizes": torch.tensor([[side, side]] * 2)}


def _tiles(config, gen: torch.Generator) -> dict:
    """Granite Docling's: one tile per image, its mask of real tiles."""
    side = _side(config.vision_config)
    return {"pixel_values": torch.randn(2, 1, 3, side, side, generator=gen),
            "pixel_attention_mask": torch.ones(2, 1, dtype=torch.bool)}


def _patch_strip(config, gen: torch.Generator) -> dict:
    """MiniCPM-V's (NaViT): every image's patches side by side in one strip (1, 3, patch, patches * patch), each
    image's grid in patches (8 x 8: merged twice 2 x 2, 4 tokens)."""
    patch = config.vision_config.patch_size
    return {"pixel_values": torch.randn(1, 3, patch, 2 * 64 * patch, generator=gen),
            "target_sizes": torch.tensor([[8, 8]] * 2, dtype=torch.int32)}


# {model_type: pixels(config, generator) -> {input name: tensor}}: the image inputs of 2 images, one per row, where the
# generic layouts (hf_vlm_survey._candidates) miss the type's
PIXELS: dict[str, Callable] = {
    "deepseek_ocr2": square(16),  # its SAM encoder's image size
    "deepseek_vl_hybrid": _two_resolutions,
    **{t: _anyres for t in ("llava_next", "llava_next_video", "llava_onevision", "granite4_vision")},
    "granite_docling": _tiles,
    "perception_lm": square(28, frames=1),  # one tile per image, at its timm tower's size
    **{t: _patch_strip for t in ("minicpm_ocr", "minicpmv4_6", "minicpmv4_7")},
    **{t: _positioned_patches for t in ("gemma4", "gemma4_unified", "diffusion_gemma")},
}

# {model_type: why}: types whose fp64 model computes a step in fp32 (transformers' own code), so that tptrain's exact
# reorderings of fp64 sums (a row-parallel all-reduce) round differently there: the steps stage's losses are compared
# at fp32's bound (1e-5 relative) instead of fp64's (1e-7); logits and gradients keep theirs
FP32_INSIDE: dict[str, str] = {
    "llama4": "its text and vision RoPE in complex64 (view_as_complex(q.float()))",
}

# {model_type: why}: types the survey cannot build or train as a tiny causal image-text model, said beside the error
NOT_SURVEYED: dict[str, str] = {
    "diffusion_gemma": "a diffusion decoder: its logits are not next-token logits of the input ids",
    "t5gemma2": "an encoder-decoder: no causal loss on the input ids alone",
    "mistral4": "its config has no vision tower (a text model registered as image-text-to-text), and the tiny one "
                "the survey derives does not run in transformers (its MLA RoPE widths)",
    "gemma3n": "its vision tower is timm's MobileNetV5, 294M parameters at every config",
}
