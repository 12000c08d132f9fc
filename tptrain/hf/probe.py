"""What reads a split activation: the data flow of a transformers model under its plan, found by one forward of a
copy built on the meta device (shapes only, no weights, no process group).

transformers' plans give rules only to the modules they split; a module between them without a rule (a per-head
norm, an activation with parameters, MLA's low-rank projections) runs as it is on every rank. Whether that is right
depends on what it reads: a whole activation (MiniCPM3's kv_a_layernorm, fed by the replicated kv_a_proj) gives it
the whole gradient on every rank; one rank's share of the features (Doge's k_norm on this rank's heads, Apertus'
xIELU on its slice of the MLP) gives it a partial gradient, which must be summed over the ranks
('replicated_with_grad_allreduce'); and a weight spanning the split features themselves (a norm over all heads)
cannot run on a share at all. The forward records which planned module produced each output (its style's
`splits_output`); each unplanned module's input is traced back through the autograd graph to the planned outputs
it derives from.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from tptrain.hf.plan import resolve_names, unplanned_modules
from tptrain.hf.towers import decoder_name
from tptrain.parallel.styles import STYLES, canonical_style

SEQ = 4


def split_readers(model: nn.Module, styles: dict[str, str], candidates: list[str]) -> dict[str, str] | None:
    """{candidate module: "whole" (reads only whole activations), "per_part" (reads a split activation; its
    parameters do not span the split features) or "spanning" (a parameter spans the split features)}, from a forward
    of `model` (a throwaway meta-device transformers *ForCausalLM: its experts' forwards are replaced; module names
    as in `styles`). A model whose forward cannot run on meta (Qwen3-Omni's thinker, on meta ids) is probed by its text decoder's, for the candidates inside it. None when neither runs (the caller then
    keeps its static check)."""
    modules = dict(model.named_modules())
    marks: dict[torch.autograd.graph.Node, tuple[bool, int]] = {}  # output node -> (split, global width)
    seen: dict[str, str] = {}
    for name, style in styles.items():
        cls = STYLES.get(canonical_style(style))
        if cls is None or name not in modules:
            continue
        if cls.name == "moe_tp_experts":  # opaque: its output is whole (summed); its loop cannot run on meta
            modules[name].forward = lambda x, *args, **kwargs: x * 1
        modules[name].register_forward_hook(_marker(marks, cls.splits_output))
    for name in candidates:
        modules[name].register_forward_pre_hook(_reader(name, modules[name], marks, seen))
    if meta_forward(model, seen.clear):
        return {name: seen.get(name, "whole") for name in candidates}
    decoder = decoder_name(model)  # a vision-language model whose own forward cannot run on meta: its text decoder's
    if decoder and meta_forward(model.get_submodule(decoder), seen.clear):
        return {name: seen.get(name, "whole") for name in candidates if name.startswith(decoder + ".")}
    return None


def _marker(marks, splits: bool):
    def hook(module, args, out):
        if torch.is_tensor(out) and out.grad_fn is not None:
            marks[out.grad_fn] = (splits, out.shape[-1])
    return hook


def _reader(name: str, module: nn.Module, marks, seen: dict[str, str]):
    def hook(m, args):
        x = next((a for a in args if torch.is_tensor(a)), None)
        if x is None or x.grad_fn is None:
            return
        widths = _split_widths(x.grad_fn, marks)
        if not widths:
            seen.setdefault(name, "whole")
            return
        # Per part only if every parameter is a scalar or a vector over the input's last dim that is not the split
        # width itself (a per-head norm over head_dim); anything else (a (heads, head_dim) weight, a norm over the
        # whole split width) spans the split features.
        spans = any(p.dim() > 1 or p.numel() > 1 and (p.shape[0] != x.shape[-1] or x.shape[-1] in widths)
                    for p in m.parameters(recurse=False))
        seen[name] = "spanning" if spans or seen.get(name) == "spanning" else "per_part"
    return hook


def _split_widths(node, marks) -> set[int]:
    """The global widths of the split outputs `node` derives from, not looking past any planned output."""
    widths, stack, visited = set(), [node], set()
    while stack:
        n = stack.pop()
        if n is None or n in visited:
            continue
        visited.add(n)
        if n in marks:
            split, width = marks[n]
            if split:
                widths.add(width)
            continue
        stack.extend(next_fn for next_fn, _ in n.next_functions)
    return widths


def meta_copy(hf_model: nn.Module) -> nn.Module:
    """A throwaway copy of the transformers model `hf_model`'s architecture on the meta device (eager attention: sdpa's
    meta kernel refuses grouped KV heads; experts through batched_mm)."""
    from tptrain.meta_init import build_on

    config = copy.deepcopy(hf_model.config)
    config._attn_implementation = "eager"
    with build_on(torch.device("meta")):
        meta = type(hf_model)(config)
    if hasattr(meta, "set_experts_implementation"):  # grouped_mm takes bf16 only on meta; the eager loop reads values
        meta.set_experts_implementation("batched_mm")
    return meta


def meta_forward(model: nn.Module, before: Callable[[], None] = lambda: None, *, batch: int = 1,
                 seq: int = SEQ) -> bool:
    """One forward of a meta model on (batch, seq) meta ids (`before` called ahead of each try); whether one ran.
    transformers' mask preparation reads values (not on meta), so the masks are given: per layer type (a dict) for
    models that take one, else none (the data flow does not depend on the mask)."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    for mask in (defaultdict(lambda: None), torch.zeros(batch, 1, seq, seq, device="meta")):
        before()
        try:
            with torch.enable_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            return True
        except Exception:  # noqa: BLE001 - a forward this probe cannot run: the caller's static answer stands
            continue
    return False


