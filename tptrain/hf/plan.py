"""transformers' tensor-parallel plan in tptrain's spelling, and the facts tptrain's engine reads from a model.

transformers names its styles by the layouts of a DTensor (`colwise_rep`: column-parallel, output gathered);
tptrain's are the same splits with tptrain's collectives. A style with no tptrain counterpart stays under its
transformers name, so `check_plan` reports it as an unknown style, naming the rule.

Nothing here imports transformers: it reads the plan and the modules as data.
"""
from __future__ import annotations

from torch import nn

from tptrain.parallel import contract
from tptrain.parallel.styles import canonical_style

# transformers style -> tptrain style (None: no rule, the weight is whole on every rank).
STYLE_NAMES: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_gather_output",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_rep": "rowwise",  # tptrain's rowwise already ends in the all-reduce that replicates the output
    "embedding_rowwise": "embedding_rowwise",
    "packed_colwise": "packed_colwise",  # tptrain's alias of fused_colwise
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "replicate": None,
}


def translate_plan(plan: dict[str, str] | None) -> dict[str, str]:
    """{glob: tptrain style}; an unmapped transformers style keeps its name (reported by check_plan)."""
    out = {}
    for glob, style in (plan or {}).items():
        name = STYLE_NAMES.get(style, style)
        if name is not None:
            out[glob] = name
    return out


def parameter_rules(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{glob: problem} for the rules of `plan` (full names) that name a parameter, not a module: transformers'
    per-parameter styles (stacked MoE experts, attention sinks). tptrain's styles apply to modules."""
    modules = dict(model.named_modules())
    out = {}
    for glob, style in plan.items():
        parent, _, leaf = glob.rpartition(".")
        owners = [m for n, m in modules.items() if n and _matches(parent, n)]
        if owners and not any(_matches(glob, n) for n in modules) and any(leaf in dict(m.named_parameters(
                recurse=False)) for m in owners):
            out[glob] = (f"tp_plan rule {glob!r} ({style!r}) names a parameter, not a module: a transformers "
                         f"per-parameter style (stacked MoE experts, attention sinks) that tptrain's transformers "
                         f"backend does not have; use tp_size=1, or a model type tptrain implements natively")
    return out


def _matches(glob: str, name: str) -> bool:
    parts, names = glob.split("."), name.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def declare_tp_facts(model: nn.Module, plan: dict[str, str], config) -> None:
    """Set, on transformers' modules, what tptrain's plan check and engine read as data:

    * `tp_pairs = {consumer: (producers, ...)}` on every module whose children the model's own plan splits
      column- then row-wise (attention: q/k/v -> o_proj; MLP: gate/up -> down);
    * `tp_kv_projections` on attention modules (those with `head_dim` and `num_key_value_groups`): the
      column-parallel children whose rows are the KV heads, replicated when tp_size > num_key_value_heads;
      `tp_query_projection`: the one whose rows are the query heads (the per-rank head count comes from it).
    `plan` is in full module names (tptrain spelling), before user overrides, so overrides are checked against it.
    """
    styles: dict[str, str] = {}
    names = [n for n, _ in model.named_modules() if n]
    for glob, style in plan.items():
        styles.update({n: style for n in names if _matches(glob, n)})
    heads = config.num_attention_heads
    n_kv = contract.kv_heads(config)
    for owner, module in model.named_modules():
        children = {n: c for n, c in module.named_children() if f"{owner}.{n}" in styles}
        cols = tuple(n for n in children if canonical_style(styles[f"{owner}.{n}"]) in ("colwise", "fused_colwise"))
        rows = [n for n in children if styles[f"{owner}.{n}"] == "rowwise"]
        if cols and rows:
            module.tp_pairs = {row: cols for row in rows}
        head_dim = getattr(module, "head_dim", None)
        if cols and head_dim and hasattr(module, "num_key_value_groups"):
            linear = {n: children[n] for n in cols if isinstance(children[n], nn.Linear)}
            module.tp_kv_projections = tuple(n for n, c in linear.items() if c.out_features == n_kv * head_dim)
            module.tp_query_projection = next((n for n, c in linear.items() if c.out_features == heads * head_dim),
                                              None)


def unplanned_parameters(model: nn.Module, styles: dict[str, str]) -> list[str]:
    """Problems: modules with parameters inside a split region (under a module with `tp_pairs`) that the plan
    gives no rule. Under TP they see this rank's share of the features with a whole weight, which
    transformers' plan does not say how to handle (a per-head norm needs 'replicated_with_grad_allreduce'; a
    norm over all heads cannot run on a shard)."""
    problems = []
    for owner, module in model.named_modules():
        pairs = contract.pairs(module)
        if not pairs:
            continue
        known = {*pairs, *(p for producers in pairs.values() for p in producers)}
        for name, sub in module.named_modules():
            full = f"{owner}.{name}"
            if not name or name.split(".")[0] in known or full in styles:
                continue
            params = [p for p, _ in sub.named_parameters(recurse=False)]
            if params:
                problems.append(f"{full} ({type(sub).__name__}, parameters {params}) sits between the split "
                                f"projections of {owner} but the plan has no rule for it, so it would see one "
                                f"rank's share of the features with a whole weight; give it a tp_plan rule "
                                f"('replicated_with_grad_allreduce' if it acts on each head alone) or use tp_size=1")
    return problems
