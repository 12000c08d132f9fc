"""AutoConfig / AutoModelForCausalLM: pick the config and model class from `model_type`.

    config = AutoConfig.from_pretrained("path/to/checkpoint")
    model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint", dtype=torch.bfloat16)
"""
from __future__ import annotations

import os
from typing import Any

from tptrain.models import configuration, decoder
from tptrain.models.configuration import PretrainedConfig, absorb_rope_parameters, load_config_dict
from tptrain.models.decoder import DecoderForCausalLM
from tptrain.models.registry import NATIVE_MODEL_TYPES, check_native, select_backend

__all__ = ["MODEL_REGISTRY", "AutoConfig", "AutoModelForCausalLM", "select_backend"]

MODEL_REGISTRY: dict[str, tuple[type[PretrainedConfig], type[DecoderForCausalLM]]] = {
    model_type: (getattr(configuration, config_name), getattr(decoder, model_name))
    for model_type, (config_name, model_name) in NATIVE_MODEL_TYPES.items()}


def _lookup(model_type: str | None) -> tuple[type[PretrainedConfig], type[DecoderForCausalLM]]:
    check_native(model_type)
    return MODEL_REGISTRY[model_type]


def _transformers_backend():
    from tptrain.hf import model  # imports transformers: only once that backend is chosen

    return model


class AutoConfig:
    @staticmethod
    def from_pretrained(path_or_id: str | os.PathLike, *, backend: str = "auto") -> Any:
        """tptrain's config for a native model type; transformers' config for one that runs on transformers."""
        config_dict = load_config_dict(path_or_id)
        if select_backend(config_dict.get("model_type"), backend) == "transformers":
            return _transformers_backend().load_config(config_dict)
        return _lookup(config_dict.get("model_type"))[0].from_dict(config_dict)

    @staticmethod
    def for_model(model_type: str, **kwargs: Any) -> PretrainedConfig:
        """The config of `model_type` from keyword arguments (transformers 5's `rope_parameters` spelling too)."""
        absorb_rope_parameters(kwargs)
        return _lookup(model_type)[0](**kwargs)


class AutoModelForCausalLM:
    @staticmethod
    def from_config(config: Any, **kwargs: Any) -> DecoderForCausalLM:
        """Random init (or meta, with device="meta"); kwargs go to `PreTrainedModel.from_config`. A transformers
        config (from `AutoConfig.from_pretrained` of a non-native type) builds a TransformersCausalLM."""
        if not isinstance(config, PretrainedConfig):
            return _transformers_backend().TransformersCausalLM.from_config(config, **kwargs)
        return _lookup(config.model_type)[1].from_config(config, **kwargs)

    @staticmethod
    def from_pretrained(path_or_id: str | os.PathLike, *, backend: str = "auto", **kwargs: Any) -> DecoderForCausalLM:
        """Resolve the class from config.json, then `cls.from_pretrained(path_or_id, **kwargs)`. The backend is
        `distributed_config.backend` when given, else `backend` (see `select_backend`)."""
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("trust_remote_code is out of scope: tptrain runs its own model code, or transformers' "
                             "own model classes (backend='transformers'), never modeling code from the hub")
        model_type = load_config_dict(path_or_id).get("model_type")
        config = kwargs.get("distributed_config")
        if select_backend(model_type, config.backend if config is not None else backend) == "transformers":
            return _transformers_backend().TransformersCausalLM.from_pretrained(path_or_id, **kwargs)
        return _lookup(model_type)[1].from_pretrained(path_or_id, **kwargs)
