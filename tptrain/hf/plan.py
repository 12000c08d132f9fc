"""transformers' tensor-parallel plan in tptrain's spelling, and the facts tptrain's engine reads from a model.

transformers names its styles by the layouts of a DTensor (`colwise_rep`: column-parallel, output gathered);
tptrain's are the same splits with tptrain's collectives. A style with no tptrain counterpart stays under its
transformers name, so `check_plan` reports it as an unknown style, naming the rule.

Nothing here imports transformers: it reads the plan and the modules as data.
"""
from __future__ import annotations

from torch import nn

from tptrain.parallel import contract
from tptrain.parallel.styles import ShardSpec, canonical_style

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
    "rowwise_split_input": "rowwise_split_input",
    "local_params": "local_params",
    "moe_tp_experts": "moe_tp_experts",
    "all_reduce": "all_reduce",
    "moe_identity_expert": "moe_identity_expert",
    "mla_kv_a_proj": "mla_kv_a_proj",
    "ep_dispatch_experts": "ep_dispatch_experts",  # tptrain.hf.styles
    "grouped_gemm": None,  # the stacked weights of ep_dispatch_experts: its own split (dim 0)
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


# The owners' styles under which transformers' per-parameter rules apply (the owner's forward reads its pieces).
PARAMETER_OWNER_STYLES = ("local_params", "moe_tp_experts", "all_reduce")


def parameter_spec(style: str, name: str, ndim: int) -> ShardSpec | None:
    """tptrain's ShardSpec of a transformers per-parameter rule on a parameter of `ndim` dims (None: no such rule).
    As transformers' styles shard a parameter: colwise Shard(ndim-2) (the output rows of a linear or of each stacked
    expert), rowwise Shard(-1) (a bias whole), packed_colwise / packed_rowwise the same dims with each of the two
    packed halves (gate, up) split alone (its `_StridedShard(split_factor=2)`)."""
    if style == "colwise":
        return ShardSpec(max(ndim - 2, 0))
    if style == "rowwise":
        return ShardSpec(None) if ndim == 1 else ShardSpec(ndim - 1)
    if style in ("packed_colwise", "packed_rowwise"):
        if ndim == 1:
            return ShardSpec(0) if style == "packed_colwise" else ShardSpec(None)
        return ShardSpec(ndim - 2 if style == "packed_colwise" else ndim - 1, segments=((0, 1), (0, 1)))
    return None


def packed_like_stored(spec: ShardSpec, shape: tuple[int, ...], interleaved_dim: int | None) -> ShardSpec:
    """The split a plain 'colwise' rule along `interleaved_dim` needs on a [gate; up] parameter its forward halves:
    each half split alone (a packed split). transformers' TP gives it that way when the file stores the rows
    interleaved (it cuts the stored tensor: Inkling 2); stored as [gate; up] (Inkling), its cut would give rank 0
    only gate rows. Any other spec unchanged."""
    if interleaved_dim is None or spec.dim != interleaved_dim or spec.segments or spec.replicas > 1:
        return spec
    half = shape[spec.dim] // 2
    return ShardSpec(spec.dim, segments=((half, 1), (half, 1)))


