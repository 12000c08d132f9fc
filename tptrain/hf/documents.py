"""Packed documents through the token mixers outside attention: each document run as its own row, as if alone.

A packed row holds several documents, each starting where a position id is not its predecessor's plus one
(transformers' rule, `find_packed_sequence_indices`). Attention keeps them apart by its mask; a recurrence (Mamba,
gated DeltaNet, lightning attention, Kimi's KDA) or a short convolution would carry its state, or its window, from
one document into the next. So while a forward of a packed batch runs, each module of the model's
`cp_whole_sequence` fact (parallel/contract.py: a mixer called with (batch, seq, ...) tensors, returning
(batch, seq, ...) or a tuple led by one, each token's output depending on the earlier tokens of its row only) runs
on (documents, longest document, ...) rows instead: every document a row of its own, right-padded with zeros
(which a causal mixer cannot carry back to earlier positions), its output put back in (batch, seq, ...) order; the
documents in groups of similar length (one call of the mixer each), so padding at most doubles its work. The result
is each document run alone, exactly. A batch whose rows do not restart runs as it is (no copy).

Under context parallelism the mixer already runs on the whole sequence gathered over cp, around this: the gather
is the engine's pre-hook, the regrouping is inside the module's forward, this rank's rows are the engine's hook.

Where a forward runs (TransformersCausalLM's forward and pipeline stages), the model holds its batch's documents
(`PackedForward.running`); activation checkpointing recomputes a layer in backward, after the forward is over, so
the documents of the forward that saved it are restored around the recompute (`context_fn`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tptrain.hf.attention import per_document_mixers, use_tptrain_attention
from tptrain.hf.probe import masks_see_positions


@dataclass(frozen=True)
class Documents:
    """The documents of a (batch, seq) batch, in groups of similar length (the longest of a group at most twice its
    shortest, so its padding at most doubles a mixer's work; one long document beside many short ones pads none of
    them to its length): `shapes`, (count, longest) of each group's rows; `rows`, per group (count * longest,): the
    index into the flattened (batch * seq) tokens of each place of its rows (batch * seq: padding); `places`
    (batch * seq,): each token's place in the groups' rows, flattened one group after another."""

    batch: int
    seq: int
    shapes: tuple[tuple[int, int], ...]
    rows: tuple[torch.Tensor, ...]
    places: torch.Tensor

    @classmethod
    def of(cls, position_ids: torch.Tensor, batch: int) -> "Documents | None":
        """The documents of `position_ids` (batch or 1, seq) for a batch of `batch` rows; None when no row restarts
        (one document per row: nothing to regroup)."""
        positions = position_ids.expand(batch, -1)
        seq = positions.shape[1]
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1  # (batch, seq)
        if not bool(starts[:, 1:].any()):
            return None
        starts = starts.reshape(-1)
        token = torch.arange(batch * seq, device=positions.device)
        document = starts.cumsum(0) - 1  # (batch * seq,) the document of each token
        first = token[starts]  # (documents,) where each starts
        lengths = torch.diff(first, append=first.new_tensor([batch * seq])).tolist()
        shapes, base = _groups(lengths)
        places = torch.tensor(base, device=token.device)[document] + token - first[document]
        rows = torch.full((sum(c * n for c, n in shapes),), batch * seq, dtype=torch.long, device=token.device)
        rows[places] = token
        return cls(batch, seq, tuple(shapes), tuple(rows.split([c * n for c, n in shapes])), places)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(batch or 1, seq, ...) -> each group's (count, longest, ...): a document a row, right-padded with zeros."""
        flat = x.expand(self.batch, *x.shape[1:]).reshape(self.batch * self.seq, *x.shape[2:])
        padded = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return [padded.index_select(0, rows).view(*shape, *x.shape[2:]) for rows, shape in zip(self.rows, self.shapes)]

    def join(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """Each group's (count, longest, ...) -> (batch, seq, ...): the tokens back in their rows (padding dropped)."""
        flat = torch.cat([y.reshape(-1, *y.shape[2:]) for y in ys])
        return flat.index_select(0, self.places).view(self.batch, self.seq, *ys[0].shape[2:])

    def holds(self, x: Any) -> bool:
        """Whether `x` is a (batch or 1, seq, ...) tensor of this batch (what `split` takes)."""
        return torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == self.seq and x.shape[0] in (1, self.batch)


def _groups(lengths: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Documents of `lengths` grouped by ceil(log2(length)): ((count, longest) of each group, in order of length;
    each document's first place in the groups' rows flattened one after another)."""
    members: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        members.setdefault((n - 1).bit_length(), []).append(i)
    shapes, base, offset = [], [0] * len(lengths), 0
    for key in sorted(members):
        longest = max(lengths[i] for i in members[key])
        for row, i in enumerate(members[key]):
            base[i] = offset + row * longest
        shapes.append((len(members[key]), longest))
        offset += len(members[key]) * longest
    return shapes, base


class PackedForward:
    """A model's token mixers run per document (`mixers`, their names) or why it cannot keep packed documents apart
    (`refusal`, the model's `packing_refusal`), and the documents of the forward running on it (`current`: None, no
    packed batch running)."""

    def __init__(self, model: torch.nn.Module, mixers: list[str], refusal: str | None) -> None:
        owner = getattr(model, "hf_model", model)  # (the transformers model a TransformersCausalLM runs)
        self.name = f"{type(owner).__name__} ({getattr(owner.config, 'model_type', '?')})"
        self.mixers, self.refusal = mixers, refusal
        self.current: Documents | None = None

    def documents(self, batch: int, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, *,
                  cache: bool = False) -> Documents | None:
        """The packed documents of a whole batch of `batch` rows, from its position ids (batch or 1, seq), when no
        padding mask is given (transformers' rule for its masks: a padding mask turns the search off); None for rows
        that do not restart, or a model without mixers to run per document. ValueError for packed documents the
        model cannot keep apart, or with a cache (`cache`)."""
        if position_ids is None or attention_mask is not None or not (self.mixers or self.refusal):
            return None
        documents = Documents.of(position_ids, batch)
        if documents is not None and self.refusal:
            raise ValueError(f"{self.name} cannot keep packed documents (position ids restarting inside a row) apart: "
                             f"{self.refusal}; give one document per row (packing=False, --no-packing)")
        if documents is not None and cache:
            raise ValueError(f"{self.name}: packed documents (position ids restarting inside a row) run without a "
                             f"cache; call the model with use_cache=False")
        return documents

    def of_forward(self, batch: int, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                   cp: Any, kwargs: dict) -> Documents | None:
        """The packed documents of a forward's whole batch (`batch` rows; under context parallelism, `cp` its
        context, the whole sequence's position ids and padding mask, which the batch split keeps). None on a cache
        (`past_key_values` in the forward's `kwargs`: generation's steps continue each row, as transformers' masks
        take them); packed documents filling a new cache (`use_cache`) are refused."""
        if kwargs.get("past_key_values") is not None:
            return None
        if cp is not None:
            position_ids, attention_mask = cp.position_ids, cp.attention_mask
        return self.documents(batch, position_ids, attention_mask, cache=bool(kwargs.get("use_cache")))

    @contextlib.contextmanager
    def running(self, documents: Documents | None) -> Iterator[None]:
        previous, self.current = self.current, documents
        try:
            yield
        finally:
            self.current = previous

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's `context_fn`: nothing around the forward; the documents of this forward around
        its recompute in backward (when another forward's, or none, are running)."""
        return contextlib.nullcontext(), self.running(self.current)


class PerDocument:
    """A token mixer's forward run on each document of the running forward's packed batch as a row of its own. An
    object holding the module's forward (not a closure), so a deep copy of the module calls its own."""

    def __init__(self, forward: Callable[..., Any], packed: PackedForward, name: str) -> None:
        self.forward, self.packed, self.name = forward, packed, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        documents = self.packed.current
        if documents is None:
            return self.forward(*args, **kwargs)
        first = next((x for x in (*args, *kwargs.values()) if torch.is_tensor(x) and x.dim() >= 2), None)
        if not documents.holds(first):
            raise TypeError(f"{self.name} mixes the tokens of packed documents: it must take (batch, seq, ...) "
                            f"tensors of the batch ({documents.batch}, {documents.seq}), its first is "
                            f"{None if first is None else tuple(first.shape)}; train without packing "
                            f"(packing=False, --no-packing)")
        groups = len(documents.shapes)

        def split(x: Any) -> list[Any]:  # x as each group's
            if isinstance(x, tuple):
                return [tuple(parts) for parts in zip(*(split(y) for y in x))] if x else [()] * groups
            return documents.split(x) if documents.holds(x) else [x] * groups

        parts, named = split(args), {k: split(v) for k, v in kwargs.items()}
        outs = [self.forward(*parts[g], **{k: v[g] for k, v in named.items()}) for g in range(groups)]
        return _joined(outs, documents, self.name)


def _joined(outs: list[Any], documents: Documents, name: str) -> Any:
    """A mixer's output for each group's (count, longest, ...) rows (a tensor, or a tuple led by one) back in
    (batch, seq, ...) rows. What else a tuple holds (a final recurrent state, for a cache packed documents do not
    use; attention weights) is per document, not per token: None."""
    tupled = isinstance(outs[0], tuple)
    columns = list(zip(*outs)) if tupled else [outs]  # each output, over the groups
    if not all(torch.is_tensor(y) and tuple(y.shape[:2]) == shape for y, shape in zip(columns[0], documents.shapes)):
        got = [tuple(y.shape) if torch.is_tensor(y) else type(y).__name__ for y in columns[0]]
        raise TypeError(f"{name} mixes the tokens of packed documents and must return a (documents, tokens, ...) "
                        f"tensor, or a tuple led by one, for its (documents, tokens, ...) inputs; it returned {got} "
                        f"for {list(documents.shapes)}; train without packing (packing=False, --no-packing)")
    joined = [documents.join(list(column)) if all(torch.is_tensor(y) and tuple(y.shape[:2]) == shape for y, shape
                                                  in zip(column, documents.shapes)) else None for column in columns]
    return tuple(joined) if tupled else joined[0]


def run_per_document(model: torch.nn.Module, names: list[str], *, refusal: str | None = None) -> PackedForward:
    """Make each module `names` of `model` (its token mixers outside attention) run per document while a packed batch
    runs; returns what the model's forwards ask for a batch's documents and set the running ones on."""
    packed = PackedForward(model, list(names), refusal)
    for name in packed.mixers:
        module = model.get_submodule(name)
        module.forward = PerDocument(module.forward, packed, f"{name} ({type(module).__name__})")
    return packed


def declare_packed_documents(model: torch.nn.Module) -> PackedForward:
    """A transformers-backend model's packed documents: its token mixers outside attention (its `sequence_mixers`'
    kin, hf/attention.py) run on each document as a row of its own, or it says why it cannot keep them apart
    (`packing_refusal`, which the rule table's packed_documents reads); where transformers builds its masks without
    the position ids (they would join packed documents), tptrain's masks and attention over the forward's."""
    mixers, model.packing_refusal = per_document_mixers(model, model.sequence_mixers)
    if masks_see_positions(model.hf_model) is False:
        use_tptrain_attention(model)
    return run_per_document(model, mixers, refusal=model.packing_refusal)
