"""The styles of transformers' own expert parallelism, on transformers' experts modules (the styles that read their
interface: `num_experts`, the `_is_expert_parallel` sentinel mask of `@use_experts_implementation`, and
forward(hidden_states, top_k_index, top_k_weights)). The all-to-all dispatch is tptrain's (parallel/dispatch.py),
with transformers' forward as the per-expert computation."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
from tptrain.parallel.dispatch import depends_on, dispatch_and_combine, grouped_by_forward
from tptrain.parallel.expert_parallel import all_to_all_wins
from tptrain.parallel.styles import ParallelStyle, ShardSpec, register_style, replace_forward
from tptrain.parallel.styles.base import own_params

EXPERTS_INTERFACE = ("num_experts", "_is_expert_parallel")  # set by transformers' @use_experts_implementation


def _summed(module, ctx, forward):
    """forward(x, ids, weights) on this rank's experts, the routes to other ranks' experts masked (local id E/p, the
    experts' sentinel, weight 0), the partial outputs summed over TP (one all-reduce)."""
    local = module.num_experts

    def summed(self, x, expert_ids, weights):
        off = expert_ids // local != ctx.rank
        expert_ids = torch.where(off, local, expert_ids % local)
        weights = comm.copy_to_tp(weights, ctx.group_name).masked_fill(off, 0.0)
        x = ctx.enter(x)
        return ctx.exit(depends_on(forward(self, x, expert_ids, weights), x, weights, *self.parameters()))

    return summed


@register_style
class EpDispatchExpertsAllReduce(ParallelStyle):
    """transformers' expert parallelism over the TP group as transformers runs it when the ranks share one batch (its
    AllReduceEP; tptrain's `expert_parallel_all_reduce`): rank r holds experts [r E/p, (r+1) E/p) whole (every
    stacked parameter split on dim 0) and runs every token routed to them, the other routes masked; the partial
    outputs are summed (one all-reduce). x and the routing weights enter through `copy_to_tp`, so their partial
    gradients are summed too."""

    name = "ep_dispatch_experts_all_reduce"
    sequence_parallel_ok = False  # the router would see a sequence shard
    stacked_experts = True

    def param_specs(self, module):
        missing = [a for a in EXPERTS_INTERFACE if not hasattr(module, a)]
        if missing:
            raise TypeError(f"style {self.name!r} needs transformers' experts interface (a module decorated with "
                            f"@use_experts_implementation: {', '.join(EXPERTS_INTERFACE)}, forward(hidden_states, "
                            f"top_k_index, top_k_weights)), got a {type(module).__name__} without {missing}; drop "
                            f"enable_expert_parallel for this model")
        return {n: ShardSpec(0) for n in own_params(module)}

    def install(self, module, ctx):
        forward = type(module).forward
        module.num_experts, module._is_expert_parallel = module.num_experts // ctx.size, True  # ids >= local masked
        module.tp_dispatch = "all_reduce"  # what the communication report counts for this module
        replace_forward(module, _summed(module, ctx, forward))


@register_style
class EpDispatchExpertsAllToAll(EpDispatchExpertsAllReduce):
    """The same experts per rank, the tokens dispatched as tptrain's `expert_parallel_all_to_all` does: each rank
    routes its 1/p share of the tokens to the experts' owners and back by all-to-all (`dispatch_and_combine`, with
    transformers' forward run on the held experts), then the shares are all-gathered. A batch whose tokens do not
    split into p equal shares takes the summing path (every rank holds the same tokens: the same choice)."""

    name = "ep_dispatch_experts_all_to_all"

    def install(self, module, ctx):
        forward, total = type(module).forward, module.num_experts
        grouped = grouped_by_forward(module, forward)
        super().install(module, ctx)
        summed = module.forward
        module.tp_dispatch = "all_to_all"

        def dispatched(self, x, expert_ids, weights):
            if x.shape[0] % ctx.size:
                return summed(x, expert_ids, weights)
            return dispatch_and_combine(grouped, total, x, expert_ids, weights, ctx)

        replace_forward(module, dispatched)


@register_style
class EpDispatchExperts(EpDispatchExpertsAllToAll):
    """transformers' 'ep_dispatch_experts' (its `base_model_ep_plan`, what `enable_expert_parallel` plans): as
    tptrain's `expert_parallel`, whichever of the two sends fewer bytes per rank (`all_to_all_wins`, by the
    router's k: the module's `tp_top_k`, the config's num_experts_per_tok)."""

    name = "ep_dispatch_experts"

    def install(self, module, ctx):
        top_k = getattr(module, "tp_top_k", None)
        if top_k and all_to_all_wins(ctx.size, top_k):
            super().install(module, ctx)
        else:
            EpDispatchExpertsAllReduce.install(self, module, ctx)
