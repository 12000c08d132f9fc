"""A column-parallel block whose backward overlaps its input-gradient collective with its weight gradients.

The colwise linears that read one tensor (q/k/v, gate/up: siblings under one parent module) share one TP
boundary, so backward sums their input gradients and issues ONE all-reduce (under SP: one reduce-scatter).
Left to autograd, each linear computes its input and weight gradient together, and the boundary's collective
starts only after the last weight gradient, with nothing left to do while it runs. Here the whole block is one
autograd function (Megatron's async grad-input all-reduce, for a block instead of one fused linear):

    forward   y = x (under SP: all-gather x along the sequence);  out_i = F.linear(y, W_i, b_i) for every member
    backward  [SP: start the re-gather of x]  grad_y = sum_i grad_out_i @ W_i  ->  start its all-reduce
              (SP: reduce-scatter)  ->  grad W_i = grad_out_i^T @ y, grad b_i  ->  wait  ->  grad x

The collectives are the ones the unfused path issues (same ops, bytes and phases in `CommTracker`), started
with `async_op` (`comm.start_*`). The result is bit for bit the unfused path's: the same matmuls on the same
operands, and the input gradients added in the order autograd would add them (each member's output passes
through `_Arrival`, which records when its gradient is complete; autograd sums a tensor's gradient in that
order). The block computes every member's output when the first member enters; each member's forward then
returns its own (`take`).

Only blocks that can be fused are (`fusable`): plain `nn.Linear` members with no adapter on their local
output (a LoRA-wrapped projection adds its own term to the boundary's gradient), no other forward pre-hook,
weights in the input's dtype, a contiguous input, grad enabled and autocast off. Anything else takes the
unfused path (`TPContext.enter` as before). `TPTRAIN_OVERLAP=0` (or `TPContext.overlap = False`) turns it off.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from tptrain.distributed import comm

OVERLAP_ENV = "TPTRAIN_OVERLAP"


def overlap_enabled() -> bool:
    """$TPTRAIN_OVERLAP: "1" (the default) fuses column-parallel blocks, "0" keeps autograd's unfused path."""
    value = os.environ.get(OVERLAP_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{OVERLAP_ENV}={value!r} must be 1 (overlap the grad-input collective in backward, the "
                         f"default) or 0 (off)")
    return value == "1"


def fusable(x: torch.Tensor, members: tuple[nn.Module, ...], *, sequence_parallel: bool) -> bool:
    """Whether the block of `members` reading `x` can run as one function (else: the unfused path). The linears
    must see a contiguous input (as SP's gather makes it), which autograd folds into one matmul."""
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return False
    if torch.compiler.is_compiling():  # a compiled block: the async collectives would break its graph
        return False
    if not (sequence_parallel or x.is_contiguous()):
        return False
    for m in members:
        if (type(m).forward is not nn.Linear.forward or getattr(m, "_local_output_hooks", None)
                or len(m._forward_pre_hooks) != 1 or m._forward_pre_hooks_with_kwargs):
            return False
        if any(p is not None and (p.dtype != x.dtype or p.device != x.device
                                  or type(p) not in (torch.Tensor, nn.Parameter)) for p in (m.weight, m.bias)):
            return False
    return True


class Block:
    """One forward's fused block: the entered tensor `y` and each member's output, until the member takes it."""

    def __init__(self, x: torch.Tensor, members: tuple[nn.Module, ...], group: comm.ProcessGroup, *,
                 sequence_parallel: bool, keep_shard: bool) -> None:
        self.order: list[int] = []  # the backward's arrival order: member index, or -1 for y itself
        params = [t for m in members for t in (m.weight, m.bias)]
        y, *outs = _BlockFunction.apply(x, self.order, comm.group_name(group), sequence_parallel, keep_shard, *params)
        self.y = y
        self._outputs = {id(m): (i, out) for i, (m, out) in enumerate(zip(members, outs))}

    def take(self, module: nn.Module) -> torch.Tensor | None:
        """`module`'s output, the first time it asks (None after, or for a module outside the block)."""
        i, out = self._outputs.pop(id(module), (None, None))
        return None if out is None else _Arrival.apply(out, self.order, i)

    def entered(self, module: nn.Module | None) -> torch.Tensor:
        """What `TPContext.enter` returns: `y`; for a reader other than a member still to take its output
        (which computes from y itself), through `_Arrival` so its gradient is added in autograd's order."""
        return self.y if module is not None and id(module) in self._outputs else _Arrival.apply(self.y, self.order, -1)


class _Arrival(Function):
    """identity fwd / identity bwd, noting that gradient `index` of the block is complete."""

    @staticmethod
    def forward(ctx, t, order, index):
        ctx.order, ctx.index = order, index
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.order.append(ctx.index)
        return grad, None, None


def _in_order(terms: dict[int, torch.Tensor], order: list[int]) -> torch.Tensor:
    """sum(terms), added in `order` (first arrival first), as autograd's gradient buffer would add them. A term
    that arrived unannounced (y read by a hook on a member) comes last."""
    keys = list(dict.fromkeys([*(k for k in order if k in terms), *terms]))
    total = terms[keys[0]]
    for k in keys[1:]:
        total = total + terms[k]
    return total


class _BlockFunction(Function):
    """identity (SP: all-gather) + every member's linear fwd / all-reduce (SP: reduce-scatter) of the input
    gradient, started before the weight gradients and waited for after them, bwd."""

    @staticmethod
    def forward(ctx, x, order, group_name, sequence_parallel, keep_shard, *params):
        group = comm.resolve_group(group_name)
        y = comm.all_gather(x, group, dim=1) if sequence_parallel else x.view_as(x)
        outs = [F.linear(y, w, b) for w, b in zip(params[0::2], params[1::2])]
        # Under SP the shard only, gathered again in backward, as sequence_parallel.py keeps it; where it keeps
        # the whole (a checkpointed layer's recompute) the gathered input.
        ctx.save_for_backward(x if keep_shard or not sequence_parallel else y, *params)
        ctx.order, ctx.group_name = order, group_name
        ctx.sequence_parallel, ctx.regather = sequence_parallel, keep_shard
        ctx.set_materialize_grads(False)
        return (y, *outs)

    @staticmethod
    def backward(ctx, grad_y, *grad_outs):
        x, *params = ctx.saved_tensors  # x: the input, its shard, or under SP (no regather) the gathered input
        weights = params[0::2]
        group, sp = comm.resolve_group(ctx.group_name), ctx.sequence_parallel
        need_w, need_b = ctx.needs_input_grad[5::2], ctx.needs_input_grad[6::2]
        need_params = any(g is not None and (nw or nb) for g, nw, nb in zip(grad_outs, need_w, need_b))
        full = comm.start_all_gather(x, group, dim=1) if ctx.regather and need_params else None
        flat = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grad_outs]  # (tokens, out_i)
        grad_x = None
        if ctx.needs_input_grad[0]:
            shape = (*x.shape[:1], x.shape[1] * group.size(), *x.shape[2:]) if ctx.regather else x.shape
            terms = {i: g.mm(w).view(shape) for i, (g, w) in enumerate(zip(flat, weights)) if g is not None}
            if grad_y is not None:
                terms[-1] = grad_y
            total = _in_order(terms, ctx.order)
            total = total.clone() if total is grad_y else total  # reduced in place: never the incoming buffer
            grad_x = comm.start_reduce_scatter(total, group, dim=1) if sp else comm.start_all_reduce(total, group)
        y = (full.wait() if full is not None else x).reshape(-1, x.shape[-1])  # (tokens, in)
        grads = []
        for g, nw, nb in zip(flat, need_w, need_b):
            grads.append(g.t().mm(y) if g is not None and nw else None)
            grads.append(g.sum(0) if g is not None and nb else None)
        return (None if grad_x is None else grad_x.wait(), None, None, None, None, *grads)
