"""PreTrainedModel: the Hugging Face-style entry points of every model: loading and saving.

The base keeps what a single-device model needs: its config, its weights by name (`checkpoint_keys`: the hub's names
of stacked or converted tensors) and the tensors `save_pretrained` writes. It imports no parallel axis: laying a model
out (`from_pretrained(distributed_config=)`, `model.parallelize`: the one parallelize of tptrain/parallel, which fills
each parameter with only this rank's slice, read straight from the safetensors files), loading into shards
(parallel/shards.py), gathering them and the save protocol (parallel/saving.py) are the engine's, reached at call
time; the process group is started by tptrain.distributed. What the engine made of a model is `model.parallel` (a
ParallelState; the one-process state until then).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from tptrain.io import CheckpointReader, check_tensor_shape, read_json, resolve_checkpoint
from tptrain.io import INDEX_FILE, SINGLE_FILE
from tptrain.distributed import DistributedConfig, init_distributed, raise_on_any_rank
from tptrain.distributed.state import ParallelState
from tptrain.dtypes import resolve_dtype
from tptrain.meta_init import build_on


class PreTrainedModel(nn.Module):
    """Base of every CausalLM. Subclasses set `config_class` and `_tp_plan` (the head's plan)."""

    config_class: ClassVar[type]
    _tp_plan: ClassVar[dict[str, str]] = {}
    base_model_prefix: ClassVar[str] = "model"
    backend: ClassVar[str] = "native"  # "transformers": tptrain's engine on transformers' modeling code (tptrain.hf)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.parallel = ParallelState()  # what the one parallelize makes of the model (distributed/state.py)
        self.generation_config: dict[str, Any] = {}  # the checkpoint's generation_config.json: generate's defaults

    # transformers' names for what a loaded model was laid out as, read from its state
    @property
    def tp_size(self) -> int:
        return self.parallel.dims.tp

    @property
    def tp_plan(self) -> dict[str, str]:
        """{module name: style name} as applied (empty: never laid out)."""
        return self.parallel.tp.plan if self.parallel.tp is not None else {}

    @property
    def device_mesh(self):
        return self.parallel.mesh

    @classmethod
    def from_config(cls, config: Any, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> "PreTrainedModel":
        """Build with random init (or on `device="meta"` for sharded loading)."""
        prev = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        device = torch.device(device or "cpu")
        try:
            with build_on(device):
                return cls(config)
        finally:
            torch.set_default_dtype(prev)

    @classmethod
    def from_pretrained(cls, pretrained: str | os.PathLike, *, dtype: torch.dtype | str | None = "auto",
                        distributed_config: DistributedConfig | None = None, device_map: Any = None,
                        tp_plan: Any = None, tp_size: int | None = None,
                        device: torch.device | str | None = None, revision: str | None = None) -> "PreTrainedModel":
        """Load an HF checkpoint (local directory or hub id), optionally tensor-parallel.

        With `distributed_config`, every rank reads only its own slice of each sharded tensor. Whatever can
        fail on one rank alone (resolving the checkpoint, config.json, the safetensors headers, tensor names
        and shapes, the plan) is checked before the process group starts, and the outcome is shared right
        after the rendezvous, before any other collective: every rank raises the error, naming the rank(s)
        it happened on. A directory with only config.json is refused: use `from_config` for random weights.
        The model is returned in eval mode (dropout off), as transformers returns it; the Trainer switches it to
        train mode for each step, and a hand-written loop calls `model.train()`.
        """
        if device_map is not None and distributed_config is not None:  # the rule table refuses it, before the sizes
            distributed_config.parallel_dims(device_map=True)
        if tp_plan is not None or tp_size is not None:
            if distributed_config is not None:
                raise ValueError("pass tp_plan/tp_size inside distributed_config, not next to it")
            warnings.warn("from_pretrained(tp_plan=...) is deprecated; pass "
                          "distributed_config=DistributedConfig(tp_size=..., tp_plan=...) instead",
                          FutureWarning, stacklevel=2)
            distributed_config = DistributedConfig(tp_size=tp_size, tp_plan=tp_plan or "auto")
        if distributed_config is None:
            model, reader, dtype = cls._open_checkpoint(pretrained, revision, dtype)
            target = torch.device(device or (device_map if isinstance(device_map, (str, torch.device)) else "cpu"))
            model._load(reader, target, dtype)
            return model.eval()
        distributed_config.sizes()  # a bad layout is the same error on every rank: raised before the rendezvous
        error = None
        try:
            model, reader, dtype = cls._open_checkpoint(pretrained, revision, dtype)
            resolved = model._check_plan(distributed_config)
        except Exception as exc:  # noqa: BLE001 - raised below on every rank, after the rendezvous
            error = exc
        init_distributed()
        raise_on_any_rank(error)
        return model._apply_plan(resolved, distributed_config, reader=reader, dtype=dtype).eval()

    @classmethod
    def _open_checkpoint(cls, pretrained: str | os.PathLike, revision: str | None, dtype: torch.dtype | str | None):
        """(meta model, CheckpointReader, dtype), after every check of the files one rank can fail on its own."""
        directory = resolve_checkpoint(pretrained, revision=revision)
        config = cls.config_class.from_pretrained(directory)
        dtype = resolve_dtype(dtype, config)
        _check_has_weights(directory)
        reader = CheckpointReader(directory)
        model = cls.from_config(config, dtype=dtype, device="meta")
        model.name_or_path = str(pretrained)
        if (directory / "generation_config.json").is_file():  # generate's defaults, as transformers reads them
            model.generation_config = read_json(directory / "generation_config.json")
        model._check_checkpoint(reader)
        return model, reader, dtype

    def parallelize(self, distributed_config: DistributedConfig, *, reader=None,
                    dtype: torch.dtype | None = None) -> "PreTrainedModel":
        """Lay this model out as `distributed_config` says (the one parallelize's structural steps: the pipeline cut,
        TP (+SP, +EP), CP).

        On a meta model, `reader` (a CheckpointReader that `from_pretrained` checked against this model)
        fills each rank's slice; a materialised model is sliced in memory (how tests compare against the
        same model on one device).
        """
        resolved = self._check_plan(distributed_config)  # before the mesh's collectives, identically on every rank
        return self._apply_plan(resolved, distributed_config, reader=reader, dtype=dtype)

    def _apply_plan(self, resolved: Any, distributed_config: DistributedConfig, *, reader=None,
                    dtype: torch.dtype | None = None) -> "PreTrainedModel":
        """The one parallelize's structural steps with `resolved` (a ResolvedPlan of `_check_plan`) on the mesh of
        `distributed_config`; the load step reads only this rank's stages and slices."""
        from tptrain.parallel.parallelize import ParallelOptions, parallelize  # the engine, at call time

        mesh, device = distributed_config.device_mesh()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            for note in resolved.notes:  # an optional plan left out at this tp size (a tower kept whole)
                warnings.warn(note, stacklevel=3)
        options = ParallelOptions(plan=resolved, pp_schedule=distributed_config.pp_schedule,
                                  pp_layers=distributed_config.pp_layers,
                                  load=(lambda model: model._load(reader, device, dtype)) if reader is not None else None)
        parallelize(self, mesh, options, device=device)
        self.parallel.config = distributed_config
        return self

    def _check_plan(self, distributed_config: DistributedConfig) -> Any:
        """The plan resolved at this layout, after the rule table; every refusal raised (no process group needed)."""
        from tptrain.parallel.parallelize import check

        return check(self, distributed_config)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        """transformers' `generate` on this model as it is laid out (tensor parallel, data parallel, FSDP2), with a
        KV cache; collective: every rank calls it, every rank of a TP group with the same prompts. The arguments,
        what it returns and the layouts it refuses: `tptrain.generation.generate`."""
        from tptrain.generation import generate  # the engine, at call time

        return generate(self, input_ids, attention_mask, **kwargs)

    def checkpoint_keys(self) -> dict[str, Any]:
        """{parameter name: checkpoint tensor name, or the per-expert names of a stacked tensor, or a converted
        tensor (an object with `shape`, `keys()` and `read(reader, spec, ...)`: tptrain.hf.conversions) } for
        parameters stored under another name; a model whose parameters are all stored under their own names has
        none."""
        return {}

    def _check_checkpoint(self, reader) -> None:
        """Every tensor this (unsharded, meta) model needs is in the checkpoint, at its global shape."""
        params = dict(self.named_parameters())  # tied aliases dedup'd: lm_head reads embed_tokens
        keys = self.checkpoint_keys()
        wanted = {}  # checkpoint name -> shape it must have
        for name, p in params.items():
            key = keys.get(name, name)
            if isinstance(key, list):  # a stacked tensor: one checkpoint tensor per expert, the stack's rows
                wanted.update({k: tuple(p.shape[1:]) for k in key})
            elif isinstance(key, str):
                wanted[key] = tuple(p.shape)
            elif tuple(key.shape) != tuple(p.shape):  # converted: its sources' shapes make its shape
                raise ValueError(f"checkpoint {reader.directory}: {key.rule} builds {name!r} of shape "
                                 f"{tuple(key.shape)} from {list(key.keys())[:3]}, but the config implies "
                                 f"{tuple(p.shape)}; the checkpoint does not match config.json")
        missing = [n for n in wanted if n not in reader]
        if missing:
            raise ValueError(f"checkpoint {reader.directory} lacks {len(missing)} tensor(s) the model needs, "
                             f"e.g. {missing[:3]}; it was not saved for this architecture/config")
        for name, shape in wanted.items():  # every shape checked before any byte is read
            check_tensor_shape(name, shape, tuple(reader.shape(name)), reader.file_of(name))

    def _load(self, reader, device: torch.device, dtype: torch.dtype) -> None:
        """Fill every (meta) parameter with this rank's slice of the (checked) checkpoint tensor, as the model is laid
        out (whole tensors for one process): parallel/shards.py `load_parameters`."""
        from tptrain.parallel.shards import load_parameters

        load_parameters(self, reader, device, dtype)

    # ---------------------------------------------------------------- saving

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter gathered to its full shape, on CPU; tied aliases dropped (HF convention).
        Collective over the TP group; returns the dict on TP rank 0 and None elsewhere."""
        from tptrain.parallel.saving import gather_parameters

        return gather_parameters(self, [name for name, _ in self.named_parameters()])

    def config_json(self, dtype: torch.dtype) -> str:
        """The config.json written next to weights of `dtype`."""
        config = self.config.to_dict()
        config["torch_dtype"] = str(dtype).replace("torch.", "")
        config["architectures"] = config.get("architectures") or [type(self).__name__]
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> None:
        """Write one consolidated HF checkpoint (config.json + safetensors), whatever tp_size was.

        Collective: every rank must call it. Streamed: the parameters are gathered one at a time, and
        global rank 0 writes each shard file (`max_shard_size`) as soon as its tensors are in, so it
        holds at most one shard plus one tensor, never the model; the index and config.json come last
        and the directory is renamed into place. A failure on the writer is raised on every rank. Cut into
        pipeline stages, each stage writes its own shard files and rank 0 the one index
        (parallel/pipeline_checkpoint.py).
        """
        from tptrain.parallel.saving import save_model  # the engine: gathers, the save protocol

        params = dict(self.named_parameters())  # tied aliases dropped (HF convention)
        sizes, checkpoint_tensors = self._checkpoint_tensors(list(params))
        extra = {"config.json": self.config_json(next(iter(params.values())).dtype), **self.extra_files()}
        save_model(self, sizes, checkpoint_tensors, save_directory, max_shard_size=max_shard_size, extra_files=extra)

    def extra_files(self) -> dict[str, bytes | str]:
        """Files written beside the weights and config.json ({name: content}): none, but a vision-language model's
        processor files."""
        return {}

    def _checkpoint_tensors(self, names: list[str]) -> tuple[dict[str, int], Callable[[], Iterator]]:
        """({checkpoint tensor name: bytes} in writing order, a function returning the iterator that gathers the
        parameters `names` and yields them under those names): stacked experts as the hub's per-expert tensors."""
        layout = self.parallel.tp
        params = dict(self.named_parameters(remove_duplicate=False))
        keys = self.checkpoint_keys()
        sizes = {}
        for name in names:
            p = params[name]
            nbytes = math.prod(layout.global_shapes[name] if layout else p.shape) * p.element_size()
            key = keys.get(name, name)
            sizes.update({k: nbytes // len(key) for k in key} if isinstance(key, list) else {key: nbytes})

        def checkpoint_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            from tptrain.parallel.saving import gathered_parameters

            for name, t in gathered_parameters(self, names):
                yield from checkpoint_items(name, t, keys)

        return sizes, checkpoint_tensors


def checkpoint_items(name: str, t: torch.Tensor,
                     keys: dict[str, str | list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameter `name` at full shape under the checkpoint's names: a stacked tensor as its per-expert tensors."""
    key = keys.get(name, name)
    if isinstance(key, list):
        yield from ((k, row.clone()) for k, row in zip(key, t.unbind(0)))
    else:
        yield key, t


def to_checkpoint_names(state: dict[str, torch.Tensor], keys: dict[str, str | list[str]]) -> dict[str, torch.Tensor]:
    """A full state dict under the checkpoint's names (`checkpoint_items`)."""
    return {k: v for name, t in state.items() for k, v in checkpoint_items(name, t, keys)}


def _check_has_weights(directory: Path) -> None:
    """A directory with config.json but no weights (io.weights_file) is a model to initialise, not to load."""
    from tptrain.io import ADAPTER_FILE, weights_file

    if weights_file(directory) is None:
        adapter = (f"; its {ADAPTER_FILE} is a LoRA adapter: load its base model, then "
                   f"PeftModel.from_pretrained(model, {str(directory)!r})"
                   if weights_file(directory, single_file=ADAPTER_FILE) else "")
        raise FileNotFoundError(
            f"checkpoint directory {directory} holds config.json but no weights (no {SINGLE_FILE} or "
            f"{INDEX_FILE}); to start from random weights use AutoModelForCausalLM.from_config("
            f"AutoConfig.from_pretrained({str(directory)!r})) (what `tptrain train --model {directory}` does)"
            f"{adapter}")
