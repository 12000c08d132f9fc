"""What the vision-language tests share: a tiny config of each family (built with transformers: its own config
classes, every size small), a checkpoint transformers writes from it (every parameter random), and a labelled batch
of each family's inputs under transformers' names, made without a processor: pixel values of the shape its
processor returns, and as many image placeholder tokens in the ids as its tower and projector make features (asked
of transformers' own `get_image_features`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tests.helpers.checkpoints import Checkpoints, randomize
from tests.helpers.compare import full_params
from tptrain.parallel.shards import gather_full

F64 = torch.float64
VOCAB, B, S_TEXT = 128, 2, 8  # each row: an image's placeholders, then S_TEXT text tokens
IMAGE, START, END = 120, 121, 122  # the image placeholder id and the ids around it (families with such tokens)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
# transformers' norms and its loss compute in fp32 inside an fp64 model: a sum taken in another order moves results by
# fp32 rounding (~1e-7); a layout bug is an O(1) error.
TOL = dict(rtol=1e-6, atol=1e-6)
STEP_TOL = dict(rtol=1e-5, atol=1e-5)  # AdamW divides by sqrt(v): a near-zero gradient's rounding, magnified


@dataclass(frozen=True)
class Family:
    """config(): transformers' config of a tiny model; pixels(gen): {input name: tensor} of a batch of B images,
    one per row; around: the ids before and after each image's placeholders; extra(ids): other inputs."""

    config: Callable[[], Any]
    pixels: Callable[[torch.Generator], dict[str, torch.Tensor]]
    around: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    extra: Callable[[torch.Tensor], dict] = field(default=lambda ids: {})


def _config(model_type: str, **kwargs):
    import transformers
    return transformers.CONFIG_MAPPING[model_type](**kwargs)


def _qwen2_5_vl():
    return _config("qwen2_5_vl", text_config=dict(TEXT, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])), vision_config=dict(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=123, vision_start_token_id=START, vision_end_token_id=END)


def _qwen_pixels(gen: torch.Generator) -> dict[str, torch.Tensor]:
    # 4 x 4 patches of 3 x 2 x 4 x 4 values each image; 2 x 2 merged: 4 placeholders
    return {"pixel_values": torch.randn(B * 16, 3 * 2 * 4 * 4, generator=gen),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * B)}


def _images(gen: torch.Generator, size: int = 16) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(B, 3, size, size, generator=gen)}


# A 16 x 16 image in 4 x 4 patches: 16 patch features, merged or pooled 2 x 2 by most projectors.
_SIGLIP = dict(VISION, image_size=16, patch_size=4)
_GEMMA3 = dict(TEXT, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
_LLAMA4_TEXT = dict(TEXT, intermediate_size_mlp=48, num_local_experts=2, num_experts_per_tok=1,
                    interleave_moe_layer_step=2, attention_chunk_size=64, no_rope_layers=[1, 1])
# its adapter's fc1 reads intermediate_size = projector_input_dim / pixel_shuffle_ratio ** 2 features
_LLAMA4_VISION = dict(VISION, intermediate_size=128, image_size=16, patch_size=4, vision_output_dim=32,
                      projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)
FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family(_qwen2_5_vl, _qwen_pixels, ((START,), (END,))),
    "gemma3": Family(lambda: _config("gemma3", text_config=_GEMMA3, vision_config=_SIGLIP, mm_tokens_per_image=4,
                                     image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END),
                     _images, ((START,), (END,)), lambda ids: {"token_type_ids": (ids == IMAGE).long()}),
    "llava": Family(lambda: _config("llava", text_config=dict(TEXT, model_type="llama"),
                                    vision_config=dict(_SIGLIP, model_type="clip_vision_model"),
                                    image_token_index=IMAGE), _images),
    "smolvlm": Family(lambda: _config("smolvlm", text_config=dict(TEXT, model_type="llama"), vision_config=_SIGLIP,
                                      scale_factor=2, image_token_id=IMAGE),
                      lambda gen: {"pixel_values": _images(gen)["pixel_values"][:, None]}, ((START,), (END,))),
    "mistral3": Family(lambda: _config("mistral3", text_config=dict(TEXT, model_type="mistral"), vision_config=dict(
        _SIGLIP, model_type="pixtral", head_dim=8), spatial_merge_size=2, image_token_index=IMAGE),
                       lambda gen: {**_images(gen), "image_sizes": torch.tensor([[16, 16]] * B)}),
    "internvl": Family(lambda: _config("internvl", text_config=dict(TEXT, model_type="qwen2"), vision_config=dict(
        VISION, image_size=[16, 16], patch_size=[4, 4]), downsample_ratio=0.5, image_token_id=IMAGE), _images,
                       ((START,), (END,))),
    # two vision heads: at tp 4 the derived plan cannot split them, so the tower stays whole (with a note)
    "llava_2_vision_heads": Family(lambda: _config("llava", text_config=dict(TEXT, model_type="llama"), vision_config=dict(
        _SIGLIP, model_type="clip_vision_model", num_attention_heads=2), image_token_index=IMAGE), _images),
    "llama4": Family(lambda: _config("llama4", text_config=_LLAMA4_TEXT, vision_config=_LLAMA4_VISION,
                                     image_token_index=IMAGE), _images),
}


