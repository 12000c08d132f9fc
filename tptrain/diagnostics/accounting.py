"""What one training step costs in communication and saved activations, next to the Megatron minimum.

    report = comm_report(model, input_ids, labels)   # one forward + backward, collective on the TP group
    if rank == 0:
        print(report.table())

The minimum counts the TP boundaries of the model's plan: every row-parallel module (o_proj,
down_proj, the vocab-parallel embedding) ends in one sum, and every group of column-parallel siblings
(q/k/v, gate/up, lm_head) begins with one boundary. Plain TP: one all-reduce of (batch, seq, hidden)
at each, in forward (the sums) and backward (the boundaries). A colwise module that reads a sibling's output (its
block's `tp_pairs`, or an input narrower than hidden_size) enters on its own, as wide as its input: DeepSeek's latent
attention has three narrow boundaries per layer in backward, q_b_proj's (q_lora_rank features), kv_b_proj's
(kv_lora_rank) and the shared RoPE key's gradient that 'mla_kv_a_proj' sums (qk_rope_head_dim), where q/k/v share
one of hidden_size. TP+SP: the same bytes as a reduce-scatter plus an all-gather, and the backward re-gathers each boundary's input once instead of
saving it, except the head's when the loss is fused with it (its gradients are computed in forward).
The vocab-parallel loss adds 2 all-reduces per chunk of tokens (issue 24): the max (chunk,), then
[target logit, sum-exp] (2 * chunk,), the bytes of 3 (tokens,) scalars in all; from whole logits
(`return_logits`, an eval-mode forward, a head that is not a plain linear) the tokens are one chunk, fused
with the head (a training forward) `losses.chunk_tokens` a chunk. A norm over split features
(`distributed_rmsnorm`, OLMo 2's q/k norms) adds one in forward and one in backward; partial parameter
gradients (norms, q/k norms) travel in one bucketed all-reduce. Bytes are each rank's input payload.

An MoE block whose experts dispatch by all-to-all (`expert_parallel_all_to_all`) moves, per rank and layer, its
share of T/p tokens: forward the per-expert counts (E int64), one row of hidden features per (token, expert)
assignment out to the experts' owners and one per assignment this rank's experts received back, and the all-gather
of the combined share; backward the two reverse exchanges and the all-gathers of the share's and its routing
weights' gradients. The rows sent are the share's assignments; the rows received are the other shares' routing to
this rank's experts, which each dispatch notes in the CommTracker recording the step ("rows_received" over the TP
group: whatever the router, DeepSeek's group-limited one too): one row per assignment each way is the minimum of
dispatching without de-duplicating a token sent to two experts of the same rank. A batch whose tokens do not split
into p equal shares takes the summing path and is counted as such. With an ep axis (`ep_size`) each rank dispatches its own T tokens over
the ep group the same way (no share, no all-gather), and the rows its experts received come from the other ranks'
routing, which each dispatch notes in the CommTracker recording the step ("rows_received", `CommTracker.noted`).
Under SP a summing MoE block gathers its shard's routing with its input (forward: the ids, int64, and the weights,
each (tokens / tp, k); backward: the weights' reduce-scatter, in place of their all-reduce), and re-gathers its input
in backward only when a shared expert's gate/up saved it; an all-to-all block exchanges its sequence shard as it is
(no all-gather). The router aux loss, split over token shards (cp, SP), sums its counts (num_experts + 1 floats, at
least fp32) over each group ("router_aux"), and its share's scalar over cp (out.aux_loss, fp32) or over tp under SP.

Context parallelism (cp_size, parallel/context_parallel.py) adds, per attention layer, one all-gather of this rank's
K and V side by side in forward ((batch, kv heads here, seq / cp, k dim + v dim), the config's
`key_value_head_dims`: MLA's values are narrower than its keys), the same all-gather again in backward (only this
rank's K and V are kept for it) and one reduce-scatter of the gathered dK/dV ((batch, kv heads here, seq, k dim + v
dim)); the loss's sum over cp (one scalar all-reduce in forward); and, for a bare model, every gradient summed over
cp in one flat all-reduce ("grad_sync"; not the experts split over an ep axis, whose owners got every cp rank's
rows). The TP minimum above, and an ep axis's dispatch, are then of this rank's seq / cp tokens.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tptrain.distributed.state import state_of
from tptrain.distributed.comm import CommTracker
from tptrain.losses import chunk_tokens
from tptrain.parallel import contract
from tptrain.parallel.sequence_parallel import SAVED_TENSOR_OBSERVERS
from tptrain.parallel.styles import STYLES, ColwiseParallel

_PHASES = ("forward", "backward", "router_aux", "grad_sync", "token_count", "loss", "grad_norm")


class SavedTensorMeter:
    """Counts the bytes autograd keeps for backward while active: each storage once, parameters not.

        with SavedTensorMeter(model.parameters()) as meter:
            loss = model(ids, labels=labels).loss
        meter.bytes

    Only the innermost saved-tensor hooks run, so hooks that replace what is saved (sequence
    parallelism keeps a shard instead of the gathered tensor) report what they keep to
    `sequence_parallel.SAVED_TENSOR_OBSERVERS`; this meter's own hooks see everything else.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def add(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._exclude:
            self._seen[storage.data_ptr()] = storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def __enter__(self) -> "SavedTensorMeter":
        SAVED_TENSOR_OBSERVERS.append(self.add)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        SAVED_TENSOR_OBSERVERS.remove(self.add)


