"""Pipeline parallelism on torch.distributed.pipelining: the model cut into stages, one schedule of torch's.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2, tp_size=2))
    # this rank holds only its stage(s): model.parallel.pp says which layers; the Trainer runs the schedule

The decoder layers are split into `pp x stages_per_rank` stages, evenly counting the embedding and the head as one
layer each (torchtitan's rule), or as `pp_layers` says. A rank's model keeps only its stages' modules, the layers
in an nn.ModuleDict keyed by their index, so every parameter keeps its whole-model name (the loader reads only those
tensors; DCP and save_pretrained see global names). Each of its stages is a `StageModule`: a shallow view of the
model holding only that stage's modules (the same parameter objects). The model says what to cut through
`contract.PipelineModel`; nothing here names a model's module.

The other axes compose through the model's one forward scope (tptrain/distributed/state.py), which a pipeline runs
where the model's forward would: `Pipeline.step` runs it around the whole batch ("step": under cp the batch is split
over the cp group before the schedule cuts it into microbatches, and the step's loss summed over cp), each stage's
forward around its microbatch ("stage": TP's fresh boundary and vocab-sharded logits, SP's saved-tensor hooks, the
rows of CP's masks from the microbatch's global position ids). Nothing here names another axis. Under SP the
residual stream between layers is a sequence shard, so the stages exchange each tp rank's (batch, seq / cp / tp,
hidden) with the same tp rank of the next stage (the first stage's embedding scatters it, the last stage's head
gathers it).

Tied embeddings: the first stage's embedding and the last stage's head are one weight. When two ranks hold them,
each keeps a copy and `Pipeline.ties` (parallel/pipeline_grads.py) sums their gradients over a group of those two
ranks, so the copies stay equal; a V schedule puts both stages on the same rank, where they are one parameter (under
FSDP2 the last stage module holds its own copy).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tptrain.distributed.state import ROWS, Batch, ForwardScope, state_of
from tptrain.layout import check, schedules
from tptrain.layout.schedules import V_SCHEDULES, stages_per_rank
from tptrain.parallel import contract
from tptrain.parallel.pipeline_grads import TiedWeights
from tptrain.parallel.plan import ResolvedPlan


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule (case-insensitive, as torch's get_schedule_class); ValueError listing
    the valid ones (the rule table's `pp_schedule`)."""
    check("pp_schedule", pp_schedule=name)
    return schedules.canonical(name)


def rank_stages(schedule: str, pp: int, pp_rank: int) -> tuple[int, ...]:
    """The stages pp rank `pp_rank` holds: its own (one-stage schedules), looped (r, r + p), or a V (r, 2p-1-r)."""
    if stages_per_rank(schedule) == 1:
        return (pp_rank,)
    return (pp_rank, 2 * pp - 1 - pp_rank) if schedule in V_SCHEDULES else (pp_rank, pp_rank + pp)


def split_layers(num_layers: int, n_stages: int, layers: list[list[int]] | None = None) -> list[list[int]]:
    """Each stage's decoder layers: `layers` checked, or an even split of layers + embedding + head (the
    embedding counts as one layer of the first stage, the head of the last; torchtitan's rule). The rule table's
    `pp_stages` and `pp_layers` refuse what cannot be split."""
    check("pp_stages", pp=n_stages, num_layers=num_layers)
    if layers is not None:
        check("pp_layers", pp=n_stages, num_layers=num_layers, pp_layers=layers)
        return [list(stage) for stage in layers]
    return schedules.even_split(num_layers, n_stages)


def check_microbatches(schedule: str, pp: int, n_microbatches: int, batch_size: int) -> None:
    """ValueError if `schedule` cannot run `n_microbatches` at `pp`, or `batch_size` does not split into them (the
    rule table's `pp_microbatches`, `pp_rounds`, `pp_batch`)."""
    for name in ("pp_microbatches", "pp_rounds", "pp_batch"):
        check(name, pp=pp, pp_schedule=schedule, pp_microbatches=n_microbatches, batch_size=batch_size)


