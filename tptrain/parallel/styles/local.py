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

    def param_specs(self, module):
        return dict(contract.param_specs(module))


@register_style
class MoeTPExperts(ParallelStyle):
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
    sequence_parallel_ok = False  # the router would see a sequence shard
    stacked_experts = True
    ep_axis = True

    def param_specs(self, module):
        specs = dict(contract.param_specs(module))
        if not specs:
            raise TypeError(f"style {self.name!r} needs per-parameter rules for the stacked experts of a "
                            f"{type(module).__name__} (its plan's 'experts.gate_up_proj' / 'experts.down_proj')")
        return specs

    def install(self, module, ctx):
        if ctx.ep_size > 1:
            self._install_ep(module, ctx)
            return

        def enter(m, args):
            x, *rest = args
            if len(rest) >= 2 and torch.is_tensor(rest[1]):  # (ids, weights): the weights' gradient is partial
                rest[1] = comm.copy_to_tp(rest[1], ctx.group_name)
            return (ctx.enter(x), *rest)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, args, out: ctx.exit(out))

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
class MlaKvAProj(ParallelStyle):
    """MLA's kv_a_proj_with_mqa (DeepSeek-V2 style), whole on every rank: its output is [compressed KV, shared RoPE
    key]; the compressed part feeds the colwise kv_b_proj (whose input boundary sums its gradient), but the RoPE key
    goes straight to this rank's heads, so its gradient is partial: identity fwd / all-reduce bwd on those
    `tp_replicated_tail` features."""

    name = "mla_kv_a_proj"

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
