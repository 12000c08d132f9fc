"""Context parallelism: every rank of a cp group computes 1/cp of each sequence (Llama 3's all-gather CP).

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(cp_size=2))
    out = model(ids, labels=ids, position_ids=pos)   # every rank of the cp group passes the same whole batch
    out.loss.backward()                              # out.loss and every gradient: one process's

    torchrun --nproc-per-node 4 train.py             # DistributedConfig(tp_size=2, cp_size=2)

Load balancing (head-tail): the sequence is cut into 2 x cp chunks and rank i keeps chunks i and 2cp-1-i, so every
rank has the same causal work. The labels are shifted over the whole sequence BEFORE the split (a shard's last token
keeps its target), the global position ids go with the tokens (RoPE and per-layer bases see true positions;
longrope's long factors are picked by the whole batch's longest position), and each mask is the rows of the whole
sequence's mask for this rank's queries (causal, sliding window, packed documents from restarting position ids,
padding), its columns ordered as the keys are gathered.

Each attention layer all-gathers K and V over the cp group (one collective for both, side by side along the head
dim, so MLA's narrower values need no padding; with GQA they are smaller than Q, and any mask works); only this
rank's q, k and v are kept for backward, which gathers K and V again, recomputes the attention and reduce-scatters
dK/dV (`comm.on_gathered_over_cp`), so the activations kept per rank are 1/cp of one process's. Everything else is
per token (norms, MLPs, MoE routing: each rank routes its own tokens, the router aux loss's token counts summed over
cp), so it runs on the shard unchanged.

The loss: each rank's token sum over the real-token count of the WHOLE batch (each rank holds the whole batch, so
it is counted here with no collective), summed over cp (`comm.sum_over_cp`: all-reduce fwd / identity bwd), so
`out.loss` is one process's. Every parameter's gradient is then a per-rank share: the grad sync sums them over cp
at the end of backward (bare model), or FSDP2's reduce-scatter over dp_shard x cp does (the Trainer).
`out.logits` holds this rank's tokens only: (batch, seq / cp, vocab), chunks i and 2cp-1-i in that order
(`local_index`).

`CPContext` is context parallelism's part of the forward scope (tptrain/distributed/state.py), which every path
through the model runs: its begin splits a whole batch (the model's forward; a pipeline step, before the schedule cuts
it into microbatches) and starts the masks' rows from the global position ids of what the modules run on (the model's
forward; each pipeline stage's forward, on its microbatch); its end sums a whole batch's loss over cp. Each pipeline
microbatch's loss is its token sum over the step's global count, and the step's loss is summed over cp and pp.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tptrain.distributed import comm
from tptrain.distributed.state import Batch
from tptrain.distributed.topology import cp_mesh
from tptrain.layout import Spelling, check
from tptrain.losses import IGNORE_INDEX, shift_labels
from tptrain.parallel import contract


@dataclass
class CPContext:
    """One model's cp group (by name), its size and this rank; and, during a forward, the whole batch's
    position ids (batch or 1, seq) and padding mask (batch, seq) or None, this rank's token indices (seq / cp,),
    and every rank's in gathered order (seq,).

    Context parallelism's part of the forward scope: `begin(batch)` splits a whole batch (`split`: the model's forward,
    a pipeline step before torch's schedule cuts it into microbatches) and, where modules run on it (the model's
    forward, each stage's forward on its microbatch), starts the rows of the masks from its global position ids
    (`start`); `end` stops them and sums a whole batch's loss over cp."""

    group_name: str
    size: int
    rank: int
    entry: bool = False  # the model splits its sequence where it enters its text decoder (contract.sequence_entry)
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    query_index: torch.Tensor | None = None
    key_index: torch.Tensor | None = None

    def split(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> CPShard:
        """This rank's tokens of a whole batch (every tensor (batch, seq)): the labels shifted over the whole sequence
        first, so a chunk's last token keeps its target; the real-token count of the whole batch. ValueError (the
        same on every rank: each holds the batch) when the length does not split into 2 x cp chunks."""
        check_sequence_length(input_ids.shape[1], self.size,
                              what=f"input_ids' length (shape {tuple(input_ids.shape)})")
        index = local_index(input_ids.shape[1], self.size, self.rank, input_ids.device)
        target = None if labels is None else shift_labels(labels)  # (batch, seq): position t's target
        return CPShard(input_ids[:, index], None if target is None else target[:, index],
                       None if attention_mask is None else attention_mask[:, index],
                       None if target is None else (target != IGNORE_INDEX).sum())

    def start(self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, *, seq: int,
              device: torch.device) -> torch.Tensor:
        """Start a forward on this rank's tokens of sequences of `seq` tokens: the whole batch's `position_ids`
        (batch or 1, seq; None: 0..seq-1) and padding mask kept for the rows of the masks; returns this rank's
        positions (batch or 1, seq / cp), the global ones (RoPE). `stop` clears them."""
        if position_ids is None:
            position_ids = torch.arange(seq, device=device)[None]
        self.position_ids, self.attention_mask = position_ids, attention_mask
        self.query_index = local_index(seq, self.size, self.rank, device)
        self.key_index = gathered_index(seq, self.size, device)
        return position_ids[:, self.query_index]

    def stop(self) -> None:
        self.position_ids = self.attention_mask = self.query_index = self.key_index = None

    def begin(self, batch: Batch) -> Batch:
        """A whole batch -> this rank's tokens (`split`; when no count is given and labels are, the whole batch's
        real-token count as `num_items_in_batch`, so the loss is a share of one process's); where modules run on it,
        its global positions started (`start`) and this rank's given as `position_ids`. A pipeline stage's batch is
        this rank's already: its whole sequences' position ids start the masks. With an `entry` (a vision-language
        model) only the labels are split here: the ids, mask and positions reach the model whole, and the sequence is
        split where it enters the text decoder (`_entering`)."""
        mask = batch.attention_mask
        if batch.whole:
            shard = self.split(batch.input_ids, batch.labels, mask)
            changes = {} if self.entry else dict(input_ids=shard.input_ids)
            if mask is not None and not self.entry:
                changes["attention_mask"] = shard.attention_mask
            if shard.labels is not None:
                changes["labels"] = shard.labels
                if batch.num_items_in_batch is None:
                    changes["num_items_in_batch"] = shard.num_items
            seq, device = batch.input_ids.shape[1], batch.input_ids.device
        else:
            seq, device = batch.position_ids.shape[-1], batch.position_ids.device
            changes = {}
        if batch.runs:
            positions = batch.position_ids
            if self.entry:  # multimodal rows ((batch, rows, seq), (rows, batch, seq)): the masks read no positions
                positions = positions if positions is not None and positions.dim() == 2 else None
            local = self.start(positions, mask if batch.whole else None, seq=seq, device=device)
            if not self.entry:
                changes["position_ids"] = local
        return batch.replace(**changes)

    def end(self, batch: Batch, output):
        """Positions stopped; a whole batch's loss (the model's `out.loss` and router `aux_loss`, each rank's share:
        all-reduce fwd / identity bwd; a pipeline step's total, a value) summed over cp."""
        if batch.runs:
            self.stop()
        if not batch.whole or output is None:
            return output
        if not batch.runs:  # a pipeline step's loss: fp64, no graph
            return comm.all_reduce(output, comm.resolve_group(self.group_name), phase="loss")
        if getattr(output, "loss", None) is not None:
            output.loss = comm.sum_over_cp(output.loss, self.group_name)
        if getattr(output, "aux_loss", None) is not None:  # each rank's share of the router aux loss
            output.aux_loss = comm.sum_over_cp(output.aux_loss, self.group_name)
        return output

    def adopt(self, mesh: DeviceMesh) -> None:
        """Move onto `mesh` (the Trainer's): its cp group holds the same ranks, only its name changes."""
        old, new = comm.resolve_group(self.group_name), cp_mesh(mesh).get_group()
        assert dist.get_process_group_ranks(old) == dist.get_process_group_ranks(new), (old, new)
        self.group_name = comm.group_name(new)


@dataclass(frozen=True)
class CPShard:
    """This rank's tokens of a whole batch (`CPContext.split`): (batch, seq / cp) ids, shifted labels and padding
    mask (None where the batch has none), and the whole batch's real-token count (a 0-d tensor)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    attention_mask: torch.Tensor | None
    num_items: torch.Tensor | None


def check_sequence_length(seq: int, cp_size: int, *, what: str = "the sequence length") -> None:
    """ValueError unless `seq` splits into 2 x cp_size equal chunks (the head-tail load balancing; the rule table's
    `cp_seq_len`)."""
    check("cp_seq_len", cp=cp_size, seq_len=seq, spelling=Spelling(seq_len=what))


def local_index(seq: int, cp_size: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(seq / cp_size,) the sequence indices cp rank `rank` holds: chunks rank and 2cp-1-rank of 2 x cp_size."""
    chunk = seq // (2 * cp_size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp_size - 1 - rank) * chunk, (2 * cp_size - rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_index(seq: int, cp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(seq,) the sequence index of each position of a tensor all-gathered over cp in rank order (every rank's
    `local_index` in turn); its argsort puts the gathered positions back in sequence order."""
    return torch.cat([local_index(seq, cp_size, r, device) for r in range(cp_size)])


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> CPContext | None:
    """Make `model` (refused by no row of the rule table, already TP-sharded) split its sequences over the cp axis of
    `mesh`; returns its CPContext, which joins the forward scope (None: no cp axis, nothing installed). Installed:
    the K/V gather around every attention's `attend`, the whole sequence for the token mixers outside attention, the
    rows of the masks, and the loss functions on pre-shifted labels."""
    if cp_mesh(mesh) is None:
        return None
    cp_group = cp_mesh(mesh).get_group()
    entry = contract.sequence_entry(model)
    ctx = CPContext(comm.group_name(cp_group), dist.get_world_size(cp_group), dist.get_rank(cp_group),
                    entry=entry is not None)
    held = dict(model.named_modules())  # (a pipeline stage holds its own layers only)
    for name, module in held.items():
        if not contract.in_sequence(model, name):  # a vision tower: the whole batch's images, before the split
            continue
        if isinstance(module, contract.TPAttention):
            module.attend = _gathering(contract.attend(module), ctx)
        if contract.long_context(module) is not None:  # longrope: the whole sequence's length picks the factors
            module.long_context = _on_whole_sequence(contract.long_context(module), ctx)
    if entry is not None:
        held[entry].register_forward_pre_hook(functools.partial(_entering, ctx), with_kwargs=True)
    for module in (held[name] for name in contract.whole_sequence_modules(model) if name in held):
        module.register_forward_pre_hook(functools.partial(_whole_sequence_inputs, ctx), with_kwargs=True)
        module.register_forward_hook(functools.partial(_this_ranks_rows, ctx))  # recurrences, short convolutions
    base = contract.base_model(model)
    base.attention_masks = _rows_for_this_rank(contract.mask_builder(model), ctx)
    model.loss_function = _on_shifted(model.loss_function)
    if contract.has_head_loss(model):
        model.head_loss_function = _on_shifted(model.head_loss_function)
    return ctx


def _gathering(attend, ctx: CPContext):
    """`attend` on this rank's queries against every rank's keys and values (gathered in rank order). Only this
    rank's q, k and v are kept for backward, which gathers K and V again and recomputes the attention
    (`comm.on_gathered_over_cp`): the whole sequence's K and V, and what attention's backward keeps, live per layer
    only while it runs. An `attend` whose `recomputable()` says no (the transformers backend's, with attention sinks
    or dropout) keeps the gathered K and V instead."""

    def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # One collective for both, side by side: (batch, kv_heads, seq / cp, k dim + v dim). MLA's values are
        # narrower than its keys (v_head_dim < qk_nope_head_dim + qk_rope_head_dim): no padding needed.
        assert k.shape[:-1] == v.shape[:-1] and k.dtype == v.dtype, (k.shape, v.shape, k.dtype, v.dtype)
        if not getattr(attend, "recomputable", lambda: True)():  # parameters or random numbers inside: keep K and V
            kv = comm.gather_to_sp(torch.cat([k, v], dim=-1), ctx.group_name, dim=2)  # all-gather / reduce-scatter
            return _attend_all(attend, ctx, (k.shape[-1], v.shape[-1]), kv, q, mask)
        return comm.on_gathered_over_cp(functools.partial(_attend_all, attend, ctx, (k.shape[-1], v.shape[-1])),
                                        torch.cat([k, v], dim=-1), ctx.group_name, q, mask, dim=2)

    return attend_gathered


def _attend_all(attend, ctx: CPContext, widths: tuple[int, int], kv: torch.Tensor, q: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
    """`attend` of q (batch, heads, seq / cp, qk dim) against every rank's K and V, side by side in kv (batch,
    kv_heads, seq, k dim + v dim) in gathered order; mask's columns in that order, or None (plain causal)."""
    k, v = kv.split(list(widths), dim=-1)
    if mask is not None:
        return attend(q, k, v, mask)
    # Plain causal: no mask at all. The keys in sequence order; each of this rank's two chunks attends the keys up
    # to its own end, causal at the end (attend's None), so the fused kernels keep working. (Derived from the
    # shapes, not the forward's state: backward and activation checkpointing recompute this.)
    seq = k.shape[2]
    order = torch.argsort(gathered_index(seq, ctx.size, k.device))
    k, v = k.index_select(2, order), v.index_select(2, order)
    chunk = q.shape[2] // 2
    ends = (ctx.rank + 1) * chunk, (2 * ctx.size - ctx.rank) * chunk
    return torch.cat([attend(q[:, :, :chunk], k[:, :, :ends[0]], v[:, :, :ends[0]], None),
                      attend(q[:, :, chunk:], k[:, :, :ends[1]], v[:, :, :ends[1]], None)], dim=2)


