"""Which vision-language (image-text-to-text) model types of the installed transformers tptrain trains at tp N: every
type whose config, or its text config, declares base_model_tp_plan. For each, a tiny checkpoint transformers writes
(the text config at hf_backend_survey's TINY sizes, the vision tower's depth cut to one layer and its image to a few
patches), a labelled batch with an image (pixel values in the layout the tower takes, and as many placeholder
tokens as transformers' own `get_image_features` makes features of it; a type whose tower none of the layouts
fits gets a text-only batch, marked so), then the stages of hf_checkpoint_survey.py (scripts/hf_survey_stages.py:
load, forward, backward, steps, save; no plan stage) through `tptrain.AutoModelForImageTextToText`, against
transformers on one process, and (--peer) transformers' own TP at tp N on the same checkpoint and batch.

    nice -n 10 .venv-vision/bin/python scripts/hf_vlm_survey.py --tp-size 2 --peer [--types qwen2_5_vl,gemma3]

Prints the markdown table (type x stages, the image column, the peer column), each failure's reason and the count.
Tens of minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from hf_backend_survey import TINY
from hf_checkpoint_survey import TINY_OVERRIDES, _append, spelled, survey_loop
from hf_survey_stages import reference, run_stages, steps_dtype

AUTO = "AutoModelForImageTextToText"
STAGES = ("load", "forward", "backward", "steps", "save")
DEPTH_KEYS = ("num_hidden_layers", "depth", "num_layers", "encoder_layers")
TOKEN_ID = 100  # the first of the ids given to a config's special tokens (image, start/end of image, ...)
# the ids around an image's placeholders, where the config has them (Qwen's rope index finds images by the first)
START_TOKENS = ("vision_start_token_id", "boi_token_index", "boi_token_id", "image_start_token_id")
END_TOKENS = ("vision_end_token_id", "eoi_token_index", "eoi_token_id", "image_end_token_id")
# Types on which the generic tiny config makes transformers itself fail: their own keys, still tiny.
OVERRIDES: dict[str, dict] = {
    **{t: dict(mm_tokens_per_image=16) for t in ("gemma3", "shieldgemma2")},  # 8 x 8 patches pooled to 4 x 4
}
# a tower's widths in the narrow tiny config (16 per head); its output width follows the text's
VISION_SHRINK = dict(hidden_size=64, embed_dim=64, intermediate_size=128, num_attention_heads=4, num_heads=4,
                     out_hidden_size=TINY["hidden_size"], text_hidden_size=TINY["hidden_size"])
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
    kwargs = {}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            kwargs[key] = _tiny_text(sub.to_dict(), mrope) if key == "text_config" else \
                _tiny_tower(sub.to_dict(), narrow)
    tokens = {k: TOKEN_ID + i for i, k in enumerate(sorted(k for k, v in config.to_dict().items() if isinstance(v, int)
                                                           and (k.endswith("token_id") or k.endswith("token_index"))
                                                           and not k.startswith(("pad", "bos", "eos"))))}
    return type(config)(**{**kwargs, **tokens, **OVERRIDES.get(model_type, {})})


def _tiny_tower(values: dict, narrow: bool) -> dict:
    """A tower's config values one layer deep; `narrow`: VISION_SHRINK's widths where it has those keys (ints), its
    output width the text's, and its image 4 x merge patches wide."""
    values = {**values, **{k: 1 for k in DEPTH_KEYS if isinstance(values.get(k), int)}}
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
    values = {**values, **{k: v for k, v in text.items() if k in ("vocab_size", "hidden_size") or k in values and
                           isinstance(values[k], (int, type(None))) and not isinstance(values[k], bool)},
              **TINY_OVERRIDES.get(values.get("model_type"), {})}
    if isinstance(values.get("per_layer_config"), dict):  # keyed by layers the tiny model does not have
        values["per_layer_config"] = {}
    layers = values.get("num_hidden_layers", 2)
    for key, value in list(values.items()):
        if key.endswith("layer_types") and isinstance(value, list) and len(value) != layers:
            values[key] = [value[0]] * (layers - 1) + [value[-1]]
    rope = values.get("rope_parameters")
    if mrope and isinstance(rope, dict) and "rope_type" in rope:
        rope.setdefault("mrope_section", [1, 1, 1])  # scaled below
    for params in (rope.values() if isinstance(rope, dict) and "rope_type" not in rope else [rope]):
        if isinstance(params, dict) and params.get("mrope_section"):
            half, sections = values.get("head_dim", 16) // 2, params["mrope_section"]
            scaled = [max(1, s * half // sum(sections)) for s in sections]
            params["mrope_section"] = [*scaled[:-1], half - sum(scaled[:-1])]
    return values


def _candidates(config, gen: torch.Generator) -> list[dict]:
    """Pixel layouts a tower may take, for one image per row of 2: (batch, channels, size, size), with one image
    dimension more, flattened patches with their (t, h, w) grid, each with the image sizes too."""
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
    flat = {"pixel_values": torch.randn(2 * grid * grid, channels * temporal * patch * patch, generator=gen),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * 2)}
    sizes = {"image_sizes": torch.tensor([[size, size]] * 2)}
    return [{"pixel_values": image}, {"pixel_values": image, **sizes}, {"pixel_values": image[:, None]},
            {"pixel_values": image[:, None], **sizes}, flat]


def _image_features(model, pixels: dict) -> int | None:
    """The placeholders one image needs (transformers' get_image_features of the batch), or None if it fails."""
    try:
        with torch.no_grad():
            features = model.get_image_features(**pixels)
    except Exception:  # noqa: BLE001 - not this layout
        return None
    if not torch.is_tensor(features) and not isinstance(features, (list, tuple)):
        features = features.pooler_output if features.pooler_output is not None else features.last_hidden_state
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
    for pixels in _candidates(config, gen) if image_id is not None else []:
        n = _image_features(model, pixels)
        if not n:
            continue
        ids = torch.cat([torch.tensor([[*before, *[image_id] * n, *after]] * 2), text], dim=1)
        inputs = {"input_ids": ids, **pixels}
        if "token_type_ids" in model.forward.__code__.co_varnames:
            inputs["token_type_ids"] = (ids == image_id).long()
        try:
            with torch.no_grad():
                model(**inputs, use_cache=False)
            return inputs, True
        except Exception:  # noqa: BLE001 - not this layout
            continue
    return {"input_ids": text}, False


def _token(config, *names: str) -> int | None:
    return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)