@dataclass
class CommRow:
    phase: str
    op: str
    count: int
    bytes: int
    min_count: int
    min_bytes: int


@dataclass
class CommReport:
    tp_size: int
    sequence_parallel: bool
    rows: list[CommRow]
    saved_activation_bytes: int
    full_logit_collectives: int  # collectives of (.., vocab) or (.., vocab / tp) logits: should be 0

    @property
    def matches_minimum(self) -> bool:
        return all(r.count == r.min_count and r.bytes == r.min_bytes for r in self.rows)

    def table(self) -> str:
        lines = [f"collectives per training step on one rank (tp={self.tp_size}, "
                 f"sequence_parallel={self.sequence_parallel})"]
        if not self.rows:  # none issued and none needed: tp 1 (no ep axis) computes as one device does
            lines.append(f"tp {self.tp_size}: no collectives (single-device computation)")
        else:
            lines.append(f"{'phase':<10} {'collective':<15} {'count':>6} {'minimum':>8} {'MiB':>10} {'min MiB':>10}")
        for r in self.rows:
            flag = "" if (r.count, r.bytes) == (r.min_count, r.min_bytes) else "  <- above minimum"
            lines.append(f"{r.phase:<10} {r.op:<15} {r.count:>6} {r.min_count:>8} {r.bytes / 2**20:>10.3f} "
                         f"{r.min_bytes / 2**20:>10.3f}{flag}")
        lines.append(f"full-logit collectives: {self.full_logit_collectives}; saved activations: "
                     f"{self.saved_activation_bytes / 2**20:.2f} MiB")
        return "\n".join(lines)


def _expert_dispatch(model: nn.Module, plan: dict[str, str], tokens: int, tp: int) -> dict[str, str]:
    """{MoE block name: "all_reduce" or "all_to_all"}: how each block's experts exchanged a batch of `tokens`.
    Summed partial outputs (expert TP, expert parallelism by all-reduce, or an all-to-all block given tokens that do
    not split into `tp` equal shares) cost a column-parallel boundary (shared with a shared expert's gate/up) and one
    row-parallel sum each."""
    out = {}
    for name in plan:
        dispatch = getattr(model.get_submodule(name), "tp_dispatch", None)
        if dispatch is not None:
            out[name.rpartition(".")[0]] = "all_reduce" if dispatch == "all_to_all" and tokens % tp else dispatch
    return out


def _boundaries(model: nn.Module, plan: dict[str, str], summed: set[str] = frozenset()) -> tuple[list[int], int]:
    """(the input features of each column-parallel boundary, row-parallel sums) of a resolved plan. Siblings reading
    the block's input share a boundary (q/k/v, gate/up), and a shared expert's gate/up share their MoE block's; a
    colwise module that reads a sibling's output has a boundary of its own, as wide as its input: its parent's
    `tp_pairs` name the sibling (MLA's q_b_proj after q_a_layernorm, kv_b_proj after kv_a_layernorm), or, on
    transformers' modules, which declare no such pair, its input is narrower than the residual stream's hidden_size."""
    hidden = model.config.hidden_size
    widths = {(name, None): hidden for name in summed}
    for name, style in plan.items():
        if issubclass(STYLES[style], ColwiseParallel):
            parent, _, child = name.rpartition(".")
            block = parent.rpartition(".")[0]
            if block in summed:
                continue
            width = getattr(model.get_submodule(name), "in_features", hidden)
            source = contract.pairs(model.get_submodule(parent)).get(child) or (child if width != hidden else None)
            widths[(parent, source)] = width
    exits = sum(STYLES[style].sums_output for style in plan.values()) + len(summed)
    return list(widths.values()), exits


