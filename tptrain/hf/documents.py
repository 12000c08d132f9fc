"""Packed documents through the token mixers outside attention: each document run as its own row, as if alone.

A packed row holds several documents, each starting where a position id is not its predecessor's plus one
(transformers' rule, `find_packed_sequence_indices`). Attention keeps them apart by its mask; a recurrence (Mamba,
gated DeltaNet, lightning attention, Kimi's KDA) or a short convolution would carry its state, or its window, from
one document into the next. So while a forward of a packed batch runs, each module of the model's
`cp_whole_sequence` fact (parallel/contract.py: a mixer called with (batch, seq, ...) tensors, returning
(batch, seq, ...) or a tuple led by one, each token's output depending on the earlier tokens of its row only) runs
on (documents, longest document, ...) rows instead: every document a row of its own, right-padded with zeros
(which a causal mixer cannot carry back to earlier positions), its output put back in (batch, seq, ...) order. The
result is each document run alone, exactly. A batch whose rows do not restart runs as it is (no copy).

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


@dataclass(frozen=True)
class Documents:
    """The documents of a (batch, seq) batch: `count` of them, the longest `longest` tokens; `rows`
    (count * longest,): the index into the flattened (batch * seq) tokens of each place of the (count, longest) rows
    (batch * seq: padding); `places` (batch * seq,): each token's place in the flattened rows."""

    batch: int
    seq: int
    count: int
    longest: int
    rows: torch.Tensor
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
        first = token[starts]  # (count,) where each document starts
        lengths = torch.diff(first, append=first.new_tensor([batch * seq]))
        count, longest = first.numel(), int(lengths.max())
        places = document * longest + token - first[document]
        rows = torch.full((count * longest,), batch * seq, dtype=torch.long, device=positions.device)
        rows[places] = token
        return cls(batch, seq, count, longest, rows, places)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(batch or 1, seq, ...) -> (count, longest, ...): each document a row, right-padded with zeros."""
        flat = x.expand(self.batch, *x.shape[1:]).reshape(self.batch * self.seq, *x.shape[2:])
        padded = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return padded.index_select(0, self.rows).view(self.count, self.longest, *x.shape[2:])

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """(count, longest, ...) -> (batch, seq, ...): the tokens back in their rows (the padding dropped)."""
        flat = y.reshape(self.count * self.longest, *y.shape[2:])
        return flat.index_select(0, self.places).view(self.batch, self.seq, *y.shape[2:])

    def holds(self, x: Any) -> bool:
        """Whether `x` is a (batch or 1, seq, ...) tensor of this batch (what `split` takes)."""
        return torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == self.seq and x.shape[0] in (1, self.batch)


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

        def split(x: Any) -> Any:
            if isinstance(x, tuple):
                return tuple(split(y) for y in x)
            return documents.split(x) if documents.holds(x) else x

        out = self.forward(*split(args), **{k: split(v) for k, v in kwargs.items()})
        return _joined(out, documents, self.name)


def _joined(out: Any, documents: Documents, name: str) -> Any:
    """A mixer's (count, longest, ...) output (a tensor or a tuple led by one) back in (batch, seq, ...) rows."""
    head = out[0] if isinstance(out, tuple) else out
    rows = (documents.count, documents.longest)
    if not torch.is_tensor(head) or tuple(head.shape[:2]) != rows:
        raise TypeError(f"{name} mixes the tokens of packed documents and must return a (documents, tokens, ...) "
                        f"tensor, or a tuple led by one, for its (documents, tokens, ...) inputs {rows}; it returned "
                        f"{tuple(head.shape) if torch.is_tensor(head) else type(head).__name__}; train without "
                        f"packing (packing=False, --no-packing)")

    def join(x: Any) -> Any:
        return documents.join(x) if torch.is_tensor(x) and tuple(x.shape[:2]) == rows else x

    return tuple(join(x) for x in out) if isinstance(out, tuple) else join(out)


def run_per_document(model: torch.nn.Module, names: list[str], *, refusal: str | None = None) -> PackedForward:
    """Make each module `names` of `model` (its token mixers outside attention) run per document while a packed batch
    runs; returns what the model's forwards ask for a batch's documents and set the running ones on."""
    packed = PackedForward(model, list(names), refusal)
    for name in packed.mixers:
        module = model.get_submodule(name)
        module.forward = PerDocument(module.forward, packed, f"{name} ({type(module).__name__})")
    return packed
