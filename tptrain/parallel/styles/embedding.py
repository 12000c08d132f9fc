"""The vocab-parallel embedding: each rank owns a contiguous slice of the vocabulary."""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from tptrain.parallel.styles.base import ParallelStyle, local_output, replace_forward, register_style
from tptrain.parallel.styles.spec import ShardSpec


def vocab_shard_ids(ids: torch.Tensor, *, rank: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ids` as indices into rank `rank`'s contiguous vocabulary slice, 0 where another rank owns the id;
    the mask of those ids owned elsewhere)."""
    start = rank * local_vocab
    outside = (ids < start) | (ids >= start + local_vocab)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, *, rank: int,
                          padding_idx: int | None = None) -> torch.Tensor:
    """F.embedding on rank `rank`'s contiguous vocabulary slice `weight` (local_vocab, dim); ids owned by another
    rank give zero rows, which the sum over ranks fills in."""
    local_vocab = weight.shape[0]
    start = rank * local_vocab
    local_ids, outside = vocab_shard_ids(ids, rank=rank, local_vocab=local_vocab)
    # The pad row gets no gradient, as in nn.Embedding; only the rank owning it has it.
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + local_vocab else None
    local = F.embedding(local_ids, weight, padding_idx=local_pad)
    return local.masked_fill(outside.unsqueeze(-1), 0.0)



@register_style
class EmbeddingRowwise(ParallelStyle):
    """Vocab-parallel embedding: each rank owns a contiguous slice of the vocabulary (weight dim 0)."""

    name = "embedding_rowwise"
    module_types = (nn.Embedding,)
    adapter_split = "input"  # the vocabulary: A split on it with the base's masking, B whole
    sums_output = True

    def param_specs(self, module):
        return {"weight": ShardSpec(0)}

    def install(self, module, ctx):
        # The module's own forward on this rank's ids (a subclass's, e.g. Gemma's scaled embedding, included), with
        # padding_idx moved to this rank's slice for the call (its row gets no gradient, as in nn.Embedding).
        class_forward = type(module).forward

        def forward(self, ids):
            local_vocab = self.weight.shape[0]
            start = ctx.rank * local_vocab
            local_ids, outside = vocab_shard_ids(ids, rank=ctx.rank, local_vocab=local_vocab)
            pad = self.padding_idx
            self.padding_idx = pad - start if pad is not None and start <= pad < start + local_vocab else None
            try:
                local = class_forward(self, local_ids)
            finally:
                self.padding_idx = pad
            local = local.masked_fill(outside.unsqueeze(-1), 0.0)
            return ctx.exit(local_output(self, ids, local))

        module._local_output_hooks = OrderedDict()  # weak-referenceable, for RemovableHandle
        replace_forward(module, forward)
