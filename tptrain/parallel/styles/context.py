"""TPContext: the run-time state every style of one model shares (the TP group by name, the per-forward
flags), and the column-parallel block boundaries it enters and exits."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.parallel.colwise_block import Block, fusable, overlap_enabled


@dataclass
class TPContext:
    """Run-time state shared by every style of one model: the TP group (by name, see `comm.group_name`) and
    per-forward flags."""

    group_name: str
    size: int
    rank: int
    sequence_parallel: bool = False
    # The ep axis (DistributedConfig(ep_size=)): this rank's group of expert owners, by name, its size and rank.
    ep_group_name: str | None = None
    ep_size: int = 1
    ep_rank: int = 0
    # Set per forward by the engine: with labels, the head keeps logits vocab-sharded for the
    # vocab-parallel loss instead of all-gathering them.
    keep_logits_sharded: bool = False
    # Called as on_gather(local, gathered, dim) after each SP all-gather: sequence_parallel.py keeps
    # only `local` for backward wherever autograd would save `gathered`.
    on_gather: Callable[[torch.Tensor, torch.Tensor, int], None] | None = field(default=None, repr=False)
    # Under SP: whether what is saved for backward now keeps only the sequence shard (sequence_parallel.py: in the
    # model's forward, outside checkpointed layers, whose own hooks take what is saved).
    keeps_shards: Callable[[], bool] = field(default=lambda: False, repr=False)
    # Fuse each column-parallel block so its backward overlaps the input-gradient collective with the weight
    # gradients (colwise_block.py): on unless TPTRAIN_OVERLAP=0; bit for bit the same either way.
    overlap: bool = field(default_factory=overlap_enabled)
    # id(colwise module) -> the colwise siblings it shares an input with (itself included), in module order.
    blocks: dict[int, tuple[nn.Module, ...]] = field(default_factory=dict, repr=False)
    _boundary: tuple | None = field(default=None, repr=False)

    @property
    def group(self) -> comm.ProcessGroup:
        return comm.resolve_group(self.group_name)

    @property
    def ep_group(self) -> comm.ProcessGroup:
        return comm.resolve_group(self.ep_group_name)

    def enter(self, x: torch.Tensor, module: nn.Module | None = None) -> torch.Tensor:
        """Input boundary of a column-parallel block (`module`: the colwise member entering, if one).

        Siblings reading the same tensor (q/k/v, gate/up) share one boundary, so backward issues a
        single all-reduce (or reduce-scatter under SP) for all of them: the Megatron minimum. With
        `overlap`, the first member to enter runs the whole block as one function (`colwise_block.Block`).
        Over one rank there is no boundary: `x` itself (the experts of a tp-1 model split over an ep axis).
        """
        if self.size == 1:
            return x
        if self._boundary is not None and self._boundary[0]() is x:
            block = self._boundary[2]
            return self._boundary[1] if block is None else block.entered(module)
        members = self.blocks.get(id(module)) if self.overlap and module is not None else None
        block = Block(x, members, self.group, sequence_parallel=self.sequence_parallel,
                      keep_shard=self.sequence_parallel and self.keeps_shards()) \
            if members and fusable(x, members, sequence_parallel=self.sequence_parallel) else None
        if block is not None:
            y = block.y
        elif self.sequence_parallel:
            y = comm.gather_to_sp(x, self.group_name, dim=1)
        else:
            y = comm.copy_to_tp(x, self.group_name)
        if self.sequence_parallel and self.on_gather is not None:
            self.on_gather(x, y, 1)
        self._boundary = (weakref.ref(x), y, block)
        return y if block is None else block.entered(module)

    def fused_output(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor | None:
        """`module`'s output if the block it entered computed it (None: compute it)."""
        block = self._boundary[2] if self._boundary is not None else None
        return block.take(module) if block is not None and block.y is y else None

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Output boundary of a row-parallel block: sum the per-rank partial results (over one rank: `partial`)."""
        if self.size == 1:
            return partial
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.group_name, dim=1)
        return comm.reduce_from_tp(partial, self.group_name)

    def reset(self) -> None:
        self._boundary = None
