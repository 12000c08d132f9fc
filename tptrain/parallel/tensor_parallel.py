"""Apply a resolved plan to a model: shard parameters, install communication, swap in the TP loss.

Works on a model built on the meta device (from_pretrained then fills each local shard from the
checkpoint) and on a materialised model (each full parameter is sliced in memory).

    resolved = check_plan(model, "auto", tp_size)      # pure: no process group
    resolved.raise_problems(model)                     # identical on every rank
    layout = apply_tensor_parallel(model, resolved, tp_group=mesh["tp"].get_group())
    scope.add(TPForward(layout))                       # TP's begin / end around every forward (parallelize does it)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm
from tptrain.distributed.state import Batch
from tptrain.parallel import contract
from tptrain.parallel.loss import make_vocab_parallel_causal_lm_loss, make_vocab_parallel_head_loss
from tptrain.parallel.plan import ResolvedPlan, check_plan
from tptrain.parallel.shards import gather_full, read_shard
from tptrain.parallel.styles import ColwiseParallel, ShardSpec, TPContext

__all__ = ["ParamLayout", "TPForward", "TPLayout", "apply_tensor_parallel", "check_plan", "gather_full", "read_shard"]


@dataclass(frozen=True)
class ParamLayout:
    spec: ShardSpec  # how the parameter is split over the TP axis
    global_shape: tuple[int, ...]  # its unsharded shape


class _Column(Mapping):
    """A read-only, live view of one field of the layout table ({name: spec} or {name: global shape})."""

    def __init__(self, table: dict[str, ParamLayout], field: str) -> None:
        self._table, self._field = table, field

    def __getitem__(self, name: str):
        return getattr(self._table[name], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class TPLayout:
    """What the engine did to one model: enough to load, gather, save or reshard it.

    One table, parameter name (every alias of a tied weight) -> ParamLayout, changed only through
    `add`, `rename` and `drop` (adapters add their factors and move the base weights under
    `base_layer`). `specs` and `global_shapes` are read-only views of it; the parameters whose
    gradients are per-rank shares (what the gradient sync sums) are derived from it.
    """

    def __init__(self, plan: dict[str, str], params: dict[str, ParamLayout], ctx: TPContext, *,
                 vocab_parallel_loss: bool) -> None:
        self.plan = plan  # module name -> style name
        self.ctx = ctx
        self.vocab_parallel_loss = vocab_parallel_loss
        self._params = dict(params)
        self.specs: Mapping[str, ShardSpec] = _Column(self._params, "spec")
        self.global_shapes: Mapping[str, tuple[int, ...]] = _Column(self._params, "global_shape")

    def spec(self, name: str) -> ShardSpec:
        return self._params[name].spec if name in self._params else ShardSpec()

    def partial_grad_specs(self) -> dict[str, ShardSpec]:
        """{name: spec} of the parameters whose gradient is a per-rank share, in table order (none over one TP rank:
        its share is the whole gradient)."""
        if self.ctx.size == 1:
            return {}
        return {name: p.spec for name, p in self._params.items() if p.spec.partial_grad}

    def add(self, name: str, spec: ShardSpec, global_shape: tuple[int, ...]) -> None:
        self._params[name] = ParamLayout(spec, tuple(global_shape))

    def rename(self, old_prefix: str, new_prefix: str) -> None:
        """Move every entry under name prefix `old_prefix` to `new_prefix`."""
        for key in [k for k in self._params if k.startswith(old_prefix)]:
            self._params[new_prefix + key[len(old_prefix):]] = self._params.pop(key)

    def drop(self, prefix: str) -> None:
        for key in [k for k in self._params if k.startswith(prefix)]:
            del self._params[key]

    def ep_split_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of `model` whose parameters this layout splits over the ep axis (the stacked experts)."""
        names = dict.fromkeys(name.rpartition(".")[0] for name, spec in self.specs.items() if spec.ep_split)
        return [model.get_submodule(name) for name in names]

    def adopt(self, mesh) -> None:
        """Move onto `mesh` (the Trainer's, of other data-parallel sizes): its tp and ep groups hold the same ranks as
        those the model was laid out over, so only the groups' names change."""
        self.ctx.group_name = _same_ranks(self.ctx.group, mesh["tp"].get_group())
        if self.ctx.ep_size > 1:
            self.ctx.ep_group_name = _same_ranks(self.ctx.ep_group, mesh["ep"].get_group())


def _same_ranks(old, new) -> str:
    assert dist.get_process_group_ranks(old) == dist.get_process_group_ranks(new), (old, new)
    return comm.group_name(new)


class TPForward:
    """TP's part of the forward scope (tptrain/distributed/state.py): each forward starts without the last one's
    shared boundary, and the head keeps its logits vocab-sharded when a loss follows (the vocab-parallel loss reads
    them: a model's forward with labels, a pipeline stage's, whose schedule computes the loss) or the next tokens are
    sampled from them (a generation step: each rank's candidates)."""

    def __init__(self, layout: TPLayout) -> None:
        self.ctx, self.vocab_parallel_loss = layout.ctx, layout.vocab_parallel_loss

    def begin(self, batch: Batch) -> Batch:
        if batch.runs:
            self.ctx.reset()
            self.ctx.keep_logits_sharded = self.vocab_parallel_loss and (batch.loss or batch.sampled)
        return batch

    def end(self, batch: Batch, output):
        if batch.runs:
            self.ctx.reset()
        return output


