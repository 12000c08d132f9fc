"""The batches tests feed: one labelled-batch builder (each file's batch is it with a vocabulary, a shape, a seed and
the positions whose labels are ignored), the families' batch (vocab 128, 2 x 12, in every family file), each data-
parallel rank's batch beside their concatenation, and context parallelism's packed documents."""
from __future__ import annotations

import torch

from tests.helpers.configs import CP_TINY, VOCAB

B, S = 2, 12  # the families' batch
FIRST_THREE = ((0, slice(None, 3)),)  # row 0's first 3 labels ignored
# every row's first 3 labels and 3 near the end of row 1 ignored
FAMILY_IGNORED = ((slice(None), slice(None, 3)), (1, slice(-4, -1)))
PACKED_SEQ = 16  # 2 x cp chunks at cp 2 and cp 4


def labelled_batch(vocab: int, seed: int = 1, b: int = 2, s: int = 16, *,
                   ignored: tuple = FIRST_THREE) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): (b, s) random ids below `vocab` (a generator seeded `seed`), labels the ids with -100 at each
    index of `ignored` (labels[index] = -100), so ignored positions are tested too."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    for index in ignored:
        labels[index] = -100
    return ids, labels


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The families' (ids, labels): vocab 128, 2 x 12, with some -100 labels."""
    return labelled_batch(VOCAB, seed, B, S, ignored=FAMILY_IGNORED)


def dp_batches(dp=None, seed: int = 2):
    """(ids, labels) this rank feeds and (all ids, all labels, token count) one process feeds: `batch(seed)` without
    data parallelism; over `dp` (a process-group mesh) each rank its own batch (seed 10 + rank), one process their
    concatenation (every loss then normalised by the global token count)."""
    if dp is None:
        ids, labels = all_ids, all_labels = batch(seed=seed)
    else:
        parts = [batch(seed=10 + r) for r in range(dp.size())]
        ids, labels = parts[dp.get_local_rank()]
        all_ids, all_labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return ids, labels, all_ids, all_labels, int((all_labels[:, 1:] != -100).sum())


def packed_batch(seed: int = 0, seq: int = PACKED_SEQ, *, packed: bool = True) -> dict[str, torch.Tensor]:
    """Two rows of packed documents (position ids restarting inside each row; every document longer than
    tests.helpers.configs.CP_FAMILIES' windows), each document's first label -100 as packing makes them, and a few
    more -100. `packed=False`: one document per row, no position ids (plain causal attention)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CP_TINY["vocab_size"], (2, seq), generator=g)
    lengths = ([7, seq - 7], [5, 6, seq - 11])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = ids.clone()
    labels[positions == 0] = -100
    labels[1, 2] = -100
    if not packed:
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
