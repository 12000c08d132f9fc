"""Which vision-language (image-text-to-text) model types of the installed transformers tptrain trains at tp N: every
type whose config, or its text config, declares base_model_tp_plan. For each, a tiny checkpoint transformers writes
(the text config at hf_backend_survey's TINY sizes, the vision tower's depth cut to one layer and its image to a few
patches; a type's own needs from scripts/hf_vlm_types.py), a labelled batch with an image (pixel values in the
layout the tower takes: a common one, the type's own image processor's, or the type's builder; and as many
placeholder tokens as transformers' own `get_image_features` makes features of it; a type whose tower none of them
fits gets a text-only batch, marked so), then the stages of hf_checkpoint_survey.py (scripts/hf_survey_stages.py:
load, forward, backward, steps, save; no plan stage) through `tptrain.AutoModelForImageTextToText`, against
transformers on one process, and (--peer) transformers' own TP at tp N on the same checkpoint and batch.

    PYTHONPATH=. nice -n 10 .venv-vision/bin/python scripts/hf_vlm_survey.py --tp-size 2 --peer [--types qwen2_5_vl,gemma3]
    PYTHONPATH=. nice -n 10 .venv-vision/bin/python scripts/hf_vlm_survey.py --tp-size 1 --cp-size 2   # or --pp-size 2

--cp-size / --pp-size: the layout stages instead (load, train, save: scripts/hf_vlm_layouts.py), on tp x cp x pp ranks.

Prints the markdown table (type x stages, the image column, the peer column), each failure's reason and the count.
About 15 minutes on 2 CPU cores at tp 2 (7-8 GB at most); run it in chunks of types on a shared machine.
"""
from __future__ import annotations

import argparse
import inspect
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from hf_backend_survey import TINY
from hf_checkpoint_survey import TINY_OVERRIDES, _append, spelled, survey_loop
from hf_survey_stages import LAYOUT_STAGES, reference, run_stages, steps_dtype
from hf_vlm_layouts import cp_batch, run_vlm_layout_stages
from hf_vlm_types import FP32_INSIDE, NOT_SURVEYED, OVERRIDES, PIXELS

AUTO = "AutoModelForImageTextToText"
STAGES = ("load", "forward", "backward", "steps", "save")
DEPTH_KEYS = ("num_hidden_layers", "depth", "num_layers", "encoder_layers", "n_layers")
TOKEN_ID = 100  # the first of the ids given to a config's special tokens (image, start/end of image, ...)
# the ids around an image's placeholders, where the config has them (Qwen's rope index finds images by the first)
START_TOKENS = ("vision_start_token_id", "boi_token_index", "boi_token_id", "image_start_token_id")
END_TOKENS = ("vision_end_token_id", "eoi_token_index", "eoi_token_id", "image_end_token_id")
# a tower's widths in the narrow tiny config (16 per head); its output width follows the text's
VISION_SHRINK = dict(hidden_size=64, embed_dim=64, intermediate_size=128, mlp_dim=128, num_attention_heads=4, num_heads=4,
                     num_key_value_heads=4, head_dim=16,
                     out_hidden_size=TINY["hidden_size"], text_hidden_size=TINY["hidden_size"],
                     adapter_in_dim=64, adapter_input_size=64, adapter_out_dim=TINY["hidden_size"], projection_dim=TINY["hidden_size"])
MAX_PARAMETERS = 200_000_000  # a tiny config above it shrank nothing (fp64 steps on 3 processes: GBs each)