def _whole_sequence_inputs(ctx: CPContext, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A token mixer outside attention (`contract.whole_sequence_modules`: a recurrence, a short convolution) is
    given the whole sequence: each of its (batch, seq / cp, ...) inputs, the length of its first tensor input,
    all-gathered over cp in sequence order (floating point: reduce-scatter in backward, so each rank's input gets
    every rank's share of its gradient; the rest, padding masks, without one). Every cp rank then runs the mixer on
    the whole sequence and keeps its own rows (`_this_ranks_rows`): its activations and compute are one process's,
    not 1/cp. Derived from the shapes, not the forward's state, as activation checkpointing runs it again."""
    first = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() >= 2), None)
    if first is None:
        return args, kwargs
    local = first.shape[1]
    order = torch.argsort(gathered_index(local * ctx.size, ctx.size, first.device))

    def whole(x):
        if isinstance(x, tuple):
            return tuple(whole(y) for y in x)
        if not torch.is_tensor(x) or x.dim() < 2 or x.shape[1] != local:
            return x
        if not x.is_floating_point():  # a padding mask (gloo gathers no bool)
            return gather_sequence(x.to(torch.int64), ctx).to(x.dtype)
        return comm.gather_to_sp(x.contiguous(), ctx.group_name, dim=1).index_select(1, order)

    return whole(args), {k: whole(v) for k, v in kwargs.items()}


