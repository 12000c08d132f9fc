"""The layout a tensor-parallel degree gives a model, as text: what `tptrain plan` prints.

A dry run: the model is built on the meta device from its config, checked by the same rule table and `check_plan`
that `from_pretrained` runs on every rank (`parallelize.check`), so no process group and no weights are needed.

    report = plan_report(AutoConfig.from_pretrained("Qwen/Qwen3-0.6B"), tp_size=4)
    print(report.text); sys.exit(2 if report.problems else 0)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from tptrain.distributed import DistributedConfig
from tptrain.dtypes import dtype_name, resolve_dtype
from tptrain.diagnostics.model_shapes import meta_model
from tptrain.parallel import contract, pipeline_parallel
from tptrain.parallel.parallelize import check
from tptrain.parallel.expert_parallel import all_to_all_wins
from tptrain.parallel.plan import kv_replicas, working_tp_sizes
from tptrain.parallel.styles import ShardSpec

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class PlanReport:
    """text: the printable report. problems: every reason the layout is impossible (empty if fine).
    bytes_per_rank / total_bytes: parameter bytes one rank holds / the whole model holds."""

    text: str
    problems: list[str]
    bytes_per_rank: int
    total_bytes: int


def plan_report(config: Any, tp_size: int, *, tp_plan: str | Mapping[str, Any] = "auto",
                sequence_parallel: bool = False, expert_parallel: bool = False, ep_size: int = 1,
                dtype: torch.dtype | str | None = None, cp_size: int = 1, pp_size: int = 1,
                pp_schedule: str = "1F1B") -> PlanReport:
    """Resolve `tp_plan` for `config` at `tp_size` (and the experts over an ep axis of `ep_size`) and describe
    every module's shards; with `cp_size`, what context parallelism splits; with `pp_size` > 1, the pipeline stages
    of each pp rank, their layers and bytes. What the rule table refuses (tptrain/layout: the sizes, what composes
    with what and with this model) is a ValueError, as `from_pretrained` raises it; the plan's problems are listed."""
    layout = DistributedConfig(tp_size=tp_size, tp_plan=tp_plan, enable_sequence_parallel=sequence_parallel,
                               enable_expert_parallel=expert_parallel, ep_size=ep_size, cp_size=cp_size, pp_size=pp_size,
                               pp_schedule=pp_schedule)
    sizes = (tp_size, ep_size, cp_size, pp_size)
    world = math.prod(sizes) if all(isinstance(s, int) and s > 0 for s in sizes) else 1  # the least: dp_shard = ep
    dtype = resolve_dtype(dtype, config)
    model = meta_model(config, dtype=dtype)
    text = config.get_text_config() if hasattr(model, "tower_facts") else config  # a vision-language model's decoder
    resolved = check(model, layout, world_size=world, plan_problems=False)
    problems = resolved.problems
    rows, per_rank, total = _rows(model, resolved.styles, resolved.specs, tp_size, dtype.itemsize, ep_size)
    name = type(getattr(model, "hf_model", model)).__name__
    lines = [f"tptrain plan: {name} (model_type {config.model_type!r}), tp_size={tp_size}, "
             + (f"ep_size={ep_size} (experts over ep ranks of dp_shard; dense layers data-parallel there), "
                if ep_size > 1 else "") +
             f"dtype={dtype_name(dtype)}, sequence_parallel={sequence_parallel}",
             f"backend: {model.backend}" + (" (transformers' modeling code on tptrain's engine)"
                                            if model.backend == "transformers" else " (tptrain's own model code)"),
             *_head_lines(text, tp_size), *_expert_lines(model, resolved, tp_size, dtype.itemsize, ep_size),
             *_context_lines(text, tp_size, cp_size, dtype.itemsize), "",
             *_table(rows), "",
             *(_pipeline_lines(config, resolved, dtype, tp_size, ep_size, pp_size, pp_schedule) if pp_size > 1 else []),
             f"parameter bytes per rank: {_size(per_rank)} of {_size(total)} in all "
             f"({100 * per_rank / max(total, 1):.1f}%; every rank holds the same amount)"]
    if problems:
        sizes = working_tp_sizes(model, tp_plan, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                                 ep_size=ep_size)
        lines += ["", f"IMPOSSIBLE LAYOUT: {len(problems)} problem(s):", *(f"  - {p}" for p in problems),
                  f"sizes that work: {', '.join(map(str, sizes))}" if sizes else
                  "no tp size up to the number of attention heads works with these options"]
    else:
        lines += ["layout OK"]
    return PlanReport("\n".join(lines) + "\n", problems, per_rank, total)