def masks_see_positions(hf_model: nn.Module) -> bool | None:
    """Whether transformers' forward of `hf_model` hands its position ids to the attention masks it builds (then a
    packed row's documents, position ids restarting inside it, attend only to themselves): whether its mask
    preparation looks for packed documents (`find_packed_sequence_indices`, recorded) in one forward of a meta copy
    given position ids and no padding mask. None when that forward cannot run on meta."""
    from transformers import masking_utils

    looked: list[bool] = []

    def recorded(position_ids: torch.Tensor) -> None:
        looked.append(True)
        return None  # (on meta there are no values to search; the masks are built as for one document)

    meta = meta_copy(hf_model)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    search, masking_utils.find_packed_sequence_indices = masking_utils.find_packed_sequence_indices, recorded
    try:
        with torch.no_grad():
            meta(input_ids=ids, position_ids=torch.arange(SEQ, device="meta")[None], use_cache=False)
    except Exception:  # noqa: BLE001 - a forward this probe cannot run: unknown
        return None
    finally:
        masking_utils.find_packed_sequence_indices = search
    return bool(looked)


def rule_unplanned(model: nn.Module, prefix: str) -> set[str]:
    """A transformers-backend model's modules with parameters the plan leaves without a rule inside a split region,
    sorted by what they read (split_readers, on a meta copy): those reading this rank's share of the features get
    'replicated_with_grad_allreduce' (their partial gradient summed over TP); the names of those reading whole
    activations are returned (they need nothing); the rest stay plan problems (`unplanned_parameters`)."""
    styles = resolve_names(model, {**{f"{prefix}.{g}": s for g, s in model.tp_base_plan.items()}, **model._tp_plan})
    candidates = unplanned_modules(model, styles)
    if not candidates:
        return set()
    kinds = split_readers(meta_copy(model.hf_model), styles, candidates) or {}
    for name, kind in kinds.items():
        if kind == "per_part" and name.startswith(prefix + "."):
            model.tp_base_plan[name[len(prefix) + 1:]] = "replicated_with_grad_allreduce"
    return {name for name, kind in kinds.items() if kind == "whole"}