def parameter_rules(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, dict[str, ShardSpec]], dict[str, str]]:
    """The rules of `plan` (full names, transformers' spelling) that name a parameter, not a module: transformers'
    per-parameter styles (stacked MoE experts, attention sinks). Returns ({owner module: {parameter: ShardSpec}},
    {glob: problem}): a rule applies when its owner's own rule is 'local_params', 'moe_tp_experts' or 'all_reduce' (whose
    forward reads the pieces as they are); any other is a problem naming it."""
    modules = dict(model.named_modules())
    specs: dict[str, dict[str, ShardSpec]] = {}
    problems = {}
    for glob, style in plan.items():
        parent, _, leaf = glob.rpartition(".")
        owners = {n: m for n, m in modules.items() if n and _matches(parent, n)}
        if not owners or any(_matches(glob, n) for n in modules) or not any(
                leaf in dict(m.named_parameters(recurse=False)) for m in owners.values()):
            continue
        owner_style = STYLE_NAMES.get(plan.get(parent, ""), plan.get(parent))
        for name, module in owners.items():
            param = dict(module.named_parameters(recurse=False)).get(leaf)
            spec = None if param is None else parameter_spec(style, leaf, param.dim())
            if spec is not None and spec.segments:  # each packed half: half the rows of the split dim
                half = param.shape[spec.dim] // 2
                spec = ShardSpec(spec.dim, segments=((half, 1), (half, 1)))
            if spec is not None and owner_style in PARAMETER_OWNER_STYLES:
                specs.setdefault(name, {})[leaf] = spec
            elif param is not None:
                problems[glob] = (f"tp_plan rule {glob!r} ({style!r}) names a parameter, not a module: a transformers "
                                  f"per-parameter style tptrain applies only under an owner ruled "
                                  f"{' or '.join(map(repr, PARAMETER_OWNER_STYLES))} and only for colwise, rowwise, "
                                  f"packed_colwise, packed_rowwise; {parent!r} has "
                                  f"{plan.get(parent, 'no rule')!r}; use tp_size=1 or fix the plan")
    return specs, problems


def vocab_parallel_embedding(embed: nn.Module, name: str, plan: dict[str, str] | None) -> bool:
    """Whether the input embedding `embed` (`name` under the base model) is made vocab-parallel, as tptrain's own
    plans do: an nn.Embedding (a subclass scaling its rows too, Gemma's) the plan gives no rule of its own. One the
    plan keeps whole ('replicate', Inkling 2's), or a subclass with submodules of its own (Inkling's norm over the
    looked-up row, which a vocabulary shard's partial row cannot go through), stays whole on every rank."""
    if not isinstance(embed, nn.Embedding) or any(True for _ in embed.children()):
        return False
    return not any(_matches(glob, name) for glob in (plan or {}))


def module_rules(model: nn.Module, plan: dict[str, str], prefix: str) -> dict[str, str]:
    """The rules of `plan` (under the base model `prefix`) that name at least one module of `model`."""
    names = [n for n, _ in model.named_modules() if n]
    return {g: s for g, s in plan.items() if any(_matches(f"{prefix}.{g}", n) for n in names)}


def base_prefix(hf_model: nn.Module) -> str:
    """The attribute holding the base model (Llama 4's text model says "language_model" but holds it as `model`):
    `base_model_prefix` if it names a child, else the child holding the input embedding."""
    prefix = hf_model.base_model_prefix
    if isinstance(getattr(hf_model, prefix, None), nn.Module):
        return prefix
    embed = hf_model.get_input_embeddings()
    return next(n for n, c in hf_model.named_children() if any(m is embed for m in c.modules()))


