"""The column split of a fused projection (q/k/v or gate/up rows in one weight): each segment split on its own."""
from __future__ import annotations

from tptrain.parallel import contract
from tptrain.parallel.styles.base import own_params, register_style
from tptrain.parallel.styles.linear import ColwiseParallel
from tptrain.parallel.styles.spec import ShardSpec


@register_style
class FusedColwiseParallel(ColwiseParallel):
    """Colwise for a fused projection (fused q/k/v, gate/up): each segment of the output rows is split on its
    own, so a rank holds its q, k and v heads (its gate and up columns), concatenated in the checkpoint's order.
    The module declares its segments as data (`contract.FusedProjection`), `tp_segments = ((global rows, holds KV
    heads), ...)`; KV segments get the plan's KV replicas. The forward is colwise's: the model splits the local
    output by local sizes."""

    name = "fused_colwise"  # transformers' spelling, "packed_colwise", is accepted too
    fused = True

    def param_specs(self, module):
        segments = contract.segments(module)
        if not segments:
            raise TypeError(f"style {self.name!r} needs a module declaring tp_segments ((rows, is_kv), ...), "
                            f"got a {type(module).__name__} without them; use 'colwise' for an unfused projection")
        parts = tuple((rows, self.kv_replicas if kv else 1) for rows, kv in segments)
        spec = ShardSpec(0, segments=parts, partial_grad=any(reps > 1 for _, reps in parts))
        return {n: spec for n in own_params(module)}

    def install(self, module, ctx):
        super().install(module, ctx)
        # This rank's rows of each segment: what the model splits the local output by.
        spec = self.param_specs(module)["weight"]
        rows = sum(r for r, _ in contract.segments(module))
        module.segment_sizes = tuple(stop - start for start, stop in spec.local_ranges((rows,), ctx.size, ctx.rank))
