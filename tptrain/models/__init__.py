"""Single-device model code: configs, the decoder, rotary embeddings and the model_type registry.

Each name's module is imported on first use, so `tptrain.models.registry` and the configs (neither needs torch) can
be read without importing the decoder: the CLI refuses an unknown model_type before torch is imported.
"""
from __future__ import annotations

import importlib

from tptrain.models.registry import NATIVE_MODEL_TYPES

_EXPORTS = {
    # with each native model_type's class (LlamaForCausalLM, ...), made there from the registry
    "tptrain.models.auto": ("MODEL_REGISTRY", "AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText",
                            *(model_name for _, model_name in NATIVE_MODEL_TYPES.values())),
    "tptrain.models.configuration": (
        "PretrainedConfig", "LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig", "MinistralConfig",
        "Ministral3Config", "GraniteConfig", "SmolLM3Config", "Olmo2Config", "Olmo3Config", "Gemma2Config",
        "Gemma3TextConfig", "Phi3Config", "MoeConfig", "Qwen3MoeConfig", "MixtralConfig", "Qwen2MoeConfig",
        "OlmoeConfig", "DeepseekV3Config"),
    "tptrain.models.decoder": ("CausalLMOutput", "DecoderForCausalLM", "DecoderModel", "RMSNorm", "causal_lm_loss"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'tptrain.models' has no attribute {name!r}")
