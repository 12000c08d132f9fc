"""Styles whose module's forward runs on this rank's pieces as they are (transformers' styles for modules that are
not plain linears): the parameters are split by per-parameter rules the module declares as data
(`contract.param_specs`: attention sinks, stacked experts), and the style adds only the collectives at its edges."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
from tptrain.parallel import contract
from tptrain.parallel.dispatch import exchange, grouped_by_forward
from tptrain.parallel.styles.base import ParallelStyle, own_params, register_style, replace_forward
from tptrain.parallel.styles.spec import ShardSpec


@register_style
class LocalParams(ParallelStyle):
    """A module whose own parameters the plan splits one by one (`tp_param_specs`; attention sinks, one per query
    head): its forward already reads this rank's heads, so it runs as it is. Parameters without a rule are whole."""

    name = "local_params"
    per_parameter_rules = True

    def param_specs(self, module):
        return dict(contract.param_specs(module))


@register_style
class AllReduceParallel(ParallelStyle):
    """A module split inside by its per-parameter rules (`tp_param_specs`; Inkling's shared experts, kept as bare
    stacked parameters: gate / up along the inner features, down along its input) and called on whole inputs: each
    rank's output is a partial sum, summed over TP (one all-reduce). Every floating input enters through
    `copy_to_tp` (the first through the block boundary), so its gradient, partial per rank, is summed too."""

    name = "all_reduce"
    sequence_parallel_ok = False  # its inputs must be whole (a router's weights over the sequence)
    per_parameter_rules = True

    def param_specs(self, module):
        specs = dict(contract.param_specs(module))
        if not specs:
            raise TypeError(f"style {self.name!r} needs per-parameter rules splitting a {type(module).__name__} "
                            f"(its plan's rules on the module's own parameters), else its output summed over TP "
                            f"would count the whole module tp_size times")
        return specs

    def install(self, module, ctx):
        module.tp_dispatch = "all_reduce"  # what the communication report counts for this module

        def enter(m, args, kwargs):
            x, *rest = args
            rest = [comm.copy_to_tp(a, ctx.group_name) if _floating(a) else a for a in rest]
            kwargs = {k: comm.copy_to_tp(v, ctx.group_name) if _floating(v) else v for k, v in kwargs.items()}
            return (ctx.enter(x), *rest), kwargs

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(lambda m, args, out: ctx.exit(out))


def _floating(value) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


@register_style
class MoeTPExperts(AllReduceParallel):
    """transformers' stacked experts, each split inside like a dense MLP by its per-parameter rules (gate_up along
    the inner features, each half alone; down along its input): called on the block's whole input as
    `experts(x, [ids, weights])`, every rank runs every token through its slice of every expert, and the partial
    outputs are summed (the layer's one all-reduce). x and the routing weights enter through `copy_to_tp`, so
    their gradients, partial per rank, are summed too.

    Over an ep axis (`DistributedConfig(ep_size=)`, as tptrain's 'expert_tensor_parallel'): ep rank e holds experts
    [e E/ep, (e+1) E/ep) (`num_experts` becomes E/ep), each split over tp as above; its own tokens go to their
    experts' owners by all-to-all over ep (`dispatch.exchange`, transformers' forward run there on the held ids),
    come back, are weighted and summed, and the partial sums over tp ride the same one all-reduce."""

    name = "moe_tp_experts"
    stacked_experts = True
    ep_axis = True

    def install(self, module, ctx):
        if ctx.ep_size > 1:
            self._install_ep(module, ctx)
        else:
            super().install(module, ctx)

    @staticmethod
    def _install_ep(module, ctx):
        total = module.num_experts  # an int: plan.ep_problems checked it
        grouped = grouped_by_forward(module, type(module).forward)
        module.num_experts = total // ctx.ep_size  # transformers' experts index their stack by the ids it is given
        module.tp_dispatch, module.ep_dispatch = "all_reduce", "all_to_all"  # what the communication report counts

        def forward(self, x, expert_ids, weights):
            x, weights = ctx.enter(x), comm.copy_to_tp(weights, ctx.group_name)
            return ctx.exit(exchange(grouped, total, x, expert_ids, weights, ctx.ep_group_name, ctx.ep_size))

        replace_forward(module, forward)


@register_style
class MoeIdentityExpert(ParallelStyle):
    """An expert that returns its input (LongCat-Flash's zero-computation experts, `nn.Identity` inside stacked
    experts ruled 'moe_tp_experts'): every rank computes it whole, and the experts' partial outputs are summed over
    TP, so its input is divided by tp_size first (its gradient, reaching each rank divided alike, is summed back
    whole at the experts' input boundary)."""

    name = "moe_identity_expert"
    sequence_parallel_ok = False

    def param_specs(self, module):
        return {n: ShardSpec(None) for n in own_params(module)}

    def install(self, module, ctx):
        module.register_forward_pre_hook(lambda m, args: (args[0] / ctx.size, *args[1:]))


@register_style
class MlaKvAProj(ParallelStyle):
    """MLA's kv_a_proj_with_mqa (DeepSeek-V2 style), whole on every rank: its output is [compressed KV, shared RoPE
    key]; the compressed part feeds the colwise kv_b_proj (whose input boundary sums its gradient), but the RoPE key
    goes straight to this rank's heads, so its gradient is partial: identity fwd / all-reduce bwd on those
    `tp_replicated_tail` features."""

    name = "mla_kv_a_proj"
    replicated_tail = "gradient_summed"

    def param_specs(self, module):
        return {n: ShardSpec(None) for n in own_params(module)}

    def install(self, module, ctx):
        tail = contract.replicated_tail(module)
        if not tail:
            raise TypeError(f"style {self.name!r} needs the module to declare tp_replicated_tail (the RoPE features "
                            f"at the end of its output: qk_rope_head_dim), got a {type(module).__name__} without it")

        def split_tail(m, args, out):
            head, rope = out.split([out.shape[-1] - tail, tail], dim=-1)
            return torch.cat([head, comm.copy_to_tp(rope, ctx.group_name)], dim=-1)

        module.register_forward_hook(split_tail)
