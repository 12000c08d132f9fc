"""PreTrainedModel: the Hugging Face-style entry points of every model: loading and saving.

`from_pretrained` builds the model on the meta device, lays it out with the one parallelize (tptrain/parallel/
parallelize.py: every axis, applied from outside the model), which fills each parameter with only this rank's slice,
read straight from the safetensors files. `save_pretrained` gathers the shards and writes one consolidated HF
checkpoint, once, atomically. This module applies no axis itself.
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
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tptrain.io import (CheckpointReader, check_tensor_shape, resolve_checkpoint,
                                writable_error)
from tptrain.io import INDEX_FILE, SINGLE_FILE, save_streamed
from tptrain.distributed import DistributedConfig, init_distributed, raise_on_any_rank
from tptrain.parallel import parallelize as axes
from tptrain.dtypes import resolve_dtype
from tptrain.meta_init import build_on
from tptrain.parallel.plan import ResolvedPlan
from tptrain.parallel.shards import gather_full, read_shard
from tptrain.parallel.styles import ShardSpec


class PreTrainedModel(nn.Module):
    """Base of every CausalLM. Subclasses set `config_class` and `_tp_plan` (the head's plan)."""

    config_class: ClassVar[type]
    _tp_plan: ClassVar[dict[str, str]] = {}
    base_model_prefix: ClassVar[str] = "model"
    backend: ClassVar[str] = "native"  # "transformers": tptrain's engine on transformers' modeling code (tptrain.hf)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.tp_size = 1
        self.tp_plan: dict[str, str] = {}
        self.device_mesh = None
        self.tp_layout = None  # tptrain.parallel.tensor_parallel.TPLayout once parallelised
        self.cp_context = None  # tptrain.parallel.context_parallel.CPContext under context parallelism

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
            model._load(reader, target, dtype, rank=0)
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

    def _apply_plan(self, resolved: ResolvedPlan, distributed_config: DistributedConfig, *, reader=None,
                    dtype: torch.dtype | None = None) -> "PreTrainedModel":
        mesh, device = distributed_config.device_mesh()
        if dist.get_rank() == 0:
            for note in resolved.notes:  # an optional plan left out at this tp size (a tower kept whole)
                warnings.warn(note, stacklevel=3)

        def load(model: "PreTrainedModel") -> None:  # once laid out: only this rank's stages and slices are read
            ctx = model.tp_layout.ctx
            model._load(reader, device, dtype, rank=ctx.rank, ep_rank=ctx.ep_rank)

        options = axes.ParallelOptions(plan=resolved, pp_schedule=distributed_config.pp_schedule,
                                       pp_layers=distributed_config.pp_layers,
                                       load=load if reader is not None else None)
        axes.parallelize(self, mesh, options, device=device)
        return self

    def _check_plan(self, distributed_config: DistributedConfig) -> ResolvedPlan:
        """The plan resolved at this layout, after the rule table; every refusal raised (no process group needed)."""
        return axes.check(self, distributed_config)

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

    def _load(self, reader, device: torch.device, dtype: torch.dtype, *, rank: int, ep_rank: int = 0) -> None:
        """Fill every (meta) parameter with this rank's slice of the (checked) checkpoint tensor (`rank`: its tp
        rank; `ep_rank`: its rank on the ep axis, which picks its experts)."""
        layout = self.tp_layout
        keys = self.checkpoint_keys()
        loaded: dict[int, nn.Parameter] = {}
        for name, p in self.named_parameters():  # tied aliases dedup'd: lm_head reads embed_tokens
            spec = layout.spec(name) if layout else ShardSpec()
            key = keys.get(name, name)
            if isinstance(key, list):
                t = _read_stacked(reader, key, spec, tp_size=self.tp_size, tp_rank=rank, ep_rank=ep_rank,
                                  ep_size=layout.ctx.ep_size if layout else 1, dtype=dtype, device=device)
            elif not isinstance(key, str):
                t = key.read(reader, spec, tp_size=self.tp_size, tp_rank=rank, ep_rank=ep_rank,
                             ep_size=layout.ctx.ep_size if layout else 1, dtype=dtype, device=device)
            else:
                t = read_shard(reader, key, spec, tp_size=self.tp_size, tp_rank=rank,
                               dtype=_load_dtype(self, name, dtype), device=device)
            loaded[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
        for name, p in list(self.named_parameters(remove_duplicate=False)):
            mod_name, _, pname = name.rpartition(".")
            setattr(self.get_submodule(mod_name), pname, loaded[id(p)])

    # ---------------------------------------------------------------- saving

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter gathered to its full shape, on CPU; tied aliases dropped (HF convention).
        Collective over the TP group; returns the dict on TP rank 0 and None elsewhere."""
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
        params = dict(self.named_parameters())  # tied aliases dropped (HF convention)
        sizes, checkpoint_tensors = self._checkpoint_tensors(list(params))
        extra = {"config.json": self.config_json(next(iter(params.values())).dtype), **self.extra_files()}
        if axes.save_stages(self, sizes, checkpoint_tensors, save_directory, max_shard_size=max_shard_size,
                            extra_files=extra):  # cut into stages: each writes its own files
            return
        save_once(save_directory, collective=is_sharded(self), gather=checkpoint_tensors,
                  write=lambda tensors: save_streamed(sizes, tensors, save_directory, max_shard_size=max_shard_size,
                                                      extra_files=extra))

    def extra_files(self) -> dict[str, bytes | str]:
        """Files written beside the weights and config.json ({name: content}): none, but a vision-language model's
        processor files."""
        return {}

    def _checkpoint_tensors(self, names: list[str]) -> tuple[dict[str, int], Callable[[], Iterator]]:
        """({checkpoint tensor name: bytes} in writing order, a function returning the iterator that gathers the
        parameters `names` and yields them under those names): stacked experts as the hub's per-expert tensors."""
        layout = getattr(self, "tp_layout", None)
        params = dict(self.named_parameters(remove_duplicate=False))
        keys = self.checkpoint_keys()
        sizes = {}
        for name in names:
            p = params[name]
            nbytes = math.prod(layout.global_shapes[name] if layout else p.shape) * p.element_size()
            key = keys.get(name, name)
            sizes.update({k: nbytes // len(key) for k in key} if isinstance(key, list) else {key: nbytes})

        def checkpoint_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in gathered_parameters(self, names):
                yield from checkpoint_items(name, t, keys)

        return sizes, checkpoint_tensors


def _load_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is loaded in: `dtype`, or at least fp32 for those its module lists in
    `keep_in_float32` (transformers' `_keep_in_fp32_modules_strict`: DeepSeek's router bias)."""
    module, _, pname = name.rpartition(".")
    keep = pname in getattr(model.get_submodule(module), "keep_in_float32", ())
    return torch.promote_types(dtype, torch.float32) if keep else dtype


def _read_stacked(reader, keys: list[str], spec: ShardSpec, *, tp_size: int, tp_rank: int, ep_size: int = 1,
                  ep_rank: int = 0, **kwargs) -> torch.Tensor:
    """This rank's piece of a stacked (experts, ...) tensor stored as one checkpoint tensor per expert: split along
    dim 0, only its experts are read; split along another dim, that dim's slice of every expert (of its own
    experts only, when they are also split over the ep axis)."""
    if spec.ep_split:
        per_rank = len(keys) // ep_size
        keys = keys[ep_rank * per_rank:(ep_rank + 1) * per_rank]
    if spec.dim == 0:
        per_rank = len(keys) // spec.num_chunks(tp_size)
        first = spec.chunk_index(tp_rank) * per_rank
        keys, inner = keys[first:first + per_rank], ShardSpec()
    else:
        inner = ShardSpec() if spec.dim is None else ShardSpec(spec.dim - 1, spec.replicas)
    out = None
    for i, key in enumerate(keys):  # one expert at a time: the peak is the stack plus one expert's slice
        t = read_shard(reader, key, inner, tp_size=tp_size, tp_rank=tp_rank, **kwargs)
        out = t.new_empty((len(keys), *t.shape)) if out is None else out
        out[i] = t
    return out


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


def gathered_parameters(model: nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the parameter at full shape on the CPU) for each of `names`, gathered when the caller asks for
    it: FSDP2 shards first, then TP shards. Collective (each step) over the TP group and FSDP's; the
    tensors are complete on TP rank 0."""
    layout = getattr(model, "tp_layout", None)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        t = params[name].detach()
        if isinstance(t, DTensor):  # FSDP2-sharded over data parallelism: gather this rank's TP shard
            t = t.full_tensor()
        yield name, (t if layout is None else gather_full(t, layout.specs[name], layout.ctx)).cpu()


def gather_parameters(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The parameters `names` of `model` at full shape, on the CPU, all at once (`gathered_parameters`).
    Collective over the TP group (and FSDP's); returns the dict on TP rank 0 and None elsewhere."""
    layout = getattr(model, "tp_layout", None)
    out = dict(gathered_parameters(model, names))
    return out if layout is None or layout.ctx.rank == 0 else None


def is_sharded(model: nn.Module) -> bool:
    """Sharded over TP, or over data parallelism by FSDP2 (DTensor parameters): saving is then collective."""
    return dist.is_initialized() and (getattr(model, "tp_layout", None) is not None
                                      or any(isinstance(p, DTensor) for p in model.parameters()))


def save_once(target: str | os.PathLike, *, collective: bool, gather: Callable[[], Any],
              write: Callable[[Any], None]) -> None:
    """The save protocol: global rank 0 checks `target`, every rank takes part in `gather()`, rank 0
    calls `write(gathered)`. Any failure is raised on every rank, so none waits in a later collective.
    `gather()` may return an iterator that gathers as it is consumed (streaming): every rank then runs
    it to the end after `write` (the writer too, should its write fail half-way)."""
    # Global rank 0 writes even for an unsharded model that every rank saves: one writer per directory.
    writer = not dist.is_initialized() or dist.get_rank() == 0
    raise_on_any_rank(writable_error(Path(target)) if writer else None, collective=collective)
    gathered = gather()
    error = None
    if writer:
        try:
            write(gathered)
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            error = f"saving to {target} failed: {type(exc).__name__}: {exc}"
    if isinstance(gathered, Iterator):
        for _ in gathered:  # the gathers the writer did not consume: every rank takes part in each
            pass
    raise_on_any_rank(error, collective=collective)