def _matches(glob: str, name: str) -> bool:
    parts, names = glob.split("."), name.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def declare_tp_facts(model: nn.Module, plan: dict[str, str], config, *, config_of=None) -> None:
    """Set, on transformers' modules, what tptrain's plan check and engine read as data:

    * `tp_pairs = {consumer: (producers, ...)}` on every module whose children the model's own plan splits
      column- then row-wise (attention: q/k/v -> o_proj; MLP: gate/up -> down);
    * `tp_kv_projections` on attention modules (those with `head_dim` and `num_key_value_groups`): the
      column-parallel children whose rows are the KV heads (x head_dim, or x the module's v_head_dim), replicated
      when tp_size > num_key_value_heads;
      `tp_query_projection`: the one whose rows are the query heads (the per-rank head count comes from it);
    * `tp_replicated_tail` on 'mla_kv_a_proj' modules: the config's qk_rope_head_dim;
    * on transformers' experts modules (`@use_experts_implementation`'s, with `_is_expert_parallel`):
      `tp_routed_experts` (forward(x, expert_ids, weights), what an ep axis splits: `contract.routed_experts`) and
      `tp_top_k`, the config's num_experts_per_tok, which 'ep_dispatch_experts' chooses its dispatch by.
    `plan` is in full module names (tptrain spelling), before user overrides, so overrides are checked against it.
    `config_of(module name)`: the config a module's facts come from where it is not `config` (a vision-language
    model's text decoder and vision tower); the attention modules then carry their counts as `tp_heads`.
    """
    styles = resolve_names(model, plan)
    for name, style in styles.items():
        rope = getattr(config_of(name) if config_of else config, "qk_rope_head_dim", None)  # MLA's shared RoPE key
        if style == "mla_kv_a_proj" and rope:
            model.get_submodule(name).tp_replicated_tail = rope
    for owner, module in model.named_modules():
        own = config_of(owner) if config_of else config
        heads, n_kv = contract.attention_heads(own), contract.kv_heads(own)
        top_k = getattr(own, "num_experts_per_tok", None)
        if hasattr(module, "_is_expert_parallel"):
            module.tp_routed_experts, module.tp_top_k = True, top_k if isinstance(top_k, int) else None
        children = {n: c for n, c in module.named_children() if f"{owner}.{n}" in styles}
        cols = tuple(n for n in children if canonical_style(styles[f"{owner}.{n}"]) in ("colwise", "fused_colwise"))
        rows = [n for n in children if styles[f"{owner}.{n}"] == "rowwise"]
        if cols and rows:
            module.tp_pairs = {row: cols for row in rows}
        head_dim = getattr(module, "head_dim", None)
        if cols and head_dim and heads and hasattr(module, "num_key_value_groups"):
            linear = {n: children[n] for n in cols if isinstance(children[n], nn.Linear)}
            # K rows are KV heads x head_dim; V rows may be x v_head_dim (MiMo-V2-Flash's 128 with 192-wide keys).
            # A layer with other KV heads than the config's (MiMo's sliding layers: twice as many) is split plainly.
            widths = {n_kv * head_dim, n_kv * (getattr(module, "v_head_dim", None) or head_dim)}
            groups = module.num_key_value_groups
            own_kv = heads // groups if isinstance(groups, int) and groups > 0 else n_kv
            module.tp_kv_projections = tuple(n for n, c in linear.items() if c.out_features in widths) \
                if own_kv == n_kv else ()
            module.tp_query_projection = next((n for n, c in linear.items() if c.out_features == heads * head_dim),
                                              None)
            if config_of is not None:
                module.tp_heads = (heads, n_kv)


def resolve_names(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module name: style} of `plan` (full-name globs; later rules win)."""
    names = [n for n, _ in model.named_modules() if n]
    styles: dict[str, str] = {}
    for glob, style in plan.items():
        styles.update({n: style for n in names if _matches(glob, n)})
    return styles


def unplanned_modules(model: nn.Module, styles: dict[str, str]) -> list[str]:
    """Modules with parameters inside a split region (under a module with `tp_pairs`) that the plan gives no rule."""
    out = []
    for owner, module in model.named_modules():
        pairs = contract.pairs(module)
        if not pairs:
            continue
        known = {*pairs, *(p for producers in pairs.values() for p in producers)}
        if not any(f"{owner}.{n}" in styles for n in known):  # not split (an optional plan left out): no region
            continue
        for name, sub in module.named_modules():
            full = f"{owner}.{name}"
            if name and name.split(".")[0] not in known and full not in styles and any(
                    True for _ in sub.parameters(recurse=False)):
                out.append(full)
    return out


def unplanned_parameters(model: nn.Module, styles: dict[str, str], whole: set[str] = frozenset()) -> list[str]:
    """Problems: the unplanned modules inside a split region, except those known to read only whole activations
    (`whole`, from hf/probe.py). Under TP they may see this rank's share of the features with a whole weight,
    which transformers' plan does not say how to handle (a per-head norm needs 'replicated_with_grad_allreduce';
    a norm over all heads cannot run on a shard)."""
    problems = []
    for full in unplanned_modules(model, styles):
        if full in whole:
            continue
        sub = model.get_submodule(full)
        params = [p for p, _ in sub.named_parameters(recurse=False)]
        owner = next(o for o in _parents(full) if contract.pairs(model.get_submodule(o)))
        problems.append(f"{full} ({type(sub).__name__}, parameters {params}) sits between the split "
                        f"projections of {owner} but the plan has no rule for it, so it would see one "
                        f"rank's share of the features with a whole weight; give it a tp_plan rule "
                        f"('replicated_with_grad_allreduce' if it acts on each head alone) or use tp_size=1")
    return problems


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
