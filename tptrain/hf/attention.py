"""Context parallelism on transformers' modeling code: tptrain's attention function and mask function, registered
with transformers' attention interfaces under the name "tptrain", and the two contract facts they give the engine.

transformers' attention modules call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)`; its base
models build their masks through `ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]` (masking_utils). Under
context parallelism (`cp_size`) the backend sets that name to "tptrain" on every config of the model, so:

* each attention module's call lands in `attention`, which runs the module's `attend(q, k, v, mask)` (the contract's
  TPAttention fact, `parallel/contract.py`): the engine wraps it on the instance to all-gather K and V over the cp
  group (`parallel/context_parallel.py`); the math is transformers' eager/SDPA attention with its options (scaling,
  soft-capping, attention sinks `s_aux`, dropout), so this rank's queries attend every rank's keys;
* each mask transformers builds (causal, sliding window, chunked: each a `mask_function` of (batch, head, query
  index, key index)) lands in `build_mask`, which asks the base model's `attention_masks` (the contract's mask
  builder, which the engine wraps to pass the whole batch's position ids and padding, this rank's query indices and
  the keys' gathered order): the mask function is evaluated at the tokens' GLOBAL indices, packed documents found
  from the whole batch's restarting position ids as transformers finds them (`find_packed_sequence_indices`, the
  mask function then on positions within each document), padding from the whole batch's mask.

The rotary embedding needs nothing: the batch split hands the model each token's global position id.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import (AttentionMaskInterface, and_masks, find_packed_sequence_indices,
                                        packed_sequence_compatibility_function, padding_mask_function)
from transformers.modeling_utils import AttentionInterface


NAME = "tptrain"
# Keyword arguments of transformers' attention modules that the math here does not need: the mask already holds the
# window; the rest serve flash-attention's varlen kernels or the cache. Any other tensor (a position bias, a sparse
# attention's chosen keys) changes the math: refused.
_UNUSED = {"sliding_window", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
           "past_key_values", "cache_position"}
# The base model whose forward is running, and its model's cp context (None without context parallelism): its mask
# builder is what `build_mask` asks (transformers' mask interface is called with the config only).
_RUNNING: contextvars.ContextVar[tuple[nn.Module, Any] | None] = contextvars.ContextVar("tptrain_hf_running",
                                                                                         default=None)


@contextlib.contextmanager
def running(base: nn.Module, cp_context: Any = None):
    """While transformers' forward of `base` (a base model with `attention_masks`) runs."""
    token = _RUNNING.set((base, cp_context))
    try:
        yield
    finally:
        _RUNNING.reset(token)


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether `module`'s forward computes attention through transformers' attention interface."""
    return _calls_interface(type(module))


@functools.cache
def _calls_interface(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source


def use_tptrain_attention(model: nn.Module, within: str = "") -> None:
    """Every config of `model`'s modules (those under `within` only: a vision-language model's text decoder, whose
    tower runs on the whole batch with its own attention) names "tptrain" as its attention implementation (masks and
    attention)."""
    root = model.get_submodule(within)
    configs = {id(c): c for m in root.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation_internal")}
    for config in configs.values():
        config._attn_implementation = NAME


# Modules that mix tokens other than by attention over the keys: recurrences (Mamba, gated DeltaNet, lightning/linear
# attention), short convolutions, and what selects or compresses keys from all of them (DSA's indexer, compressors).
_MIXER_NAMES = re.compile(r"Mamba|DeltaNet|Lightning|LinearAttention|ShortConv|Recurrent|Indexer|Compressor|SSM")
# Of those, the ones whose output indexes or summarises the attention's keys: the attention under context parallelism
# sees this rank's keys only, so they cannot run on the whole sequence beside it.
_KEY_SELECTORS = re.compile(r"Indexer|Compressor")
# config.layer_types values whose layers attend by a mask over the keys (or do not mix tokens at all)
_ATTENDING_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "moe", "mlp"}


def declare_cp_facts(model: nn.Module, base: nn.Module, layers: str | None, *, within: str = "") -> dict[str, str]:
    """Give the engine what context parallelism reads (parallel/contract.py): `attend` on every module computing
    attention through transformers' interface (under `within`: a vision-language model's text decoder; a TPAttention,
    `tp_kv_projections` () where the plan did not split it), the base model's `attention_masks`, and
    `cp_whole_sequence`: {module: class} of the decoder layers' token mixers outside attention (recurrences, short
    convolutions) that run on the whole sequence under context parallelism, each the largest part of its layer
    holding no attention. Returns {module: class} of the modules of the decoder layers (`layers`, their list's name;
    None: the whole model) mixing tokens in a way context parallelism can do neither (the model's `sequence_mixers`
    fact, which it refuses)."""
    base.attention_masks = attention_masks
    interface = []
    for name, module in model.named_modules():
        if (not within or name.startswith(f"{within}.")) and calls_attention_interface(module):
            interface.append(name)
            module.attend = Attend(module)
            if not hasattr(module, "tp_kv_projections"):
                module.tp_kv_projections = ()
    model.cp_whole_sequence, refused = {}, {}
    for name, cls in _token_mixers(model, base, layers).items():
        unit = None if _KEY_SELECTORS.search(cls) else _whole_sequence_unit(name, layers, interface)
        if unit is None:
            refused[name] = cls
        else:
            model.cp_whole_sequence[unit] = type(model.get_submodule(unit)).__name__
    return refused


def _token_mixers(model: nn.Module, base: nn.Module, layers: str | None) -> dict[str, str]:
    """{module: class} of the modules of the decoder layers mixing tokens outside attention: named so (not the
    decoder layers themselves, nor attention named "linear": their parts are looked at), or holding a convolution;
    else the layers of the config's `layer_types` that do not attend."""
    mixers: dict[str, str] = {}
    layer = re.compile(rf"{re.escape(layers)}\.\d+") if layers is not None else None
    for name, module in model.named_modules():
        if layers is not None and not name.startswith(f"{layers}.") or any(name.startswith(f"{m}.") for m in mixers):
            continue
        named = _MIXER_NAMES.search(type(module).__name__) and not calls_attention_interface(module)
        if named and not (layer is not None and layer.fullmatch(name)):  # (a layer: its parts are looked at)
            mixers[name] = type(module).__name__
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
            owner = name.rpartition(".")[0]
            mixers.setdefault(owner, type(model.get_submodule(owner)).__name__)
    kinds = getattr(getattr(base, "config", model.config), "layer_types", None) or ()
    if not mixers:  # the modules named none: the config's layer types may
        mixers = {f"{layers or 'layers'}.{i}": f"a {kind!r} layer" for i, kind in enumerate(kinds)
                  if kind not in _ATTENDING_LAYER_TYPES}
    return mixers


