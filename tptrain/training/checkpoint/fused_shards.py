"""A fused tensor's shards (fused q/k/v or gate/up rows) as a ShardedTensor, so DCP saves them ungathered.

A rank's TP shard of a fused tensor is its chunk of every segment, concatenated (`ShardSpec.segments`);
FSDP then cuts that along dim 0 into dp_shard pieces, which may straddle segments. A rank so holds up to
one row range per segment of the global tensor: several boxes, which no DTensor placement describes but
a ShardedTensor's local shards do (DCP writes each as it is). Segments along a later dim (the [gate; up]
halves of transformers' stacked experts, [E, 2I, H], split on dim 1) meet FSDP's and the ep axis's cuts of
dim 0 crosswise: each box is then this rank's dim-0 rows by one segment's range. Replicated copies (KV
segments shared by several TP ranks, HSDP's dp_replicate) are listed once, by their first holder, so the
boxes tile the tensor exactly, and every rank computes every rank's boxes alike (no communication).
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.device_mesh import DeviceMesh

from tptrain.distributed.topology import rank_grid
from tptrain.parallel.styles import ShardSpec


def fused_sharded_tensor(local: torch.Tensor, spec: ShardSpec, shape: tuple[int, ...], mesh: DeviceMesh, *,
                          fsdp: bool, ep: int = 1) -> ShardedTensor:
    """This rank's `local` (its FSDP piece of its TP shard when `fsdp`, else the TP shard) of the fused
    tensor of global `shape`, laid out over `mesh` (dp_replicate, dp_shard, tp), as a ShardedTensor. `ep`:
    the ep axis's size when dim 0 is split over it (`ShardSpec.ep_split`; dp_shard is (dp_shard_mod_ep, ep)
    flattened, FSDP shards over dp_shard_mod_ep)."""
    assert spec.segments and (ep == 1 or spec.dim != 0), spec  # an ep split cuts dim 0: segments lie across it
    ranks = rank_grid(mesh)
    rep, dp_shard, tp = ranks.shape
    me, shards, metas = dist.get_rank(), [], []
    for r, d, k in itertools.product(range(rep), range(dp_shard), range(tp)):
        rank = int(ranks[r, d, k])
        writer_dp = r == 0 and (fsdp or d // ep == 0)  # FSDP's pieces differ over dp_shard; else alike but for ep
        for offsets, sizes, at, replicas in _boxes(spec, shape, tp, k, d, dp_shard, fsdp=fsdp, ep=ep):
            if not writer_dp or k % replicas:
                continue
            metas.append(ShardMetadata(offsets, sizes, f"rank:{rank}/{local.device}"))
            if rank == me:
                box = local
                for dim, (start, size) in enumerate(zip(at, sizes)):
                    box = box.narrow(dim, start, size)
                shards.append(Shard(box.contiguous(), metas[-1]))  # a copy only of a box across a later dim
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def fsdp_segment_pieces(piece: torch.Tensor, spec: ShardSpec, tp: int, tp_rank: int, dp_rank: int,
                        dp_size: int) -> list[tuple[ShardSpec, torch.Tensor]]:
    """`ShardSpec.local_parts` for FSDP's piece `dp_rank` (of `dp_size`) of a fused TP shard: (the
    segment's plain spec, view of its rows in `piece`), for the segments the piece reaches. Segments along a
    later dim than FSDP's 0 are each whole in every piece: `local_parts` of the piece."""
    if spec.dim != 0:
        return spec.local_parts(piece, tp)
    subs = [sub for _, _, sub in spec.parts()]
    by_replicas = {sub.replicas: sub for sub in subs}
    return [(by_replicas[replicas], piece.narrow(0, at, rows))
            for _, rows, at, replicas in _row_boxes(spec, tuple(piece.shape), tp, tp_rank, dp_rank, dp_size)]


def _boxes(spec: ShardSpec, shape: tuple[int, ...], tp: int, tp_rank: int, dp_rank: int, dp_size: int, *,
           fsdp: bool, ep: int):
    """(global offsets, sizes, offsets in the local piece, segment replicas) of each box that rank (`dp_rank` of
    dp_shard, `tp_rank`) holds of the fused tensor of global `shape` (module docstring)."""
    if spec.dim == 0:
        for start, rows, at, replicas in _row_boxes(spec, shape, tp, tp_rank, dp_rank if fsdp else 0,
                                                     dp_size if fsdp else 1):
            rest = [0] * (len(shape) - 1)
            yield [start, *rest], [rows, *shape[1:]], [at, *rest], replicas
        return
    held = shape[0] // ep  # dim 0 over ep (outer), then FSDP's chunks of it over dp_shard_mod_ep
    first = dp_rank % ep * held
    lo, hi = 0, held
    if fsdp:
        size = math.ceil(held / (dp_size // ep))  # torch.chunk's split, as FSDP2's
        lo, hi = min(held, dp_rank // ep * size), min(held, (dp_rank // ep + 1) * size)
    if lo >= hi:
        return
    at = 0
    for (start, stop), (_, _, sub) in zip(spec.local_ranges(shape, tp, tp_rank), spec.parts()):
        offsets, sizes, local = [first + lo, *[0] * (len(shape) - 1)], [hi - lo, *shape[1:]], [0] * len(shape)
        offsets[spec.dim], sizes[spec.dim], local[spec.dim] = start, stop - start, at
        yield offsets, sizes, local, sub.replicas
        at += stop - start


def _row_boxes(spec: ShardSpec, shape: tuple[int, ...], tp: int, tp_rank: int, dp_rank: int, dp_size: int):
    """(global start row, rows, start in the FSDP piece, segment replicas) of each segment's rows that
    FSDP piece `dp_rank` of TP rank `tp_rank`'s shard holds (`shape` matters only past dim 0)."""
    ranges = spec.local_ranges(shape, tp, tp_rank)  # global [start, stop) per segment, in local order
    total = sum(stop - start for start, stop in ranges)
    size = math.ceil(total / dp_size)  # torch.chunk's split, as FSDP2's
    first, last = dp_rank * size, min(total, (dp_rank + 1) * size)
    offset = 0
    for (start, stop), (_, _, sub) in zip(ranges, spec.parts()):
        lo, hi = max(first, offset), min(last, offset + stop - start)
        if lo < hi:
            yield start + lo - offset, hi - lo, lo - first, sub.replicas
        offset += stop - start
