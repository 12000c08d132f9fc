"""Partition styles: how one module is split across the tensor-parallel axis.

A style is a small class registered by name. It declares, as data, which dim of each parameter is
split (`ShardSpec`) and installs the forward-time communication on the module. Adding a style means
adding one class here. Modules stay ordinary `nn.Linear` / `nn.Embedding` / norm modules holding
their local shard under their Hugging Face parameter names.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from tptrain.distributed import comm
from tptrain.parallel.colwise_block import Block, fusable, overlap_enabled


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over the TP axis.

    dim: the tensor dim split into equal chunks (None: every rank holds the whole tensor).
    replicas: how many consecutive ranks hold the same chunk (KV heads when tp > num_key_value_heads).
    partial_grad: each rank's gradient is only its share; the true gradient is the sum over the ranks
        holding the same chunk (replicated weights applied to sharded activations).
    segments: a packed tensor (fused q/k/v or gate/up rows): ((global size along dim, replicas), ...) in
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
        assert not self.segments, "a packed spec has one chunk count per segment: use parts()"
        return 1 if self.dim is None else tp_size // self.replicas

    def chunk_index(self, tp_rank: int) -> int:
        assert not self.segments, "a packed spec has one chunk index per segment: use parts()"
        return 0 if self.dim is None else tp_rank // self.replicas

    @property
    def single_placement(self) -> bool:
        """Expressible as one DTensor placement (Replicate or Shard(dim)): neither KV replicas nor segments."""
        return self.dim is None or (self.replicas == 1 and not self.segments)

    def parts(self) -> list[tuple[int, int | None, "ShardSpec"]]:
        """[(global start along dim, global size or None for all, plain spec of that part)]: one part unless packed."""
        if not self.segments:
            return [(0, None, self)]
        out, start = [], 0
        for size, reps in self.segments:
            out.append((start, size, ShardSpec(self.dim, reps, partial_grad=reps > 1)))
            start += size
        return out

    def local_parts(self, local: torch.Tensor, tp_size: int) -> list[tuple["ShardSpec", torch.Tensor]]:
        """[(plain spec, view of this rank's `local` holding that part)]: the packed segments of a local shard."""
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
        """Rank `tp_rank`'s piece of the unsharded tensor `full` (a view unless packed; `full` itself when
        replicated)."""
        if self.dim is None:
            return full
        ranges = self.local_ranges(tuple(full.shape), tp_size, tp_rank)
        pieces = [full.narrow(self.dim, start, stop - start) for start, stop in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


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
        """
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
        """Output boundary of a row-parallel block: sum the per-rank partial results."""
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.group_name, dim=1)
        return comm.reduce_from_tp(partial, self.group_name)

    def reset(self) -> None:
        self._boundary = None


class ParallelStyle:
    """Base class. `kv_replicas` > 1 only for colwise projections producing replicated KV heads.

    Two facts per style let the plan check see layouts whose local shapes cannot meet (a split output
    feeding a module that wants the whole width) without knowing any module: `splits_output` (this
    rank's output holds only its share of the features) and `needs_split_input` (it must be fed such
    a share). `vocab_parallel_loss`: on the model's output head, the logits stay vocab-sharded for
    the vocab-parallel loss whenever labels are given.
    """

    name: ClassVar[str]
    module_types: ClassVar[tuple[type, ...]] = (nn.Module,)
    splits_output: ClassVar[bool] = False
    needs_split_input: ClassVar[bool] = False
    vocab_parallel_loss: ClassVar[bool] = False
    # All-reduces of one float per token this style issues in forward, and as many in backward
    # (a norm over split features): counted in the communication report's minimum.
    token_all_reduces: ClassVar[int] = 0
    # Splits each of a packed module's segments (`tp_segments`) on its own.
    packed: ClassVar[bool] = False
    # Works under sequence parallelism (False: the plan check refuses the combination).
    sequence_parallel_ok: ClassVar[bool] = True

    def __init__(self, *, kv_replicas: int = 1) -> None:
        self.kv_replicas = kv_replicas

    def param_specs(self, module: nn.Module) -> dict[str, ShardSpec]:
        """ShardSpec of each parameter directly owned by `module` (local names)."""
        raise NotImplementedError

    def install(self, module: nn.Module, ctx: TPContext) -> None:
        """Attach the forward-time communication. Called once, after the parameters are sharded."""


STYLES: dict[str, type[ParallelStyle]] = {}


def register_style(cls: type[ParallelStyle]) -> type[ParallelStyle]:
    STYLES[cls.name] = cls
    return cls


def make_style(name: str, *, where: str, kv_replicas: int = 1) -> ParallelStyle:
    if name not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {name!r} for {where!r}; "
                         f"known styles: {', '.join(sorted(STYLES))}")
    return STYLES[name](kv_replicas=kv_replicas)


def _own_params(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p is not None]


def _replace_forward(module: nn.Module, fn: Callable) -> None:
    # An instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks) still run.
    module.forward = fn.__get__(module, type(module))


def register_local_output_hook(module: nn.Module, hook: Callable) -> RemovableHandle:
    """Run `hook(module, input, local_out) -> local_out` on this rank's result of `module`, before the style's
    output collective (rowwise / vocab-parallel embedding: the all-reduce of partial sums; colwise_gather_output:
    the vocabulary gather; colwise: before any forward hook). `input` is what the local computation saw (a colwise
    module's entered tensor). Adapters such as LoRA join the base computation here and so need no collective of
    their own; a colwise module with such a hook is computed on its own, never by a fused block (colwise_block.py).
    Modules without a style run it as a forward hook, prepended."""
    hooks = getattr(module, "_local_output_hooks", None)
    if hooks is None:
        return module.register_forward_hook(lambda m, args, out: hook(m, args[0], out), prepend=True)
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def _local_output(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for hook in module._local_output_hooks.values():
        out = hook(module, x, out)
    return out


def vocab_shard_ids(ids: torch.Tensor, *, rank: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ids` as indices into rank `rank`'s contiguous vocabulary slice, 0 where another rank owns the id;
    the mask of those ids owned elsewhere)."""
    start = rank * local_vocab
    outside = (ids < start) | (ids >= start + local_vocab)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, *, rank: int,
                          padding_idx: int | None = None) -> torch.Tensor:
    """F.embedding on rank `rank`'s contiguous vocabulary slice `weight` (local_vocab, dim); ids owned by another
    rank give zero rows, which the sum over ranks fills in."""
    local_vocab = weight.shape[0]
    start = rank * local_vocab
    local_ids, outside = vocab_shard_ids(ids, rank=rank, local_vocab=local_vocab)
    # The pad row gets no gradient, as in nn.Embedding; only the rank owning it has it.
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + local_vocab else None
    local = F.embedding(local_ids, weight, padding_idx=local_pad)
    return local.masked_fill(outside.unsqueeze(-1), 0.0)


@register_style
class ColwiseParallel(ParallelStyle):
    """Split output features (weight dim 0, bias dim 0); the output stays sharded."""

    name = "colwise"
    module_types = (nn.Linear,)
    splits_output = True

    def param_specs(self, module):
        spec = ShardSpec(0, self.kv_replicas, partial_grad=self.kv_replicas > 1)
        return {n: spec for n in _own_params(module)}

    def install(self, module, ctx):
        local_forward = type(module).forward

        def forward(self, x, *args, **kwargs):
            out = ctx.fused_output(self, x)  # computed by the block this module entered (colwise_block.py)
            return _local_output(self, x, local_forward(self, x, *args, **kwargs)) if out is None else out

        module.register_forward_pre_hook(lambda m, args: (ctx.enter(args[0], m), *args[1:]))
        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        _replace_forward(module, forward)


@register_style
class PackedColwiseParallel(ColwiseParallel):
    """Colwise for a packed projection (fused q/k/v, gate/up): each segment of the output rows is split on its
    own, so a rank holds its q, k and v heads (its gate and up columns), concatenated in the checkpoint's order.
    The module declares its segments as data, `tp_segments = ((global rows, holds KV heads), ...)`; KV segments
    get the plan's KV replicas. The forward is colwise's: the model splits the local output by local sizes."""

    name = "packed_colwise"
    packed = True

    def param_specs(self, module):
        segments = getattr(module, "tp_segments", None)
        if not segments:
            raise TypeError(f"style {self.name!r} needs a module declaring tp_segments ((rows, is_kv), ...), "
                            f"got a {type(module).__name__} without them; use 'colwise' for an unpacked projection")
        packed = tuple((rows, self.kv_replicas if kv else 1) for rows, kv in segments)
        spec = ShardSpec(0, segments=packed, partial_grad=any(reps > 1 for _, reps in packed))
        return {n: spec for n in _own_params(module)}

    def install(self, module, ctx):
        super().install(module, ctx)
        # This rank's rows of each segment: what the model splits the local output by.
        spec = self.param_specs(module)["weight"]
        module.segment_sizes = tuple(stop - start for start, stop in
                                     spec.local_ranges((sum(r for r, _ in module.tp_segments),), ctx.size, ctx.rank))


@register_style
class RowwiseParallel(ParallelStyle):
    """Split input features (weight dim 1); partial outputs are summed, then the bias added once."""

    name = "rowwise"
    module_types = (nn.Linear,)
    needs_split_input = True

    def param_specs(self, module):
        specs = {"weight": ShardSpec(1)}
        if module.bias is not None:
            specs["bias"] = ShardSpec(None)
        return specs

    def install(self, module, ctx):
        def forward(self, x):
            y = ctx.exit(_local_output(self, x, F.linear(x, self.weight)))
            return y if self.bias is None else y + self.bias

        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        _replace_forward(module, forward)


@register_style
class ColwiseGatherOutput(ColwiseParallel):
    """LM head: colwise, then all-gather the vocabulary unless the vocab-parallel loss consumes it."""

    name = "colwise_gather_output"
    splits_output = False  # gathered (or consumed sharded by the loss only)
    vocab_parallel_loss = True

    def install(self, module, ctx):
        super().install(module, ctx)

        def gather(m, args, out):
            return out if ctx.keep_logits_sharded else comm.gather_from_tp(out, ctx.group_name, dim=-1)

        module.register_forward_hook(gather)


@register_style
class EmbeddingRowwise(ParallelStyle):
    """Vocab-parallel embedding: each rank owns a contiguous slice of the vocabulary (weight dim 0)."""

    name = "embedding_rowwise"
    module_types = (nn.Embedding,)

    def param_specs(self, module):
        return {"weight": ShardSpec(0)}

    def install(self, module, ctx):
        def forward(self, ids):
            local = vocab_shard_embedding(ids, self.weight, rank=ctx.rank, padding_idx=self.padding_idx)
            return ctx.exit(_local_output(self, ids, local))

        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        _replace_forward(module, forward)


@register_style
class ReplicatedWithGradAllreduce(ParallelStyle):
    """Whole weights on every rank, applied to sharded activations (Qwen3's per-head q/k norms):
    forward needs no communication, the gradient is a partial sum over the TP group."""

    name = "replicated_with_grad_allreduce"
    needs_split_input = True

    def param_specs(self, module):
        return {n: ShardSpec(None, partial_grad=True) for n in _own_params(module)}


@register_style
class SequenceParallel(ReplicatedWithGradAllreduce):
    """Norms between TP regions under sequence parallelism: each rank normalises its own sequence
    shard, so the weight gradient is a partial sum over the TP group."""

    name = "sequence_parallel"
    needs_split_input = False  # split along the sequence, not the features


@register_style
class DistributedRMSNorm(ParallelStyle):
    """An RMSNorm over features a colwise projection split (OLMo 2's q/k norms over the whole projected width),
    so attention stays sharded. The weight is split like the projection's output rows (dim 0, with its KV
    replicas); the module's `mean_square(h)` (`(..., local) -> (..., 1)`) becomes each rank's sum of squares,
    summed over TP (one all-reduce of one float per token, forward and backward), over the global width.
    Ranks holding the same KV chunk each add it, so the sum is divided by the replica count; in backward the
    summed gradient, divided alike, reaches each holder, and their weight and input shares add up to the whole."""

    name = "distributed_rmsnorm"
    splits_output = True
    needs_split_input = True
    token_all_reduces = 1

    def param_specs(self, module):
        spec = ShardSpec(0, self.kv_replicas, partial_grad=self.kv_replicas > 1)
        return {n: spec for n in _own_params(module)}

    def install(self, module, ctx):
        if not callable(getattr(module, "mean_square", None)):
            raise TypeError(f"style {self.name!r} needs a norm with a mean_square(h) method (tptrain's RMSNorm), "
                            f"got a {type(module).__name__}")
        width = module.weight.shape[0] * (ctx.size // self.kv_replicas)  # the unsplit feature count

        def mean_square(h):  # (..., local_width) -> (..., 1)
            total = comm.sum_over_tp(h.pow(2).sum(-1, keepdim=True), ctx.group_name) / self.kv_replicas
            return total / width

        module.mean_square = mean_square
