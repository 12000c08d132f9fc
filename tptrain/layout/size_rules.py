"""The rows of the rule table about the sizes as given (checked when they are resolved against the world size), in
the order they are checked. Each function returns the refusal's message, or None."""
from __future__ import annotations

import math

from tptrain.layout.case import Case, Rule, rule
from tptrain.layout.dims import SIZES

ROWS: list[Rule] = []


def _described(c: Case) -> str:
    return c.spelling.described or c.spelling.owner


@rule(ROWS, "device_map_pp", between=("pp", "device_map"), needs=("asked",),
      when="from_pretrained(device_map=...) with pp_size > 1",
      reason="pipeline parallelism places each stage on its own rank (device from LOCAL_RANK)", fix="drop device_map")
def _device_map_pp(c: Case, r: Rule) -> str | None:
    if c.features.device_map and c.asked.pp_size > 1:
        return f"device_map cannot be combined with DistributedConfig(pp_size={c.asked.pp_size}): {r.reason}; {r.fix}"


@rule(ROWS, "device_map", between=("tp", "device_map"), needs=("asked",),
      when="from_pretrained(device_map=...) with a distributed_config",
      reason="each rank's device comes from LOCAL_RANK and every rank holds every layer (or a slice of it)",
      fix="drop device_map (or drop distributed_config for a single-device load)")
def _device_map(c: Case, r: Rule) -> str | None:
    if c.features.device_map:
        split = "context" if (c.asked.cp_size or 1) > 1 else "tensor"
        return (f"device_map cannot be combined with distributed_config: under {split} parallelism each rank's device "
                f"comes from LOCAL_RANK and every rank holds every layer (or a slice of it). Drop device_map (or drop "
                f"distributed_config for a single-device load).")


@rule(ROWS, "model_layout", needs=("model_axes", "config_axes"),
      when="a ParallelismConfig size (tp, ep, cp, pp, pp_schedule) other than the model's",
      reason="a model's tp, ep, cp and pipeline stages are fixed when it is loaded (its weights are sliced then)",
      fix="load the model with that DistributedConfig size, or leave the ParallelismConfig field None (the model's)")
def _model_layout(c: Case, r: Rule) -> str | None:
    fixed = dict(c.model_axes)
    for name, given in c.config_axes:
        if given is not None and given != fixed.get(name, given):
            return (f"ParallelismConfig({name}={given!r}) disagrees with the model, which was laid out with "
                    f"{name}={fixed[name]!r} when it was loaded ({r.reason}); load the model "
                    f"with DistributedConfig({name}={given!r}), or leave ParallelismConfig.{name} None (it then takes "
                    f"the model's)")


@rule(ROWS, "positive", needs=("asked",), when="a size that is not an int >= 1", reason="a size counts ranks",
      fix="pass a positive int (or None: resolved from the world size)")
