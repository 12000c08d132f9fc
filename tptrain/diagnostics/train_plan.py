"""`tptrain plan --train`: every layout of N ranks that the rules allow, its peak memory per rank and its step time,
ranked; the fastest one that fits, and why.

    shapes = ModelShapes.of(config, dtype=torch.float32)
    plan = plan_training(shapes, world=8, settings=TrainSettings(batch_size=2, seq_len=8192, bf16=True),
                         profile=device_profile("h100"))
    plan.layouts[plan.best].layout                # ParallelDims(tp=2, dp_shard=4)

`valid_layouts` is the one place that decides which layouts exist: the one rule table (tptrain/layout) and the
model's plan at each tp / ep, through `layout_problem`; nothing else filters.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tptrain.diagnostics.device_profiles import DeviceProfile
from tptrain.diagnostics.train_settings import TrainSettings
from tptrain.layout import ParallelDims
from tptrain.diagnostics.memory_plan import RankMemory, rank_memory, stages, states
from tptrain.diagnostics.activations import precision
from tptrain.diagnostics.model_shapes import ModelShapes
from tptrain.diagnostics.step_time import StepTime, step_time
from tptrain.distributed import DistributedConfig
from tptrain.layout.case import Spelling
from tptrain.parallel.parallelize import check


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world: int, *, moe: bool) -> list[ParallelDims]:
    """Every way to write `world` as pp x dp_replicate x dp_shard x cp x tp (with ep for a mixture-of-experts model: a
    divisor of dp_shard x cp that holds whole cp groups, folded over them)."""
    out = []
    for pp in _divisors(world):
        for rep in _divisors(world // pp):
            for cp in _divisors(world // pp // rep):
                for tp in _divisors(world // pp // rep // cp):
                    shard = world // (pp * rep * cp * tp)
                    for ep in [e for e in _divisors(shard * cp) if e == 1 or e % cp == 0] if moe else [1]:
                        out.append(ParallelDims(tp=tp, cp=cp, pp=pp, dp_shard=shard, dp_replicate=rep, ep=ep))
    return out


def layout_problem(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings) -> str | None:
    """Why the one rule table (tptrain/layout, as `from_pretrained`, the Trainer and `tptrain train` check it) or the
    model's plan refuses `layout` for this model and run (None: it is allowed): the one place the planner asks."""
    config = DistributedConfig(tp_size=layout.tp, cp_size=layout.cp, pp_size=layout.pp,
                               ep_size=layout.ep if layout.ep > 1 else None, dp_replicate_size=layout.dp_replicate,
                               dp_shard_size=layout.dp_shard, enable_sequence_parallel=settings.sequence_parallel,
                               enable_expert_parallel=settings.expert_parallel, pp_schedule=settings.pp_schedule)
    training = dict(batch_size=settings.batch_size, seq_len=settings.seq_len,
                    pp_microbatches=settings.microbatches(layout.pp) if layout.pp > 1 else None)
    try:
        resolved = check(shapes.model, config, world_size=layout.world_size, training=training,
                         plan_problems=False, spelling=Spelling(described=layout.spell(), seq_len="--seq-len"))
    except ValueError as exc:
        return str(exc)
    return resolved.problems[0] if resolved.problems else None


def valid_layouts(world: int, shapes: ModelShapes,
                  settings: TrainSettings) -> tuple[list[ParallelDims], dict[ParallelDims, str]]:
    """(the layouts of `world` ranks the rules allow, {refused layout: why})."""
    valid, refused = [], {}
    for layout in candidate_layouts(world, moe=shapes.is_moe):
        problem = layout_problem(shapes, layout, settings)
        if problem is None:
            valid.append(layout)
        else:
            refused[layout] = problem
    return valid, refused


@dataclass
class LayoutPlan:
    """One layout's estimate. ranks: each pp rank's memory; peak: the largest; budget: the memory a rank's tensors
    may use (the device's, less the runtime's own); time: the step."""

    layout: ParallelDims
    ranks: list[RankMemory]
    budget: int
    runtime: int
    time: StepTime

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.peak, -r.pp_rank))

    @property
    def peak(self) -> int:
        return self.worst.peak

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget


def estimate(shapes: ModelShapes, layout: ParallelDims, settings: TrainSettings, profile: DeviceProfile) -> LayoutPlan:
    """Memory per pp rank and the step time of `layout` (valid or not: the rules are `layout_problem`'s)."""
    ranks = rank_memory(shapes, layout, settings, device=profile.kind)
    prec = precision(settings.dtype.itemsize, bf16=settings.bf16, fsdp=layout.data_parallel)
    stage_list = stages(shapes, layout, settings)
    slowest = max(range(len(stage_list)), key=lambda r: len(stage_list[r].layers))
    st = states(stage_list[slowest], layout, settings, prec)
    gathered = sum(p.numel for p in stage_list[slowest].params) * prec.unsharded
    grads = st.grads * layout.dp_shard_cp * prec.reduce // prec.param if layout.data_parallel else st.grads
    activations = sum(ranks[slowest].per_layer.values()) * len(stage_list[slowest].layers)
    time = step_time(shapes, layout, settings, profile, gathered=gathered, grads=grads,
                     optimizer_bytes=2 * (st.params + st.grads + st.optimizer), activation_bytes=activations)
    world_on_node = min(layout.world_size, profile.devices_per_node)
    budget = profile.memory_per_rank(world_on_node) - profile.runtime_bytes
    return LayoutPlan(layout, ranks, budget, profile.runtime_bytes, time)