@dataclass(frozen=True)
class PipelinePlan:
    """The stages of a pipeline and which of them this rank holds. stage_layers: every stage's decoder layers;
    tied: (first-stage name, last-stage name) of each parameter the embedding and the head share."""

    schedule: str
    pp: int
    pp_rank: int
    stage_layers: tuple[tuple[int, ...], ...]
    tied: tuple[tuple[str, str], ...] = ()

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def stages(self) -> tuple[int, ...]:
        return rank_stages(self.schedule, self.pp, self.pp_rank)

    def holds(self, stage: int) -> bool:
        return stage in self.stages

    def layers(self) -> list[int]:
        return sorted(i for s in self.stages for i in self.stage_layers[s])

    def stage_rank(self, stage: int) -> int:
        """The pp rank holding `stage`."""
        return next(r for r in range(self.pp) if stage in rank_stages(self.schedule, self.pp, r))


def plan_pipeline(model: nn.Module, *, pp: int, pp_rank: int, schedule: str,
                  layers: list[list[int]] | None = None) -> PipelinePlan:
    """The stages of `model` (whole, e.g. on meta) at `pp`; every problem a ValueError (no process group)."""
    parts = contract.pipeline_parts(model)
    if parts is None:  # the rule table's pp_uncuttable
        check("pp_uncuttable", pp=pp, name=type(model).__name__)
    schedule = schedule_name(schedule)
    n_layers = len(model.get_submodule(parts[0]))
    split = split_layers(n_layers, pp * stages_per_rank(schedule), layers)
    return PipelinePlan(schedule, pp, pp_rank, tuple(map(tuple, split)), _tied(model, parts))


def _tied(model: nn.Module, parts) -> tuple[tuple[str, str], ...]:
    """Parameters shared by a first-stage module and a last-stage module, by their names in each."""
    def params(paths):
        return {id(p): f"{path}.{n}" for path in paths for n, p in model.get_submodule(path).named_parameters()}
    first, last = params(parts[1]), params(parts[2])
    return tuple((first[k], last[k]) for k in first if k in last)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing every parameter and child, with dicts of its own (so removing a child leaves the original)."""
    out = copy.copy(module)
    out._modules, out._parameters, out._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return out


def _replace(root: nn.Module, path: str, value: nn.Module | None, *, shallow: bool) -> None:
    """Set the module at dotted `path` (copying its parents first when `shallow`, so `root` is a view)."""
    *parents, leaf = path.split(".")
    module = root
    for name in parents:
        if shallow:
            module._modules[name] = _shallow(module._modules[name])
        module = module._modules[name]
    setattr(module, leaf, value)


def keep_stage(model: nn.Module, layers: list[int], *, first: bool, last: bool, shallow: bool = False) -> None:
    """Remove from `model` what a stage holding `layers` (and the first / last stage's modules if it is that stage)
    does not hold. In place, or on a view of the model when `shallow`."""
    layers_path, first_paths, last_paths = contract.pipeline_parts(model)
    container = model.get_submodule(layers_path)
    def layer(i):
        return container[str(i)] if isinstance(container, nn.ModuleDict) else container[i]
    _replace(model, layers_path, nn.ModuleDict({str(i): layer(i) for i in layers}), shallow=shallow)
    for path in (() if first else first_paths) + (() if last else last_paths):
        _replace(model, path, None, shallow=shallow)


def cut_model(model: nn.Module, plan: PipelinePlan) -> None:
    """Keep only this rank's stages of `model` (before its parameters are materialised: then only their tensors
    are read)."""
    keep_stage(model, plan.layers(), first=plan.holds(0), last=plan.holds(plan.n_stages - 1))


def stage_plan(resolved: ResolvedPlan, model: nn.Module, plan: PipelinePlan) -> ResolvedPlan:
    """A TP plan resolved on the whole model, restricted to the modules and parameters a stage (of `plan`) holds. A
    tied head on a stage without the embedding takes the embedding's spec (both split the vocab rows)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    specs = {n: s for n, s in resolved.specs.items() if n in params}
    for first, last in plan.tied:
        if last in params and first in resolved.specs:
            specs[last] = resolved.specs[first]
    return dataclasses.replace(resolved, styles={k: v for k, v in resolved.styles.items() if k in modules},
                               objects={k: v for k, v in resolved.objects.items() if k in modules}, specs=specs)


