"""Megatron-style sequence parallelism: backward re-gathers the sequence instead of saving it.

Under SP the residual stream and the norms hold a sequence shard (batch, seq/tp, hidden); the TP
boundary all-gathers it before q/k/v (gate/up, lm_head) and reduce-scatters after o_proj (down_proj).
Left alone, autograd would make every column-parallel `nn.Linear` save the GATHERED (batch, seq,
hidden) input for its weight gradient: tp times the bytes of the shard. While the model runs forward,
a `saved_tensors_hooks` pair keeps only the local shard of any tensor the SP all-gather produced, and
the backward gathers it again when first needed. q/k/v (gate/up) save views of the same gathered
tensor, so they share ONE re-gather, cached until the last of them has run its backward.

    model.parallelize(DistributedConfig(tp_size=2, enable_sequence_parallel=True))
    model(input_ids, labels=labels).loss.backward()   # seq len must be a multiple of tp_size

The saver is sequence parallelism's part of the forward scope (tptrain/distributed/state.py): every forward through
the model (its own, a pipeline stage's) begins and ends it. Under pipeline parallelism the stages exchange the residual
stream as it is between layers, each tp rank's shard going to the same tp rank of the next stage.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from tptrain.distributed import comm
from tptrain.distributed.state import Batch
from tptrain.layout import Spelling, check
from tptrain.parallel.styles import TPContext


# Observers of what SP keeps for backward (diagnostics.accounting.SavedTensorMeter subscribes while it
# measures): SP's own saved-tensor hooks replace the meter's, so it reports here what it keeps instead.
# A measuring aid, like comm.CommTracker: it holds no training state.
SAVED_TENSOR_OBSERVERS: list = []


def record_saved(t: torch.Tensor) -> None:
    for observe in SAVED_TENSOR_OBSERVERS:
        observe(t)


@dataclass
class _Gathered:
    """One SP all-gather: its local input (kept for backward) and the re-gathered tensor, cached
    while some saved view of it still waits for its backward."""

    local: torch.Tensor
    full: weakref.ref  # the forward's gathered tensor: only to tell it apart from a reused address
    nbytes: int
    ctx: TPContext
    dim: int
    version: int  # autograd's check, kept: the shard must not change in place before backward
    _regathered: torch.Tensor | None = field(default=None, repr=False)

    def regather(self) -> torch.Tensor:
        if self._regathered is None:
            if self.local._version != self.version:
                raise RuntimeError("a sequence-parallel shard saved for backward was modified in place after the "
                                   "forward (its all-gather input); clone it before modifying it")
            self._regathered = comm.all_gather(self.local, self.ctx.group, dim=self.dim)
        return self._regathered


@dataclass
class _Packed:
    """What autograd stores instead of a view of a gathered tensor."""

    source: _Gathered
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class SequenceParallelSaver:
    """The saved-tensor hooks of one SP model, active only while that model runs forward: sequence parallelism's part
    of the forward scope. Its begin checks a whole batch's sequence length first (the same on every rank: all raise,
    none is left in a collective; a pipeline's batches were checked by the Trainer before it built the pipeline)."""

    def __init__(self, ctx: TPContext, model_name: str) -> None:
        self.ctx, self.model_name = ctx, model_name
        self._gathered: dict[int, _Gathered] = {}  # storage address -> gather, for this forward only
        self._hooks: list = []
        ctx.on_gather, ctx.keeps_shards = self.on_gather, self.active

    def on_gather(self, local: torch.Tensor, full: torch.Tensor, dim: int) -> None:
        if torch.compiler.is_compiling():  # a compiled layer: its compiler, not autograd's hooks, picks what it saves
            return
        if not self._hooks:  # activation checkpointing's recompute in backward: nothing will be packed, and
            return           # an entry would keep its shard alive until the next forward ends
        storage = full.untyped_storage()
        # Detached: the shard's storage is kept, not the autograd graph that produced it.
        self._gathered[storage.data_ptr()] = _Gathered(local.detach(), weakref.ref(full), storage.nbytes(),
                                                       self.ctx, dim, local._version)

    def active(self) -> bool:
        """Whether tensors saved now are packed by these hooks: the model's forward, outside any checkpointed
        layer (whose own hooks, innermost, take the tensors in its forward and in its recompute alike)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) in effect, or None
        return bool(self._hooks) and top is not None and top[0] == self._pack

    def _pack(self, t: torch.Tensor):
        source = self._gathered.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if source is None or source.full() is None or source.nbytes != t.untyped_storage().nbytes():
            record_saved(t)
            return t
        record_saved(source.local)
        return _Packed(source, tuple(t.shape), t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Packed):
            return packed
        # The re-gathered tensor has the forward's contiguous layout, so the saved view maps onto it.
        return packed.source.regather().as_strided(packed.shape, packed.stride, packed.offset)

    def begin(self, batch: Batch) -> Batch:
        if not batch.runs:
            return batch
        if batch.whole and batch.input_ids is not None:
            check_sequence_length(self.model_name, batch.input_ids.shape[1], self.ctx.size)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return batch

    def end(self, batch: Batch, output):
        if batch.runs:
            self._gathered.clear()  # packed views keep what they need; the rest may be freed
            self._hooks.pop().__exit__(None, None, None)
        return output


def check_sequence_length(model_name: str, seq_len: int, tp_size: int, *, what: str | None = None) -> None:
    """ValueError unless `seq_len` splits over the TP ranks (the rule table's `sp_seq_len`); `what` names where the
    length comes from."""
    check("sp_seq_len", tp=tp_size, sequence_parallel=True, seq_len=seq_len, name=model_name,
          spelling=Spelling(seq_len=what or f"the input's sequence length {seq_len}"))
