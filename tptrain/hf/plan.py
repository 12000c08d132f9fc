"""transformers' tensor-parallel plan in tptrain's spelling, and the facts tptrain's engine reads from a model.

transformers names its styles by the layouts of a DTensor (`colwise_rep`: column-parallel, output gathered);
tptrain's are the same splits with tptrain's collectives, most under the same names; a style says which other
transformers names it is (`ParallelStyle.transformers_names`). A style with no tptrain counterpart stays under its
transformers name, so `check_plan` reports it as an unknown style, naming the rule.

Nothing here imports transformers: it reads the plan and the modules as data.
"""
from __future__ import annotations

from torch import nn

from tptrain.parallel import contract
from tptrain.parallel.styles import STYLES, ColwiseParallel, ParallelStyle, RowwiseParallel, ShardSpec, canonical_style
from tptrain.parallel.styles.base import declared

# transformers styles that leave the weight whole on every rank: no rule ("grouped_gemm": the stacked weights of
# ep_dispatch_experts, split by that style itself, dim 0).
NO_RULE = ("grouped_gemm", "replicate")


def style_name(style: str) -> str:
    """tptrain's name of transformers style `style`: the style declaring it among its `transformers_names`, else the
    same name (tptrain's styles spelled as transformers spells them; an unknown one is check_plan's to report)."""
    return next((cls.name for cls in STYLES.values() if style in declared(cls, "transformers_names", ())), style)


def translate_plan(plan: dict[str, str] | None) -> dict[str, str]:
    """{glob: tptrain style}; an unmapped transformers style keeps its name (reported by check_plan)."""
    return {glob: style_name(style) for glob, style in (plan or {}).items() if style not in NO_RULE}


def parameter_owner_styles() -> list[str]:
    """The owners' styles under which transformers' per-parameter rules apply (the owner's forward reads its pieces:
    `ParallelStyle.per_parameter_rules`)."""
    return [name for name, cls in STYLES.items() if cls.per_parameter_rules]


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
    {glob: problem}): a rule applies when its owner's own rule is a style with `per_parameter_rules`
    ('local_params', 'moe_tp_experts', 'all_reduce': its forward reads the pieces as they are); any other is a
    problem naming it."""
    modules = dict(model.named_modules())
    specs: dict[str, dict[str, ShardSpec]] = {}
    problems, owner_styles = {}, parameter_owner_styles()
    for glob, style in plan.items():
        parent, _, leaf = glob.rpartition(".")
        owners = {n: m for n, m in modules.items() if n and _matches(parent, n)}
        if not owners or any(_matches(glob, n) for n in modules) or not any(
                leaf in dict(m.named_parameters(recurse=False)) for m in owners.values()):
            continue
        owner_style = plan.get(parent) and style_name(plan[parent])
        for name, module in owners.items():
            param = dict(module.named_parameters(recurse=False)).get(leaf)
            spec = None if param is None else parameter_spec(style, leaf, param.dim())
            if spec is not None and spec.segments:  # each packed half: half the rows of the split dim
                half = param.shape[spec.dim] // 2
                spec = ShardSpec(spec.dim, segments=((half, 1), (half, 1)))
            if spec is not None and owner_style in owner_styles:
                specs.setdefault(name, {})[leaf] = spec
            elif param is not None:
                problems[glob] = (f"tp_plan rule {glob!r} ({style!r}) names a parameter, not a module: a transformers "
                                  f"per-parameter style tptrain applies only under an owner ruled "
                                  f"{' or '.join(map(repr, owner_styles))} and only for colwise, rowwise, "
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
    * `tp_replicated_tail` on modules whose style sums that tail's gradient ('mla_kv_a_proj': `replicated_tail`):
      the config's qk_rope_head_dim;
    * on transformers' experts modules (`@use_experts_implementation`'s, with `_is_expert_parallel`):
      `tp_routed_experts` (forward(x, expert_ids, weights), what an ep axis splits: `contract.routed_experts`) and
      `tp_top_k`, the config's num_experts_per_tok, which 'ep_dispatch_experts' chooses its dispatch by.
    `plan` is in full module names (tptrain spelling), before user overrides, so overrides are checked against it.
    `config_of(module name)`: the config a module's facts come from where it is not `config` (a vision-language
    model's text decoder and vision tower); the attention modules then carry their counts as `tp_heads`.
    """
    styles = resolve_names(model, plan)
    facts = {name: STYLES.get(canonical_style(style)) for name, style in styles.items()}  # None: not tptrain's
    for name, cls in facts.items():
        rope = getattr(config_of(name) if config_of else config, "qk_rope_head_dim", None)  # MLA's shared RoPE key
        if cls is not None and cls.replicated_tail == "gradient_summed" and rope:
            model.get_submodule(name).tp_replicated_tail = rope
    for owner, module in model.named_modules():
        own = config_of(owner) if config_of else config
        heads, n_kv = contract.attention_heads(own), contract.kv_heads(own)
        top_k = getattr(own, "num_experts_per_tok", None)
        if hasattr(module, "_is_expert_parallel"):
            module.tp_routed_experts, module.tp_top_k = True, top_k if isinstance(top_k, int) else None
        children = {n: c for n, c in module.named_children() if f"{owner}.{n}" in styles}
        cols = tuple(n for n in children if _splits_columns(facts[f"{owner}.{n}"]))
        rows = [n for n in children if _reads_split_columns(facts[f"{owner}.{n}"])]
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


def _splits_columns(cls: type[ParallelStyle] | None) -> bool:
    """A column-parallel style whose output stays split (colwise, fused_colwise): the producer of a pair."""
    return cls is not None and issubclass(cls, ColwiseParallel) and cls.splits_output


def _reads_split_columns(cls: type[ParallelStyle] | None) -> bool:
    """A row-parallel style fed the producers' split features (rowwise): the consumer of a pair."""
    return cls is not None and issubclass(cls, RowwiseParallel) and cls.needs_split_input


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