class StageModule(nn.Module):
    """One stage of this rank's model: a view holding only that stage's modules (the same parameter objects), so
    its `parameters()` are the stage's, as PipelineStage (and the zero-bubble weight backward) expect."""

    def __init__(self, model: nn.Module, layers: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.view, self.first = _shallow(model), first
        keep_stage(self.view, layers, first=first, last=last, shallow=True)
        self.scope: ForwardScope = state_of(model).scope  # the model's forward scope (empty for one process)
        self.last = last

    def own_parameter(self, name: str) -> None:
        """Give this view its own copy of the model's parameter `name` (the module holding it, and that module's
        parents, copied in the view), so no other stage module holds it (pipeline_grads.TiedWeights.own_copy)."""
        path, _, attr = name.rpartition(".")
        module = _shallow(self.view.get_submodule(path))
        weight = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        _replace(self.view, path, module, shallow=True)

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor,
                rows: torch.Tensor | None = None, **inputs: torch.Tensor):
        """x: token ids (batch, seq / cp: this rank's tokens under cp) on the first stage, else the hidden states
        the stage before sent (batch, seq / cp (/ tp under SP), hidden); carried: what else it sent (the router
        statistics, `contract.PipelineModel`); position_ids: the microbatch's whole sequences' (batch, seq) or
        (batch, rows, seq), which RoPE and the masks read (a stage's input may be a shard of the sequence); inputs:
        the microbatch's other inputs (`by_microbatch`). Inside the model's forward scope, as the model's own forward
        would be (a loss follows: MicrobatchLoss computes it from the last stage's logits). rows: the microbatch's
        per-row values a workflow's loss reads (batch, ...), handed on by the last stage after its output
        (MicrobatchLoss.objective)."""
        inputs = own_rows(inputs, first=self.first)
        batch = Batch("stage", position_ids=position_ids, loss=True)
        out = self.scope.run(batch, lambda b: self.view.pipeline_forward(x, *carried, position_ids=b.position_ids,
                                                                         **inputs))
        if rows is None or not self.last:
            return out
        return (*out, rows) if isinstance(out, tuple) else (out, rows)