def write_checkpoint(path: Path, model_type: str):
    """(path, transformers' model): a random tiny checkpoint written by transformers' save_pretrained."""
    import transformers
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(FAMILIES[model_type].config()).eval()
    randomize(hf)
    hf.save_pretrained(path)
    return path, hf


class VisionCheckpoints(Checkpoints):
    """write_checkpoint of each model type; `finish(model_type, directory, model)` (files beside the weights, a
    batch) gives what the tests get."""

    def __init__(self, types, finish: Callable) -> None:
        super().__init__(types)
        self.finish = finish

    def write_one(self, index: int, name: str, directory: Path) -> Any:
        return self.finish(name, *write_checkpoint(directory, name))


def image_tokens(hf, pixels: dict[str, torch.Tensor]) -> int:
    """How many placeholders each image needs: the features transformers' tower and projector make of it."""
    with torch.no_grad():
        features = hf.get_image_features(**{k: v.to(hf.dtype) if v.is_floating_point() else v
                                            for k, v in pixels.items()})
    if not torch.is_tensor(features) and not isinstance(features, (list, tuple)):  # a model output
        features = features.pooler_output if features.pooler_output is not None else features.last_hidden_state
    rows = torch.cat([f.reshape(-1, f.shape[-1]) for f in features]) if isinstance(features, (list, tuple)) else \
        features.reshape(-1, features.shape[-1])
    return rows.shape[0] // B


def batch(model_type: str, hf, seed: int = 1) -> dict[str, torch.Tensor]:
    """One labelled batch of B rows: [before, image placeholders, after, S_TEXT text tokens], labels -100 on
    everything but the text (and one text token of row 1), the pixels in fp64."""
    family = FAMILIES[model_type]
    gen = torch.Generator().manual_seed(seed)
    pixels = {k: v.to(F64) if v.is_floating_point() else v for k, v in family.pixels(gen).items()}
    before, after = family.around
    n = image_tokens(hf, pixels)
    prefix = [*before, *([IMAGE] * n), *after]
    text = torch.randint(3, IMAGE, (B, S_TEXT), generator=gen)
    ids = torch.cat([torch.tensor([prefix] * B), text], dim=1)
    labels = ids.clone()
    labels[:, :len(prefix)] = -100
    labels[1, -3] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), **pixels, **family.extra(ids)}


def transformers_model(path):
    """transformers' model in fp64, train mode, its experts (if any) through the eager loop (no fp64 kernel)."""
    import transformers
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=F64).train()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    return hf


def equivalence(model, ref, inputs: dict, steps: int = 3) -> None:
    """The TP `model` against transformers' `ref` on one process: the loss of each of `steps` AdamW steps, every
    gradient (gathered) of the first, every parameter after the last."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)  # as the survey's: a near-zero gradient's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)      # rounding is not a whole step
    for step in range(steps):
        ref_loss, loss = ref(**inputs).loss, model(**inputs).loss
        torch.testing.assert_close(loss, ref_loss.to(F64), **TOL, msg=lambda m: f"loss at step {step}: {m}")
        ref_loss.backward(), loss.backward()
        if step == 0:
            grads = gathered_grads(model)
            for name, p in ref.named_parameters():
                if p.grad is None:  # a part this input does not reach (SigLIP's pooling head): in neither model
                    assert grads[name] is None, name
                    continue
                torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **STEP_TOL, msg=lambda m: f"{name} after {steps}: {m}")


def gathered_grads(model) -> dict:
    """Every parameter's gradient at full shape (None where the input does not reach it: on every rank alike)."""
    layout = model.parallel.tp
    return {n: None if p.grad is None else gather_full(p.grad, layout.specs[n], layout.ctx)
            for n, p in model.named_parameters()}


QWEN_SPECIALS = {"<|image_pad|>": IMAGE, "<|vision_start|>": START, "<|vision_end|>": END, "<|video_pad|>": 123,
                 "<|endoftext|>": 124}


def qwen_processor():
    """A Qwen2.5-VL processor for the tiny qwen2_5_vl config, built offline: a word-level tokenizer (w0 .. w119,
    then the special tokens at the config's ids) and the image processor's patches (4 x 4, merged 2 x 2, images of
    16 x 16 pixels). Needs torchvision (its video processor)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(IMAGE)}, **QWEN_SPECIALS}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="<|endoftext|>",
                                                     eos_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)[:4]})
    patches = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    return transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**patches, min_pixels=16 * 16, max_pixels=16 * 16),
        tokenizer=tokenizer, video_processor=transformers.Qwen2VLVideoProcessor(**patches))