def write_checkpoint(model_type: str, directory: Path) -> tuple[dict, dict, bool]:
    """transformers' own random tiny model, saved; (its batch, transformers' single-process reference, whether the
    batch has an image)."""
    import transformers

    tried = None
    for config in tiny_configs(model_type):  # the first that builds and takes an image; else the first that builds
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForImageTextToText.from_config(config).parameters())
        if size > MAX_PARAMETERS:  # a sub-config's sizes the survey does not shrink
            continue
        torch.manual_seed(0)
        try:
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
    return inputs, reference(model, inputs, steps_dtype(directory)), image


def survey_type(model_type: str, root: Path, tp: int, peer: bool) -> dict:
    from tptrain.distributed import comm

    rank = torch.distributed.get_rank()
    directory, saved = root / model_type, root / f"{model_type}-saved"
    written, error = None, None
    if rank == 0:
        try:
            written = write_checkpoint(model_type, directory)
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    error = comm.all_gather_object(error)[0]
    if error:
        return {"error": f"transformers (not tptrain) fails: {error}"}
    inputs, dtype, image = comm.all_gather_object((written[0], written[1]["steps_dtype"], written[2])
                                                  if written else None)[0]
    try:
        out = run_stages(directory, saved, inputs, written[1] if written else None, tp, peer, steps_dtype=dtype,
                         auto=AUTO)
        return {**out, "image": "yes" if image else "text only"}
    finally:
        comm.all_gather_object(None)  # every rank done with the files
        if rank == 0:
            for path in root.glob(f"{model_type}*"):
                shutil.rmtree(path, ignore_errors=True)


def worker(types: list[str], out: str, tp: int, peer: bool) -> None:
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
            result = survey_type(model_type, Path(tmp), tp, peer)
            if rank == 0:
                _append(out, {"type": model_type, "result": result})


def passed(result: dict) -> bool:
    return all(result.get(stage) == "OK" for stage in STAGES)


def table(results: dict[str, dict], tp: int, peer: bool) -> str:
    head = ["type", *STAGES, "image", *([f"peer (transformers TP {tp})"] if peer else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reasons = []
    for model_type, r in results.items():
        cells = [r.get(stage, "-") for stage in STAGES] if any(s in r for s in STAGES) else ["n/a"] * len(STAGES)
        peer_cell = r.get("peer", "-")
        peer_cell = "OK" if peer_cell == "OK" else peer_cell.split(" (")[0].split(":")[0]
        lines.append(f"| `{model_type}` | " + " | ".join([*cells, r.get("image", "-"), *([peer_cell] if peer else [])])
                     + " |")
        if "error" in r:
            reasons.append(f"- `{model_type}`: {r['error']}")
        if peer and r.get("peer", "OK") != "OK":
            reasons.append(f"- `{model_type}` (transformers' own TP at tp {tp}): {r['peer']}")
    return "\n".join([*lines, "", *reasons])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--types", default="", help="comma-separated model types (default: every one with a plan)")
    parser.add_argument("--peer", action="store_true", help="also run transformers' own TP at --tp-size")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--type-timeout", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t] or model_types()
    if args.worker:
        return worker(types, args.out, args.tp_size, args.peer)
    extra = ["--tp-size", str(args.tp_size), *(["--peer"] if args.peer else [])]
    results = survey_loop(types, __file__, args.tp_size, extra, args.type_timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, args.tp_size, args.peer), flush=True)
    ok = [t for t, r in results.items() if passed(r)]
    skipped = [t for t, r in results.items() if r.get("error", "").startswith("transformers (not tptrain)")]
    images = [t for t in ok if results[t].get("image") == "yes"]
    print(f"\n{len(ok)} of {len(results)} image-text-to-text model types with a base_model_tp_plan pass every stage at "
          f"{spelled((args.tp_size, 1, 1))} ({len(images)} of them with an image in the batch; {len(skipped)} with no "
          f"tiny checkpoint transformers itself runs): {', '.join(ok)}")
    if args.peer:
        peers = [t for t, r in results.items() if r.get("peer") == "OK"]
        print(f"transformers' own TP at tp {args.tp_size} matches its single-process logits on {len(peers)}: "
              f"{', '.join(peers)}")


if __name__ == "__main__":
    main()
