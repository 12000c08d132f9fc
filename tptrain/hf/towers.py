"""The vision tower and projector of a vision-language model, split as its text decoder is: by the config's own
plan where the tower's config has one (Llama 4's), else by a plan derived here from the modules' shapes.

transformers' VLM configs give a plan for their text decoder, and only a few for their vision tower; the rest keep
the tower whole on every rank. The common encoder block is the decoder's: an attention whose q/k/v (or one fused
qkv) read the block's input and whose output projection reads their heads, and an MLP whose fc1 (and gate) read it
and whose fc2 reads their features; the projector is often such an MLP too. Each is a module whose direct
`nn.Linear` children are some projections reading one input (`colwise`; one fused projection of 2 or 3 equal parts:
`fused_colwise`, each part split alone) and, registered last, the one projection reading their outputs (`rowwise`):
what `derive_plan` looks for, and nothing else. A module with a head count (`num_heads` / `num_attention_heads`)
and an output projection as wide as its heads is split by heads; any other by features. Weights between them must
act on each head alone (a vector of head_dim: 'replicated_with_grad_allreduce'); anything else there (a norm over
all heads, another linear) leaves the module whole. What stays whole computes the same on every rank from the same
inputs, and gets its whole gradient there too (the gradient reaching it is complete on every rank).

transformers' tower code sometimes reshapes by its global head count (`reshape(seq, 3, self.num_heads, -1)`);
`localise_heads` makes each split attention module's head-count attributes this rank's.
"""
from __future__ import annotations

import re

from torch import nn

from tptrain.hf.plan import resolve_names

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads")  # an attention module's head count, as transformers names it
HEAD_WIDTHS = ("embed_dim", "all_head_size", "inner_dim")  # ... and its heads' total width, where the module keeps it


