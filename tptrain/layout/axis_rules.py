"""The rows of the rule table about which axes and features compose (with each other, and with what a model is), in
the order they are checked. Each function returns the refusal's message, or None."""
from __future__ import annotations

from tptrain.layout import schedules
from tptrain.layout.case import Case, Rule, rule

ROWS: list[Rule] = []
MODEL = ("dims", "facts")


def _cannot_cp(c: Case, detail: str) -> str:
    return f"{c.facts.name} ({c.facts.model_type}) cannot run with cp_size={c.dims.cp}: {detail}"


def _first_of(modules: list[tuple[str, str]]) -> str:
    """"model.layers.0.mixer (MambaMixer and 3 more)": the first (name, class) of `modules` and how many follow."""
    (name, cls), more = modules[0], len(modules) - 1
    return f"{name} ({cls}{f' and {more} more' if more else ''})"


def _schedule(c: Case) -> str:
    return schedules.canonical(c.features.pp_schedule) or c.features.pp_schedule


@rule(ROWS, "pp_schedule", needs=("features",), when="a pp_schedule torch.distributed.pipelining does not have",
      reason="the stages run one of torch's schedules", fix="use one of " + ", ".join(schedules.SCHEDULES))
def _pp_schedule(c: Case, r: Rule) -> str | None:
    if schedules.canonical(c.features.pp_schedule) is None:
        return (f"unknown pipeline schedule {c.features.pp_schedule!r}; the valid ones are "
                f"{', '.join(schedules.SCHEDULES)} (torch.distributed.pipelining's names)")


@rule(ROWS, "pp_uncuttable", between=("pp",), needs=MODEL,
      when="pp_size > 1 on a model that cannot be cut into stages (it says why, or declares no pipeline parts)",
      reason="a stage holds consecutive decoder layers and passes only hidden states to the next",
      fix="load it with pp_size=1")
def _pp_uncuttable(c: Case, r: Rule) -> str | None:
    if c.dims.pp > 1 and c.facts.num_layers is None:
        why = c.facts.pp_refusal or "it does not declare pp_layers / pp_first / pp_last / pipeline_forward"
        return (f"{c.facts.name} ({c.facts.model_type}) cannot be cut into pipeline stages (pp_size={c.dims.pp}): "
                f"{why}; {r.fix}")


@rule(ROWS, "pp_stages", needs=("dims", "facts.num_layers"), when="more pipeline stages than decoder layers",
      reason="every stage needs at least one layer", fix="a pp_size (x stages per rank) <= the layers")
def _pp_stages(c: Case, r: Rule) -> str | None:
    n_stages, layers = c.dims.pp * schedules.stages_per_rank(_schedule(c)), c.facts.num_layers
    if c.dims.pp > 1 and n_stages > layers:
        return (f"{n_stages} pipeline stages for a model of {layers} decoder layers: every stage needs at least one "
                f"layer; use pp_size (x stages per rank) <= {layers}")


@rule(ROWS, "pp_layers", needs=("dims", "facts.num_layers", "features.pp_layers"),
      when="pp_layers that are not the stages' consecutive layers, each once",
      reason="each stage holds consecutive layers, in order", fix="list every stage's layers, 0..L-1 once each")
def _pp_layers(c: Case, r: Rule) -> str | None:
    n_stages = c.dims.pp * schedules.stages_per_rank(_schedule(c))
    layers, given = c.facts.num_layers, c.features.pp_layers
    if c.dims.pp > 1 and not schedules.valid_layers(given, layers, n_stages):
        given = [list(stage) for stage in given]
        return (f"pp_layers={given} must list {n_stages} stages of consecutive decoder layers covering 0..{layers - 1} "
                f"once each, in order (e.g. {schedules.even_split(layers, n_stages)})")


@rule(ROWS, "cp_sequence_mixer", between=("cp", "sequence_mixers"), needs=MODEL,
      when="cp_size > 1 on a model with layers mixing tokens outside attention that cannot run on the whole "
           "sequence (an indexer or compressor of the keys; a mixer holding attention)",
      reason="context parallelism splits every sequence and gathers only the attention's keys and values; a "
             "recurrence or short convolution runs on the whole sequence gathered (contract cp_whole_sequence), "
             "but what picks or compresses the keys must see the keys the attention sees",
      fix="drop cp_size for this model type")
def _cp_sequence_mixer(c: Case, r: Rule) -> str | None:
    mixers = c.facts.sequence_mixers
    if c.dims.cp == 1 or not mixers:
        return None
    return _cannot_cp(c, f"{_first_of(mixers)} mixes tokens outside attention (an indexer or compressor "
                         f"choosing among all keys, or a mixer holding an attention), which context parallelism "
                         f"cannot split: each cp rank holds a share of every sequence and gathers only the "
                         f"attention's keys and values; {r.fix}")


@rule(ROWS, "cp_attention", between=("cp",), needs=MODEL,
      when="cp_size > 1 on a model with no attention module (nor token mixer run on the whole sequence) it can find",
      reason="context parallelism gathers the keys and values of each attention module (tp_kv_projections)",
      fix="drop cp_size")
def _cp_attention(c: Case, r: Rule) -> str | None:
    if c.dims.cp > 1 and c.facts.attention == 0 and not c.facts.whole_sequence:
        return _cannot_cp(c, f"cp_size found no attention module in {c.facts.name} (none declares tp_kv_projections)")


@rule(ROWS, "cp_attend", between=("cp",), needs=MODEL,
      when="cp_size > 1 on attention without attend(q, k, v, mask)",
      reason="context parallelism gathers the keys and values through the attention's attend",
      fix="drop cp_size for this model type")
