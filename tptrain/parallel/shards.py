"""A ShardSpec's slices: one rank's piece read from a checkpoint (what loading reads) and every rank's pieces gathered
into the whole tensor (what saving writes). Used by the model base class's load and save, LoRA and the checkpoints;
applying the plan is tensor_parallel.py's."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
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
