"""Summing the gradients that are per-rank shares: TP's partial ones, bucketed into one all-reduce, and under context
parallelism every one over the cp group.

Some parameters receive only a per-rank share of their gradient: replicated weights applied to
sharded activations (Qwen3's q/k norms, norms under sequence parallelism) and KV projections that
several ranks hold when tp_size > num_key_value_heads. Their gradients are summed over the ranks
holding the same chunk. All of them travel in ONE flat all-reduce: a KV projection's region is
laid out chunk by chunk, each rank writing its own chunk's slot, so summing the whole buffer sums
exactly the ranks that share a chunk.

Under context parallelism (the state's `cp`) EVERY gradient is a per-rank share (each cp rank's tokens): in
"backward" mode every parameter is recorded and, after the TP sum, summed over the cp group in one more flat
all-reduce. In "step" mode (the Trainer) FSDP2's reduce-scatter over dp_shard x cp sums them instead. Experts
split over an ep axis are not: their ep group holds the cp ranks (each rank's owner got every cp rank's tokens
by the dispatch), so their gradients are whole already.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tptrain.distributed import comm
from tptrain.parallel.styles import ShardSpec, TPContext


class GradSync:
    """Sums the per-rank gradient shares of one laid-out model (its ParallelState: the TP layout's table says which
    gradients are partial over tp; under cp every one is a share over cp); one mode, set by whoever owns the training
    loop. It belongs to no axis: it reads the TP layout and the CP context as they are at each sum.

    mode "backward" (the default): a tensor hook records each incoming local share and the sum is done
    once at the end of every backward, so a plain `loss.backward()` leaves correct gradients.
    mode "step": no hooks; the owner (the Trainer, or a loop with gradient accumulation) calls
    `sync_grads(model)` once per optimizer step, summing the accumulated `.grad` in one all-reduce.
    Which parameters need the sum is read from the layout each time, so adapters added later join.
    """

    MODES = ("backward", "step")

    def __init__(self, state) -> None:
        self.state = state  # a ParallelState (tptrain/distributed/state.py) with its TP layout
        self.mode = "backward"
        self._pending: dict[str, torch.Tensor] = {}
        self._queued = False
        self._params: dict[str, nn.Parameter] = {}
        self._handles: list = []

    @property
    def layout(self):
        return self.state.tp  # a TPLayout: its table says which gradients are partial

    @property
    def ctx(self) -> TPContext:
        return self.layout.ctx

    @property
    def cp_group_name(self) -> str | None:
        """Context parallelism's group (every gradient is also summed over it), as it is now; None without cp."""
        return self.state.cp.group_name if self.state.cp is not None else None

    def set_mode(self, mode: str, model: nn.Module | None = None) -> None:
        """Switch to `mode`; in "backward" mode the hooks are (re)attached to `model`'s parameters."""
        if mode not in self.MODES:
            raise ValueError(f"gradient-sync mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self._remove_hooks()
        if mode == "backward" and model is not None:
            self.attach(model)

    def attach(self, model: nn.Module) -> None:
        """Follow the model's current parameter objects (after loading, or after adapters changed which
        parameters require grad). A no-op in "step" mode, where nothing is recorded."""
        self._remove_hooks()
        if self.mode != "backward":
            return
        params = dict(model.named_parameters(remove_duplicate=False))
        names = list(self.layout.partial_grad_specs())
        if self.cp_group_name is not None:  # every parameter, each tied one once
            names += [name for name, _ in model.named_parameters() if name not in names]
        self._params = {name: params[name] for name in names if name in params}
        self._handles = [p.register_hook(lambda g, name=name: self._record(name, g))
                         for name, p in self._params.items() if p.requires_grad]

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._params, self._pending, self._queued = [], {}, {}, False

    def _record(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        prev = self._pending.get(name)
        self._pending[name] = grad.detach().clone() if prev is None else prev + grad.detach()
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sync_pending)
        return grad

    def _sync_pending(self) -> None:
        """End of a backward: replace every recorded local share in `.grad` by the sum over the ranks sharing it."""
        self._queued = False
        if not self._pending:
            return
        local = {name: t.clone() for name, t in self._pending.items()}
        self.reduce_grads(self._pending)
        if self.cp_group_name is not None:  # not the experts split over ep (whole already: the docstring)
            specs = self.layout.specs
            over_cp = {n: g for n, g in self._pending.items() if not (n in specs and specs[n].ep_split)}
            if over_cp:
                _sum_flat(over_cp, self.cp_group_name)
        for name, summed in self._pending.items():
            p = self._params[name]
            if torch.equal(p.grad, local[name]):  # nothing else accumulated: take the sum as is, so replicated
                p.grad.copy_(summed)  # weights stay bit-identical across ranks (g + (s - g) != s in floats)
            else:
                p.grad.add_(summed.to(p.grad.dtype) - local[name].to(p.grad.dtype))
        self._pending.clear()

    def sync_grads(self, model: nn.Module) -> None:
        """"step" mode: sum the accumulated partial `.grad`s of `model` over TP (one all-reduce). Collective."""
        self.reduce_grads({n: local_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    def reduce_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Sum each local share in `grads` ({param name: tensor}, updated in place) over the ranks
        holding the same chunk, all in one all-reduce. Names that need no sum are ignored."""
        specs = self.layout.partial_grad_specs()
        # Table order, identical on every rank; of a fused tensor only its partial segments (views of the grad).
        pieces = [(part, piece) for n in specs if n in grads
                  for part, piece in specs[n].local_parts(grads[n], self.ctx.size) if part.partial_grad]
        if not pieces:
            return
        # At least fp32, so half-precision gradients are summed without loss; fp64 stays fp64.
        dtype = functools.reduce(torch.promote_types, (piece.dtype for _, piece in pieces), torch.float32)
        flat = torch.cat([self._slot_buffer(piece, spec, dtype).flatten() for spec, piece in pieces])
        comm.all_reduce(flat, self.ctx.group, phase="grad_sync")
        offset = 0
        for spec, local in pieces:
            width = local.numel() * spec.num_chunks(self.ctx.size)
            region = flat[offset:offset + width].view(spec.num_chunks(self.ctx.size), -1)
            local.copy_(region[spec.chunk_index(self.ctx.rank)].view_as(local))
            offset += width

    def _slot_buffer(self, local: torch.Tensor, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        buf = local.new_zeros((spec.num_chunks(self.ctx.size), local.numel()), dtype=dtype)
        buf[spec.chunk_index(self.ctx.rank)] = local.flatten()
        return buf


def _sum_flat(grads: dict[str, torch.Tensor], group_name: str) -> None:
    """Sum every tensor of `grads` (updated in place) over the group, in one flat all-reduce (at least fp32)."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads.values()), torch.float32)
    flat = torch.cat([g.to(dtype).flatten() for g in grads.values()])
    comm.all_reduce(flat, comm.resolve_group(group_name), phase="grad_sync")
    for g, summed in zip(grads.values(), flat.split([g.numel() for g in grads.values()])):
        g.copy_(summed.view_as(g))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient: the local shard of an FSDP2 DTensor (a view: writes go through)."""
    return t.to_local() if isinstance(t, DTensor) else t
