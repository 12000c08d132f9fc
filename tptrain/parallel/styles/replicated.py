"""Weights whole on every rank, applied to split activations (a partial gradient summed over TP), and the
norm over features a colwise projection split (its sum of squares summed over TP)."""
from __future__ import annotations

from tptrain.distributed import comm
from tptrain.parallel import contract
from tptrain.parallel.styles.base import ParallelStyle, own_params, register_style
from tptrain.parallel.styles.spec import ShardSpec


@register_style
class ReplicatedWithGradAllreduce(ParallelStyle):
    """Whole weights on every rank, applied to sharded activations (Qwen3's per-head q/k norms):
    forward needs no communication, the gradient is a partial sum over the TP group."""

    name = "replicated_with_grad_allreduce"
    needs_split_input = True

    def param_specs(self, module):
        return {n: ShardSpec(None, partial_grad=True) for n in own_params(module)}


@register_style
class SequenceParallel(ReplicatedWithGradAllreduce):
    """Norms between TP regions under sequence parallelism: each rank normalises its own sequence
    shard, so the weight gradient is a partial sum over the TP group."""

    name = "sequence_parallel"
    needs_split_input = False  # split along the sequence, not the features


@register_style
class SequenceGather(ParallelStyle):
    """Under sequence parallelism, an activation computed per token of this rank's sequence shard that every rank
    reads over the whole sequence (MLA's shared RoPE key, read by each rank's heads at every position): all-gather
    fwd / reduce-scatter bwd along the sequence (each rank's heads add their share of every position's gradient).
    On a module without parameters (the model's named point, e.g. LatentAttention.rope_key)."""

    name = "sequence_gather"
    replicated_tail = "sequence_gathered"  # the module's whole output: its tp_replicated_tail features

    def param_specs(self, module):
        return {}

    def install(self, module, ctx):
        if not ctx.sequence_parallel:
            raise ValueError(f"style {self.name!r} gathers a sequence shard: it is for sequence parallelism "
                             f"(enable_sequence_parallel=True; a model's base_model_sp_plan)")
        module.register_forward_hook(lambda m, args, out: comm.gather_to_sp(out, ctx.group_name, dim=1))


@register_style
class DistributedRMSNorm(ParallelStyle):
    """An RMSNorm over features a colwise projection split (OLMo 2's q/k norms over the whole projected width),
    so attention stays sharded. The weight is split like the projection's output rows (dim 0, with its KV
    replicas); the module's `mean_square(h)` (`(..., local) -> (..., 1)`) becomes each rank's sum of squares,
    summed over TP (one all-reduce of one float per token, forward and backward), over the global width.
    Ranks holding the same KV chunk each add it, so the sum is divided by the replica count; in backward the
    summed gradient, divided alike, reaches each holder, and their weight and input shares add up to the whole."""

    name = "distributed_rmsnorm"
    splits_output = True
    needs_split_input = True
    token_all_reduces = 1

    def param_specs(self, module):
        spec = ShardSpec(0, self.kv_replicas, partial_grad=self.kv_replicas > 1)
        return {n: spec for n in own_params(module)}

    def install(self, module, ctx):
        if not isinstance(module, contract.SplitNorm):
            raise TypeError(f"style {self.name!r} needs a norm with a mean_square(h) method (tptrain's RMSNorm), "
                            f"got a {type(module).__name__}")
        width = module.weight.shape[0] * (ctx.size // self.kv_replicas)  # the unsplit feature count

        def mean_square(h):  # (..., local_width) -> (..., 1)
            total = comm.sum_over_tp(h.pow(2).sum(-1, keepdim=True), ctx.group_name) / self.kv_replicas
            return total / width

        module.mean_square = mean_square