def _shard_parameters(model: nn.Module, specs: dict[str, ShardSpec], ctx: TPContext) -> dict[str, ParamLayout]:
    """Replace every planned parameter by its local shard; tied parameters stay one object.
    Returns the layout of every parameter name (aliases of tied weights included)."""
    old = dict(model.named_parameters(remove_duplicate=False))  # keeps old objects alive: ids stay unique
    aliases: dict[int, list[str]] = {}
    for name, p in old.items():
        aliases.setdefault(id(p), []).append(name)
    out = {name: ParamLayout(ShardSpec(), tuple(p.shape)) for name, p in old.items()}
    new: dict[int, nn.Parameter] = {}
    for full, spec in specs.items():
        p = old[full]
        for alias in aliases[id(p)]:
            if alias in specs and specs[alias] != spec:
                raise ValueError(f"tied parameters {full!r} and {alias!r} are given different layouts "
                                 f"({spec} vs {specs[alias]}); give both modules the same split")
            out[alias] = ParamLayout(spec, tuple(p.shape))
        if id(p) not in new:
            # A copy, so the full tensor can be freed (on meta it is a shape only).
            local = p.data
            if spec.ep_split or spec.dim is not None and ctx.size > 1:  # its experts, then its TP chunk of them
                local = spec.local_chunk(spec.ep_chunk(local, ctx.ep_size, ctx.ep_rank), ctx.size, ctx.rank).clone()
            new[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
    for name, p in old.items():
        if id(p) in new:
            mod_name, _, pname = name.rpartition(".")
            setattr(model.get_submodule(mod_name), pname, new[id(p)])
    return out


def colwise_blocks(model: nn.Module, resolved: ResolvedPlan) -> dict[int, tuple[nn.Module, ...]]:
    """id(colwise module) -> its colwise siblings (same parent, itself included): the linears that read one input
    (q/k/v, gate/up) and so may run as one fused block. A sibling first called on another input starts a block
    of its own there (the others' outputs of that block go unused: correct, only wasted work); siblings of another
    input width (Qwen3.5's linear attention: in_proj_* and out_proj) can never read one input, so are not grouped."""
    by_parent: dict[tuple[str, int], list[nn.Module]] = {}
    for name, style in resolved.objects.items():
        if isinstance(style, ColwiseParallel):
            module = model.get_submodule(name)
            by_parent.setdefault((name.rpartition(".")[0], module.weight.shape[-1]), []).append(module)
    return {id(m): tuple(members) for members in by_parent.values() for m in members}


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, *, tp_group, ep_group=None) -> TPLayout:
    """Shard `model` in place over `tp_group` as `resolved` (from `check_plan`, problem-free) says; the experts of a
    plan resolved at ep_size > 1 also over `ep_group` (the mesh's "ep" axis).

    Over one TP rank the layout is recorded (the specs as resolved, each one chunk: saving, DCP and LoRA read it as
    at any size) but nothing is installed: no style, hook, boundary or TP loss, so the model computes as on one
    device; only experts split over an ep axis get their style (their exchange over ep). What acts around the
    model's forward (`TPForward`, sequence parallelism's saver) joins the forward scope in parallelize."""
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    assert not resolved.problems and resolved.tp_size == tp_size, (resolved.problems, resolved.tp_size, tp_size)
    ep = {}
    if resolved.ep_size > 1:
        assert dist.get_world_size(ep_group) == resolved.ep_size, (ep_group, resolved.ep_size)
        ep = dict(ep_group_name=comm.group_name(ep_group), ep_size=resolved.ep_size, ep_rank=dist.get_rank(ep_group))
    ctx = TPContext(comm.group_name(tp_group), tp_size, tp_rank, sequence_parallel=resolved.sequence_parallel, **ep)
    params = _shard_parameters(model, resolved.specs, ctx)
    layout = TPLayout(dict(resolved.styles), params, ctx, vocab_parallel_loss=resolved.vocab_parallel_loss)
    if tp_size == 1:
        for name in dict.fromkeys(n.rpartition(".")[0] for n, spec in resolved.specs.items() if spec.ep_split):
            resolved.objects[name].install(model.get_submodule(name), ctx)
        return layout
    for name, style in resolved.objects.items():
        style.install(model.get_submodule(name), ctx)
    ctx.blocks = colwise_blocks(model, resolved)
    if resolved.vocab_parallel_loss:  # logits stay vocab-sharded whenever a loss is computed (TPForward)
        model.loss_function = make_vocab_parallel_causal_lm_loss(ctx)
        if contract.has_head_loss(model):
            model.head_loss_function = make_vocab_parallel_head_loss(ctx)
    return layout
