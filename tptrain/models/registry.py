"""Which code runs a model_type: tptrain's own (native), or transformers' under tptrain's engine (tptrain.hf).

Decided from config.json's model_type alone, without importing torch or transformers (seconds of imports), so the
CLI refuses an unknown model_type at once. auto.py makes the classes of the entries below (MODEL_REGISTRY).
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from tptrain.backends import BACKENDS

# model_type -> (config class in tptrain.models.configuration, the name of its model class). The model class is the one
# decoder with that config class, made by auto.py: a new family is its config file and its entry here.
NATIVE_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
_CAUSAL_LM_NAMES = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"  # transformers' {model_type: causal-LM class name}
_IMAGE_TEXT_NAMES = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"  # ... and image-text-to-text class name


def check_native(model_type: str | None) -> None:
    if model_type not in NATIVE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported by tptrain; supported: "
                         f"{', '.join(sorted(NATIVE_MODEL_TYPES))}.")


def select_backend(model_type: str | None, backend: str = "auto") -> str:
    """"native" (tptrain's model code) or "transformers" (transformers' modeling code under tptrain's engine,
    tptrain.hf). "auto": native for tptrain's model types, transformers for any other when it is installed."""
    if backend not in BACKENDS:
        *others, last = (repr(b) for b in BACKENDS)
        raise ValueError(f"backend must be {', '.join(others)} or {last}, got {backend!r}")
    native = ", ".join(sorted(NATIVE_MODEL_TYPES))
    if backend == "native" or (backend == "auto" and model_type in NATIVE_MODEL_TYPES):
        check_native(model_type)
        return "native"
    if not _installed("transformers"):
        why = "is not implemented natively by tptrain" if backend == "auto" else "was asked for backend='transformers'"
        raise ValueError(f"model_type {model_type!r} {why}, and transformers is not installed. Either "
                         f"`pip install \"tptrain[hf]\"` (tptrain's engine on transformers' modeling code), or use "
                         f"one of tptrain's native model types: {native}.")
    if not _transformers_has_causal_lm(model_type):
        raise ValueError(f"model_type {model_type!r} is not supported: tptrain implements {native}, and the "
                         f"installed transformers has no causal LM of that type for tptrain's transformers backend "
                         f"either.")
    return "transformers"


def vision_language(config: dict) -> bool:
    """Whether a checkpoint's config.json is a vision-language model's: a `vision_config`, and a model type the
    installed transformers has an image-text-to-text class for (read from its source where it can: no import).
    Such a checkpoint loads with AutoModelForImageTextToText."""
    if "vision_config" not in config or not _installed("transformers"):
        return False
    listed = _listed_types(_IMAGE_TEXT_NAMES)
    if listed is not None:
        return config.get("model_type") in listed
    from tptrain.hf import vlm  # imports transformers

    return vlm.knows(config.get("model_type"))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it
        return False


def _transformers_has_causal_lm(model_type: str | None) -> bool:
    listed = _listed_types(_CAUSAL_LM_NAMES)
    if listed is not None and model_type not in listed:
        return False  # answered from transformers' source text, without its import
    from tptrain.hf import model  # imports transformers: the authority on what it has

    return model.knows(model_type)


def _listed_types(mapping: str) -> frozenset[str] | None:
    """The model types of transformers' `mapping` (its causal-LM one, ...), read from its modeling_auto.py as text;
    None unless that file binds the mapping once, to one literal `OrderedDict([(model_type, class name), ...])`, and
    never changes it (then only importing transformers can tell)."""
    try:
        locations = importlib.util.find_spec("transformers").submodule_search_locations
        tree = ast.parse(Path(next(iter(locations)), "models", "auto", "modeling_auto.py").read_text())
    except (ImportError, AttributeError, TypeError, StopIteration, OSError, SyntaxError, ValueError):
        return None
    bindings = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == mapping for t in node.targets)]
    changed = any(_changes(node, mapping) for node in ast.walk(tree))
    if len(bindings) != 1 or changed or not isinstance(bindings[0], ast.Call) or len(bindings[0].args) != 1:
        return None
    try:
        return frozenset(model_type for model_type, _ in ast.literal_eval(bindings[0].args[0]))
    except (ValueError, TypeError, SyntaxError):
        return None


def _changes(node: ast.AST, name: str) -> bool:
    """Whether `node` may change the dict bound to `name`: a mutating method, an item stored or deleted, `|=`."""
    of_name = isinstance(getattr(node, "value", None), ast.Name) and node.value.id == name
    return (of_name and isinstance(node, ast.Attribute) and node.attr in _MUTATORS
            or of_name and isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del))
            or isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == name)


_MUTATORS = ("update", "pop", "popitem", "setdefault", "clear", "move_to_end", "__setitem__", "__delitem__")
