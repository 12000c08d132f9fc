"""Summing partial parameter gradients over the TP axis, bucketed into one all-reduce.

Some parameters receive only a per-rank share of their gradient: replicated weights applied to
sharded activations (Qwen3's q/k norms, norms under sequence parallelism) and KV projections that
several ranks hold when tp_size > num_key_value_heads. Their gradients are summed over the ranks
holding the same chunk. All of them travel in ONE flat all-reduce: a KV projection's region is
laid out chunk by chunk, each rank writing its own chunk's slot, so summing the whole buffer sums
exactly the ranks that share a chunk.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from tptrain.distributed import comm
from tptrain.parallel.styles import ShardSpec, TPContext


class PartialGradSync:
    """Owns the partial-gradient parameters of one model.

    With `auto=True` (the default) a tensor hook records each incoming local gradient and the sum is
    done once at the end of every backward, so a plain `loss.backward()` leaves correct gradients.
    A trainer with gradient accumulation sets `auto=False` and calls `sync()` once per optimizer
    step instead: the hooks keep accumulating local shares until then.
    """

    def __init__(self, specs: dict[str, ShardSpec], ctx: TPContext) -> None:
        self.specs = {name: spec for name, spec in specs.items() if spec.partial_grad}
        self.ctx = ctx
        self.auto = True
        self._pending: dict[str, torch.Tensor] = {}
        self._queued = False
        self._params: dict[str, nn.Parameter] = {}
        self._handles: list = []

    def bind(self, model: nn.Module) -> None:
        """(Re)attach the hooks to the model's current parameter objects: after loading replaced
        them, or after a wrapper such as FSDP did."""
        for handle in self._handles:
            handle.remove()
        params = dict(model.named_parameters(remove_duplicate=False))
        self._params = {name: params[name] for name in self.specs if name in params}
        self._handles = [p.register_hook(lambda g, name=name: self._record(name, g))
                         for name, p in self._params.items() if p.requires_grad]

    def _record(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        prev = self._pending.get(name)
        self._pending[name] = grad.detach().clone() if prev is None else prev + grad.detach()
        if self.auto and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.sync)
        return grad

    def unbind(self) -> None:
        """Remove the hooks: the owner then sums the gradients itself with `reduce_grads` once per
        optimizer step (a trainer under FSDP, whose sharded parameters never see these hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._params, self._pending, self.auto = [], {}, {}, False

    def sync(self) -> None:
        """Replace every recorded local share in `.grad` by the sum over the ranks sharing it."""
        self._queued = False
        if not self._pending:
            return
        local = {name: t.clone() for name, t in self._pending.items()}
        self.reduce_grads(self._pending)
        for name, summed in self._pending.items():
            p = self._params[name]
            if torch.equal(p.grad, local[name]):  # nothing else accumulated: take the sum as is, so replicated
                p.grad.copy_(summed)  # weights stay bit-identical across ranks (g + (s - g) != s in floats)
            else:
                p.grad.add_(summed.to(p.grad.dtype) - local[name].to(p.grad.dtype))
        self._pending.clear()

    def reduce_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Sum each local share in `grads` ({param name: tensor}, updated in place) over the ranks
        holding the same chunk, all in one all-reduce. Names that need no sum are ignored."""
        names = [n for n in self.specs if n in grads]  # fixed order: identical on every rank
        if not names:
            return
        # At least fp32, so half-precision gradients are summed without loss; fp64 stays fp64.
        dtype = functools.reduce(torch.promote_types, (grads[n].dtype for n in names), torch.float32)
        flat = torch.cat([self._slot_buffer(grads[n], self.specs[n], dtype).flatten() for n in names])
        comm.all_reduce(flat, self.ctx.group, phase="grad_sync")
        offset = 0
        for name in names:
            local, spec = grads[name], self.specs[name]
            width = local.numel() * spec.num_chunks(self.ctx.size)
            region = flat[offset:offset + width].view(spec.num_chunks(self.ctx.size), -1)
            local.copy_(region[spec.chunk_index(self.ctx.rank)].view_as(local))
            offset += width

    def _slot_buffer(self, local: torch.Tensor, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        buf = local.new_zeros((spec.num_chunks(self.ctx.size), local.numel()), dtype=dtype)
        buf[spec.chunk_index(self.ctx.rank)] = local.flatten()
        return buf