def _pipeline_lines(config: Any, resolved, dtype: torch.dtype, tp_size: int, ep_size: int, pp_size: int,
                    schedule: str) -> list[str]:
    """Each pp rank's stages (their decoder layers, the embedding on the first, norm and head on the last) and the
    parameter bytes one of its ranks holds: the model cut as `from_pretrained` cuts it on that rank."""
    lines = [f"pipeline: pp_size={pp_size}, schedule {pipeline_parallel.schedule_name(schedule)} "
             f"(the table above is the whole model; each rank holds its stages' part of it)"]
    for pp_rank in range(pp_size):
        model = meta_model(config, dtype=dtype)
        plan, stage = pipeline_parallel.cut_for_rank(model, resolved, pp=pp_size, pp_rank=pp_rank, schedule=schedule)
        _, per_rank, _ = _rows(model, stage.styles, stage.specs, tp_size, dtype.itemsize, ep_size)
        stages = "; ".join(f"stage {s}: " + ("embedding, " if s == 0 else "")
                           + (f"layers {_ranges(list(plan.stage_layers[s]))}" if plan.stage_layers[s] else "no layer")
                           + (", norm, head" if s == plan.n_stages - 1 else "") for s in plan.stages)
        lines.append(f"  pp rank {pp_rank}: {stages}; parameter bytes per rank {_size(per_rank)}")
    return lines + [""]