def model_types() -> list[str]:
    """The image-text-to-text types whose config (or its text config) declares base_model_tp_plan."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = transformers.CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a type whose default config does not build: not surveyed
            continue
        text = config.get_text_config()
        if getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def tiny_configs(model_type: str) -> list:
    """The type's tiny configs to try, smallest first: the other towers narrow too (VISION_SHRINK) or only one layer
    deep. Those transformers refuses are left out."""
    out = []
    for narrow, mrope in ((True, False), (True, True), (False, False), (False, True)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(tiny_config(model_type, narrow=narrow, mrope=mrope))
        except Exception as exc:  # noqa: BLE001 - transformers refuses it: the next
            error = exc
    if not out:
        raise error
    return out


def tiny_config(model_type: str, *, narrow: bool = True, mrope: bool = False):
    """The type's config: its text config at TINY's sizes, its sub-configs of other towers one layer deep (and, with
    `narrow`, at VISION_SHRINK's widths, their images a few patches wide), its special token ids inside the tiny
    vocabulary; `mrope`: multimodal RoPE sections for the tiny heads (a model whose rotary embedding has its own
    default sections for the full-size heads: Qwen2-VL's, GLM-4V's)."""
    import transformers

    config = transformers.CONFIG_MAPPING[model_type]()
    overrides = dict(OVERRIDES.get(model_type, {}))
    kwargs = {}
    for key, sub_class in (getattr(config, "sub_configs", {}) or {}).items():
        sub = getattr(config, key, None)
        if sub is None and key in overrides:  # a tower the default leaves out (Gemma 4's): its own defaults
            sub = (sub_class.config_class if hasattr(sub_class, "config_class") else sub_class)()
        if sub is not None:
            kwargs[key] = {**(_tiny_text(sub.to_dict(), mrope) if key == "text_config" else
                              _tiny_tower(sub.to_dict(), narrow)), **overrides.pop(key, {})}
    tokens = {k: TOKEN_ID + i for i, k in enumerate(sorted(
        k for k, v in config.to_dict().items() if (isinstance(v, int) or v is None and k.startswith("image_token"))
        and (k.endswith("token_id") or k.endswith("token_index")) and not k.startswith(("pad", "bos", "eos"))))}
    if "text_config" not in kwargs:  # no sub-configs: the config is the text model's own (Mistral 4's)
        kwargs.update(_tiny_text(config.to_dict(), mrope))
    # the composite config's own copies of the text's sizes (PaliGemma's projection_dim, Ovis 2's vocab_size)
    top = {k: TINY[t] for k, t in (("hidden_size", "hidden_size"), ("projection_dim", "hidden_size"),
                                   ("vocab_size", "vocab_size")) if type(getattr(config, k, None)) is int}
    # ... and of the tower's width (Kimi K2.5's projector input, Nemotron H Omni's)
    top.update({k: VISION_SHRINK["hidden_size"] for k in ("vision_hidden_size", "projection_hidden_size")
                if narrow and type(getattr(config, k, None)) is int})
    return type(config)(**{**kwargs, **top, **tokens, **overrides})


def _tiny_tower(values: dict, narrow: bool) -> dict:
    """A tower's config values (and its own sub-configs') one layer deep; `narrow`: VISION_SHRINK's widths where it
    has those keys (ints), its output width the text's, and its image 4 x merge patches wide."""
    depth = next((values[k] for k in DEPTH_KEYS if isinstance(values.get(k), int)), None)
    values = {**values, **{k: 1 for k in DEPTH_KEYS if isinstance(values.get(k), int)},
              **{k: v[:1] for k, v in values.items() if isinstance(v, list) and depth and len(v) == depth > 1},
              **{k: _tiny_tower(v, narrow) for k, v in values.items() if isinstance(v, dict) and "model_type" in v},
              **{k: v[:1] for k, v in values.items() if k.endswith("layer_types") and isinstance(v, list)},
              **{k: [0] for k, v in values.items() if k.endswith(("_indexes", "_indices")) and isinstance(v, list)
                 and v and all(isinstance(i, int) for i in v)},  # the layers picked out: the one left
              **({"per_layer_config": {}} if isinstance(values.get("per_layer_config"), dict) else {})}
    if not narrow:
        return values
    values.update({k: v for k, v in VISION_SHRINK.items() if isinstance(values.get(k), int)})
    patch = values.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    size = values.get("image_size")
    if isinstance(patch, int) and isinstance(size, (int, list, tuple)):
        side = patch * 4 * (values.get("spatial_merge_size") or 2)
        values["image_size"] = side if isinstance(size, int) else [side] * len(size)
    return values


