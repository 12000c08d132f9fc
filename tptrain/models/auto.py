"""AutoConfig / AutoModelForCausalLM: pick the config and model class from `model_type`.

    config = AutoConfig.from_pretrained("path/to/checkpoint")
    model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint", dtype=torch.bfloat16)
"""
from __future__ import annotations

import os
from typing import Any

from tptrain.distributed import DistributedConfig, init_distributed, raise_on_any_rank
from tptrain.models import configuration
from tptrain.models.configuration import PretrainedConfig, absorb_rope_parameters, load_config_dict
from tptrain.models.decoder import DecoderForCausalLM
from tptrain.models.registry import NATIVE_MODEL_TYPES, check_native, select_backend


def _family(config_name: str, model_name: str) -> tuple[type[PretrainedConfig], type[DecoderForCausalLM]]:
    """A registry entry's classes: its config class, and the one decoder reading it under the name transformers gives
    that model (a saved config.json's `architectures` is the class name)."""
    config_class = getattr(configuration, config_name)
    model_class = type(model_name, (DecoderForCausalLM,), {
        "config_class": config_class, "__module__": __name__, "__qualname__": model_name,
        "__doc__": f"The decoder as a {config_class.model_type!r} model (config class {config_name})."})
    return config_class, model_class


# model_type -> (config class, model class), made from the registry: a new family is a config class and an entry there.
MODEL_REGISTRY: dict[str, tuple[type[PretrainedConfig], type[DecoderForCausalLM]]] = {
    model_type: _family(*names) for model_type, names in NATIVE_MODEL_TYPES.items()}
MODEL_CLASSES = {model.__name__: model for _, model in MODEL_REGISTRY.values()}

__all__ = ["MODEL_CLASSES", "MODEL_REGISTRY", "AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText",
           "select_backend"]


def __getattr__(name: str) -> type[DecoderForCausalLM]:
    """Each model class by its name (`from tptrain.models import LlamaForCausalLM`; pickle finds them so too)."""
    if name in MODEL_CLASSES:
        return MODEL_CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


class AutoModelForImageTextToText:
    """Vision-language models (a vision tower, a projector, a text decoder: transformers' image-text-to-text
    classes) on transformers' modeling code under tptrain's engine (`pip install "tptrain[hf]"`; their processors
    need `tptrain[vision]`): tptrain has no native one.

        model = AutoModelForImageTextToText.from_pretrained("Qwen/Qwen2.5-VL-3B-Instruct", dtype=torch.bfloat16,
                                                            distributed_config=DistributedConfig(tp_size=2))
    """

    @staticmethod
    def config(path_or_id: str | os.PathLike) -> Any:
        """transformers' config of an image-text-to-text checkpoint (its directory or hub id)."""
        backend = _vision_backend(load_config_dict(path_or_id).get("model_type"))
        return backend.TransformersImageTextToText.config_class.from_pretrained(path_or_id)

    @staticmethod
    def from_config(config: Any, **kwargs: Any):
        """Random init (or meta, with device="meta") from transformers' config of an image-text-to-text model."""
        return _vision_backend(getattr(config, "model_type", None)).TransformersImageTextToText.from_config(
            config, **kwargs)

    @staticmethod
    def from_pretrained(path_or_id: str | os.PathLike, **kwargs: Any):
        """`TransformersImageTextToText.from_pretrained(path_or_id, **kwargs)` (dtype, distributed_config, ...); a
        checkpoint this rank cannot resolve, or of a model type transformers has no image-text-to-text class for, is
        raised on every rank with a `distributed_config`, as `from_pretrained` raises its own checks' errors."""
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("trust_remote_code is out of scope: tptrain runs transformers' own model classes, never "
                             "modeling code from the hub")
        config = kwargs.get("distributed_config")
        try:
            backend = _vision_backend(load_config_dict(path_or_id).get("model_type"))
        except Exception as exc:
            if config is not None:
                _raise_on_every_rank(config, exc)
            raise
        return backend.TransformersImageTextToText.from_pretrained(path_or_id, **kwargs)


def _vision_backend(model_type: str | None):
    """tptrain.hf.vlm, once `model_type` is known to have an image-text-to-text class in the installed transformers."""
    try:
        from tptrain.hf import vlm  # imports transformers
    except ImportError as exc:
        raise ValueError(f"model_type {model_type!r} is a vision-language model, which tptrain runs on transformers' "
                         f"modeling code: pip install \"tptrain[hf,vision]\" ({exc})") from None
    if not vlm.knows(model_type):
        raise ValueError(f"model_type {model_type!r} is not an image-text-to-text model of the installed transformers "
                         f"(no class in its AutoModelForImageTextToText mapping); for a text-only model use "
                         f"AutoModelForCausalLM")
    return vlm


def _raise_on_every_rank(distributed_config: DistributedConfig, error: Exception) -> None:
    """Raise `error`, met before the process group starts, where every other rank's `from_pretrained` shares the
    outcome of its own checks: right after the rendezvous, so the others raise it too, naming this rank, at once
    (each rank may load its own copy of the checkpoint, e.g. one per node), instead of waiting for this rank until
    the rendezvous times out."""
    distributed_config.sizes()  # a bad layout first, as the other ranks raise it: before the rendezvous
    init_distributed()
    raise_on_any_rank(error)