def _positive(c: Case, r: Rule) -> str | None:
    for name in SIZES:
        value = getattr(c.asked, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            if c.spelling.cli:
                return f"{c.spelling.name(name)} must be a positive integer, got {value}"
            return f"{c.spelling.name(name)} must be a positive int, got {value!r}"


@rule(ROWS, "pp_divides", needs=("asked", "world"), when="pp_size does not divide the world size",
      reason="each pipeline stage gets world_size / pp_size ranks",
      fix="launch a multiple of pp_size processes, or pick a pp_size that divides the world size")
def _pp_divides(c: Case, r: Rule) -> str | None:
    pp, world = c.asked.pp_size, c.world
    if world % pp == 0:
        return None
    if c.spelling.cli:
        return (f"{c.spelling.processes} is not a multiple of --pp-size {pp} (each of the {pp} pipeline stages gets "
                f"1/{pp} of the processes); launch a multiple of {pp} processes or pick a --pp-size that divides "
                f"{world}")
    return (f"{_described(c)}: pp_size={pp} must divide the world size {world} (each of the {pp} pipeline stages "
            f"gets world_size / pp_size ranks); launch a multiple of {pp} processes or pick a pp_size that divides "
            f"{world}")


@rule(ROWS, "world", needs=("asked", "world"), when="the sizes do not multiply to the world size",
      reason="every rank holds one place of the layout", fix="launch their product, or change the sizes")
def _world(c: Case, r: Rule) -> str | None:
    if c.asked.solve(c.world) is not None:
        return None
    a, world = c.asked, c.world // c.asked.pp_size
    if c.spelling.cli:
        flags = [f"--tp-size {a.tp_size}"] + [f"--{n.replace('_', '-')} {getattr(a, n)}" for n in ("cp_size", "pp_size")
                                                if getattr(a, n) > 1]
        unit = a.tp_size * a.cp_size * a.pp_size
        return (f"{c.spelling.processes} is not a multiple of {' x '.join(flags)}; each tensor-parallel group needs "
                f"--tp-size processes{', each context-parallel group --cp-size of them' * (a.cp_size > 1)}"
                f"{', each pipeline stage 1/--pp-size of them' * (a.pp_size > 1)} (use {unit} or a multiple)")
    sizes = {"tp_size": a.tp_size, "dp_shard_size": a.dp_shard_size, "dp_replicate_size": a.dp_replicate_size}
    if (a.cp_size or 1) > 1:  # named only when used, so the messages without cp read as before
        sizes["cp_size"] = a.cp_size
    name = c.spelling.described or (f"{c.spelling.owner}(" + ", ".join(f"{k}={v or 'auto'}" for k, v in sizes.items())
                                    + ")")
    per_stage = f" per pipeline stage (pp_size={a.pp_size})" if a.pp_size > 1 else ""
    given = {k: v for k, v in sizes.items() if v is not None}
    product = math.prod(given.values())
    if len(given) == len(sizes):
        return (f"{name} needs {' x '.join(map(str, given.values()))} = {product} process{'es' * (product > 1)} "
                f"({' x '.join(k[:-5] for k in sizes)}), but the world size is {world}{per_stage}; launch {product} "
                f"(`torchrun --nproc-per-node {product}`), or change the sizes so that their product is {world}")
    auto = [k for k in sizes if k not in given]
    terms = " x ".join(f"{k}={v}" for k, v in given.items()) + (f" = {product}" if len(given) > 1 else "")
    return (f"{name} needs a world size that is a multiple of {terms} ({' and '.join(auto)} "
            f"take{'s' * (len(auto) == 1)} the rest), but the world size is {world}{per_stage}; launch a multiple of "
            f"{product} processes, or change the sizes")


@rule(ROWS, "ep_cp", needs=("asked",), when="cp_size > 1 with an ep_size not a multiple of it",
      reason="ep is folded over dp_shard x cp with each ep group holding whole cp groups (the cp ranks of a sequence "
             "send their tokens to the same experts' owners)",
      fix="an ep_size that is a multiple of cp_size (or ep_size=1)")
def _ep_cp(c: Case, r: Rule) -> str | None:
    cp, ep = c.asked.cp_size or 1, c.asked.ep_size or 1
    if cp > 1 and ep > 1 and ep % cp:
        return (f"ep_size={ep} (--ep-size) is not a multiple of cp_size={cp} (--cp-size): {r.reason}; use an ep_size "
                f"that is a multiple of {cp} (e.g. {cp} or {2 * cp}), or ep_size=1")


@rule(ROWS, "ep_twice", between=("ep", "ep_tp"), needs=("asked",),
      when="ep_size > 1 with enable_expert_parallel=True",
      reason="both split the experts by expert (over an ep axis of data-parallel ranks, or over the TP group)",
      fix="pass one of them")
def _ep_twice(c: Case, r: Rule) -> str | None:
    ep = c.asked.ep_size or 1
    if ep > 1 and c.features.expert_parallel:
        return (f"{_described(c)}: ep_size={ep} and enable_expert_parallel=True both split the experts by expert "
                f"(over an ep axis of data-parallel ranks, or over the TP group, ep_size = tp_size); pass one of them")


@rule(ROWS, "ep_divides", needs=("asked", "world"), when="ep_size does not divide dp_shard (x cp)",
      reason="the experts' owners are the ranks ep is folded over",
      fix="launch a multiple of ep x tp x dp_replicate processes, or an ep_size that divides dp_shard (x cp)")
def _ep_divides(c: Case, r: Rule) -> str | None:
    dims, ep = c.asked.solve(c.world), c.asked.ep_size or 1
    if dims.ep_pool % ep == 0:
        return None
    shard, rep, tp, cp = dims.dp_shard, dims.dp_replicate, dims.tp, dims.cp
    if cp > 1:
        return (f"{_described(c)}: ep_size={ep} must divide dp_shard x cp = {shard} x {cp} (world size "
                f"{c.world // dims.pp} = dp_replicate {rep} x dp_shard {shard} x cp {cp} x tp {tp}): the experts' owners "
                f"are the dp_shard x cp ranks; launch a multiple of {ep * tp * rep} processes (ep x tp x "
                f"dp_replicate), or use an ep_size that divides {shard * cp}")
    return (f"{_described(c)}: ep_size={ep} must divide the data-parallel shard degree dp_shard={shard} (world size "
            f"{c.world // dims.pp} = dp_replicate {rep} x dp_shard {shard} x tp {tp}): the experts' owners are "
            f"dp_shard ranks; launch a multiple of {ep * tp * rep} processes (ep x tp x dp_replicate), or use an "
            f"ep_size that divides {shard}")
