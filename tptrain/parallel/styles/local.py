"""Styles whose module's forward runs on this rank's pieces as they are, the style adding only the collectives at its
edges: mla_kv_a_proj (MLA's kv_a_proj_with_mqa, whole on every rank)."""
from __future__ import annotations

import torch

from tptrain.distributed import comm
from tptrain.parallel import contract
from tptrain.parallel.styles.base import ParallelStyle, own_params, register_style
from tptrain.parallel.styles.spec import ShardSpec


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
