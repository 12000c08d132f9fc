"""Pipeline stages of a transformers model: where to cut its module tree (the contract's PipelineModel facts) and how
one stage runs transformers' own forward on what it holds.

The cut (`stage_parts`): the decoder layers are the base model's ModuleList of `num_hidden_layers`; every other module
of the base model with parameters goes to the first stage if transformers' forward calls it before the first layer (or
never: a vision tower a text batch does not use), to the last if after the last layer, as one forward of a meta copy
shows (the embedding, Gemma 3n's per-layer embeddings, the final norm, DeepSeek-V4's hyper-connection head); the
output head is the last stage's. Modules without parameters (rotary embeddings, dropout) stay on every stage, so each
stage computes its position embeddings from the position ids itself. A module called both before and after the layers
cannot be cut (`stage_parts` says why). A vision-language model's decoder layers are its text decoder's (inside the
base model); the modules beside the text decoder (the vision tower, the projector) are the first stage's, whose
forward runs them on its microbatch's images and places their features among the token embeddings.

A stage runs transformers' forward of the base model (the last stage: of the causal LM, head and logit transforms
included) over a full-length layer list in which the layers it does not hold are placeholders, so every layer it holds
keeps its own index (`config.layer_types[i]`, the mask of its attention type, its rotary) and transformers builds the
masks of every layer type on each stage. The placeholder just before the stage's first layer hands that layer the
hidden states received from the previous stage (whatever transformers did to the embeddings before, on this stage, is
dropped); the one just after its last layer records what that layer returned, which the stage passes on. The modules
of other stages are identities meanwhile.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from tptrain.hf.probe import meta_copy, meta_forward


@dataclass(frozen=True)
class StageParts:
    """The cut of one model: `layers` (dotted name of the decoder-layer ModuleList), `first` / `last` (dotted names
    of the modules only the first / last stage holds), `layer_attributes` (each layer's plain attributes, which
    transformers' forward may read from a layer a stage does not hold: `attention_type`); from the meta forward:
    `tuple_out` (the layers return a tuple, the hidden states first), `batch_seq` (the dims of batch and sequence in
    the hidden states the layers pass on), `embedding` (the width of what the embedding makes)."""

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    layer_attributes: tuple[dict, ...]
    tuple_out: bool = False
    batch_seq: tuple[int, int] = (0, 1)
    embedding: int | None = None


_PROBE_BATCH, _PROBE_SEQ = 2, 5  # sizes no hidden dim of a probe has: where they sit in a shape says which is which


def stage_parts(model: nn.Module, prefix: str, decoder: str | None = None) -> StageParts | str:
    """The cut of `model` (a TransformersCausalLM, whole), or why it cannot be cut. `decoder`: the dotted name of the
    module holding the decoder layers where it is not the base model at `prefix` (a vision-language model's text
    decoder: the modules around it, the vision tower and projector, go to the first stage, which places their
    features among the token embeddings)."""
    hf = model.hf_model
    text = decoder or prefix
    base = hf.get_submodule(text)
    n_layers = getattr(base.config, "num_hidden_layers", None)
    lists = [n for n, c in base.named_children() if isinstance(c, nn.ModuleList)]
    found = [n for n in lists if len(getattr(base, n)) == n_layers] or lists
    if len(found) != 1:
        return (f"its base model {type(base).__name__} holds no list of its decoder layers (children: "
                f"{[n for n, _ in base.named_children()]})")
    layers = found[0]
    weighted = [f"{text}.{n}" for n, c in base.named_children() if n != layers and _weighted(c)] + \
        _around(hf, text, prefix)
    head = [n for n, c in hf.named_children() if n != prefix and _weighted(c)]
    probe = _probe(hf, text, layers, weighted + head)
    if probe.get("fed"):
        name = probe["fed"]
        source = f"{name} ({type(hf.get_submodule(name)).__name__})" if name in weighted else name
        return (f"its decoder layers take inputs beside the hidden states, computed by {source} (per-layer inputs), "
                f"which a stage holding only its own layers does not have")
    if probe.get("more"):
        return (f"each decoder layer ({type(getattr(base, layers)[0]).__name__}) hands the next one more than its "
                f"hidden states ({probe['more']} values)")
    embed = next((n for n, m in hf.named_modules() if m is hf.get_input_embeddings()), None)
    first, last = [], []
    for name in weighted:
        calls = probe["calls"].get(name) if probe else ({"before"} if name == embed else {"after"})
        if calls is not None and len(calls) > 1:
            return (f"transformers' forward calls {name} ({type(hf.get_submodule(name)).__name__}) both before and "
                    f"after the decoder layers")
        (last if calls == {"after"} else first).append(name)
    outside = [n for n in head if decoder is not None and probe and probe["calls"].get(n) != {"after"}]
    if outside:  # Llama 4's tower beside its causal LM: a stage runs the base model, not the tower
        return (f"its {outside[0]} ({type(hf.get_submodule(outside[0])).__name__}) runs before the decoder layers "
                f"outside its base model {prefix}, which a pipeline stage's forward runs")
    attributes = tuple({k: v for k, v in vars(layer).items() if not k.startswith("_") and k != "training"
                        and isinstance(v, (str, int, float, bool, type(None)))} for layer in getattr(base, layers))
    found = {k: probe[k] for k in ("tuple_out", "batch_seq", "embedding") if k in probe}
    return StageParts(f"{text}.{layers}", tuple(first), (*last, *head), attributes, **found)


def _weighted(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _around(hf: nn.Module, text: str, prefix: str) -> list[str]:
    """The modules with parameters beside the text decoder at dotted `text` inside the base model at `prefix` (none
    when it is the base model): a vision-language model's tower and projector."""
    parts, top = text.split("."), len(prefix.split("."))
    return [f"{'.'.join(parts[:depth])}.{name}" for depth in range(top, len(parts))
            for name, child in hf.get_submodule(".".join(parts[:depth])).named_children()
            if name != parts[depth] and _weighted(child)]


def _probe(hf: nn.Module, text: str, layers: str, names: list[str]) -> dict:
    """What one forward of a meta copy of `hf` shows ({} when none can run): "calls" {module in `names` (dotted):
    {"before", "after"}: when it is called relative to the decoder layers}, "fed" (one called before the layers whose
    output reaches a layer other than as its hidden states), "tuple_out", "batch_seq", "embedding" (see
    StageParts)."""
    meta = meta_copy(hf)
    base = meta.get_submodule(text)
    state: dict = {}
    marks: dict = {}  # autograd node of a child's output -> the child

    def called(name):
        def hook(module, args, out):
            state["calls"].setdefault(name, set()).add("after" if state["layers"] else "before")
            if torch.is_tensor(out) and out.grad_fn is not None and not state["layers"]:
                marks[out.grad_fn] = name
            if module is meta.get_input_embeddings() and torch.is_tensor(out):
                state["embedding"] = out.shape[-1]
        return hook

    def layer_in(module, args, kwargs):
        h = args[0] if args else kwargs.get("hidden_states")
        if torch.is_tensor(h) and _PROBE_BATCH in h.shape and _PROBE_SEQ in h.shape:
            state["batch_seq"] = (list(h.shape).index(_PROBE_BATCH), list(h.shape).index(_PROBE_SEQ))
        others = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")]
        state["fed"] = state.get("fed") or _reaches([t for t in _tensors(others) if t.grad_fn is not None], marks)
        if torch.is_tensor(kwargs.get("input_ids")):
            state["fed"] = state.get("fed") or "the model's caller: the token ids (input_ids)"

    def layer_out(module, args, out):
        state["layers"] += 1
        state["tuple_out"] = isinstance(out, tuple)
        if isinstance(out, tuple) and any(o is not None for o in out[1:]):
            state["more"] = len(out)
        for t in _tensors([out])[1:]:  # what a layer returns beside its hidden states, read by a later one
            if t.grad_fn is not None:
                marks[t.grad_fn] = f"{type(module).__name__} (an earlier decoder layer)"

    for name in names:
        meta.get_submodule(name).register_forward_hook(called(name))
    for layer in getattr(base, layers):
        layer.register_forward_pre_hook(layer_in, with_kwargs=True)
        layer.register_forward_hook(layer_out)
    ran = meta_forward(meta, lambda: (state.clear(), marks.clear(), state.update(layers=0, calls={})),
                       batch=_PROBE_BATCH, seq=_PROBE_SEQ)
    return state if ran else {}


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += _tensors(v)
        elif isinstance(v, dict):
            out += _tensors(v.values())
    return out


def _reaches(tensors: list[torch.Tensor], marks: dict) -> str | None:
    """The marked module any of `tensors` is computed from, through the autograd graph; None if none."""
    stack, seen = [t.grad_fn for t in tensors], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in marks:
            return marks[node]
        stack.extend(n for n, _ in node.next_functions)
    return None


class _Placeholder(nn.Module):
    """A decoder layer this stage does not hold: its hidden states pass through, replaced by the stage's input
    (`role` "enter"), or recorded as the stage's output ("leave")."""

    def __init__(self, run: "_Run", role: str, attributes: dict) -> None:
        super().__init__()
        self.run, self.role = run, role
        self.__dict__.update(attributes)

    def forward(self, *args, **kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if self.role == "enter":
            h = self.run.x
        elif self.role == "leave":
            self.run.out = h
        return (h,) if self.run.tuple_out else h


class _Identity(nn.Module):
    """A module another stage holds: its input passes through."""

    def forward(self, x=None, *args, **kwargs):
        return x


@dataclass
class _Run:
    x: torch.Tensor
    tuple_out: bool
    out: torch.Tensor | None = None


def run_stage(view: nn.Module, parts: StageParts, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """`view` (a TransformersCausalLM, or a pipeline stage's view of one) on what it holds: token ids in if it holds
    the embedding, else the previous stage's hidden states; logits out if it holds the head, else hidden states.
    `kwargs`: transformers' forward arguments (position_ids, attention_mask, use_cache)."""
    prefix = parts.layers.partition(".")[0]
    first = all(_get(view, p) is not None for p in parts.first)
    last = all(_get(view, p) is not None for p in parts.last)
    container = view.get_submodule(parts.layers)
    held = {int(i): layer for i, layer in (container.items() if isinstance(container, nn.ModuleDict)
                                           else enumerate(container))}
    run = _Run(x, parts.tuple_out)
    roles = {min(held) - 1: "enter"} if not first else {}
    roles.update({max(held) + 1: "leave"} if not last else {})
    full = nn.ModuleList(held.get(i) or _Placeholder(run, roles.get(i, "pass"), attributes)
                         for i, attributes in enumerate(parts.layer_attributes))
    absent = {p: _Identity() for p in (*parts.first, *parts.last) if _get(view, p) is None}
    inputs = dict(input_ids=x) if first else dict(inputs_embeds=_embedding_like(x, parts))
    with _installed(view, {parts.layers: full, **absent}):
        if not last:
            getattr(view, prefix)(**inputs, **kwargs)
            return run.out
        hf = copy.copy(view.hf_model)  # transformers' causal LM over this view's modules
        hf._modules = view._modules
        return hf(**inputs, **kwargs).logits


def _embedding_like(x: torch.Tensor, parts: StageParts) -> torch.Tensor:
    """Zeros shaped as the embedding's output for the stage's input `x`: what transformers' forward computes on before
    the layers (the enter placeholder then hands the first layer `x` itself)."""
    batch, seq = (x.shape[d] for d in parts.batch_seq)
    return x.new_zeros(batch, seq, parts.embedding or x.shape[-1])


def _get(root: nn.Module, path: str) -> nn.Module | None:
    module = root
    for name in path.split("."):
        module = module._modules.get(name) if module is not None else None
    return module


@contextlib.contextmanager
def _installed(root: nn.Module, modules: dict[str, nn.Module]):
    """`modules` set at their dotted paths under `root` while the block runs, the previous ones back after it."""
    before = {path: _get(root, path) for path in modules}
    try:
        for path, module in modules.items():
            parent, _, leaf = path.rpartition(".")
            root.get_submodule(parent)._modules[leaf] = module
        yield
    finally:
        for path, module in before.items():
            parent, _, leaf = path.rpartition(".")
            root.get_submodule(parent)._modules[leaf] = module
