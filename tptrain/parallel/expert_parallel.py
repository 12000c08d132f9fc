"""Experts over the TP group: split inside each expert (expert tensor parallelism) or split by expert (expert
parallelism), the token dispatch / combine by all-to-all (parallel/dispatch.py) or the partial outputs summed.

The experts module (tptrain.models.moe.Experts, named here only through its interface, `contract.TPExperts`: stacked
`gate_proj`, `up_proj` (experts, inner, hidden), `down_proj` (experts, hidden, inner), `num_experts`, `top_k`,
`expert_offset`, `grouped(rows, counts)`, and forward(x, expert_ids, weights)) is called on the MoE block's input,
which under plain TP every rank of the group holds whole (attention's all-reduce made it so). The router is
replicated and computed on every rank, identically.

* `expert_tensor_parallel` (the default): each expert's gate/up split along the inner dim, down along its input
  dim. Every rank runs every token through its slice of its experts; the partial outputs are summed by the one
  all-reduce that closes the block (the Megatron MLP, once per layer).
* `expert_parallel_all_reduce`: rank r holds experts [r E/p, (r+1) E/p) whole and runs every token routed to them;
  the partial outputs (zero for tokens routed elsewhere) ride the same one all-reduce. No token moves: the tokens
  are already on every rank.
* `expert_parallel_all_to_all`: rank r routes only its 1/p share of the tokens, sends each (token, expert) row to
  the expert's owner (all-to-all, variable splits), gets the results back (the reverse all-to-all), weights and
  sums them, and the shares are all-gathered into the whole block output (tokens not divisible by p: the
  summing path for that batch).
* `expert_parallel` (what DistributedConfig(enable_expert_parallel=True) plans): whichever of the two sends fewer
  bytes per rank. With T tokens of H features, k experts per token and p ranks, the all-reduce sends
  2 (p-1)/p T H, the all-to-all path (p-1)/p T H (2k/p + 1): all-to-all from p >= 2k on.

With an ep axis of its own (`DistributedConfig(ep_size=)`, folded over the data- and context-parallel ranks: each
holds its own tokens), `expert_tensor_parallel` splits the experts by expert over ep as well (`ShardSpec.ep_split`):
a rank holds E/ep experts x 1/tp of each. Its tokens (whole over tp) are dispatched by all-to-all over the ep group
to the experts' owners, each owner's tp ranks run them through their slice (partial outputs), the results come back
the same way, and the weighted sum rides the layer's one tp all-reduce as in plain expert TP.

In all of them the routing weights enter through `copy_to_tp` (or the share's split), so the router's gradient,
whose expert-path part each rank computes only for its own experts (or tokens), is summed to the whole on every
rank: (tokens, k) floats in backward, k/H of the activation all-reduce. The aux loss needs nothing over tp (the
router is replicated).

Under sequence parallelism each tp rank routes its own sequence shard: the summing styles gather the shard's
routing with the block input (`_gathered`: the same all-gather of the sequence a dense MLP's boundary does, and the
ids and weights alike) and reduce-scatter their partial output, exact and no more bytes than a dense MLP under SP
(every tp rank must see every token for its slice of every expert); the all-to-all style exchanges the shard as it
is (its share). The router aux loss is then split over token shards (and under cp): `router_aux_over_sp` /
`router_aux_over_cp` sum its token counts over them.
"""
from __future__ import annotations

from typing import Callable, ClassVar

from torch import nn

from tptrain.distributed import comm
from tptrain.parallel import contract
from tptrain.parallel.dispatch import Grouped, dispatch_and_combine, exchange
from tptrain.parallel.styles import ParallelStyle, ShardSpec, TPContext, replace_forward, register_style

__all__ = ["ExpertStyle", "TPExpertsStyle", "ExpertTensorParallel", "ExpertParallelAllReduce",
           "ExpertParallelAllToAll", "ExpertParallel", "all_to_all_wins"]

Forward = Callable[..., object]  # forward(module, x, expert_ids, weights), installed with `replace_forward`


def all_to_all_wins(ranks: int, top_k: int) -> bool:
    """Whether dispatching by all-to-all sends no more bytes than summing partial outputs (see the module doc)."""
    return ranks >= 2 * top_k