def _cp_attend(c: Case, r: Rule) -> str | None:
    lacking = c.facts.without_attend
    if c.dims.cp == 1 or not lacking:
        return None
    how = ("it does not compute attention through transformers' attention interface" if c.facts.backend ==
           "transformers" else "it has no attend(q, k, v, mask)")
    return _cannot_cp(c, f"cp_size cannot split the attention of {_first_of(lacking)}: "
                         f"{how}, which context parallelism gathers the keys and values through; {r.fix}")


@rule(ROWS, "cp_masks", between=("cp",), needs=MODEL,
      when="cp_size > 1 on a base model without attention_masks(...)",
      reason="each cp rank builds its query rows of the whole sequence's masks", fix="drop cp_size for this model")
def _cp_masks(c: Case, r: Rule) -> str | None:
    if c.dims.cp > 1 and c.facts.mask_builder is not None:
        return _cannot_cp(c, f"cp_size needs the base model ({c.facts.mask_builder}) to build its attention masks "
                             f"through attention_masks(...) (parallel/contract.py); {r.fix}")


@rule(ROWS, "sp_refused", between=("sp",), needs=("facts",),
      when="enable_sequence_parallel on a model that says why its sequence cannot be split (a vision-language model)",
      reason="sequence parallelism splits the residual stream's sequence over the TP group from the first decoder "
             "layer on; a model whose sequence is assembled inside its forward cannot hand its layers a shard",
      fix="drop enable_sequence_parallel (--sequence-parallel); activation checkpointing (--gradient-checkpointing) "
          "or a larger tp_size cut activation memory instead")
def _sp_refused(c: Case, r: Rule) -> str | None:
    if c.features.sequence_parallel and c.facts.sp_refusal:
        return (f"{c.facts.name} ({c.facts.model_type}) cannot run with enable_sequence_parallel: "
                f"{c.facts.sp_refusal}; {r.fix}")


@rule(ROWS, "sp_transformers", between=("sp", "transformers_backend"), needs=("facts",),
      when="enable_sequence_parallel on the transformers backend",
      reason="transformers' attention and MLP modules take their shapes from their input (the attention output is "
             "reshaped to the input's sequence length), which sequence parallelism would make a shard of the sequence",
      fix="drop enable_sequence_parallel (--sequence-parallel), or load with backend='native' if tptrain has the type")
def _sp_transformers(c: Case, r: Rule) -> str | None:
    if c.features.sequence_parallel and c.facts.backend == "transformers":
        return (f"sequence parallelism is not supported on the transformers backend ({c.facts.model_type}): {r.reason}; "
                f"{r.fix}")


@rule(ROWS, "ep_dense", between=("ep", "dense_model"), needs=("dims", "facts.experts"),
      when="ep_size > 1 on a model without experts", reason="expert parallelism is for mixture-of-experts models",
      fix="drop ep_size (--ep-size)")
def _ep_dense(c: Case, r: Rule) -> str | None:
    if c.dims.ep > 1 and c.facts.experts == 0:
        return (f"ep_size={c.dims.ep} (--ep-size), but {c.facts.name} ({c.facts.model_type!r}) has no experts to "
                f"split: {r.reason}; {r.fix}")


@rule(ROWS, "expert_parallel_dense", between=("ep_tp", "dense_model"), needs=("facts",),
      when="enable_expert_parallel on a model whose config has no base_model_ep_plan",
      reason="expert parallelism is for mixture-of-experts models", fix="drop enable_expert_parallel (--expert-parallel)")
def _expert_parallel_dense(c: Case, r: Rule) -> str | None:
    if c.features.expert_parallel and not c.facts.ep_plan:
        return (f"enable_expert_parallel=True (--expert-parallel), but {c.facts.name} ({c.facts.model_type!r}) has "
                f"no experts to split: {r.reason}; {r.fix}")


GENERATION = ("dims", "features.generation")


@rule(ROWS, "generate_pp", between=("pp", "generation"), needs=GENERATION,
      when="model.generate on a model cut into pipeline stages (pp_size > 1)",
      reason="a decode step is one token per sequence through every layer: a pipeline would run its stages one "
             "after another for each token, and a rank holds only its stages' KV cache",
      fix="generate from a model loaded with pp_size=1 (e.g. the saved final/ checkpoint)")
def _generate_pp(c: Case, r: Rule) -> str | None:
    if c.dims.pp > 1:
        return f"model.generate cannot run on pipeline stages (pp_size={c.dims.pp}): {r.reason}; {r.fix}"


@rule(ROWS, "generate_cp", between=("cp", "generation"), needs=GENERATION,
      when="model.generate with a KV cache under context parallelism (cp_size > 1)",
      reason="a decode step's one new token per sequence cannot be split over the cp ranks, and a KV cache would "
             "hold every position of a sequence on each rank",
      fix="use_cache=False (each step recomputes the whole sequence, padded to split), or a model loaded with "
          "cp_size=1")
def _generate_cp(c: Case, r: Rule) -> str | None:
    if c.features.generation == "cache" and c.dims.cp > 1:
        return (f"model.generate cannot keep a KV cache under context parallelism (cp_size={c.dims.cp}): "
                f"{r.reason}; {r.fix}")


@rule(ROWS, "generate_sp", between=("sp", "generation"), needs=GENERATION,
      when="model.generate with a KV cache under sequence parallelism (enable_sequence_parallel)",
      reason="a decode step's one new token per sequence cannot be split over the tp ranks",
      fix="use_cache=False (each step recomputes the whole sequence, padded to split), or a model loaded without "
          "enable_sequence_parallel")
def _generate_sp(c: Case, r: Rule) -> str | None:
    if c.features.generation == "cache" and c.features.sequence_parallel and c.dims.tp > 1:
        return (f"model.generate cannot keep a KV cache under sequence parallelism (tp_size={c.dims.tp}): "
                f"{r.reason}; {r.fix}")