def _this_ranks_rows(ctx: CPContext, module: nn.Module, args: tuple, out):
    """The whole-sequence output of a token mixer (`_whole_sequence_inputs`) -> this rank's tokens: rows
    `local_index` of dim 1 of every (batch, seq, ...) tensor of the output (a tensor or a tuple led by one)."""
    head = out[0] if isinstance(out, tuple) else out
    if not torch.is_tensor(head) or head.dim() < 2:
        raise TypeError(f"{type(module).__name__} runs on the whole sequence under context parallelism and must return "
                        f"a (batch, seq, ...) tensor or a tuple led by one; it returned {type(head).__name__}")
    seq = head.shape[1]
    index = local_index(seq, ctx.size, ctx.rank, head.device)

    def rows(x):
        return x.index_select(1, index) if torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == seq else x

    return tuple(rows(x) for x in out) if isinstance(out, tuple) else rows(out)


def _entering(ctx: CPContext, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The whole sequence entering the model's text decoder (`contract.sequence_entry`) -> this rank's tokens: of
    `inputs_embeds` (batch, seq, hidden), `position_ids` (..., seq; None: 0..seq-1) and a padding `attention_mask`
    (batch, seq), the positions `local_index` of the sequence dim. What is this rank's already (a later pipeline
    stage's hidden states) stays; a dict of built masks holds this rank's rows already (`_rows_for_this_rank`).
    Backward scatters each rank's rows of the gradient into the whole sequence, so the tower's and projector's
    gradients are this rank's share, summed over cp with every other."""
    if ctx.query_index is None:
        raise RuntimeError(f"under context parallelism {type(module).__name__} runs inside the model's forward (which "
                           f"starts the split of the sequence); call the model itself, not its text decoder")
    index, seq = ctx.query_index, len(ctx.key_index)
    kwargs = dict(kwargs)
    embeds, positions, mask = (kwargs.get(k) for k in ("inputs_embeds", "position_ids", "attention_mask"))
    if torch.is_tensor(embeds) and embeds.shape[1] == seq:
        kwargs["inputs_embeds"] = embeds.index_select(1, index)
    if positions is None:
        kwargs["position_ids"] = index[None]
    elif positions.shape[-1] == seq:
        kwargs["position_ids"] = positions.index_select(positions.dim() - 1, index)
    if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[1] == seq:
        kwargs["attention_mask"] = mask.index_select(1, index)
    return args, kwargs


def _rows_for_this_rank(attention_masks, ctx: CPContext):
    """The base model's mask builder on the whole batch's positions and padding: this rank's query rows, the keys
    in gathered order (always a mask: no rank's queries are the plain causal square)."""

    def masks(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, windows: set, **_) -> dict:
        if ctx.query_index is None:
            raise RuntimeError("under context parallelism the base model runs inside the CausalLM's forward (which "
                               "splits the batch over the cp group); call the model itself, not its base model")
        return attention_masks(ctx.position_ids, ctx.attention_mask, windows, query_index=ctx.query_index,
                               key_index=ctx.key_index)

    return masks


def _on_whole_sequence(long_context, ctx: CPContext):
    """A rotary embedding's `long_context(position_ids)` on the whole batch's positions, whichever chunks it is given."""

    def whole(position_ids: torch.Tensor) -> torch.Tensor | None:
        if ctx.position_ids is None:
            raise RuntimeError("under context parallelism the base model runs inside the CausalLM's forward (which "
                               "splits the batch over the cp group); call the model itself, not its base model")
        return long_context(ctx.position_ids)

    return whole


def _on_shifted(loss_function):
    """A loss function of the model contract, handed labels the batch split has already shifted."""

    def loss(*args, **kwargs):
        return loss_function(*args, **kwargs, shifted=True)

    return loss


def gather_sequence(t: torch.Tensor, ctx: CPContext, *, dim: int = 1) -> torch.Tensor:
    """(batch, seq / cp, ...) of this rank's tokens (`out.logits`) -> (batch, seq, ...) of every rank's, in
    sequence order. Not differentiable: for reading outputs (generation, inspection). Collective over cp."""
    full = comm.all_gather(t.contiguous(), comm.resolve_group(ctx.group_name), dim=dim)
    return full.index_select(dim, torch.argsort(gathered_index(full.shape[dim], ctx.size, t.device)))