class ExpertStyle(ParallelStyle):
    """The one mechanism of every expert style, parametrised by `split` and `dispatch`:

    * `split`: "experts" (by expert: rank r holds experts [r E/p, (r+1) E/p) whole) or "inner" (each expert split
      inside like a dense MLP; over an ep axis also by expert there, `ep_axis`);
    * `dispatch`: "all_reduce" (every rank runs every token through its share, the partial outputs summed),
      "all_to_all" (each rank's share of the tokens sent to the experts' owners and back, the shares all-gathered; a
      batch whose tokens do not split into equal shares takes the summing path: every rank holds the same tokens,
      so every rank takes the same path; under SP a rank's share is its sequence shard, exchanged as it is) or
      "auto" (all-to-all when it sends fewer bytes: `all_to_all_wins` by the router's k, `top_k`).

    A kind of experts module supplies only its interface: `param_specs` (its stacks split by `split`), `hold` (keep
    only a rank's experts), `summed` (the summing forward), `held_experts` (what the all-to-all runs rows through)
    and `top_k`. A new expert style is then one registered subclass naming its split and dispatch."""

    stacked_experts = True
    split: ClassVar[str] = "experts"
    dispatch: ClassVar[str] = "all_reduce"

    def hold(self, module: nn.Module, rank: int, size: int) -> None:
        """Make `module` hold only experts [rank E/size, (rank+1) E/size) (its stacks already split on dim 0)."""
        raise NotImplementedError

    def summed(self, module: nn.Module, ctx: TPContext) -> Forward:
        """forward(m, x, ids, weights) on this rank's share of the experts, its partial output summed over TP."""
        raise NotImplementedError

    def held_experts(self, module: nn.Module) -> Callable[[nn.Module], tuple[Grouped, int]]:
        """m -> (grouped(rows, counts) of the experts m holds, the experts held over the group): what an exchange
        runs (taken before `hold` changes what the module says)."""
        raise NotImplementedError

    def top_k(self, module: nn.Module) -> int | None:
        """The experts each token is routed to (None: not known, the summing path)."""
        raise NotImplementedError

    def chosen_dispatch(self, module: nn.Module, ctx: TPContext) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        top_k = self.top_k(module)
        return "all_to_all" if top_k and all_to_all_wins(ctx.size, top_k) else "all_reduce"

    def install(self, module, ctx):
        if self.ep_axis and ctx.ep_size > 1:
            self._install_over_ep(module, ctx)
            return
        dispatch, held = self.chosen_dispatch(module, ctx), self.held_experts(module)
        assert dispatch == "all_reduce" or self.split == "experts", f"{self.name}: an all-to-all needs whole experts"
        if self.split == "experts":
            self.hold(module, ctx.rank, ctx.size)
        summed = self.summed(module, ctx)
        module.tp_dispatch = dispatch  # what the communication report counts for this module
        replace_forward(module, summed if dispatch == "all_reduce" else _all_to_all(summed, held, ctx))

    def _install_over_ep(self, module: nn.Module, ctx: TPContext) -> None:
        """Experts split by expert over the ep group and each over tp (`split` "inner", ShardSpec.ep_split): this
        rank's tokens (whole over tp) dispatched to their owners over ep, run through each owner's tp slice, the
        partial outputs back and summed by the layer's one tp all-reduce."""
        held = self.held_experts(module)
        self.hold(module, ctx.ep_rank, ctx.ep_size)
        module.tp_dispatch, module.ep_dispatch = "all_reduce", "all_to_all"  # over tp; the ep dispatch is ep's

        def forward(self, x, expert_ids, weights):
            x, expert_ids, weights = _gathered(ctx, x, expert_ids, weights)
            grouped, total = held(self)
            return ctx.exit(exchange(grouped, total, x, expert_ids, weights, ctx.ep_group_name, ctx.ep_size))

        replace_forward(module, forward)


def _all_to_all(summed: Forward, held: Callable[[nn.Module], tuple[Grouped, int]], ctx: TPContext) -> Forward:
    """forward(m, x, ids, weights): this rank's share of the tokens dispatched to the experts' owners and combined
    back (the shares cut along the dim before hidden: `dispatch_and_combine`), `summed` where they do not split."""
    def forward(self, x, expert_ids, weights):
        grouped, total = held(self)
        if ctx.sequence_parallel:
            return exchange(grouped, total, x, expert_ids, weights, ctx.group_name, ctx.size)
        if x.shape[-2] % ctx.size:  # the sequence (or the tokens) do not split into equal shares
            return summed(self, x, expert_ids, weights)
        return dispatch_and_combine(grouped, total, x, expert_ids, weights, ctx)

    return forward


def _gathered(ctx: TPContext, x, expert_ids, weights):
    """The block input x (batch, seq, hidden) and its routing (tokens, k) as every rank of the TP group sees them when
    each runs every token through its share of the experts: x through the block's input boundary (`ctx.enter`,
    shared with the shared expert's gate/up; under SP the all-gather of the sequence), the weights through
    `copy_to_tp`, so their gradient, partial per rank, is summed; under SP every rank's shard of the routing is
    all-gathered along the sequence as x is (the weights: all-gather fwd / reduce-scatter bwd, each rank's tokens'
    gradient summed back to it). Returns (x (batch, seq, hidden) whole, ids, weights (batch * seq, k))."""
    if not ctx.sequence_parallel:
        return ctx.enter(x), expert_ids, comm.copy_to_tp(weights, ctx.group_name)
    b, k = x.shape[0], expert_ids.shape[-1]
    ids, weights = (comm.gather_to_sp(t.view(b, -1, k), ctx.group_name, dim=1).flatten(0, 1)
                    for t in (expert_ids, weights))
    return ctx.enter(x), ids, weights