def _replicated_tails(model: nn.Module, plan: dict[str, str], how: str = "gradient_summed") -> list[int]:
    """The features each module whose style does `how` with them (`ParallelStyle.replicated_tail`) has every rank's
    heads read whole (MLA's shared RoPE key): "gradient_summed" ('mla_kv_a_proj'), one backward all-reduce of
    (batch, seq, features) each; "sequence_gathered" ('sequence_gather', under SP), one forward all-gather and one
    backward reduce-scatter."""
    return [contract.replicated_tail(model.get_submodule(name)) for name, style in plan.items()
            if STYLES[style].replicated_tail == how]


def _add_all_to_all(add, model: nn.Module, blocks: list[str], tokens: int, tp: int, act_size: int,
                    weight_size: int, tracker: CommTracker | None, *, sp: bool = False) -> None:
    """`add` what dispatching by all-to-all over the TP group sends from this rank (see the module doc; under SP the
    share is the rank's sequence shard: no all-gather). The rows this rank's experts received are the ones `tracker`
    saw noted over the TP group (every router's choice, the group-limited one's too)."""
    hidden, k = model.config.hidden_size, model.config.num_experts_per_tok
    share = tokens // tp
    received = _rows_received(tracker, model.parallel.tp.ctx.group_name)
    rows_out, row, n = share * k, hidden * act_size, len(blocks)
    experts = sum(model.get_submodule(name).experts.num_experts for name in blocks)
    add(("forward", "all_to_all"), 3 * n, experts * 8 + (n * rows_out + received) * row)
    add(("backward", "all_to_all"), 2 * n, (n * rows_out + received) * row)
    if not sp:
        add(("forward", "all_gather"), n, n * share * row)
        add(("backward", "all_gather"), 2 * n, n * (share * row + share * k * weight_size))


def _has_shared_expert(plan: dict[str, str], block: str) -> bool:
    """Whether MoE block `block` has a column-parallel child besides its experts (a shared expert's gate/up)."""
    return any(name.startswith(f"{block}.") and issubclass(STYLES[style], ColwiseParallel) for name, style in plan.items())


def _add_router_aux(add, model: nn.Module, dtype: torch.dtype) -> None:
    """`add` the router aux loss's sums over the token shards (see the module doc): over cp and over tp under SP."""
    if not getattr(model.config, "output_router_logits", False) or contract.router_aux(model) is None:
        return
    wide = torch.promote_types(dtype, torch.float32).itemsize
    ctx, cp = model.parallel.tp.ctx, model.parallel.cp
    for over in ((ctx.size > 1 and ctx.sequence_parallel), cp is not None):
        if over:
            add(("router_aux", "all_reduce"), 1, (model.config.num_experts + 1) * wide)
    if ctx.size > 1 and ctx.sequence_parallel:  # the share summed over tp: every tp rank's loss whole
        add(("forward", "all_reduce"), 1, wide)
    if cp is not None:  # out.aux_loss (fp32) summed over cp
        add(("forward", "all_reduce"), 1, 4)


def _rows_received(tracker: CommTracker | None, group: str) -> int:
    if tracker is None:
        raise ValueError("the minimum of an expert dispatch by all-to-all depends on the rows the other ranks' "
                         "routing sent here: pass the CommTracker that recorded the step (megatron_minimum(..., "
                         "tracker=)), or use comm_report")
    return tracker.noted("rows_received", group)


def _add_ep_dispatch(add, model: nn.Module, plan: dict[str, str], tokens: int, act_size: int,
                     tracker: CommTracker | None) -> None:
    """`add` the ep axis's dispatch (see the module doc): per MoE block, forward the counts, one row per assignment
    out and one per row received back; backward the two reverse exchanges. The rows received are the ones
    `tracker` saw noted over the ep group in forward, every block's together."""
    hidden, k = model.config.hidden_size, getattr(model.config, "num_experts_per_tok", 0)
    blocks = [name for name in plan if getattr(model.get_submodule(name), "ep_dispatch", None) == "all_to_all"]
    if not blocks:
        return
    received = _rows_received(tracker, model.parallel.tp.ctx.ep_group_name)
    rows = (len(blocks) * tokens * k + received) * hidden * act_size
    counts = sum(_global_experts(model, name) for name in blocks) * 8  # one int64 per expert of the group
    add(("forward", "all_to_all"), 3 * len(blocks), counts + rows)
    add(("backward", "all_to_all"), 2 * len(blocks), rows)


def _global_experts(model: nn.Module, name: str) -> int:
    """How many experts the stacked-experts module `name` holds over all ranks (its stacks' global dim 0; a module's
    own `num_experts` may count only its share)."""
    first = next(n for n, _ in model.get_submodule(name).named_parameters(recurse=False))
    return model.parallel.tp.global_shapes[f"{name}.{first}"][0]


