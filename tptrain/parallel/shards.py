"""A ShardSpec's slices: one rank's piece read from a checkpoint (what loading reads: `load_parameters` fills a laid-out
model, or a whole one) and every rank's pieces gathered into the whole tensor (what saving writes: parallel/saving.py).
Reached by the model base class's `_load` at call time, and used by LoRA and the checkpoints; applying the plan is
tensor_parallel.py's."""
from __future__ import annotations

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.state import state_of
from tptrain.parallel.styles import ShardSpec, TPContext


def gather_full(t: torch.Tensor, spec: ShardSpec, ctx: TPContext) -> torch.Tensor:
    """The unsharded tensor from every rank's local `t` (a parameter or its gradient). Collective: one
    all-gather, whatever the layout (a fused tensor's segments are put back in the checkpoint's order), and one
    over the ep group for experts split over it."""
    if spec.ep_split:
        t = comm.all_gather(t.contiguous(), ctx.ep_group, dim=0, phase="gather")
    if spec.dim is None:
        return t
    full = comm.all_gather(t.contiguous(), ctx.group, dim=spec.dim, phase="gather")
    if spec.single_placement:
        return full
    # Rank r's block holds its chunk of every part; keep each distinct chunk once (ranks sharing a KV chunk
    # are consecutive), part by part.
    blocks = [spec.local_parts(block, ctx.size) for block in full.chunk(ctx.size, dim=spec.dim)]
    return torch.cat([blocks[r][i][1] for i, (part, _) in enumerate(blocks[0])
                      for r in range(0, ctx.size, part.replicas)], dim=spec.dim)


def read_shard(reader, name: str, spec: ShardSpec, *, tp_size: int, tp_rank: int, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """Rank `tp_rank`'s piece of checkpoint tensor `name` (a CheckpointReader), reading only its bytes."""
    if spec.segments:
        return reader.read_ranges(name, dim=spec.dim, ranges=spec.local_ranges(reader.shape(name), tp_size, tp_rank),
                                  dtype=dtype, device=device)
    return reader.read(name, dim=spec.dim, index=spec.chunk_index(tp_rank), count=spec.num_chunks(tp_size),
                       dtype=dtype, device=device)


def load_parameters(model: nn.Module, reader, device: torch.device, dtype: torch.dtype) -> None:
    """Fill every (meta) parameter of `model` with this rank's slice of its (checked) checkpoint tensor, as its
    layout says (`model.parallel.tp`: the spec, this rank's tp and ep ranks; not laid out: whole tensors). A
    parameter stored under other names (`model.checkpoint_keys()`) is read from them: one tensor per expert of a
    stack, or a converted tensor (an object with `read`, tptrain.hf.conversions). Tied aliases are read once."""
    layout = state_of(model).tp
    ctx = layout.ctx if layout is not None else None
    ranks = dict(tp_size=ctx.size, tp_rank=ctx.rank, ep_size=ctx.ep_size, ep_rank=ctx.ep_rank) if ctx else \
        dict(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0)
    keys = model.checkpoint_keys()
    loaded: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():  # tied aliases dedup'd: lm_head reads embed_tokens
        spec = layout.spec(name) if layout else ShardSpec()
        key = keys.get(name, name)
        if isinstance(key, list):
            t = _read_stacked(reader, key, spec, **ranks, dtype=dtype, device=device)
        elif not isinstance(key, str):
            t = key.read(reader, spec, **ranks, dtype=dtype, device=device)
        else:
            t = read_shard(reader, key, spec, tp_size=ranks["tp_size"], tp_rank=ranks["tp_rank"],
                           dtype=_load_dtype(model, name, dtype), device=device)
        loaded[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        mod_name, _, pname = name.rpartition(".")
        setattr(model.get_submodule(mod_name), pname, loaded[id(p)])


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