class TPExpertsStyle(ExpertStyle):
    """The interface of tptrain's experts (`contract.TPExperts`: stacked gate/up/down, `expert_offset`, `grouped`,
    `top_k`). Under sequence parallelism each tp rank routes its own sequence shard (the router is per token; its
    weight's gradient, a partial sum over tp, is summed by the grad sync: the SP plan's 'sequence_parallel' rule on
    it), and the experts take the block input (batch, seq / tp, hidden) with its routing (`_gathered`)."""

    def param_specs(self, module: nn.Module) -> dict[str, ShardSpec]:
        missing = contract.missing(module, contract.TPExperts)
        if missing:
            raise TypeError(f"style {self.name!r} needs a stacked-experts module "
                            f"({', '.join(contract.members(contract.TPExperts))}), got a {type(module).__name__} "
                            f"without {missing}")
        if self.split == "inner":  # gate/up colwise along the inner dim (dim 1), down rowwise (dim 2)
            return {"gate_proj": ShardSpec(1), "up_proj": ShardSpec(1), "down_proj": ShardSpec(2)}
        return {"gate_proj": ShardSpec(0), "up_proj": ShardSpec(0), "down_proj": ShardSpec(0)}

    def hold(self, module, rank, size):
        module.expert_offset = rank * module.gate_proj.shape[0]

    def summed(self, module, ctx):
        local_forward = type(module).forward

        def forward(self, x, expert_ids, weights):
            x, expert_ids, weights = _gathered(ctx, x, expert_ids, weights)
            return ctx.exit(local_forward(self, x, expert_ids, weights))

        return forward

    def held_experts(self, module):
        return _own_grouped

    def top_k(self, module):
        return module.top_k  # a TPExperts: param_specs checked it in check_plan


def _own_grouped(module: nn.Module) -> tuple[Grouped, int]:
    return module.grouped, module.num_experts  # num_experts: the global count


@register_style
class ExpertTensorParallel(TPExpertsStyle):
    """Every expert split like a dense MLP, the partial outputs summed; over an ep axis split by expert there too."""

    name = "expert_tensor_parallel"
    split, dispatch, ep_axis = "inner", "all_reduce", True


@register_style
class ExpertParallelAllReduce(TPExpertsStyle):
    """Experts split by expert; every rank runs all tokens routed to its experts, outputs summed."""

    name = "expert_parallel_all_reduce"
    split, dispatch = "experts", "all_reduce"


@register_style
class ExpertParallelAllToAll(TPExpertsStyle):
    """Experts split by expert; each rank's share of the tokens dispatched to the experts' owners by all-to-all."""

    name = "expert_parallel_all_to_all"
    split, dispatch = "experts", "all_to_all"


@register_style
class ExpertParallel(TPExpertsStyle):
    """Experts split by expert; dispatched by all-to-all or summed by all-reduce, whichever sends fewer bytes."""

    name = "expert_parallel"
    split, dispatch = "experts", "auto"


def router_aux_over_token_shards(model: nn.Module, state) -> None:
    """The router aux loss (`contract.router_aux`) when one batch's tokens are sharded over ranks (`state`'s
    `token_shard_groups`: tp under sequence parallelism, then cp; read at each call, as the Trainer may move the model
    onto a mesh of its own): each rank routes its own tokens, so the token counts are summed over those groups (one
    all-reduce of num_experts + 1 floats each) and each rank's loss is its share (its own router probabilities).
    Under SP the padding mask's columns are this rank's shard, and the share is summed over the tp group in the loss
    (all-reduce fwd / identity bwd: every tp rank's loss is the whole, each share's gradient its own); under cp it is
    summed with the rest of the loss (CPContext.end)."""
    if contract.router_aux(model) is None or not state.token_shard_groups():
        return
    statistics, loss_function = contract.router_aux(model)
    ctx = state.tp.ctx if state.sequence_parallel else None

    def router_statistics(router_logits, attention_mask):
        if ctx is not None and attention_mask is not None:  # (batch, seq) -> (batch, seq / tp), as SP splits it
            attention_mask = attention_mask.chunk(ctx.size, dim=1)[ctx.rank]
        return statistics(router_logits, attention_mask)

    def router_aux_loss_function(stats, *, total=None):
        def summed(t):
            t = t.clone()
            for group_name in state.token_shard_groups():
                comm.all_reduce(t, comm.resolve_group(group_name), phase="router_aux")
            return t if total is None else total(t)

        share = loss_function(stats, total=summed)
        return share if ctx is None else comm.reduce_from_tp(share, ctx.group_name)

    model.router_statistics, model.router_aux_loss_function = router_statistics, router_aux_loss_function