def _context_lines(config: Any, tp_size: int, cp_size: int, itemsize: int) -> list[str]:
    """What cp_size splits, and its collectives per attention layer (parallel/context_parallel.py)."""
    if cp_size == 1:
        return []
    # K and V of one token, per rank
    kv_bytes = max(1, contract.kv_heads(config) // tp_size) * sum(contract.key_value_head_dims(config)) * itemsize
    return [f"context parallelism: cp_size={cp_size}: each rank computes seq / {cp_size} tokens (chunks i and "
            f"{2 * cp_size - 1}-i of {2 * cp_size}; seq_len a multiple of {2 * cp_size}); per attention layer one K/V "
            f"all-gather forward and one dK/dV reduce-scatter backward over the cp group, {kv_bytes} bytes per "
            f"token of this rank's share each"]


def _head_lines(config: Any, tp_size: int) -> list[str]:
    heads = config.num_attention_heads
    n_kv = contract.kv_heads(config)
    try:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    except Exception:  # noqa: BLE001 - transformers' per-layer configs (Gemma 4) refuse a global read of it
        head_dim = "per layer"
    out = [f"attention: {heads} query heads, {n_kv} KV heads, head_dim {head_dim}; "
           f"vocab_size {config.vocab_size}, intermediate_size {getattr(config, 'intermediate_size', None)}"]
    if heads % tp_size == 0 and (n_kv % tp_size == 0 or tp_size % n_kv == 0):
        out.append(f"per rank: {heads // tp_size} query head(s), {max(n_kv // tp_size, 1)} KV head(s)")
    replicas = kv_replicas(config, tp_size)
    if replicas > 1:
        out.append(f"KV heads replicated: tp_size={tp_size} > num_key_value_heads={n_kv}, so each KV head is held by "
                   f"{replicas} consecutive ranks (rank r holds KV head r // {replicas})")
    return out


def _expert_lines(model: torch.nn.Module, resolved, tp_size: int, itemsize: int, ep_size: int) -> list[str]:
    """Experts per rank, their bytes per rank, and the collectives that move their tokens (MoE models only)."""
    config = model.config
    layers = [name for name, style in resolved.styles.items() if style.startswith("expert_")]
    # tptrain's MoE configs say which layers are MoE; a transformers config (the transformers backend) need not
    if not getattr(config, "num_experts", None) or not any(getattr(config, "layer_is_moe", None) or ()):
        return []
    moe_layers, experts, k = sum(config.layer_is_moe), config.num_experts, config.num_experts_per_tok
    params = dict(model.named_parameters())
    total = sum(p.numel() for n, p in params.items() if ".experts." in n) * itemsize
    local = sum(math.prod(resolved.specs.get(n, ShardSpec()).local_shape(tuple(p.shape), tp_size, ep_size))
                for n, p in params.items() if ".experts." in n) * itemsize
    style = resolved.styles.get(layers[0]) if layers else "replicated"
    if style == "expert_parallel":
        style = "expert_parallel_all_to_all" if all_to_all_wins(tp_size, k) else "expert_parallel_all_reduce"
    if ep_size > 1 and experts % ep_size == 0:
        held = experts // ep_size
        where = (f"{held} expert(s) per rank (ep rank e holds experts e*{held} .. e*{held}+{held - 1}), each split "
                 f"1/{tp_size} along moe_intermediate_size")
        style = "expert_tensor_parallel over an ep axis"
    elif style.startswith("expert_parallel") and experts % tp_size == 0:
        held = experts // tp_size
        where = f"{held} whole expert(s) per rank (rank r holds experts r*{held} .. r*{held}+{held - 1})"
    elif style == "expert_tensor_parallel":
        where = f"all {experts} experts per rank, each split 1/{tp_size} along moe_intermediate_size"
    else:
        where = f"{experts} experts per rank"
    moves = {"expert_parallel_all_to_all": "per MoE layer: forward 3 all-to-alls (counts, rows out, results back) "
                                           "+ 1 all-gather of the token shares; backward 2 all-to-alls + 2 "
                                           "all-gathers (token share, routing weights)",
             "expert_tensor_parallel": "per MoE layer: the partial outputs summed by the layer's one all-reduce "
                                       "(+ 1 (tokens, top_k) all-reduce in backward for the router)",
             "expert_parallel_all_reduce": "per MoE layer: no token moves; partial outputs summed by the layer's "
                                           "one all-reduce (+ 1 (tokens, top_k) all-reduce in backward)",
             "expert_tensor_parallel over an ep axis": (
                 f"per MoE layer: forward 3 all-to-alls over the {ep_size} ep ranks (counts, rows out, results "
                 f"back), partial outputs summed by the layer's one tp all-reduce; backward 2 all-to-alls (+ 1 "
                 f"(tokens, top_k) tp all-reduce for the router)")}
    return [f"experts: {moe_layers} MoE layer(s) x {experts} experts, top-{k}, style {style}: {where}",
            f"expert bytes per rank: {_size(local)} of {_size(total)}",
            f"dispatch: {moves.get(style, 'replicated experts: no communication')}"]


def _rows(model: torch.nn.Module, resolved: Mapping[str, str], specs: Mapping[str, ShardSpec], tp_size: int,
          itemsize: int, ep_size: int = 1) -> tuple[list[tuple[str, str, str, str, str, str]], int, int]:
    """One row per parameter, identical decoder layers merged into one `layers.[0-N]` row."""
    seen: dict[int, str] = {}
    groups: dict[tuple, list[int]] = {}  # (generic module, style, pname, shapes, note) -> layer indices
    per_rank = total = 0
    for full, p in model.named_parameters(remove_duplicate=False):
        module, _, pname = full.rpartition(".")
        spec = specs.get(full, ShardSpec())
        shape = tuple(p.shape)
        local = spec.local_shape(shape, tp_size, ep_size)
        if id(p) in seen:
            note = f"tied to {seen[id(p)]}"
        else:
            seen[id(p)] = full
            total += p.numel() * itemsize
            per_rank += math.prod(local) * itemsize
            note = _split_note(spec, shape, tp_size)
        style = resolved.get(module, "replicated")  # no rule: the whole tensor on every rank
        match = _LAYER_INDEX.search(module)
        generic = _LAYER_INDEX.sub(".{}.", module, count=1) if match else module
        key = (generic, style, pname, str(shape), str(local), note)
        groups.setdefault(key, []).append(int(match.group(1)) if match else -1)
    rows = [(generic.format(f"[{_ranges(idx)}]") if "{}" in generic else generic, style, pname, shape, local, note)
            for (generic, style, pname, shape, local, note), idx in groups.items()]
    return rows, per_rank, total


def _split_note(spec: ShardSpec, shape: tuple[int, ...], tp_size: int) -> str:
    if spec.dim is None:
        return "whole on every rank" + ("; gradient all-reduced over TP" if spec.partial_grad else "")
    if spec.segments:  # each fused segment split on its own: its rows per rank, and KV replicas
        return f"fused along dim {spec.dim}, each segment split: " + " + ".join(
            f"{size}/{part.num_chunks(tp_size)}" + (f" (each chunk on {part.replicas} ranks)" if part.replicas > 1 else "")
            + ("" if size % part.num_chunks(tp_size) == 0 else "  <-- not divisible")
            for _, size, part in spec.parts())
    chunks = spec.num_chunks(tp_size)
    note = f"dim {spec.dim} split in {chunks}"
    if spec.replicas > 1:
        note += f", each chunk on {spec.replicas} ranks"
    if shape[spec.dim] % chunks:
        note += f"  <-- {shape[spec.dim]} is not divisible by {chunks}"
    return note


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    header = ("module", "style", "param", "global shape", "shape per rank", "layout")
    cells = [header, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header) - 1)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]) for r in cells]


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None]):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(out)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