def _fused_loss_chunks(model: nn.Module, tokens: int, return_logits: bool) -> int:
    """Chunks of tokens the vocab-parallel loss fused with the head takes; 0: the loss is computed from logits."""
    if return_logits or not getattr(model, "fuses_head_loss", lambda: False)():
        return 0
    return -(-tokens // chunk_tokens(model.get_output_embeddings().weight.shape[0]))


def _add_context_parallel(add, model: nn.Module, batch: int, seq: int, dtype: torch.dtype) -> int:
    """`add` the cp group's collectives (see the module doc); returns the tokens per row this rank computes."""
    ctx = model.parallel.cp
    if ctx is None:
        return seq
    config, tp = model.config, model.parallel.tp.ctx.size
    layers = sum(isinstance(m, contract.TPAttention) for m in model.modules())
    heads = max(1, contract.kv_heads(config) // tp)  # K and V side by side, per token
    kv = batch * heads * sum(contract.key_value_head_dims(config)) * dtype.itemsize
    add(("forward", "all_gather"), layers, layers * kv * seq // ctx.size)
    add(("backward", "all_gather"), layers, layers * kv * seq // ctx.size)  # gathered again, not kept
    add(("backward", "reduce_scatter"), layers, layers * kv * seq)
    wide = torch.promote_types(dtype, torch.float32).itemsize
    add(("forward", "all_reduce"), 1, wide)  # the loss
    if model.parallel.grad_sync.mode == "backward":  # not the experts split over ep (whole on their owners)
        specs = model.parallel.tp.specs
        trained = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad
                      and not (n in specs and specs[n].ep_split))
        add(("grad_sync", "all_reduce"), 1, trained * wide)
    return seq // ctx.size


def megatron_minimum(model: nn.Module, batch: int, seq: int, *, return_logits: bool = False,
                     tracker: CommTracker | None = None) -> dict[tuple[str, str], tuple[int, int]]:
    """{(phase, collective): (count, bytes)} one rank must send for one forward + backward with labels
    (`model(ids, labels=labels, return_logits=return_logits)` in the model's current mode). Experts dispatched
    over an ep axis need the `tracker` that recorded that step (the rows the routing sent here)."""
    layout = state_of(model).tp
    if layout is None:
        return {}
    dtype = next(model.parameters()).dtype
    out: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))

    def add(key, count, nbytes):
        c, b = out[key]
        out[key] = (c + count, b + nbytes)

    _add_router_aux(add, model, dtype)
    seq = _add_context_parallel(add, model, batch, seq, dtype)
    _add_ep_dispatch(add, model, layout.plan, batch * seq, dtype.itemsize, tracker)  # this rank's tokens
    if layout.ctx.size == 1:
        return dict(out)
    tp, sp = layout.ctx.size, layout.ctx.sequence_parallel
    act = batch * seq * model.config.hidden_size * dtype.itemsize  # one (batch, seq, hidden) activation
    token_bytes = batch * seq * torch.promote_types(dtype, torch.float32).itemsize  # one float per token
    dispatch = _expert_dispatch(model, layout.plan, batch * seq, tp)
    summed = {name for name, how in dispatch.items() if how == "all_reduce"}
    widths, exits = _boundaries(model, layout.plan, summed)
    enters, entered = len(widths), sum(widths) * act // model.config.hidden_size  # the boundaries' input bytes
    chunks = _fused_loss_chunks(model, batch * seq, return_logits) if layout.vocab_parallel_loss else 0
    if sp:
        add(("forward", "reduce_scatter"), exits, exits * act)
        add(("forward", "all_gather"), enters, entered // tp)
        # the fused loss keeps no head input (its gradients are made in forward), nor does an MoE block without a
        # shared expert keep its gathered input (its experts save their rows)
        unsaved = (chunks > 0) + sum(not _has_shared_expert(layout.plan, name) for name in summed)
        add(("backward", "all_gather"), exits + enters - unsaved, (exits * act + entered - unsaved * act) // tp)
        add(("backward", "reduce_scatter"), enters, entered)
        gathered = _replicated_tails(model, layout.plan, "sequence_gathered")
        add(("forward", "all_gather"), len(gathered), sum(gathered) * act // model.config.hidden_size // tp)
        add(("backward", "reduce_scatter"), len(gathered), sum(gathered) * act // model.config.hidden_size)
    else:
        add(("forward", "all_reduce"), exits, exits * act)
        add(("backward", "all_reduce"), enters, entered)
    tails = _replicated_tails(model, layout.plan)
    if tails:
        add(("backward", "all_reduce"), len(tails), sum(tails) * act // model.config.hidden_size)
    if layout.vocab_parallel_loss:  # the max, then [target, sum-exp], per chunk (whole logits: one chunk)
        add(("forward", "all_reduce"), 2 * max(chunks, 1), 3 * token_bytes)
    if dispatch:
        _add_routing(add, model, dispatch, batch * seq, tp, sp, dtype, tracker)
    norms = sum(STYLES[style].token_all_reduces for style in layout.plan.values())
    if norms:  # norms over split features: the sum of squares, and its gradient
        add(("forward", "all_reduce"), norms, norms * token_bytes)
        add(("backward", "all_reduce"), norms, norms * token_bytes)
    _add_grad_sync(add, model, layout, tp, dtype)
    return dict(out)


def _add_routing(add, model: nn.Module, dispatch: dict[str, str], tokens: int, tp: int, sp: bool,
                 dtype: torch.dtype, tracker: CommTracker | None) -> None:
    """`add` what the MoE blocks' routing costs over TP (see the module doc): the summing blocks' routing weights
    (under SP their ids too), the all-to-all blocks' dispatch."""
    fp32 = getattr(model.config, "router_weights_in_float32", False)
    weight_size = (torch.promote_types(dtype, torch.float32) if fp32 else dtype).itemsize
    summed = {name for name, how in dispatch.items() if how == "all_reduce"}
    routing = len(summed) * tokens * model.config.num_experts_per_tok  # (tokens, top_k) per summing MoE block
    if summed and sp:  # the shard's ids and weights gathered with the input, the weights' gradient scattered back
        add(("forward", "all_gather"), 2 * len(summed), routing * (8 + weight_size) // tp)
        add(("backward", "reduce_scatter"), len(summed), routing * weight_size)
    elif summed:  # the routing weights' gradient summed over TP once per MoE block
        add(("backward", "all_reduce"), len(summed), routing * weight_size)
    dispatched = sorted(set(dispatch) - summed)
    if dispatched:
        _add_all_to_all(add, model, dispatched, tokens, tp, dtype.itemsize, weight_size, tracker, sp=sp)


def _add_grad_sync(add, model: nn.Module, layout, tp: int, dtype: torch.dtype) -> None:
    """The grad sync's one bucketed all-reduce of the trained parameters' partial gradients (fp32 at least)."""
    params = dict(model.named_parameters())
    sync = [(part, piece) for n, s in layout.partial_grad_specs().items() if n in params and params[n].requires_grad
            for part, piece in s.local_parts(params[n].detach(), tp) if part.partial_grad]  # fused: its KV parts
    if sync:
        grad_dtype = torch.promote_types(dtype, torch.float32)
        add(("grad_sync", "all_reduce"), 1,
            sum(piece.numel() * s.num_chunks(tp) for s, piece in sync) * grad_dtype.itemsize)


def comm_report(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, **forward_kwargs) -> CommReport:
    """Run one training forward + backward of `model` (every TP rank must call it with the same
    shapes), recording each collective and the saved-activation bytes. Gradients are accumulated into
    `.grad` as by any backward: call it between optimizer steps and zero the gradients afterwards."""
    with CommTracker() as tracker:
        with SavedTensorMeter(model.parameters()) as meter:
            loss = model(input_ids, labels=labels, **forward_kwargs).loss
        saved = meter.bytes
        loss.backward()
    counted: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in tracker.records:
        counted[(r.phase, r.op)][0] += 1
        counted[(r.phase, r.op)][1] += r.bytes
    minimum = megatron_minimum(model, *input_ids.shape[:2], return_logits=forward_kwargs.get("return_logits", False),
                               tracker=tracker)
    keys = sorted(set(counted) | set(minimum), key=lambda k: (_PHASES.index(k[0]) if k[0] in _PHASES else 9, k[1]))
    rows = [CommRow(p, op, *counted.get((p, op), (0, 0)), *minimum.get((p, op), (0, 0))) for p, op in keys]
    tp = getattr(model, "tp_size", 1)
    vocab = getattr(model.config, "vocab_size", None)
    # Activations end in hidden_size; a last dim of vocab (or this rank's vocab shard) is logits.
    logit_dims = ({vocab, vocab // tp} if vocab else set()) - {model.config.hidden_size}
    full_logits = sum(len(r.shape) > 1 and r.shape[-1] in logit_dims for r in tracker.records)
    return CommReport(tp, state_of(model).sequence_parallel, rows, saved, full_logits)