def tower_roots(hf_model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The modules whose plan tptrain derives: the children of the containers around the text decoder (the model and
    its multimodal base model) that are neither the decoder, nor the input embedding or output head, nor given any
    rule by the declared `plan` (full names): the vision tower and the projector."""
    styles = resolve_names(hf_model, plan)
    planned = {n.rsplit(".", i)[0] for n in styles for i in range(n.count(".") + 1)}
    containers, text = _containers(hf_model)
    return [name for name, _ in hf_model.named_modules() if name and name not in text and name not in planned
            and name.rpartition(".")[0] in containers]


def _containers(hf_model: nn.Module) -> tuple[set[str], set[str]]:
    """(the strict ancestors of the text decoder, the names on the way to the input embedding and output head)."""
    wanted = [m for m in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings()) if m is not None]
    leaves = [n for n, m in hf_model.named_modules() if any(m is w for w in wanted)]
    text = {n.rsplit(".", i)[0] if i <= n.count(".") else "" for n in leaves for i in range(n.count(".") + 2)}
    decoder = decoder_name(hf_model)
    return {n for n in _ancestors(decoder) if n != decoder}, text


def decoder_name(hf_model: nn.Module) -> str:
    """The text decoder: the innermost transformers PreTrainedModel holding the input embedding ("": the model)."""
    from transformers import PreTrainedModel

    embed = hf_model.get_input_embeddings()
    name = next((n for n, m in hf_model.named_modules() if m is embed), "")
    return next((n for n in reversed(_ancestors(name)) if isinstance(hf_model.get_submodule(n), PreTrainedModel)), "")


def _ancestors(name: str) -> list[str]:
    """"" and every prefix of dotted `name`, outermost first, `name` included."""
    parts = name.split(".") if name else []
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]


def derive_plan(hf_model: nn.Module, roots: list[str]
                ) -> tuple[dict[str, dict[str, str]], dict[str, tuple[int, int]]]:
    """({root: {module glob: style}} of the roots with a block that splits, {attention module: (heads, their
    width)})."""
    plans: dict[str, dict[str, str]] = {}
    attention: dict[str, tuple[int, int]] = {}
    for root in roots:
        plan = {}
        for name, module in hf_model.get_submodule(root).named_modules():
            full = f"{root}.{name}" if name else root
            block = _block(module)
            if block is not None:
                rules, heads = block
                plan.update({f"{full}.{child}": style for child, style in rules.items()})
                if heads:
                    attention[full] = heads
        if plan:
            plans[root] = _as_globs(hf_model, plan)
    return plans, attention


def _as_globs(hf_model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` ({module name: style}) with each layer index a `*` where the glob means the same modules and styles
    (`blocks.*.attn.qkv` for every block's)."""
    groups: dict[str, dict[str, str]] = {}
    for name, style in plan.items():
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", name), {})[name] = style
    out = {}
    for glob, members in groups.items():
        same = set(resolve_names(hf_model, {glob: "x"})) == set(members) and len(set(members.values())) == 1
        out.update({glob: next(iter(members.values()))} if same else members)
    return out


def _block(module: nn.Module) -> tuple[dict[str, str], tuple[int, int] | None] | None:
    """A column- then row-parallel block among `module`'s direct linears: ({child: style}, (heads, their width) for
    an attention split by heads), or None."""
    linears = [(n, c) for n, c in module.named_children() if type(c) is nn.Linear]
    if len(linears) < 2 or isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # a list: independent projections
        return None
    (row_name, row), cols = linears[-1], linears[:-1]
    if len({c.in_features for _, c in cols}) != 1:
        return None
    plain = all(c.out_features == row.in_features for _, c in cols)
    fused = len(cols) == 1 and cols[0][1].out_features in (2 * row.in_features, 3 * row.in_features)
    if not (plain or fused):
        return None
    heads = next((v for a in HEAD_COUNTS if isinstance(v := getattr(module, a, None), int) and v > 0), None)
    by_heads = heads is not None and row.in_features % heads == 0
    between = _between(module, {n for n, _ in linears}, row.in_features // heads if by_heads else None)
    if between is None:
        return None
    rules = {n: "fused_colwise" if fused else "colwise" for n, _ in cols}
    if fused:
        parts = cols[0][1].out_features // row.in_features
        cols[0][1].tp_segments = tuple((row.in_features, False) for _ in range(parts))
    return {**rules, **between, row_name: "rowwise"}, (heads, row.in_features) if by_heads else None


def _between(module: nn.Module, linears: set[str], head_dim: int | None) -> dict[str, str] | None:
    """Rules for the other modules with parameters under `module`: each a per-head weight (vectors of `head_dim`, or
    scalars) is 'replicated_with_grad_allreduce' (it reads this rank's heads; its gradient is a per-rank share);
    None if any other has parameters (it may span the split features)."""
    rules = {}
    for name, sub in module.named_modules():
        top = name.split(".")[0]
        params = list(sub.parameters(recurse=False))
        if not name or top in linears or not params:
            continue
        if not all(p.numel() == 1 or head_dim is not None and p.dim() == 1 and p.shape[0] == head_dim for p in params):
            return None
        rules[name] = "replicated_with_grad_allreduce"
    return rules


def localise_heads(module: nn.Module, heads: int, width: int, tp_size: int) -> None:
    """This rank's head count and heads' width on an attention module split by heads over `tp_size` ranks, in the
    attributes its forward may reshape by."""
    for attrs, whole in ((HEAD_COUNTS, heads), (HEAD_WIDTHS, width)):
        for attr in attrs:
            if getattr(module, attr, None) == whole:
                setattr(module, attr, whole // tp_size)


def tower_facts(hf_model: nn.Module, text: tuple[str, ...]) -> dict | None:
    """What `tptrain plan --train` counts of the vision tower, as plain values read from the (meta) modules and the
    vision config (diagnostics/model_shapes.TowerShape documents each), or None without one: the sub-model of
    `vision_config`, its longest layer list and that list's first block; outside the layers, on the image's side
    (not under the `text` modules: the decoder, the head), each norm as wide as the tower and each linear (a
    projector's), in order."""
    from transformers import PreTrainedModel

    vision = getattr(hf_model.config, "vision_config", None)
    root = next((n for n, m in hf_model.named_modules() if isinstance(m, PreTrainedModel) and m.config is vision), None)
    if root is None:
        return None
    lists = [(n, m) for n, m in hf_model.get_submodule(root).named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return None
    layers_name, layers = max(lists, key=lambda item: len(item[1]))
    layers_name, block = f"{root}.{layers_name}", layers[0]
    attention = next((m for m in block.modules() if _heads(m) and _block(m) is not None), None)
    linears = [c for c in (attention.children() if attention is not None else ()) if type(c) is nn.Linear]
    hidden = int(vision.hidden_size)
    heads = _heads(attention) or int(getattr(vision, "num_attention_heads", getattr(vision, "num_heads", 1)))
    mlps = [m for m in block.modules() if m is not attention and _block(m) is not None and not _heads(m)]
    gated = bool(mlps) and sum(type(c) is nn.Linear for c in mlps[0].children()) == 3
    act = str(getattr(vision, "hidden_act", "gelu"))
    norm = next((m for m in block.modules() if "norm" in type(m).__name__.lower()), None)
    outside = []
    for name, module in hf_model.named_modules():
        if name.startswith((layers_name + ".", *(t + "." for t in text))) or name in text or not name:
            continue
        if type(module) is nn.Linear:
            outside.append(("linear", module.in_features, module.out_features))
        elif "norm" in type(module).__name__.lower() and _width(module) == hidden:
            outside.append(("norm", hidden, _norm_kind(module)))
    patch = getattr(vision, "patch_size", 14)
    size = getattr(vision, "image_size", None)
    return dict(root=root, layers=layers_name, depth=len(layers), hidden=hidden, heads=heads,
                head_dim=hidden // heads, inner=int(getattr(vision, "intermediate_size", 4 * hidden)),
                norm=_norm_kind(norm), fused_qkv=len(linears) == 2,
                rotary=any("rotary" in type(m).__name__.lower() for m in hf_model.get_submodule(root).modules()),
                act_tensors=4 if gated else 3 if act == "quick_gelu" else 2,
                patch=int(patch[0] if isinstance(patch, (list, tuple)) else patch),
                image_size=int(size[0] if isinstance(size, (list, tuple)) else size) if size else None,
                class_token=any(n.endswith("class_embedding") for n, _ in hf_model.get_submodule(root).named_parameters()),
                outside=tuple(outside))


def _heads(module: nn.Module | None) -> int | None:
    return next((v for a in HEAD_COUNTS if isinstance(v := getattr(module, a, None), int) and v > 0), None)


def _width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 1 else None


def _norm_kind(norm: nn.Module | None) -> str:
    """"layer" (mean and variance: LayerNorm) or "rms" (transformers' RMSNorms, computed in fp32)."""
    return "layer" if norm is None or isinstance(norm, nn.LayerNorm) else "rms"
