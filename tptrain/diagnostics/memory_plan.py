"""Peak tensor memory per rank of one training step of a layout: the moments of the step where it can peak, each
split into parameters, gradients, optimizer states, activations, communication buffers and the largest transient.

    ranks = rank_memory(shapes, ParallelDims(tp=2, dp_shard=4), TrainSettings(batch_size=2, seq_len=4096))
    max(r.peak for r in ranks)                    # the largest pipeline rank's peak, in bytes

The step is walked as the Trainer runs it (training/trainer.py, parallelize.py): forward to the loss, the backward of
each layer from the last (its saved tensors freed as its gradients appear), the optimizer step. ZeRO-3 / FSDP
(Rajbhandari et al. 2020; FSDP2's fully_shard): each parameter, its gradient and its two AdamW states are split over
dp_shard x cp (the experts over dp_shard x cp / ep), dim 0 padded to a multiple; each layer is gathered (a flat buffer,
then copied out) before its forward and again before its backward, its gradient reduce-scattered after it; under a
pipeline the stage stays gathered and its gradients unsharded (in the reduce dtype) until the last microbatch. A
pipeline rank holds the activations of the microbatches its schedule keeps in flight (`in_flight`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tptrain.diagnostics.activations import (LossMemory, Precision, Work, checkpointed_layer, fused_loss,
                                             layer_activations, layer_backward_transient, logits_loss,
                                             model_activations, precision, tower_activations)
from tptrain.diagnostics.train_settings import TrainSettings
from tptrain.layout import ParallelDims
from tptrain.diagnostics.model_shapes import ModelShapes, ParamShape
from tptrain.parallel import pipeline_parallel

SHARD_BYTES = 5 * 10**9  # save_pretrained's max_shard_size ("5GB"): the final save's writer holds one file's tensors
TERMS = ("parameters", "gradients", "optimizer_states", "activations", "communication_buffers", "largest_transient")


@dataclass
class RankMemory:
    """One pipeline rank's peak (every rank of a pp rank holds the same). terms: the peak split as TERMS; phase: the
    moment it happens; per_layer: what one of its layers saves for one microbatch; in_flight: microbatches whose
    activations it holds at once (the schedule's); tower: what a vision-language model's tower saves for one
    microbatch's images (the first stage's)."""

    pp_rank: int
    peak: int
    phase: str
    terms: dict[str, int]
    per_layer: dict[str, int] = field(default_factory=dict)
    in_flight: float = 1.0
    tower: dict[str, int] = field(default_factory=dict)


@dataclass
class _Stage:
    """What a pp rank holds: its layers, the first / last stage's modules, its parameters (the tied head's copy when
    it holds the last stage only)."""

    layers: list[int]
    first: bool
    last: bool
    params: list[ParamShape]


def stages(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings) -> list[_Stage]:
    """Each pp rank's part of the model, cut as `pipeline_parallel` cuts it (the schedule's stages per rank)."""
    params = shapes.params(layout.tp, layout.ep, settings.sequence_parallel, settings.expert_parallel)
    if layout.pp == 1:
        return [_Stage(list(range(len(shapes.layers))), True, True, [p for p in params if not p.tied])]
    schedule = pipeline_parallel.schedule_name(settings.pp_schedule)
    n_stages = layout.pp * pipeline_parallel.stages_per_rank(schedule)
    split = pipeline_parallel.split_layers(len(shapes.layers), n_stages)
    out = []
    for rank in range(layout.pp):
        held = pipeline_parallel.rank_stages(schedule, layout.pp, rank)
        layers = sorted(i for s in held for i in split[s])
        first, last = 0 in held, n_stages - 1 in held
        keep = [p for p in params if (p.unit in layers or (p.unit == "first" and first) or
                                      (p.unit == "last" and last)) and not (p.tied and first)]
        out.append(_Stage(layers, first, last, keep))
    return out


def in_flight(schedule: str, pp: int, microbatches: int, rank: int) -> float:
    """Microbatches of a rank's whole part whose activations it holds at its peak: GPipe and looped BFS keep every
    microbatch; 1F1B keeps pp - rank (Narayanan et al. 2021, PipeDream-Flush); interleaved 1F1B keeps its warmup
    plus one of its chunks (torch's Interleaved1F1B: (v-1) x pp + 2 (pp-1-rank) forwards, v = 2 chunks of half the
    rank's layers); the V schedules keep pp microbatches' worth, as 1F1B's first stage (Qi et al. 2024)."""
    if pp == 1:
        return 1.0
    if schedule in ("GPipe", "LoopedBFS"):
        return float(microbatches)
    if schedule == "1F1B":
        return float(min(microbatches, pp - rank))
    if schedule in pipeline_parallel.V_SCHEDULES:
        return float(min(microbatches, pp))
    chunks = min(2 * microbatches, pp + 2 * (pp - 1 - rank) + 1)
    return chunks / 2


def _sharded(p: ParamShape, shards: int) -> int:
    """Elements of `p` one rank keeps under FSDP2 over `shards` ranks (dim 0 padded to a multiple)."""
    if shards == 1 or not p.shape:
        return p.numel
    return math.ceil(p.shape[0] / shards) * (p.numel // p.shape[0])


def _adapter(p: ParamShape, r: int) -> int:
    """LoRA's A (r, in) and B (out, r) of a linear weight, at its local shape (one factor split like it)."""
    return r * (p.shape[0] + p.shape[1]) if r and p.linear and len(p.shape) == 2 else 0


@dataclass
class _States:
    """A stage's persistent bytes and, per unit (layer index, "first", "last"), what FSDP2 gathers and reduces."""

    params: int = 0
    reference: int = 0  # a preference run's frozen reference copy (no gradients, no optimizer states)
    grads: int = 0
    optimizer: int = 0
    largest_grad: int = 0
    largest_of: dict = field(default_factory=dict)  # unit -> its largest gradient tensor's bytes
    gathered: dict = field(default_factory=dict)  # unit -> unsharded parameter bytes
    unsharded_grads: dict = field(default_factory=dict)  # unit -> unsharded gradient bytes (the gathered dtype)
    grads_of: dict = field(default_factory=dict)  # unit -> this rank's gradient bytes once reduced


def states(stage: _Stage, layout: ParallelDims, settings: TrainSettings, prec: Precision) -> _States:
    """Parameters, gradients and AdamW's exp_avg / exp_avg_sq (and its fp32 step) of one stage on one rank."""
    out = _States()
    dense = layout.dp_shard_cp if layout.data_parallel else 1
    expert = layout.ep_pool // layout.ep if layout.ep > 1 else dense  # the ranks holding the same experts
    tensors = 0
    for p in stage.params:
        shards = expert if p.expert else dense
        lora = _adapter(p, settings.lora_r)
        trained = lora if settings.lora_r else p.numel
        kept = _sharded(p, shards) + (math.ceil(lora / shards) if lora else 0)
        kept_trained = math.ceil(trained / shards) if settings.lora_r else _sharded(p, shards)
        out.params += kept * prec.param
        if settings.reference == "copy":  # a preference run's frozen reference, sharded as the policy
            out.reference += _sharded(p, shards) * prec.param
        out.grads_of[p.unit] = out.grads_of.get(p.unit, 0) + kept_trained * prec.param
        out.largest_grad = max(out.largest_grad, kept_trained * prec.param)
        out.largest_of[p.unit] = max(out.largest_of.get(p.unit, 0), kept_trained * prec.param)
        tensors += (2 if lora else 0) if settings.lora_r else 1
        if layout.data_parallel:  # gathered: unless it is whole here (a shard group of 1: HSDP's replicas only)
            out.gathered[p.unit] = out.gathered.get(p.unit, 0) + (p.numel + lora) * prec.unsharded * (shards > 1)
            out.unsharded_grads[p.unit] = out.unsharded_grads.get(p.unit, 0) + trained * prec.unsharded
    out.grads = sum(out.grads_of.values())
    out.optimizer = 2 * out.grads + 4 * tensors
    return out


@dataclass
class _Acts:
    """One microbatch's saved tensors on a stage: per layer (full, and checkpointed), outside the layers, the loss."""

    full: dict
    kept: dict
    extras: int
    loss: LossMemory
    transient: dict
    per_layer: dict
    tower: dict = field(default_factory=dict)


def stage_activations(shapes: ModelShapes, stage: _Stage, layout: ParallelDims, settings: TrainSettings,
                      prec: Precision, device: str) -> _Acts:
    mb = settings.batch_size // settings.microbatches(layout.pp)
    work = Work(mb, settings.seq_len, layout.tp, layout.cp, settings.sequence_parallel, prec, layout.ep,
                settings.expert_parallel, device, frozen_norms=settings.lora_r > 0)
    ledgers = {i: layer_activations(shapes.layers[i], work) for i in stage.layers}
    full = {i: sum(ledger.values()) + _lora_saved(shapes, i, work, settings.lora_r) for i, ledger in ledgers.items()}
    ac = settings.gradient_checkpointing
    kept = {i: checkpointed_layer(shapes.layers[i], work) if ac else full[i] for i in stage.layers}
    rotary = shapes.layers[0].q_dim
    extras = sum(model_activations(shapes.hidden, work, first=stage.first, last=stage.last, rotary=rotary).values())
    if prec.autocast:  # the bf16 copies of the layers' weights, cached by autocast and saved by their matmuls
        extras += 2 * sum(p.numel for p in stage.params if isinstance(p.unit, int) and (p.linear or p.expert))
    tower = _tower(shapes, stage, layout, settings, prec, mb)
    extras += sum(tower.values())
    if stage.last:
        vocab = shapes.vocab // layout.tp if shapes.vocab % layout.tp == 0 else shapes.vocab
        whole = layout.pp > 1 or settings.loss == "logits"
        loss = (logits_loss if whole else fused_loss)(shapes.hidden, vocab, work)
        if settings.lora_r:  # the head is frozen: no gradient of it is made
            loss = dataclasses.replace(loss, head_grad=0)
    else:
        loss = LossMemory(0)
    if layout.pp > 1:  # a stage's input (received, its gradient wanted) and its output, kept until its backward
        extras += work.sp_tokens * shapes.hidden * prec.residual * ((not stage.first) + (not stage.last))
    transient = {i: layer_backward_transient(shapes.layers[i], work) for i in stage.layers}
    return _Acts(full, kept, extras, loss, transient, ledgers[stage.layers[0]] if stage.layers else {}, tower)


def _tower(shapes: ModelShapes, stage: _Stage, layout: ParallelDims, settings: TrainSettings, prec: Precision,
           mb: int) -> dict[str, int]:
    """What a vision-language model's tower keeps for one microbatch's images, on the stage holding it (the first):
    every rank of a tp (and cp) group runs it on all of them, its layers split over tp where its plan splits them;
    under autocast its linears' bf16 weight copies too."""
    tower = shapes.tower
    if tower is None or not stage.first or not settings.images_per_sample:
        return {}
    tokens = mb * settings.images_per_sample * tower.tokens(settings.image_size)
    out = tower_activations(tower, tokens, shapes.tower_tp(layout.tp, layout.ep), prec,
                            checkpointed=settings.gradient_checkpointing)
    if prec.autocast:
        out["tower weight copies"] = 2 * sum(p.numel for p in stage.params if p.linear and p.unit == "first"
                                             and p.name.startswith(tower.root + "."))
    return out


def _lora_saved(shapes: ModelShapes, layer: int, work: Work, r: int) -> int:
    """LoRA's B keeps A's output (tokens, r) for each adapted linear layer of the layer (7 in a Llama layer)."""
    return 7 * work.tokens * r * work.precision.compute if r else 0


def _terms(**parts: int) -> dict[str, int]:
    return {term: int(parts.get(term, 0)) for term in TERMS}


@dataclass(frozen=True)
class _Scenario:
    """A microbatch's backward as the schedule runs it: `others` microbatches in flight beside it, gradients of
    earlier microbatches already there (`accumulated`), `outputs` microbatches' logits held (a pipeline's last stage
    keeps each until its backward)."""

    name: str
    others: float
    accumulated: bool
    outputs: float


def _scenarios(layout: ParallelDims, microbatches: int, flight: float, last: bool) -> list[_Scenario]:
    """The first microbatch's backward (the most in flight, no gradient yet) and, with several microbatches, a later
    one's (the gradients there, the logits of the microbatches still in flight held)."""
    if layout.pp == 1:
        return [_Scenario("", 0, False, 0)]
    out = [_Scenario("first microbatch: ", flight - 1, False, flight if last else 0)]
    if microbatches > 1:
        others = flight - 1 if microbatches > flight else 0
        out.append(_Scenario("last microbatch: ", others, True, others + 1 if last else 0))
    return out


def _unit_grads(st: _States, layout: ParallelDims, prec: Precision) -> dict:
    """{unit: gradient bytes it leaves once its backward is done}: this rank's gradients, or under FSDP2 in a pipeline
    the unsharded ones it accumulates over the microbatches (in the reduce dtype) until the last one's."""
    if layout.pp > 1 and layout.data_parallel:
        return {u: b * prec.reduce // prec.unsharded for u, b in st.unsharded_grads.items()}
    return dict(st.grads_of)


def _moments(stage: _Stage, st: _States, acts: _Acts, layout: ParallelDims, settings: TrainSettings, prec: Precision,
             sc: _Scenario, device: str) -> dict[str, dict[str, int]]:
    """{moment: terms} of one step on this stage under scenario `sc`: the loss, the loss's backward, each layer's
    backward, the end of backward (the embedding; FSDP2's reduce-scatters), the optimizer step."""
    pp, fsdp, loss = layout.pp > 1, layout.data_parallel, acts.loss
    # in a pipeline the optimizer in backward steps a stage once its last microbatch is in: its gradients accumulate
    # until then, as without it
    oib = settings.optim_in_backward and not pp
    kept, saved = acts.kept, sum(acts.kept.values()) + acts.extras
    # the other microbatches in flight: their saved tensors, and their losses' only where every forward comes before
    # any backward (GPipe, looped BFS: the last stage too holds all); otherwise the last stage runs each
    # microbatch's backward right after its forward
    gpipe = pp and pipeline_parallel.schedule_name(settings.pp_schedule) in ("GPipe", "LoopedBFS")
    other = sc.others * (saved + loss.held * gpipe)
    outputs = sc.outputs * loss.output
    base = dict(parameters=st.params + st.reference, optimizer_states=st.optimizer)
    root = st.gathered.get("first", 0) + st.gathered.get("last", 0)
    held = sum(st.gathered.values()) if pp else root  # a pipeline keeps its stage gathered
    unit_grads = _unit_grads(st, layout, prec)
    earlier = sum(unit_grads.values()) if sc.accumulated and not oib else 0
    head = loss.head_grad if stage.last else 0
    fused = loss.chunk > 0
    moments = {"forward end (loss)": _terms(**base, activations=other + saved + loss.held + max(outputs, loss.output),
                                            gradients=earlier + head * fused, communication_buffers=held,
                                            largest_transient=loss.forward)}
    if stage.last:  # the loss's backward (the root gathered again for it under FSDP2), then the head's
        regather = root if fsdp and not pp else 0
        moments["loss backward"] = _terms(**base, activations=other + saved + loss.held + outputs,
                                          gradients=earlier + head * fused, largest_transient=loss.backward,
                                          communication_buffers=held + regather)
        if not fused:  # whole logits: the head's gradient appears beside the logits' (in the compute dtype)
            moments["head backward"] = _terms(**base, activations=other + saved + outputs, gradients=earlier + head,
                                              largest_transient=loss.output, communication_buffers=held)
    done = 0 if sc.accumulated or oib else unit_grads.get("last", 0) + head * (fsdp and not pp)
    order = sorted(stage.layers, reverse=True)
    for k, i in enumerate(order):
        comm = held
        if fsdp and not pp:  # this layer gathered, the next one prefetched, its unsharded gradients
            nxt = order[k + 1] if k + 1 < len(order) else "first"
            comm += st.gathered.get(i, 0) + st.gathered.get(nxt, 0) + st.unsharded_grads.get(i, 0)
        fresh = st.largest_of.get(i, 0) if earlier or oib else 0  # a gradient before it is added (or stepped)
        moments[f"backward of layer {i}"] = _terms(
            **base, activations=other + outputs + sum(kept[j] for j in stage.layers if j < i) + acts.full[i]
            + acts.extras, gradients=earlier + done, communication_buffers=comm,
            largest_transient=acts.transient[i] + fresh)
        done += 0 if sc.accumulated or oib else unit_grads.get(i, 0)
    moments["backward end"] = _backward_end(stage, st, layout, prec, oib, earlier or done, outputs, head, device)
    clip = 0 if oib else st.largest_grad * (1 if prec.param >= 4 else 3)  # the norm's fp32 square of each gradient
    moments["optimizer step"] = _terms(**base, gradients=0 if oib else st.grads, largest_transient=clip)
    return {sc.name + name: terms for name, terms in moments.items()}


def _backward_end(stage: _Stage, st: _States, layout: ParallelDims, prec: Precision, oib: bool, grads_then: int,
                  outputs: int, head: int, device: str) -> dict[str, int]:
    """The end of backward: the embedding's fresh gradient beside the others; under FSDP2 the reduce-scatter of the
    root (or, in a pipeline, of each unit's accumulated gradients): its gradients copied into one flat buffer in the
    reduce dtype (a CPU's gloo reduce-scatters a copy of it; dp_replicate's all-reduce works on another); in mixed
    precision the head's gradient outlives the copy."""
    base = dict(parameters=st.params + st.reference, optimizer_states=st.optimizer)
    grads = 0 if oib else st.grads
    if not layout.data_parallel:
        fresh = st.largest_of.get("first", 0) if stage.first else 0
        return _terms(**base, gradients=grads_then, activations=outputs, largest_transient=fresh)
    copies = (device == "cpu" and layout.dp_shard_cp > 1) + (layout.dp_replicate > 1) / layout.dp_shard_cp
    if layout.pp > 1:  # the largest unit's flat buffer, beside every unit's accumulated gradients
        flat = max(st.unsharded_grads.values(), default=0) * prec.reduce // prec.unsharded
        return _terms(**base, gradients=grads_then + grads, communication_buffers=int(flat * (1 + copies)))
    flat = (st.unsharded_grads.get("first", 0) + st.unsharded_grads.get("last", 0)) * prec.reduce // prec.unsharded
    mixed = prec.reduce != prec.unsharded
    return _terms(**base, gradients=grads + head * mixed, communication_buffers=int(flat * (1 + copies)))


def _final_save(shapes: ModelShapes, stage: _Stage, st: _States, prec: Precision, device: str) -> dict[str, int]:
    """The end of the run: the stage's parameters gathered one at a time (FSDP2's then TP's all-gather: a whole
    parameter and its gather's buffer), to the CPU, where its writer (the stage's first rank) keeps one shard file's
    worth (the stage's, up to SHARD_BYTES) until it is written; the optimizer's states alive, the gradients freed."""
    held = {p.name for p in stage.params}
    whole = [p.numel * prec.param for p in shapes.params(1, 1) if p.name in held and not p.tied]
    shard = min(sum(whole), SHARD_BYTES) if device == "cpu" else 0  # on a GPU the file fills host memory
    return _terms(parameters=st.params + st.reference, optimizer_states=st.optimizer,
                  communication_buffers=shard, largest_transient=2 * max(whole, default=0))


def rank_memory(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings, *, device: str = "cuda"
                ) -> list[RankMemory]:
    """Each pp rank's peak of one training step (after the first: AdamW's states exist)."""
    prec = precision(settings.dtype.itemsize, bf16=settings.bf16, fsdp=layout.data_parallel)
    microbatches = settings.microbatches(layout.pp)
    schedule = pipeline_parallel.schedule_name(settings.pp_schedule)
    out = []
    for rank, stage in enumerate(stages(shapes, layout, settings)):
        st = states(stage, layout, settings, prec)
        acts = stage_activations(shapes, stage, layout, settings, prec, device)
        flight = in_flight(schedule, layout.pp, microbatches, rank)
        moments: dict[str, dict[str, int]] = {}
        for scenario in _scenarios(layout, microbatches, flight, stage.last):
            moments.update(_moments(stage, st, acts, layout, settings, prec, scenario, device))
        if settings.final_save and not settings.lora_r:  # LoRA's final save writes the adapter only
            moments["final save (the stage's writer)"] = _final_save(shapes, stage, st, prec, device)
        phase, terms = max(moments.items(), key=lambda item: sum(item[1].values()))
        out.append(RankMemory(rank, sum(terms.values()), phase, terms, acts.per_layer, flight, acts.tower))
    return out
