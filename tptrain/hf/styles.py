"""The style of transformers' own expert parallelism, on transformers' experts modules (the one style that reads
their interface: `num_experts` and the `_is_expert_parallel` sentinel mask of `@use_experts_implementation`)."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
from tptrain.parallel.styles import ParallelStyle, ShardSpec, register_style
from tptrain.parallel.styles.base import own_params


@register_style
class EpDispatchExperts(ParallelStyle):
    """transformers' expert parallelism (`base_model_ep_plan`: 'ep_dispatch_experts' on the experts, 'grouped_gemm'
    on their stacked weights; what `enable_expert_parallel` plans) over the TP group, as transformers runs it when
    the ranks share one batch (its AllReduceEP; tptrain's `expert_parallel_all_reduce`): rank r holds experts
    [r E/p, (r+1) E/p) whole (every stacked parameter split on dim 0) and runs every token routed to them, the
    routes to other ranks' experts masked (local id E/p, the experts' sentinel, weight 0); the partial outputs are
    summed (one all-reduce). x and the routing weights enter through `copy_to_tp`, so their partial gradients are
    summed too."""

    name = "ep_dispatch_experts"
    sequence_parallel_ok = False  # the router would see a sequence shard

    def param_specs(self, module):
        return {n: ShardSpec(0) for n in own_params(module)}

    def install(self, module, ctx):
        local = module.num_experts // ctx.size
        module.num_experts, module._is_expert_parallel = local, True  # transformers' experts mask ids >= local
        module.tp_dispatch = "all_reduce"  # what the communication report counts for this module

        def enter(m, args):
            x, ids, weights, *rest = args
            off = ids // local != ctx.rank
            ids = torch.where(off, local, ids % local)
            weights = comm.copy_to_tp(weights, ctx.group_name).masked_fill(off, 0.0)
            return (ctx.enter(x), ids, weights, *rest)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, args, out: ctx.exit(out))
