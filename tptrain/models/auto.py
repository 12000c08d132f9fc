"""AutoConfig / AutoModelForCausalLM: pick the config and model class from `model_type`.

    config = AutoConfig.from_pretrained("path/to/checkpoint")
    model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint", dtype=torch.bfloat16)
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

from tptrain.distributed import DistributedConfig, init_distributed, raise_on_any_rank
from tptrain.models.configuration import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Ministral3Config,
                                          MinistralConfig, MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config,
                                          OlmoeConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen2MoeConfig,
                                          Qwen3Config, Qwen3MoeConfig, SmolLM3Config, absorb_rope_parameters,
                                          load_config_dict)
from tptrain.models.decoder import (DecoderForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, GraniteForCausalLM,
                                    LlamaForCausalLM, Ministral3ForCausalLM, MinistralForCausalLM, MistralForCausalLM,
                                    MixtralForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM,
                                    Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,
                                    Qwen3MoeForCausalLM, SmolLM3ForCausalLM)

MODEL_REGISTRY: dict[str, tuple[type[PretrainedConfig], type[DecoderForCausalLM]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "ministral": (MinistralConfig, MinistralForCausalLM),
    "ministral3": (Ministral3Config, Ministral3ForCausalLM),
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


def select_backend(model_type: str | None, backend: str = "auto") -> str:
    """"native" (tptrain's model code) or "transformers" (transformers' modeling code under tptrain's engine,
    tptrain.hf). "auto": native for tptrain's model types, transformers for any other when it is installed."""
    if backend not in ("auto", "native", "transformers"):
        raise ValueError(f"backend must be 'auto', 'native' or 'transformers', got {backend!r}")
    if backend == "native" or (backend == "auto" and model_type in MODEL_REGISTRY):
        _lookup(model_type)
        return "native"
    if not _installed("transformers"):
        why = "is not implemented natively by tptrain" if backend == "auto" else "was asked for backend='transformers'"
        raise ValueError(f"model_type {model_type!r} {why}, and transformers is not installed. Either "
                         f"`pip install \"tptrain[hf]\"` (tptrain's engine on transformers' modeling code), or use "
                         f"one of tptrain's native model types: {', '.join(sorted(MODEL_REGISTRY))}.")
    if not _transformers_backend().knows(model_type):
        raise ValueError(f"model_type {model_type!r} is not supported: tptrain implements "
                         f"{', '.join(sorted(MODEL_REGISTRY))}, and the installed transformers has no causal LM of "
                         f"that type for tptrain's transformers backend either.")
    return "transformers"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it
        return False


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
        `distributed_config.backend` when given, else `backend` (see `select_backend`). With a
        `distributed_config`, a checkpoint this rank cannot resolve (or whose model_type it cannot run) is raised
        on every rank, naming this one, as `from_pretrained` raises the errors of its own checks."""
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("trust_remote_code is out of scope: tptrain runs its own model code, or transformers' "
                             "own model classes (backend='transformers'), never modeling code from the hub")
        config = kwargs.get("distributed_config")
        try:
            model_type = load_config_dict(path_or_id).get("model_type")
            chosen = select_backend(model_type, config.backend if config is not None else backend)
        except Exception as exc:
            if config is not None:
                _raise_on_every_rank(config, exc)
            raise
        if chosen == "transformers":
            return _transformers_backend().TransformersCausalLM.from_pretrained(path_or_id, **kwargs)
        return _lookup(model_type)[1].from_pretrained(path_or_id, **kwargs)


def _raise_on_every_rank(distributed_config: DistributedConfig, error: Exception) -> None:
    """Raise `error`, met before the process group starts, where every other rank's `from_pretrained` shares the
    outcome of its own checks: right after the rendezvous, so the others raise it too, naming this rank, at once
    (each rank may load its own copy of the checkpoint, e.g. one per node), instead of waiting for this rank until
    the rendezvous times out."""
    distributed_config.sizes()  # a bad layout first, as the other ranks raise it: before the rendezvous
    init_distributed()
    raise_on_any_rank(error)