def _tiny_text(values: dict, mrope: bool = False) -> dict:
    """A text config's values at TINY's sizes (and the causal survey's overrides of its type): per-layer lists cut
    to its layers (the first and last kinds), multimodal RoPE sections scaled to the head size."""
    text = {k: v for k, v in TINY.items() if k != "layer_types" or v is not None}
    depth = values.get("num_hidden_layers")
    values = {**values, **{k: v for k, v in text.items() if k in ("vocab_size", "hidden_size") or k in values and
                           isinstance(values[k], (int, type(None))) and not isinstance(values[k], bool)},
              **TINY_OVERRIDES.get(values.get("model_type"), {})}
    if isinstance(values.get("per_layer_config"), dict):  # keyed by layers the tiny model does not have
        values["per_layer_config"] = {}
    layers = values.get("num_hidden_layers", 2)
    for key, value in list(values.items()):
        if key.endswith("layer_types") and isinstance(value, list) and len(value) != layers:
            values[key] = [value[0]] * (layers - 1) + [value[-1]]
        elif isinstance(value, list) and len(value) == depth > layers:  # one per layer (Mistral Large 4's sources)
            values[key] = value[:layers]
    rope = values.get("rope_parameters")
    if mrope and isinstance(rope, dict) and "rope_type" in rope:
        rope.setdefault("mrope_section", [1, 1, 1])  # scaled below
    for params in (rope.values() if isinstance(rope, dict) and "rope_type" not in rope else [rope]):
        if isinstance(params, dict) and params.get("mrope_section"):
            rotary = values.get("head_dim", 16) * (params.get("partial_rotary_factor")
                                                   or values.get("partial_rotary_factor") or 1)  # GLM-4.5V's half
            half, sections = int(rotary) // 2, params["mrope_section"]
            scaled = [max(1, s * half // sum(sections)) for s in sections]
            params["mrope_section"] = [*scaled[:-1], half - sum(scaled[:-1])]
    return values


def _candidates(config, gen: torch.Generator) -> list[dict]:
    """Pixel layouts a tower may take, for one image per row of 2: (batch, channels, size, size), with one image
    dimension more, each with the image sizes too, flattened patches (of 2 frames, or 1) with their (t, h, w) grid."""
    vision = getattr(config, "vision_config", None)
    patch = getattr(vision, "patch_size", 14)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    size = getattr(vision, "image_size", None)
    size = (size[0] if isinstance(size, (list, tuple)) else size) or 4 * patch
    merge = getattr(vision, "spatial_merge_size", 2) or 2
    temporal = getattr(vision, "temporal_patch_size", 2) or 2
    channels = getattr(vision, "num_channels", 3) or 3
    image = torch.randn(2, channels, size, size, generator=gen)
    grid = 2 * merge
    flat = [{"pixel_values": torch.randn(2 * grid * grid, channels * t * patch * patch, generator=gen),
             "image_grid_thw": torch.tensor([[1, grid, grid]] * 2)} for t in (temporal, 1)]
    sizes = {"image_sizes": torch.tensor([[size, size]] * 2)}
    return [{"pixel_values": image}, {"pixel_values": image, **sizes}, {"pixel_values": image[:, None]},
            {"pixel_values": image[:, None], **sizes}, *flat]


def processor_pixels(config, model, gen: torch.Generator) -> dict | None:
    """The image inputs the type's own image processor (its defaults, the tiny tower's patch and merge sizes) makes
    of 2 small random images: for towers whose inputs none of the generic layouts fits (patch grids under the
    type's own names: image_grid_hw, image_merge_sizes, ...). None without an image processor class."""
    import numpy as np
    import transformers
    from PIL import Image
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type) or {}
    cls = getattr(transformers, names.get("torchvision") or names.get("pil") or "", None)
    if cls is None:
        return None
    vision = getattr(config, "vision_config", None)
    sizes = {k: getattr(vision, v) for k, v in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                                                ("temporal_patch_size", "temporal_patch_size"))
             if isinstance(getattr(vision, v, None), int)}
    processor = cls()
    processor = cls(**{k: v for k, v in sizes.items() if hasattr(processor, k)})
    pixels = torch.randint(0, 255, (56, 56, 3), generator=gen, dtype=torch.uint8).numpy().astype(np.uint8)
    out = processor(images=[Image.fromarray(pixels)] * 2, return_tensors="pt")
    owners = (model, model.base_model)
    wanted = {n for o in owners if hasattr(o, "get_image_features")
              for n in inspect.signature(o.get_image_features).parameters}
    return {k: v for k, v in out.items() if k in wanted and torch.is_tensor(v)}


def _image_features(model, pixels: dict) -> int | None:
    """The placeholders one image needs (transformers' get_image_features of the batch), or None if it fails."""
    owners = (model, model.base_model, getattr(model.base_model, "encoder", None))  # diffusion_gemma's: its encoder's
    get = next((o.get_image_features for o in owners if hasattr(o, "get_image_features")), None)
    try:
        with torch.no_grad():
            features = get(**pixels)
    except Exception:  # noqa: BLE001 - not this layout
        return None
    if not torch.is_tensor(features) and not isinstance(features, (list, tuple)):
        deepstack = getattr(features, "deepstack_features", None)  # Granite 4 Vision's: [(text layer, per-image features)]
        features = features.pooler_output if features.pooler_output is not None else \
            features.last_hidden_state if features.last_hidden_state is not None else list(deepstack[0][1])
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1]).shape[0] // 2


