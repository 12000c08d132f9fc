"""Building and saving tiny checkpoints: written by transformers (every parameter random), by tptrain (seeded, its
parameters perturbed or as initialised), DeepSeek-V3's with its routers' biases, a byte tokenizer beside one.

A test module declares its checkpoints as CHECKPOINTS (a `Checkpoints`); tests/conftest.py's `checkpoints` fixture
writes them once a session and gives {name: directory, or (directory, reference)}; `checkpoint` gives the one of a
module that declares one. transformers is imported inside the functions: the ranks a test starts import this module.
"""
from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from tests.helpers.configs import DEEPSEEK_TINY, F64, PIPELINE_FAMILIES
from tptrain.models import AutoConfig, AutoModelForCausalLM


def randomize(hf, seed: int = 0, *, norm_weight: float = 1.0) -> None:
    """Every parameter random (scale 0.2); norm weights around `norm_weight` (0 for (1 + w) norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (norm_weight if name.endswith("norm.weight") else 0.0))


def _randomize(hf, seed: int, norm_weight: float) -> None:
    randomize(hf, seed, norm_weight=norm_weight)


def random_checkpoint(directory: Path, build: Callable[[], Any], *, seed: int = 0, norm_weight: float = 1.0,
                      perturb: Callable = _randomize, **save: Any):
    """(directory, model): transformers' model from `build()` (torch seeded `seed`), its experts (if any) through the
    eager loop (its grouped_mm kernels take no fp64), `perturb(model, seed, norm_weight)` (default: every parameter
    random), saved by its own save_pretrained (keywords `save`)."""
    torch.manual_seed(seed)
    hf = build().eval()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    perturb(hf, seed, norm_weight)
    hf.save_pretrained(directory, **save)
    return directory, hf


class Checkpoints:
    """The checkpoints a test module declares (CHECKPOINTS): {name: write_one(its index, name, its directory)}, each
    in a directory of its own under one temporary root."""

    def __init__(self, names) -> None:
        self.names = tuple(names)

    def write(self, tmp_path_factory) -> dict[str, Any]:
        root = tmp_path_factory.mktemp("checkpoints")
        return {name: self.write_one(i, name, root / name) for i, name in enumerate(self.names)}

    def write_one(self, index: int, name: str, directory: Path) -> Any:
        raise NotImplementedError


class TransformersCheckpoints(Checkpoints):
    """Written by transformers' save_pretrained (the hub's layout) from {name: (model_type, config keywords)}: each
    model built by transformers' Auto classes, seeded `seed` (None: its index), perturbed (random_checkpoint; norm
    weights around `norm_weights.get(name, 1.0)`), saved in shards of `max_shard_size[name]` if given (the index
    checked). `reference(model)`: given beside each directory; None: the directories alone."""

    def __init__(self, configs: dict[str, tuple[str, dict]], *, reference: Callable | None = None,
                 seed: int | None = 0, norm_weights: dict[str, float] | None = None, perturb: Callable = _randomize,
                 max_shard_size: dict[str, str] | None = None) -> None:
        super().__init__(configs)
        self.configs, self.reference, self.seed, self.perturb = configs, reference, seed, perturb
        self.norm_weights, self.max_shard_size = norm_weights or {}, max_shard_size or {}

    def write_one(self, index: int, name: str, directory: Path) -> Any:
        import transformers

        model_type, kw = self.configs[name]
        config = transformers.AutoConfig.for_model(model_type, **kw)
        save = {"max_shard_size": self.max_shard_size[name]} if name in self.max_shard_size else {}
        path, hf = random_checkpoint(directory, partial(transformers.AutoModelForCausalLM.from_config, config),
                                     seed=index if self.seed is None else self.seed,
                                     norm_weight=self.norm_weights.get(name, 1.0), perturb=self.perturb, **save)
        assert not save or (path / "model.safetensors.index.json").exists(), f"{name} was not saved in shards"
        return path if self.reference is None else (path, self.reference(hf))


class DeepSeekCheckpoints(Checkpoints):
    """DeepSeek-V3 checkpoints (deepseek_checkpoint) from {name: config overrides}; `reference(directory)` beside
    each directory, or None: the directories alone."""

    def __init__(self, overrides: dict[str, dict], *, reference: Callable | None = None) -> None:
        super().__init__(overrides)
        self.overrides, self.reference = overrides, reference

    def write_one(self, index: int, name: str, directory: Path) -> Any:
        path = deepseek_checkpoint(directory, **self.overrides[name])
        return path if self.reference is None else (path, self.reference(path))


class PerturbedCheckpoints(Checkpoints):
    """Written by tptrain's save_pretrained (HF format) from {name: (model_type, config keywords)}: fp64, seeded by
    index, every parameter perturbed (norms away from 1 and biases away from 0: every parameter matters). The
    directories as strings."""

    def __init__(self, families: dict[str, tuple[str, dict]]) -> None:
        super().__init__(families)
        self.families = families

    def write_one(self, index: int, name: str, directory: Path) -> str:
        model_type, kw = self.families[name]
        torch.manual_seed(index)
        config = type(AutoConfig.for_model(model_type)).from_dict({"model_type": model_type, **kw})
        model = AutoModelForCausalLM.from_config(config, dtype=F64)
        _perturb(model)
        model.save_pretrained(str(directory))
        return str(directory)


def _perturb(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def save_perturbed(model_type: str, kw: dict, path: str) -> str:
    """A tiny fp64 native checkpoint of `model_type` at `path`, every parameter perturbed (norms away from 1: every
    parameter matters)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float64)
    _perturb(model)
    model.save_pretrained(path)
    return path


def save_family(family: str, directory) -> str:
    """PIPELINE_FAMILIES' `family` at `directory`/`family`: a tiny fp64 native checkpoint as initialised (seed 0)."""
    model_type, kw = PIPELINE_FAMILIES[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **kw)
    path = os.path.join(directory, family)
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(path)
    return path


def deepseek_checkpoint(directory: Path, **overrides) -> Path:
    """A tiny random DeepSeek-V3 written by transformers' save_pretrained (hub layout), every parameter random and
    the routers' e_score_correction_bias too (a buffer in transformers: randomized apart)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**DEEPSEEK_TINY, **overrides})).eval()
    randomize(hf)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    hf.save_pretrained(directory)
    return directory


def save_byte_tokenizer(directory) -> None:
    """A tokenizer.json of UTF-8 bytes (ids 0..255, eos 256) in `directory`, for checkpoints that tests write
    without one: a checkpoint with weights is trained only on a tokenizer of its own (no byte-level fallback)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
