"""AutoConfig / AutoModelForCausalLM: pick the config and model class from `model_type`.

    config = AutoConfig.from_pretrained("path/to/checkpoint")
    model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint", dtype=torch.bfloat16)
"""
from __future__ import annotations

import os
from typing import Any

from tptrain.models.configuration import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig,
                                          MinistralConfig, MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config,
                                          OlmoeConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen2MoeConfig,
                                          Qwen3Config, Qwen3MoeConfig, SmolLM3Config, load_config_dict)
from tptrain.models.decoder import (DecoderForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, GraniteForCausalLM,
                                    LlamaForCausalLM, MinistralForCausalLM, MistralForCausalLM, Olmo2ForCausalLM,
                                    Olmo3ForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                    SmolLM3ForCausalLM)
from tptrain.models.decoder import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, tuple[type[PretrainedConfig], type[DecoderForCausalLM]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "ministral": (MinistralConfig, MinistralForCausalLM),
    "granite": (GraniteConfig, GraniteForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM),
    "olmo3": (Olmo3Config, Olmo3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
}


def _lookup(model_type: str | None) -> tuple[type[PretrainedConfig], type[DecoderForCausalLM]]:
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"model_type {model_type!r} is not supported by tptrain; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}.")
    return MODEL_REGISTRY[model_type]


class AutoConfig:
    @staticmethod
    def from_pretrained(path_or_id: str | os.PathLike) -> PretrainedConfig:
        config_dict = load_config_dict(path_or_id)
        return _lookup(config_dict.get("model_type"))[0].from_dict(config_dict)

    @staticmethod
    def for_model(model_type: str, **kwargs: Any) -> PretrainedConfig:
        return _lookup(model_type)[0](**kwargs)


class AutoModelForCausalLM:
    @staticmethod
    def from_config(config: PretrainedConfig, **kwargs: Any) -> DecoderForCausalLM:
        """Random init (or meta, with device="meta"); kwargs go to `PreTrainedModel.from_config`."""
        return _lookup(config.model_type)[1].from_config(config, **kwargs)

    @staticmethod
    def from_pretrained(path_or_id: str | os.PathLike, **kwargs: Any) -> DecoderForCausalLM:
        """Resolve the class from config.json, then `cls.from_pretrained(path_or_id, **kwargs)`."""
        model_type = load_config_dict(path_or_id).get("model_type")
        return _lookup(model_type)[1].from_pretrained(path_or_id, **kwargs)