def batch(model, config) -> tuple[dict, bool]:
    """({input name: tensor} of 2 rows: an image's placeholders then 8 text tokens, or the text alone; whether it has
    an image): the first pixel layout transformers' forward takes with as many placeholders as features."""
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(3, TOKEN_ID, (2, 8), generator=gen)
    image_id = _token(config, "image_token_id", "image_token_index")
    before = [t for t in [_token(config, *START_TOKENS)] if t is not None]
    after = [t for t in [_token(config, *END_TOKENS)] if t is not None]
    layouts = [PIXELS[config.model_type](config, gen)] if config.model_type in PIXELS else _candidates(config, gen)
    for pixels in _layouts(layouts, config, model, gen) if image_id is not None else []:
        n = _image_features(model, pixels)
        if not n:
            continue
        ids = torch.cat([torch.tensor([[*before, *[image_id] * n, *after]] * 2), text], dim=1)
        inputs = {"input_ids": ids, **pixels}
        for name in ("token_type_ids", "mm_token_type_ids"):  # the processor's: 1 on an image's tokens
            if name in inspect.signature(model.forward).parameters:
                inputs[name] = (ids == image_id).long()
        try:
            with torch.no_grad():
                model(**inputs, use_cache=False)
            return inputs, True
        except Exception:  # noqa: BLE001 - not this layout
            continue
    return {"input_ids": text}, False


def _layouts(layouts: list[dict], config, model, gen: torch.Generator):
    """`layouts`, then the type's image processor's (made only if none of them fits)."""
    yield from layouts
    try:
        pixels = processor_pixels(config, model, gen)
    except Exception:  # noqa: BLE001 - no processor runs from its defaults: text only
        return
    if pixels:
        yield pixels


def _token(config, *names: str) -> int | None:
    return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)


def write_checkpoint(model_type: str, directory: Path, cp: int = 1) -> tuple[dict, dict, bool]:
    """transformers' own random tiny model, saved; (its batch, transformers' single-process reference, whether the
    batch has an image); `cp` > 1: the batch's length a multiple of 2 x cp (cp_batch)."""
    import transformers

    tried = None
    for config in tiny_configs(model_type):  # the first that builds and takes an image; else the first that builds
        torch.manual_seed(0)
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in transformers.AutoModelForImageTextToText.from_config(config).parameters())
            if size > MAX_PARAMETERS:  # a sub-config's sizes the survey does not shrink
                continue
            model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
        except Exception:  # noqa: BLE001 - transformers cannot build it: the next
            continue
        inputs, image = batch(model, config)
        tried = tried or (model, inputs, image)
        if image:
            break
    if tried is None:
        raise ValueError(f"transformers builds none of the tiny configs under {MAX_PARAMETERS / 1e6:.0f}M parameters")
    model, inputs, image = (model, inputs, image) if image else tried
    model.save_pretrained(directory)
    inputs = cp_batch(inputs, cp) if cp > 1 else inputs
    return inputs, reference(model, inputs, steps_dtype(directory)), image


def survey_type(model_type: str, root: Path, layout: tuple[int, int, int], peer: bool) -> dict:
    from tptrain.distributed import comm

    rank = torch.distributed.get_rank()
    directory, saved = root / model_type, root / f"{model_type}-saved"
    written, error = None, None
    if rank == 0:
        try:
            written = write_checkpoint(model_type, directory, cp=layout[1])
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    error = comm.all_gather_object(error)[0]
    if error:
        why = f" ({NOT_SURVEYED[model_type]})" if model_type in NOT_SURVEYED else ""
        return {"error": f"transformers (not tptrain) fails: {error}{why}"}
    if written and model_type in FP32_INSIDE:  # its steps' losses compared at fp32's bound (the reason: the table)
        written[1]["loss_dtype"] = torch.float32
    inputs, dtype, image = comm.all_gather_object((written[0], written[1]["steps_dtype"], written[2])
                                                  if written else None)[0]
    try:
        out = _run_layout(directory, saved, inputs, written[1] if written else None, layout, peer, dtype)
        return {**out, "image": "yes" if image else "text only"}
    finally:
        comm.all_gather_object(None)  # every rank done with the files
        if rank == 0:
            for path in root.glob(f"{model_type}*"):
                shutil.rmtree(path, ignore_errors=True)


