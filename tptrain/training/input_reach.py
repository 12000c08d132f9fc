"""Parameters that only some inputs reach, kept in step over the data-parallel ranks.

A vision-language model's tower and projector get a gradient only from a micro-batch holding an image; a text-only
micro-batch leaves them without one. FSDP2 reduce-scatters the gradients a unit's parameters got, so a dp rank whose
micro-batch holds no image, while another's does, would reduce fewer tensors than its peers (gloo: "Received data
size doesn't match"; NCCL: a hang, or wrong sums). So, on every dp rank, each such parameter that a micro-batch's loss
does not reach is touched with a zero gradient (`0 * p.sum()` added to the loss: adding it to another rank's gradient
is exact), and once the step's backwards are over, a parameter that no dp rank reached gets its gradient back to None
(one all-reduce of a flag per parameter), so AdamW skips it as it would on one process (a step of only text rows, a
part no input reaches: CLIP's last layer under LLaVA's second-to-last feature layer).

    reach = InputReach.of(model, dp_group, dp_size)   # None: nothing input-dependent, or one dp rank
    model(**batch).loss.backward()                     # each micro-batch: the model's forward touches (a hook)
    reach.settle()                                     # after the step's backwards, before the optimizer

The touch runs in a hook at the end of the model's forward, ahead of FSDP2's own (which puts the sharded parameters
back): the parameters touched are the gathered ones, which the backward fills.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tptrain.distributed import comm


class InputReach:
    """The input-dependent parameters of `model` (its `input_dependent_parameters()`: names), which dp ranks reached."""

    def __init__(self, model: nn.Module, names: list[str], group: Any) -> None:
        self.model, self.names, self.group = model, names, group
        self.reached = torch.zeros(len(names), dtype=torch.float64)
        model.register_forward_hook(self._touch_output, prepend=True)

    def _touch_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if loss is not None and loss.requires_grad:
            output.loss = self.touch(loss)
        return output

    @classmethod
    def of(cls, model: nn.Module, group: Any, dp_size: int) -> "InputReach | None":
        """For `model` (the base model a PeftModel wraps) over a dp group of `dp_size` ranks, or None where no rank
        can differ (one dp rank, no input-dependent parameter)."""
        declared = getattr(model, "input_dependent_parameters", None)
        names = [n for n in declared()] if declared is not None and dp_size > 1 else []
        return cls(model, names, group) if names else None

    def touch(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus a zero term reaching every trainable input-dependent parameter the loss does not reach; those
        it reaches are recorded."""
        reached = _leaves(loss)
        params = dict(self.model.named_parameters())
        zero = []
        for i, name in enumerate(self.names):
            p = params[name]
            if id(p) in reached:
                self.reached[i] = 1
            elif p.requires_grad:
                zero.append(p.sum() * 0)
        return loss + torch.stack(zero).sum().to(loss.dtype) if zero else loss

    def settle(self) -> None:
        """After the step's backwards: a parameter no dp rank reached gets no gradient (collective over dp)."""
        anywhere = self.reached.to(_device(self.model))
        comm.all_reduce(anywhere, self.group, phase="input_reach")
        params = dict(self.model.named_parameters())
        for name, count in zip(self.names, anywhere.tolist()):
            if count == 0:
                params[name].grad = None
        self.reached.zero_()


def _leaves(loss: torch.Tensor) -> set[int]:
    """ids of the tensors whose gradient the backward of `loss` accumulates (its graph's AccumulateGrad nodes)."""
    seen, found, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
