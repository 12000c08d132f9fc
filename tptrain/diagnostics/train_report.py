"""What `tptrain plan --train` prints: the ranked layouts as a table or as JSON (docs/planning.md has the schema).

    plan = plan_training(shapes, world=8, settings=settings, profile=profile)
    print(plan_text(plan, shapes, model_name="Qwen/Qwen3-8B"))
    json.dumps(plan_json(plan))       # {"layouts": [...], "best": 0}
"""
from __future__ import annotations

from tptrain.diagnostics.memory_plan import TERMS
from tptrain.diagnostics.model_shapes import ModelShapes
from tptrain.diagnostics.train_plan import LayoutPlan, TrainPlan
from tptrain.layout.dims import SPELLING_AXES

GiB = 2**30
SHOWN = 20  # rows of the table; --json lists every layout


def layout_json(plan: LayoutPlan) -> dict:
    """One layout as `--json` prints it. `terms` splits `peak_bytes_per_rank` (the largest pp rank's) into TERMS,
    which add up to it, and carries what explains it: the moment of the peak, the pp rank, one layer's saved
    tensors per microbatch, the microbatches in flight, the runtime's own memory (beside the peak, not in it),
    each axis's bytes and the step time's parts."""
    worst = plan.worst
    terms: dict = dict(worst.terms)
    terms.update(peak_phase=worst.phase, pp_rank=worst.pp_rank, in_flight_microbatches=worst.in_flight,
                 activations_per_layer=dict(worst.per_layer), tower_activations=dict(worst.tower),
                 runtime_bytes=plan.runtime,
                 budget_bytes=plan.budget, comm_bytes_per_axis=dict(plan.time.comm_bytes),
                 tokens_per_s=round(plan.time.tokens_per_s, 3),
                 step_time_parts={k: round(v, 6) for k, v in plan.time.parts.items()},
                 peak_bytes_per_pp_rank=[r.peak for r in plan.ranks])
    return {"layout": {axis: getattr(plan.layout, axis) for axis in SPELLING_AXES}, "peak_bytes_per_rank": int(plan.peak), "fits": bool(plan.fits),
            "step_time_s": round(plan.time.seconds, 6), "comm_bytes_per_step": int(sum(plan.time.comm_bytes.values())),
            "terms": terms}


def plan_json(plan: TrainPlan) -> dict:
    """{"layouts": [...], "best": index or None}: the given layout first (if any), then the ranked ones."""
    return {"layouts": [layout_json(p) for p in plan.layouts], "best": plan.best}


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


COLUMNS = {"parameters": "params", "gradients": "grads", "optimizer_states": "optim", "activations": "acts",
           "communication_buffers": "comm buf", "largest_transient": "transient"}


def _tower_lines(plan: TrainPlan, shapes: ModelShapes) -> list[str]:
    """A vision-language model's tower: its parameters, an image's tokens, what one microbatch's images keep on the
    best (else the first) layout's first stage."""
    tower, s = shapes.tower, plan.settings
    if tower is None:
        return []
    params = sum(p.numel for p in shapes.params(1, 1) if p.name.startswith(tower.root + "."))
    shown = plan.layouts[plan.best if plan.best is not None else 0]
    saved = sum(shown.ranks[0].tower.values())
    return [f"vision tower {tower.root}: {_count(params)} parameters, {tower.depth} layers of {tower.hidden}; "
            f"{tower.tokens(s.image_size)} tokens per image ({s.image_size or tower.image_size} px, patch "
            f"{tower.patch}), {s.images_per_sample} per sequence: {saved / 2**20:.1f} MiB of tower activations per "
            f"microbatch at {shown.layout.spell()} (in acts)"]


def plan_text(plan: TrainPlan, shapes: ModelShapes, *, model_name: str) -> str:
    """The table: one row per layout (the best marked *), its peak per rank split into TERMS, the step, and why the
    best wins; then the refused layouts' count and what the estimate leaves out."""
    s, profile = plan.settings, plan.profile
    n_params = sum(p.numel for p in shapes.params(1, 1))
    run = [f"batch {s.batch_size} x {s.seq_len} tokens per data-parallel rank", f"params {str(s.dtype)[6:]}"]
    run += [flag for flag, on in (("bf16", s.bf16), ("activation checkpointing", s.gradient_checkpointing),
                                  (f"LoRA r={s.lora_r}", s.lora_r), ("optimizer in backward", s.optim_in_backward),
                                  ("sequence parallel", s.sequence_parallel)) if on]
    unit, scale = ("GiB", GiB) if max(p.peak for p in plan.layouts) >= GiB else ("MiB", 2**20)

    def size(n: float) -> str:
        return f"{n / scale:.1f}"

    lines = [f"tptrain plan --train: {model_name} ({_count(n_params)} parameters, {shapes.family}), "
             f"world {plan.world}, {', '.join(run)}",
             f"device {profile.name}: {_gib(plan.layouts[0].budget)} GiB per rank for tensors "
             f"({_gib(profile.runtime_bytes)} GiB kept for the runtime); pipeline schedule {s.pp_schedule}",
             *_tower_lines(plan, shapes), ""]
    header = ("", "layout", f"peak {unit}", "fits", "step s", "tokens/s", f"sent {unit}",
              *(COLUMNS[t] for t in TERMS), "peak at")
    rows = [header]
    for i, p in enumerate(plan.layouts[:SHOWN]):
        rows.append(("*" if i == plan.best else "", p.layout.spell(), size(p.peak), "yes" if p.fits else "no",
                     f"{p.time.seconds:.3g}", f"{p.time.tokens_per_s:,.0f}",
                     size(sum(p.time.comm_bytes.values())), *(size(p.worst.terms[t]) for t in TERMS),
                     f"pp rank {p.worst.pp_rank}: {p.worst.phase}" if p.layout.pp > 1 else p.worst.phase))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(plan.layouts) > SHOWN:
        lines.append(f"... {len(plan.layouts) - SHOWN} more layouts (--json lists them all)")
    lines.append("")
    lines.append(f"best: {plan.why}" if plan.best is not None else "no layout fits")
    if plan.refused:
        reasons: dict[str, list[str]] = {}
        for lay, why in sorted(plan.refused.items(), key=lambda item: item[0].spell()):
            reasons.setdefault(why, []).append(lay.spell())
        lines.append(f"{len(plan.refused)} other layout(s) of {plan.world} ranks are refused by the rules:")
        lines += [f"  {', '.join(lays[:3])}{' ...' * (len(lays) > 3)}: {why}" for why, lays in list(reasons.items())[:4]]
    lines.append(f"{unit} per rank at its peak (sent: per step); not included: the CUDA caching allocator's reserve and "
                 "fragmentation, compiled kernels' workspaces, pinned host memory (docs/planning.md)")
    return "\n".join(lines) + "\n"
