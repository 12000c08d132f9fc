"""The styles of transformers' own expert parallelism, on transformers' experts modules: tptrain's one expert
mechanism (`parallel.expert_parallel.ExpertStyle`: the split, the summing or all-to-all dispatch and the choice)
with the interface of transformers' experts (`num_experts`, the `_is_expert_parallel` sentinel mask of
`@use_experts_implementation`, and forward(hidden_states, top_k_index, top_k_weights)). The all-to-all dispatch is
tptrain's (parallel/dispatch.py), with transformers' forward as the per-expert computation."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
from tptrain.parallel.dispatch import depends_on, grouped_by_forward
from tptrain.parallel.expert_parallel import ExpertStyle
from tptrain.parallel.styles import ShardSpec, register_style
from tptrain.parallel.styles.base import own_params

EXPERTS_INTERFACE = ("num_experts", "_is_expert_parallel")  # set by transformers' @use_experts_implementation


class TransformersExpertsStyle(ExpertStyle):
    """transformers' experts split by expert over the TP group, as transformers runs them (its AllReduceEP): rank r
    holds experts [r E/p, (r+1) E/p) whole (every stacked parameter split on dim 0; `num_experts` becomes the held
    count, `_is_expert_parallel` masks the routes to other ranks' experts). Summing: every rank runs every token
    routed to its experts, the other routes masked (local id E/p, the experts' sentinel, weight 0), and the partial
    outputs are summed (one all-reduce); x and the routing weights enter through `copy_to_tp`, so their partial
    gradients are summed too. All-to-all: transformers' forward run on the held ids (`grouped_by_forward`)."""

    sequence_parallel_ok = False  # the router would see a sequence shard

    def param_specs(self, module):
        missing = [a for a in EXPERTS_INTERFACE if not hasattr(module, a)]
        if missing:
            raise TypeError(f"style {self.name!r} needs transformers' experts interface (a module decorated with "
                            f"@use_experts_implementation: {', '.join(EXPERTS_INTERFACE)}, forward(hidden_states, "
                            f"top_k_index, top_k_weights)), got a {type(module).__name__} without {missing}; drop "
                            f"enable_expert_parallel for this model")
        return {n: ShardSpec(0) for n in own_params(module)}

    def hold(self, module, rank, size):
        module.num_experts, module._is_expert_parallel = module.num_experts // size, True  # ids >= local masked

    def summed(self, module, ctx):
        forward, local = type(module).forward, module.num_experts

        def summed(self, x, expert_ids, weights):
            off = expert_ids // local != ctx.rank
            expert_ids = torch.where(off, local, expert_ids % local)
            weights = comm.copy_to_tp(weights, ctx.group_name).masked_fill(off, 0.0)
            x = ctx.enter(x)
            return ctx.exit(depends_on(forward(self, x, expert_ids, weights), x, weights, *self.parameters()))

        return summed

    def held_experts(self, module):
        grouped, total = grouped_by_forward(module, type(module).forward), module.num_experts
        return lambda m: (grouped, total)

    def top_k(self, module):
        return getattr(module, "tp_top_k", None)  # the config's num_experts_per_tok (hf.plan.declare_tp_facts)


@register_style
class EpDispatchExpertsAllReduce(TransformersExpertsStyle):
    """transformers' expert parallelism summed (tptrain's `expert_parallel_all_reduce`)."""

    name = "ep_dispatch_experts_all_reduce"
    dispatch = "all_reduce"


@register_style
class EpDispatchExpertsAllToAll(TransformersExpertsStyle):
    """transformers' experts, the tokens dispatched by all-to-all (tptrain's `expert_parallel_all_to_all`)."""

    name = "ep_dispatch_experts_all_to_all"
    dispatch = "all_to_all"


@register_style
class EpDispatchExperts(TransformersExpertsStyle):
    """transformers' 'ep_dispatch_experts' (its `base_model_ep_plan`, what `enable_expert_parallel` plans): as
    tptrain's `expert_parallel`, whichever of the two sends fewer bytes per rank (by the router's k: the module's
    `tp_top_k`)."""

    name = "ep_dispatch_experts"
    dispatch = "auto"