def by_microbatch(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """A whole batch's inputs beside the ids, labels and positions (a vision-language model's) as the schedule is to
    split them, each along dim 0 into `n` microbatches of consecutive samples: those of one row per sample (attention
    mask, token types) as they are; one joined along dim 0 from its samples (its rows per sample under name + ROWS:
    images, patches) regrouped as (n, the most rows of a microbatch, ...), zero-padded, with its rows per microbatch
    as name + ROWS (n,) (`own_rows` undoes it). ValueError naming an input of other rows and no counts."""
    size, out = batch["input_ids"].shape[0], {}
    for name, value in _other_inputs(batch).items():
        counts = batch.get(name + ROWS)
        if counts is None:
            if value.shape[0] != size:
                raise ValueError(f"the batch's {name!r} has {value.shape[0]} rows for {size} samples and no "
                                 f"{name + ROWS!r} saying how many are each sample's: a pipeline's microbatches take "
                                 f"their own samples' rows (training/vision_data.py's collate_vision gives them)")
            out[name] = value
            continue
        per = torch.stack([c.sum() for c in counts.tensor_split(n)])  # rows per microbatch (the schedule's split)
        packed = value.new_zeros(n, int(per.max()), *value.shape[1:])
        for m, (start, rows) in enumerate(zip((per.cumsum(0) - per).tolist(), per.tolist())):
            packed[m, :rows] = value[start:start + rows]
        out[name], out[name + ROWS] = packed, per
    return out


def own_rows(inputs: dict[str, torch.Tensor], *, first: bool) -> dict[str, torch.Tensor]:
    """A microbatch's share of `by_microbatch`'s inputs (each (1, ...) after the schedule's split) as the model
    takes them: a joined input's rows back as they were (on the first stage only, which runs the tower; left out where
    the microbatch has none), the rest as they are."""
    out = {}
    for name, value in inputs.items():
        rows = inputs.get(name + ROWS)
        if name.endswith(ROWS):
            continue
        if rows is None:
            out[name] = value
        elif first and int(rows[0]):
            out[name] = value[0, :int(rows[0])]
    return out


class MicrobatchLoss:
    """The schedule's loss_fn: a microbatch's (logits, labels) -> its token-loss sum over the step's global token
    count (`num_items`, set each step), through the model's own `loss_function` (the TP engine's when it swapped
    one in), plus what the model adds of what its stages carried (`pipeline_loss`: the router aux loss). The
    schedule does not scale gradients (scale_grads=False): the sum over microbatches is the step's."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.num_items = model, None
        # A workflow's loss of per-sequence sums (preference tuning), set around its steps: (each row's summed token
        # loss (rows,), the rows' values the last stage handed on) -> the microbatch's loss; a vector it returns (a
        # reference's log-probabilities, in a forward-only step) is kept as it is.
        self.objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        logits, *carried = output if isinstance(output, tuple) else (output,)
        if self.objective is None:
            loss = self.model.loss_function(logits, labels, self.num_items)
        else:
            *carried, rows = carried
            loss = self.objective(self.model.loss_function(logits, labels, per_sequence=True), rows)
        return self.model.pipeline_loss(loss, *carried) if carried and loss.dim() == 0 else loss


class Pipeline:
    """This rank's stages (PipelineStage over StageModule views) and torch's schedule running them, for a model
    cut by `cut_model`. Built once for the run, on every rank of the mesh (`mesh` has the pp axis)."""

    def __init__(self, model: nn.Module, mesh, *, n_microbatches: int, device: torch.device,
                 on_forward: Callable[[], None] | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        state = state_of(model)
        plan = self.plan = state.pp
        self.model, self.loss, self.scope = model, MicrobatchLoss(model), state.scope
        self.n_microbatches = n_microbatches
        last = plan.n_stages - 1
        self.stages = [PipelineStage(StageModule(model, list(plan.stage_layers[s]), first=s == 0, last=s == last),
                                     s, plan.n_stages, device, group=mesh["pp"].get_group()) for s in plan.stages]
        for stage in self.stages if on_forward is not None else ():
            stage.submod.register_forward_pre_hook(lambda module, args: on_forward())
        schedule = get_schedule_class(plan.schedule)
        self.n_microbatches = n_microbatches
        self.schedule = schedule(self.stages if len(self.stages) > 1 else self.stages[0],
                                 n_microbatches=n_microbatches, loss_fn=self.loss, scale_grads=False)
        self.ties = TiedWeights(model, mesh, plan, self.stages)

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's stage modules, what FSDP2 wraps under data parallelism (torch's stages then see it)."""
        return [stage.submod for stage in self.stages]

    def step(self, batch: dict[str, torch.Tensor], num_items: int, *, train: bool = True,
             rows: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
        """Forward (and with `train` backward) of one batch through the pipeline, inside the model's forward scope
        ("step": under cp the whole batch is split before the schedule cuts it into microbatches, and the loss summed
        over cp). Returns this rank's sum of the microbatch losses (fp64; 0 on a rank without the last stage: the
        caller sums over pp). `rows` (batch, ...): the per-row values a workflow's loss reads (`loss.objective`), split
        with the batch; `per_row`: the objective returns a vector per microbatch (a forward-only step), and this the
        vectors concatenated (batch,) (zeros without the last stage)."""
        self.loss.num_items = num_items
        self.ties.refresh()
        ids, positions = batch["input_ids"], batch.get("position_ids")
        inputs = by_microbatch(batch, self.n_microbatches)
        if positions is None:  # multimodal RoPE's, from the whole rows (every stage reads them)
            positions = contract.input_positions(self.model, ids, _other_inputs(batch))
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        whole = Batch("step", input_ids=ids, labels=batch["labels"], position_ids=positions,
                      num_items_in_batch=num_items, loss=True)
        return self.scope.run(whole, functools.partial(self._run, train=train, inputs=inputs, rows=rows,
                                                       per_row=per_row))

    def _run(self, batch: Batch, *, train: bool, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
             per_row: bool = False) -> torch.Tensor:
        """torch's schedule on this rank's part of `batch`: the first stage takes the ids, the last the labels, every
        stage the whole sequences' position ids (RoPE, the masks) and the other `inputs` (`by_microbatch`); the
        schedule splits each along dim 0."""
        plan = self.plan
        args = (batch.input_ids,) if plan.holds(0) else ()
        target = batch.labels if plan.holds(plan.n_stages - 1) else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else functools.partial(forward_only, self.schedule)
        # return_outputs=False: the last stage drops each microbatch's logits after its backward instead of keeping
        # them all to the end of the step and concatenating them (nothing reads them: the losses are the output).
        extra = {} if rows is None else {"rows": rows}
        run(*args, target=target, losses=losses, return_outputs=False, position_ids=batch.position_ids, **inputs,
            **extra)
        device = batch.position_ids.device
        if per_row:  # each microbatch's vector, in order
            return torch.cat([v.detach().to(torch.float64) for v in losses]) if losses else \
                torch.zeros(batch.position_ids.shape[0], dtype=torch.float64, device=device)
        return sum((loss.detach().to(torch.float64) for loss in losses), torch.zeros((), dtype=torch.float64,
                                                                                     device=device))


def _other_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's inputs beside the ids, labels and positions (a vision-language model's), as the model takes them."""
    return {name: value for name, value in batch.items()
            if name not in ("input_ids", "labels", "position_ids") and not name.endswith(ROWS)}


_FORWARD_ACTIONS = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")  # torch's _ComputationType values (a str Enum)


def forward_only(schedule, *args, **kwargs) -> None:
    """`schedule.eval(*args, **kwargs)` on only the forward actions of this rank's part of a multi-stage schedule.
    torch's eval runs the training order with backward switched off, and a V schedule's hand-over of an input
    gradient between a rank's two stages then fails ("can't steal_bwd_input"). The kept actions are the forwards,
    their sends and receives and FSDP2's unshard / reshard, in the training order: a forward depends only on
    forwards, so what ran without a deadlock with the backward actions runs without them."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:  # a one-stage schedule: its own loop skips backward
        return schedule.eval(*args, **kwargs)
    mine = [action for step in order[schedule.rank] for action in (step.sub_actions or (step,))
            if action.computation_type in _FORWARD_ACTIONS]
    schedule.pipeline_order_with_comms = {**order, schedule.rank: mine}
    try:
        return schedule.eval(*args, **kwargs)
    finally:
        schedule.pipeline_order_with_comms = order


def held_elsewhere(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` (its whole-model name) belongs to a stage this rank of a cut `model` does not hold
    (a file of the whole model's tensors, a LoRA adapter's, names it: this rank skips it)."""
    plan = state_of(model).pp
    if plan is None:
        return False
    layers, first, last = contract.pipeline_parts(model)
    if name.startswith(f"{layers}."):
        return int(name[len(layers) + 1:].split(".")[0]) not in plan.layers()
    paths = (() if plan.holds(0) else first) + (() if plan.holds(plan.n_stages - 1) else last)
    return any(name.startswith(f"{path}.") for path in paths)


def cut_for_rank(model: nn.Module, resolved: ResolvedPlan, *, pp: int, pp_rank: int, schedule: str,
                 layers: list[list[int]] | None = None) -> tuple[PipelinePlan, ResolvedPlan]:
    """Cut `model` (whole, on meta) to pp rank `pp_rank`'s stages; returns the plan and the TP plan restricted to
    them."""
    plan = plan_pipeline(model, pp=pp, pp_rank=pp_rank, schedule=schedule, layers=layers)
    cut_model(model, plan)
    return plan, stage_plan(resolved, model, plan)