@dataclass
class TrainPlan:
    """layouts: the given layout first (if any), then every valid one ranked (those that fit first, fastest first);
    best: the index of the fastest that fits (None: none fits); why: that choice in words; refused: {layout: why}."""

    world: int
    settings: TrainSettings
    profile: DeviceProfile
    layouts: list[LayoutPlan]
    best: int | None
    why: str
    refused: dict[ParallelDims, str]


def rank_key(plan: LayoutPlan) -> tuple:
    """Fitting layouts first, then the most tokens per second, then the least memory; the spelling breaks ties, so
    the order is the same on every run."""
    return (not plan.fits, -round(plan.time.tokens_per_s, 6), plan.peak, plan.layout.spell())


def plan_training(shapes: ModelShapes, *, world: int, settings: TrainSettings, profile: DeviceProfile,
                  layout: ParallelDims | None = None) -> TrainPlan:
    """Estimate every valid layout of `world` ranks (`layout`, if given, must be one: ValueError naming the rule it
    breaks) and rank them; ValueError when the rules allow none."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--world must be a positive integer, got {world!r}")
    valid, refused = valid_layouts(world, shapes, settings)
    if layout is not None and layout in refused:
        raise ValueError(f"--layout {layout.spell()} is refused: {refused[layout]}")
    if not valid:
        reasons = "; ".join(sorted(set(refused.values()))[:3])
        raise ValueError(f"no layout of {world} ranks is valid for this model and run: {reasons}")
    plans = sorted((estimate(shapes, lay, settings, profile) for lay in valid), key=rank_key)
    if layout is not None:
        plans.sort(key=lambda p: p.layout != layout)  # stable: the given layout first, the rest still ranked
    fitting = [i for i, p in enumerate(plans) if p.fits]
    best = min(fitting, key=lambda i: rank_key(plans[i])) if fitting else None
    return TrainPlan(world, settings, profile, plans, best, explain_best(plans, best), refused)


def explain_best(plans: list[LayoutPlan], best: int | None) -> str:
    """Why the best layout wins: its margin, and what it spends less time on than the runner-up that fits."""
    if best is None:
        return ""
    chosen = plans[best]
    spare = chosen.budget - chosen.peak
    text = f"{chosen.layout.spell()} fits with {_gib(spare)} to spare (peak {_gib(chosen.peak)} of {_gib(chosen.budget)})"
    others = sorted((p for i, p in enumerate(plans) if p.fits and i != best), key=rank_key)
    if not others:
        return text + "; the only layout that fits"
    runner = others[0]
    ratio = chosen.time.tokens_per_s / runner.time.tokens_per_s
    saved = {part: runner.time.parts[part] - seconds for part, seconds in chosen.time.parts.items()}
    part, gain = max(saved.items(), key=lambda item: item[1])
    reason = f"{gain:.3g} s less {part.replace('_', ' ')} per step" if gain > 0 else "the same work on more ranks"
    return (text + f"; {ratio:.2f}x the tokens/s of the next that fits, {runner.layout.spell()} ({reason})")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def what_would_fit(shapes: ModelShapes, world: int, settings: TrainSettings, profile: DeviceProfile,
                   max_world: int = 4096) -> list[str]:
    """When nothing fits at `world`: the changes of the run that would make a layout fit at this world (activation
    checkpointing, the optimizer in backward, bf16, a pipeline of one-sequence microbatches), and the smallest world
    (doubling, while doubling still lowers the smallest peak) where one fits as it is."""
    if profile.memory_per_rank(1) <= profile.runtime_bytes:  # the runtime alone takes the whole device
        return [f"--gpu-memory above the runtime's own {_gib(profile.runtime_bytes)} GiB per device"]
    hints = []
    toggles = [("--gradient-checkpointing", dict(gradient_checkpointing=True)),
               ("--optim-in-backward", dict(optim_in_backward=True)), ("--bf16", dict(bf16=True)),
               (f"--pp-microbatches {settings.batch_size} (a longer pipeline of one-sequence microbatches)",
                dict(pp_microbatches=settings.batch_size))]
    for flag, change in toggles:
        if all(getattr(settings, key) == value for key, value in change.items()):
            continue
        changed = replace(settings, **change)
        found, _ = _fitting(shapes, world, changed, profile)
        if found is not None:
            hints.append(f"{flag}: {found.layout.spell()} (peak {_gib(found.peak)} of {_gib(found.budget)})")
    bigger, smallest = world * 2, None
    while bigger <= max_world:
        found, peak = _fitting(shapes, bigger, settings, profile)
        if found is not None:
            hints.append(f"--world {bigger}: {found.layout.spell()} (peak {_gib(found.peak)} of {_gib(found.budget)})")
            break
        if smallest is not None and peak > 0.99 * smallest:  # more ranks no longer lower the smallest peak
            break
        bigger, smallest = bigger * 2, peak
    return hints


@functools.lru_cache(maxsize=64)
def _fitting(shapes: ModelShapes, world: int, settings: TrainSettings,
             profile: DeviceProfile) -> tuple[LayoutPlan | None, float]:
    """The best layout of `world` ranks that fits (None: none), and the smallest peak of any (inf: no layout)."""
    valid, _ = valid_layouts(world, shapes, settings)
    plans = [estimate(shapes, layout, settings, profile) for layout in valid]
    fitting = sorted((p for p in plans if p.fits), key=rank_key)
    return (fitting[0] if fitting else None), min((p.peak for p in plans), default=float("inf"))