def _run_layout(directory: Path, saved: Path, inputs: dict, ref: dict | None, layout: tuple[int, int, int],
                peer: bool, dtype: torch.dtype) -> dict:
    """The tp stages (run_stages) at tp alone, else the layout stages (hf_vlm_layouts.run_vlm_layout_stages)."""
    tp, cp, pp = layout
    if cp * pp > 1:
        return run_vlm_layout_stages(directory, inputs, ref, tp=tp, cp=cp, pp=pp, steps_dtype=dtype)
    return run_stages(directory, saved, inputs, ref, tp, peer, steps_dtype=dtype, auto=AUTO)


def worker(types: list[str], out: str, layout: tuple[int, int, int], peer: bool) -> None:
    """One rank (torchrun-style env): every type in turn; rank 0 appends {"type", "result"} lines to `out`."""
    import transformers

    from tptrain.distributed import comm, init_distributed

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_distributed()
    rank = torch.distributed.get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = comm.all_gather_object(tmp)[0]
        for model_type in types:
            if rank == 0:
                _append(out, {"type": model_type, "started": True})
            result = survey_type(model_type, Path(tmp), layout, peer)
            if rank == 0:
                _append(out, {"type": model_type, "result": result})


def _stages(result: dict) -> tuple[str, ...]:
    return LAYOUT_STAGES if "train" in result else STAGES


def passed(result: dict) -> bool:
    return all(result.get(stage) == "OK" for stage in _stages(result))


def table(results: dict[str, dict], layout: tuple[int, int, int], peer: bool) -> str:
    tp, stages = layout[0], LAYOUT_STAGES if layout[1] * layout[2] > 1 else STAGES
    head = ["type", *stages, "image", *([f"peer (transformers TP {tp})"] if peer else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reasons = []
    for model_type, r in results.items():
        cells = [r.get(stage, "-") for stage in stages] if any(s in r for s in stages) else ["n/a"] * len(stages)
        peer_cell = r.get("peer", "-")
        peer_cell = "OK" if peer_cell == "OK" else peer_cell.split(" (")[0].split(":")[0]
        lines.append(f"| `{model_type}` | " + " | ".join([*cells, r.get("image", "-"), *([peer_cell] if peer else [])])
                     + " |")
        if "error" in r:
            reasons.append(f"- `{model_type}`: {r['error']}")
        if peer and r.get("peer", "OK") != "OK":
            reasons.append(f"- `{model_type}` (transformers' own TP at tp {tp}): {r['peer']}")
    return "\n".join([*lines, "", *reasons])


def _launch_args(layout: tuple[int, int, int], peer: bool) -> list[str]:
    """The workers' layout arguments."""
    tp, cp, pp = layout
    return ["--tp-size", str(tp), "--cp-size", str(cp), "--pp-size", str(pp), *(["--peer"] if peer else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--cp-size", type=int, default=1, help="context parallelism: the layout stages")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline parallelism: the layout stages")
    parser.add_argument("--types", default="", help="comma-separated model types (default: every one with a plan)")
    parser.add_argument("--peer", action="store_true", help="also run transformers' own TP at --tp-size")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--type-timeout", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t] or model_types()
    layout = (args.tp_size, args.cp_size, args.pp_size)
    if args.worker:
        return worker(types, args.out, layout, args.peer)
    if args.peer and args.cp_size * args.pp_size > 1:
        parser.error("--peer is for the tp stages (no --cp-size / --pp-size)")
    results = survey_loop(types, __file__, layout[0] * layout[1] * layout[2], _launch_args(layout, args.peer),
                          args.type_timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, layout, args.peer), flush=True)
    ok = [t for t, r in results.items() if passed(r)]
    skipped = [t for t, r in results.items() if r.get("error", "").startswith("transformers (not tptrain)")]
    images = [t for t in ok if results[t].get("image") == "yes"]
    print(f"\n{len(ok)} of {len(results)} image-text-to-text model types with a base_model_tp_plan pass every stage at "
          f"{spelled(layout)} ({len(images)} of them with an image in the batch; {len(skipped)} with no "
          f"tiny checkpoint transformers itself runs): {', '.join(ok)}")
    if args.peer:
        peers = [t for t, r in results.items() if r.get("peer") == "OK"]
        print(f"transformers' own TP at tp {args.tp_size} matches its single-process logits on {len(peers)}: "
              f"{', '.join(peers)}")


if __name__ == "__main__":
    main()
