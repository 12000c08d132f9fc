"""Token dispatch and combine by all-to-all: each (token, expert) row sent to the rank holding the expert, run there,
and sent back, for any stacked-experts module, named only through two facts about it: how many experts the ranks of
the group hold together (in rank order, the same number each) and `grouped(rows, counts)`, the held experts applied
to rows sorted by held expert (`counts[i]` rows for the i-th held one), unweighted. tptrain's own `Experts.grouped`
is one; the transformers backend passes transformers' experts forward called on local ids with weight 1
(tptrain/hf/styles.py). The styles choosing these live in parallel/expert_parallel.py and parallel/styles/local.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from tptrain.distributed import comm

if TYPE_CHECKING:  # the styles import this module
    from tptrain.parallel.styles.context import TPContext

Grouped = Callable[[torch.Tensor, list[int]], torch.Tensor]


def dispatch_and_combine(grouped: Grouped, num_experts: int, x: torch.Tensor, expert_ids: torch.Tensor,
                         weights: torch.Tensor, ctx: "TPContext") -> torch.Tensor:
    """The block output, x's shape, on every rank of the TP group, each rank routing only its share of the tokens to
    the `num_experts` experts held over the group.

    x (..., tokens along the dim before hidden, hidden): (tokens, hidden) or (batch, seq, hidden), whole on every
    rank; expert_ids, weights (all tokens, k). The shares are cut along the dim before hidden (the sequence of a
    (batch, seq, hidden) block input), which must split into equal shares. Forward: the share's `exchange` over the
    TP group and one all-gather of the shares (a tensor of its own, x's shape); backward: the reverse all-to-alls
    and the all-gather of the input share's gradient.
    """
    p, group, dim = ctx.size, ctx.group_name, x.dim() - 2
    assert x.shape[dim] % p == 0, f"{x.shape[dim]} tokens do not split into {p} equal shares"
    routing = x.shape[:-1] + (expert_ids.shape[-1],)  # (..., k): each token's routing where x holds the token
    x, weights = comm.split_to_tp(x, group, dim), comm.split_to_tp(weights.view(routing), group, dim)  # the share
    ids = expert_ids.view(routing).chunk(p, dim)[ctx.rank]
    combined = exchange(grouped, num_experts, x, ids.flatten(0, -2), weights.flatten(0, -2), group, p)
    return comm.gather_from_tp(combined, group, dim=dim)


def exchange(grouped: Grouped, num_experts: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
             group: str, p: int) -> torch.Tensor:
    """This rank's tokens x (..., hidden) through their experts, the `num_experts` held by the p ranks of `group`
    (num_experts / p each, in rank order): x's shape (a tensor of its own), the weighted sum over each token's
    experts (partial over tp when the owners hold a TP slice of each expert). expert_ids, weights (tokens, k) in x's
    token order. One all-to-all of per-expert counts, one of the rows (to the owners), one of the results (back).
    Ranks whose experts get no row still take part, with empty splits."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (tokens, hidden)
    k, held = expert_ids.shape[1], num_experts // p
    flat = expert_ids.flatten()
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, so by owner rank
    sent = torch.bincount(flat, minlength=num_experts)  # (experts,) rows to each expert
    got = comm.exchange_counts(sent, group).view(p, held)  # rows each source sends to each expert held here
    send_splits = sent.view(p, held).sum(1).tolist()
    recv_splits = got.sum(1).tolist()
    rows = comm.dispatch_to_ranks(x[order // k], group, send_splits, recv_splits)  # by (source, expert)
    comm.note("rows_received", rows.shape[0], group)  # comm_report: the rows sent back are the others' routing
    held_ids = torch.arange(held, device=got.device).repeat(p)  # (source, expert) blocks -> the expert held here
    by_expert = torch.sort(torch.repeat_interleave(held_ids, got.flatten()), stable=True).indices
    ran = grouped(rows[by_expert], got.sum(0).tolist())  # (rows, hidden), by expert
    out = ran.new_empty(ran.shape)
    out[by_expert] = ran
    back = comm.dispatch_to_ranks(out, group, recv_splits, send_splits)  # in `order`
    combined = x.new_zeros(shape)
    combined.view(-1, shape[-1]).index_add_(0, order // k, (back * weights.flatten()[order, None]).to(x.dtype))
    return combined


def depends_on(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`out` plus a zero term of each input (one element of it): transformers' eager experts loop runs only the
    experts some row reached, so on a rank none reached, its output is new zeros outside the autograd graph. That
    rank's backward would then skip the collectives at its inputs' boundaries that the other ranks run (a mismatched
    collective: a crash or a hang), and its experts would get no gradient at all, where one process gives the whole
    stack one (zero rows for the experts no token reached): AdamW would skip their weight decay and step count."""
    for t in inputs:
        out = out + 0 * t.reshape(-1)[:1].sum()
    return out


def grouped_by_forward(module: torch.nn.Module, forward: Callable) -> Grouped:
    """`grouped` of an experts module whose forward(x, ids, weights) takes the ids of the experts it holds (0 ..
    held - 1): each row through its expert, weight 1 (the weighted sum is `exchange`'s)."""
    def grouped(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        held = torch.arange(len(counts), device=rows.device)
        ids = torch.repeat_interleave(held, torch.tensor(counts, device=rows.device))[:, None]  # (rows, 1)
        return depends_on(forward(module, rows, ids, rows.new_ones(ids.shape)), rows, *module.parameters())

    return grouped