def _whole_sequence_unit(name: str, layers: str | None, interface: list[str]) -> str | None:
    """The largest module on the path from decoder layer `name`'s layer down to `name` that holds no module calling
    the attention interface (None: `name` is a layer itself, or holds one)."""
    if layers is None or not name.startswith(f"{layers}."):
        return None
    parts = name[len(layers) + 1:].split(".")  # [layer index, child, ...]
    for depth in range(2, len(parts) + 1):
        unit = ".".join([layers, *parts[:depth]])
        if not any(a == unit or a.startswith(f"{unit}.") for a in interface):
            return unit
    return None


# ---------------------------------------------------------------------------------------- attention


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              softcap: float | None = None, s_aux: torch.Tensor | None = None, is_causal: bool | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (batch, heads, queries, d), k and v (batch, kv heads, keys, d)
    -> ((batch, queries, heads, v dim), no weights), through `module.attend` (which context parallelism wraps)."""
    unknown = sorted(k for k, v in kwargs.items() if torch.is_tensor(v) and k not in _UNUSED)
    if unknown:
        raise ValueError(f"{type(module).__name__} passes {unknown} to its attention function; tptrain's attention "
                         f"(context parallelism on the transformers backend) does not implement them: drop cp_size")
    if is_causal is False and attention_mask is None:
        raise ValueError(f"{type(module).__name__} runs bidirectional attention without a mask; context parallelism "
                         f"splits causal attention only: drop cp_size")
    cp = (_RUNNING.get() or (None, None))[1]
    if cp is not None and getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        query = _temperature_by_global_index(module, query, cp.query_index)
    # Kept on the module after the call: context parallelism's backward recomputes this call's attention from them.
    module.tptrain_attention_options = dict(dropout=dropout if module.training else 0.0, scaling=scaling,
                                            softcap=softcap, sinks=s_aux)
    out = module.attend(query, key, value, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _temperature_by_global_index(module: nn.Module, query: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Llama 4's NoPE layers scale each query by a function of its token index, which transformers takes from an
    arange over the tokens it is given (this rank's): the scales of the whole sequence's indices instead."""
    def scale(i: torch.Tensor) -> torch.Tensor:  # transformers' attn_temperature_tuning, per token index
        return torch.log1p(torch.floor((i.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local = torch.arange(query.shape[2], device=query.device)
    return (query / scale(local).to(query.dtype)[None, None, :, None] * scale(index).to(query.dtype)[None, None, :, None]
            ).to(query.dtype)


class Attend:
    """A transformers attention module's `attend(q, k, v, mask)` (contract.TPAttention): the math of one call, its
    options (scaling, soft-capping, sinks, dropout) those `attention` received. mask: (batch or 1, 1, queries, keys)
    bool or additive, or None: plain causal, the queries at the last positions of the keys. An object holding the
    module (not a closure), so a deep copy of the module gets its own."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def recomputable(self) -> bool:
        """Whether this call's attention is a function of q, k, v and the mask alone, so context parallelism's
        backward may recompute it: not with attention sinks (a parameter, whose gradient the recompute would not
        reach) nor dropout (random numbers). Otherwise context parallelism keeps the gathered K and V."""
        options = self.module.tptrain_attention_options
        return options["sinks"] is None and not options["dropout"]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        module = self.module
        if mask is not None and mask.shape[-1] != k.shape[2]:
            raise ValueError(f"{type(module).__name__} got an attention mask over {mask.shape[-1]} keys for "
                             f"{k.shape[2]}: it was not built by transformers' masking utilities, so context "
                             f"parallelism cannot give it the whole sequence's keys; drop cp_size")
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _math(q, k, v, mask, **module.tptrain_attention_options)


def _math(q, k, v, mask, *, dropout: float, scaling: float | None, softcap: float | None,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of q (batch, heads, queries, d) over k, v (batch, heads, keys, d): SDPA, or where SDPA cannot
    (soft-capped scores, sinks) transformers' eager math, its softmax in fp32 as transformers computes it."""
    if mask is not None and mask.dtype != torch.bool:  # additive: 0 where seen
        mask = mask == 0
    if softcap is None and sinks is None:
        if mask is None and q.shape[2] != k.shape[2]:  # causal at the end: no kernel flag for it on every device
            mask = _causal(q, k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=scaling)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (batch, heads, queries, keys)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~(mask if mask is not None else _causal(q, k)), torch.finfo(scores.dtype).min)
    if sinks is not None:  # one more logit per head in the softmax's denominator, dropped after it
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(F.dropout(probs, p=dropout), v)


def _causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(queries, keys) bool: causal, the queries at the last positions of the keys."""
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])


# ---------------------------------------------------------------------------------------- masks


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
               **kwargs: Any) -> torch.Tensor:
    """transformers' mask-interface signature: the mask of `mask_function`, from the running base model's
    `attention_masks` (which context parallelism wraps: this rank's rows of the whole sequence's mask)."""
    base = (_RUNNING.get() or (None, None))[0]
    if base is None:
        raise RuntimeError("tptrain's attention masks are built inside TransformersCausalLM's forward")
    if q_offset or kv_offset:
        raise ValueError("tptrain's attention (context parallelism) runs without a cache: call the model with "
                         "use_cache=False")
    positions = torch.arange(q_length, device=kwargs.get("device"))[None]
    key = (mask_function, batch_size)
    return base.attention_masks(positions, attention_mask, {key})[key]


def attention_masks(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, windows: set, *,
                    query_index: torch.Tensor | None = None, key_index: torch.Tensor | None = None) -> dict:
    """The base model's mask builder (contract.TPModel's `attention_masks`): {(mask_function, batch size): (batch or
    1, 1, queries, keys) bool} over the sequence of `position_ids` (batch or 1, seq), rows `query_index` and columns
    `key_index` (default: all, in order). As transformers' sdpa_mask: packed documents when no padding mask is given
    (the mask function then on positions within each document), the padding mask on the keys."""
    seq, device = position_ids.shape[-1], position_ids.device
    query = torch.arange(seq, device=device) if query_index is None else query_index
    keys = torch.arange(seq, device=device) if key_index is None else key_index
    out = {}
    for mask_function, batch_size in windows:
        function = mask_function
        if attention_mask is None:
            positions = position_ids.expand(batch_size, -1)
            packed = find_packed_sequence_indices(positions)
            if packed is not None:
                function = packed_sequence_compatibility_function(function, positions, packed)
        else:
            function = and_masks(function, padding_mask_function(attention_mask.bool()))
        batch = torch.arange(batch_size, device=device)[:, None, None, None]
        head = torch.zeros(1, device=device, dtype=torch.long)[None, :, None, None]
        mask = function(batch, head, query[None, None, :, None], keys[None, None, None, :])
        out[(mask_function, batch_size)] = mask.expand(batch_size, 1, len(query), len(keys))
    return out


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, build_mask)
