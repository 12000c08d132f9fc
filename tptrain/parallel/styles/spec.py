"""ShardSpec: which dim of a parameter is split across the TP axis, with its replicas and fused segments."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over the TP axis.

    dim: the tensor dim split into equal chunks (None: every rank holds the whole tensor).
    replicas: how many consecutive ranks hold the same chunk (KV heads when tp > num_key_value_heads).
    partial_grad: each rank's gradient is only its share; the true gradient is the sum over the ranks
        holding the same chunk (replicated weights applied to sharded activations).
    segments: a fused tensor (q/k/v or gate/up rows): ((global size along dim, replicas), ...) in
        order; each segment is split on its own as a spec of its own, and rank r holds its chunk of every
        segment, concatenated in the same order. Empty: one tensor split as a whole.
    ep_split: stacked experts split by expert (dim 0) over the ep axis as well (`DistributedConfig(ep_size=)`):
        ep rank e holds chunk e of ep equal chunks of dim 0, and the TP split (another dim) applies within it.
    """

    dim: int | None = None
    replicas: int = 1
    partial_grad: bool = False
    segments: tuple[tuple[int, int], ...] = ()
    ep_split: bool = False

    def ep_chunk(self, full: torch.Tensor, ep_size: int, ep_rank: int) -> torch.Tensor:
        """Ep rank `ep_rank`'s experts of `full` (a view; `full` itself unless `ep_split`)."""
        return full.chunk(ep_size, dim=0)[ep_rank] if self.ep_split else full

    def num_chunks(self, tp_size: int) -> int:
        assert not self.segments, "a fused spec has one chunk count per segment: use parts()"
        return 1 if self.dim is None else tp_size // self.replicas

    def chunk_index(self, tp_rank: int) -> int:
        assert not self.segments, "a fused spec has one chunk index per segment: use parts()"
        return 0 if self.dim is None else tp_rank // self.replicas

    @property
    def single_placement(self) -> bool:
        """Expressible as one DTensor placement (Replicate or Shard(dim)): neither KV replicas nor segments."""
        return self.dim is None or (self.replicas == 1 and not self.segments)

    def parts(self) -> list[tuple[int, int | None, "ShardSpec"]]:
        """[(global start along dim, global size or None for all, plain spec of that part)]: one part unless fused."""
        if not self.segments:
            return [(0, None, self)]
        out, start = [], 0
        for size, reps in self.segments:
            out.append((start, size, ShardSpec(self.dim, reps, partial_grad=reps > 1)))
            start += size
        return out

    def local_parts(self, local: torch.Tensor, tp_size: int) -> list[tuple["ShardSpec", torch.Tensor]]:
        """[(plain spec, view of this rank's `local` holding that part)]: the fused segments of a local shard."""
        if not self.segments:
            return [(self, local)]
        sizes = [size // sub.num_chunks(tp_size) for _, size, sub in self.parts()]
        return [(sub, piece) for (_, _, sub), piece in zip(self.parts(), local.split(sizes, dim=self.dim))]

    def local_ranges(self, shape: tuple[int, ...], tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
        """The global [start, stop) ranges along `dim` that rank `tp_rank` holds, in local order."""
        out = []
        for start, size, sub in self.parts():
            size = shape[self.dim] if size is None else size
            step = size // sub.num_chunks(tp_size)
            first = start + sub.chunk_index(tp_rank) * step
            out.append((first, first + step))
        return out

    def local_shape(self, shape: tuple[int, ...], tp_size: int, ep_size: int = 1) -> tuple[int, ...]:
        if self.ep_split:
            shape = (shape[0] // ep_size, *shape[1:])
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = sum(stop - start for start, stop in self.local_ranges(shape, tp_size, 0))
        return tuple(out)

    def local_chunk(self, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
        """Rank `tp_rank`'s piece of the unsharded tensor `full` (a view unless fused; `full` itself when
        replicated)."""
        if self.dim is None:
            return full
        ranges = self.local_ranges(tuple(full.shape), tp_size, tp_rank)
        pieces = [full.narrow(self.dim, start, stop - start) for start, stop in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)
