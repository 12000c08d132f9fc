"""The Megatron column / row splits of an nn.Linear, and the LM head's column split with its vocabulary gather."""
from __future__ import annotations

from collections import OrderedDict

import torch.nn.functional as F
from torch import nn

from tptrain.distributed import comm
from tptrain.parallel.styles.base import ParallelStyle, local_output, own_params, replace_forward, register_style
from tptrain.parallel.styles.spec import ShardSpec


@register_style
class ColwiseParallel(ParallelStyle):
    """Split output features (weight dim 0, bias dim 0); the output stays sharded."""

    name = "colwise"
    module_types = (nn.Linear,)
    splits_output = True
    adapter_split = "output"  # B follows the weight's rows: KV-head replicas, a fused weight's segments

    def param_specs(self, module):
        spec = ShardSpec(0, self.kv_replicas, partial_grad=self.kv_replicas > 1)
        return {n: spec for n in own_params(module)}

    def install(self, module, ctx):
        local_forward = type(module).forward

        def forward(self, x, *args, **kwargs):
            out = ctx.fused_output(self, x)  # computed by the block this module entered (colwise_block.py)
            return local_output(self, x, local_forward(self, x, *args, **kwargs)) if out is None else out

        module.register_forward_pre_hook(lambda m, args: (ctx.enter(args[0], m), *args[1:]))
        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        replace_forward(module, forward)



@register_style
class RowwiseParallel(ParallelStyle):
    """Split input features (weight dim 1); partial outputs are summed, then the bias added once."""

    name = "rowwise"
    module_types = (nn.Linear,)
    needs_split_input = True
    adapter_split = "input"
    sums_output = True
    transformers_names = ("rowwise_rep",)  # tptrain's rowwise already ends in the all-reduce replicating the output

    def param_specs(self, module):
        specs = {"weight": ShardSpec(1)}
        if module.bias is not None:
            specs["bias"] = ShardSpec(None)
        return specs

    def install(self, module, ctx):
        def forward(self, x):
            y = ctx.exit(local_output(self, x, F.linear(x, self.weight)))
            return y if self.bias is None else y + self.bias

        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        replace_forward(module, forward)


@register_style
class ColwiseGatherOutput(ColwiseParallel):
    """LM head: colwise, then all-gather the vocabulary unless the vocab-parallel loss consumes it."""

    name = "colwise_gather_output"
    splits_output = False  # gathered (or consumed sharded by the loss only)
    transformers_names = ("colwise_rep",)
    vocab_parallel_loss = True
    output_head = False  # set by check_plan on the model's output head: only its logits may stay sharded

    def install(self, module, ctx):
        super().install(module, ctx)

        def gather(m, args, out):  # any other module (GLM's gate_up_proj) always gathers
            keep = ctx.keep_logits_sharded and self.output_head
            return out if keep else comm.gather_from_tp(out, ctx.group_name, dim=-1)

        module.register_forward_hook(gather)


@register_style
class RowwiseSplitInput(RowwiseParallel):
    """Rowwise fed a whole input (transformers' `rowwise_split_input`: GLM's down_proj after a gathered gate_up):
    each rank takes its share of the input features itself (split fwd / all-gather bwd), then rowwise."""

    name = "rowwise_split_input"
    needs_split_input = False
    adapter_split = None  # LoRA refuses it (an adapter on it is not checked against one process)

    def install(self, module, ctx):
        super().install(module, ctx)
        module.register_forward_pre_hook(lambda m, args: (comm.split_to_tp(args[0], ctx.group_name, dim=-1),
                                                          *args[1:]))
