"""ParallelStyle (the base class and the facts each style declares), the registry of styles by name, and the
hooks through which a style replaces a module's forward and adapters join its local result."""
from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tptrain.parallel.styles.context import TPContext
from tptrain.parallel.styles.spec import ShardSpec


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
    # Splits each of a fused projection's segments (`tp_segments`) on its own.
    fused: ClassVar[bool] = False
    # Works under sequence parallelism (False: the plan check refuses the combination).
    sequence_parallel_ok: ClassVar[bool] = True
    # Its module is a stacked-experts module (`num_experts`, forward(x, expert_ids, weights)).
    stacked_experts: ClassVar[bool] = False
    # Over an ep axis (DistributedConfig(ep_size=)) it splits the experts by expert there too (ShardSpec.ep_split)
    # and dispatches each rank's tokens to their owners by all-to-all (parallel/dispatch.py).
    ep_axis: ClassVar[bool] = False
    # How a low-rank adapter (LoRA's W + s B A, A (r, in), B (out, r)) on its module is split, its term joining the
    # module's local result before the style's output collective (`register_local_output_hook`): "output" (the
    # weight's rows split: A whole, B split like the weight), "input" (its input features split: A split on its
    # input dim, B whole) or None (LoRA refuses the module).
    adapter_split: ClassVar[str | None] = None
    # Its output is the sum of the ranks' partial results: the one all-reduce (under SP reduce-scatter) closing a
    # row-parallel block, counted in the communication report's minimum.
    sums_output: ClassVar[bool] = False
    # What it does with its module's `tp_replicated_tail` features (read whole by every rank), counted in the
    # communication report's minimum: "gradient_summed" (identity fwd / all-reduce bwd) or "sequence_gathered"
    # (under SP: all-gather fwd / reduce-scatter bwd along the sequence).
    replicated_tail: ClassVar[str | None] = None
    # Its module's own parameters are split by the per-parameter rules the module declares (`contract.param_specs`,
    # the transformers backend's rules on a parameter), its forward reading the pieces as they are.
    per_parameter_rules: ClassVar[bool] = False
    # transformers' other names for it in a model's plan (`colwise_rep`), translated to its own by the transformers
    # backend (tptrain.hf.plan); read from the class itself (`declared`): a subclass is another style.
    transformers_names: ClassVar[tuple[str, ...]] = ()

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


# Other spellings a plan may use for a registered style: transformers' name for the fused-projection split.
STYLE_ALIASES: dict[str, str] = {"packed_colwise": "fused_colwise"}


def declared(cls: type[ParallelStyle], fact: str, default=None):
    """Style fact `fact` as `cls` itself declares it (not inherited from the style it extends)."""
    return vars(cls).get(fact, default)


def canonical_style(name: str) -> str:
    """The registered name of style `name` (an alias resolved; unknown names unchanged)."""
    return STYLE_ALIASES.get(name, name)


def make_style(name: str, *, where: str, kv_replicas: int = 1) -> ParallelStyle:
    name = canonical_style(name)
    if name not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {name!r} for {where!r}; "
                         f"known styles: {', '.join(sorted(STYLES))}")
    return STYLES[name](kv_replicas=kv_replicas)


def own_params(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p is not None]


def replace_forward(module: nn.Module, fn: Callable) -> None:
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


def local_output(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for hook in module._local_output_hooks.values():
        out = hook(module, x, out)
    return out
