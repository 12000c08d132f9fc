"""Evaluation: the loss and perplexity over a whole eval set, the same at every TP / DP layout.

    metrics = evaluate_loss(model, dataset, batch_size=8, mesh=mesh, device=device, pad_id=eos)
    # {"eval_loss": token-mean loss over every real target token, "eval_ppl": exp(eval_loss), "eval_tokens": n}

Data-parallel rank r takes the r-th contiguous share of the rows; every rank runs the same number of
forward passes (a rank past the end runs a row whose labels are all -100), because FSDP's all-gathers
need every rank in each one. Each forward returns its token SUM (num_items_in_batch=1); the sums and
the token counts go through one all-reduce over dp, so the result is sum / count over the whole set.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from tptrain.distributed import comm
from tptrain.distributed.topology import dp_mesh
from tptrain.losses import IGNORE_INDEX, shift_labels
from tptrain.training.sft_data import collate
from tptrain.training.step import model_inputs


def split_dataset(dataset: Any, fraction: float, seed: int) -> tuple["Rows", "Rows"]:
    """(train, eval): a seeded random `fraction` of the rows (at least one) held out for evaluation."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"eval_split (--eval-split) must be in (0, 1), got {fraction}")
    n = len(dataset)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise ValueError(f"eval_split={fraction} of {n} row(s) leaves nothing to train on; lower it or add data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(order[:n_eval])
    kept = sorted(order[n_eval:])
    return Rows(dataset, kept), Rows(dataset, held)


class Rows:
    """A view of some rows of a dataset (keeps its attributes, e.g. num_tokens)."""

    def __init__(self, dataset: Any, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.indices[index]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def _ignored(item: Any) -> Any:
    """`item` with no target: a placeholder forward for a rank with no rows left."""
    if isinstance(item, torch.Tensor):
        return {"input_ids": item, "labels": torch.full_like(item, IGNORE_INDEX)}
    return {**item, "labels": torch.full_like(item["labels"], IGNORE_INDEX)}


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, dataset: Any, *, batch_size: int, mesh: Any, device: torch.device,
                  pad_id: int, multiple: int = 1, autocast: Callable[[], Any] = contextlib.nullcontext
                  ) -> dict[str, float]:
    """eval_loss / eval_ppl / eval_tokens over all of `dataset` (every rank calls it)."""
    dp = dp_mesh(mesh)
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    share = math.ceil(len(dataset) / dp_size)
    mine = list(range(dp_rank * share, min(len(dataset), (dp_rank + 1) * share)))
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, target tokens)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, share, batch_size):
            rows = [dataset[i] for i in mine[start:start + batch_size]] or [_ignored(dataset[0])]
            items = [r if isinstance(r, dict) else {"input_ids": r, "labels": r} for r in rows]
            batch = {k: v.to(device) for k, v in collate(items, pad_id=pad_id, multiple=multiple).items()}
            count = int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
            with autocast():
                loss = model(batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                             num_items_in_batch=1, **model_inputs(batch)).loss
            totals[0] += loss.to(torch.float64) if count else 0.0
            totals[1] += count
    finally:
        model.train(was_training)
    return _summed(totals, dp)


@torch.no_grad()
def evaluate_pipeline(pipeline: Any, dataset: Any, *, batch_size: int, seq_len: int, mesh: Any,
                      device: torch.device, pad_id: int) -> dict[str, float]:
    """`evaluate_loss` through a pipeline's schedule (forward only, `pipeline.step(train=False)`): every batch is
    padded to the training shape (`batch_size` rows of `seq_len` tokens, the padding ignored), the one its stages
    exchange. The loss sums come from the last stage: summed over pp, then over dp with the token counts."""
    dp = dp_mesh(mesh)
    share = math.ceil(len(dataset) / dp.size())
    mine = list(range(dp.get_local_rank() * share, min(len(dataset), (dp.get_local_rank() + 1) * share)))
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, target tokens)
    model = pipeline.model
    was_training = model.training
    model.eval()
    try:
        for start in range(0, share, batch_size):
            rows = [dataset[i] for i in mine[start:start + batch_size]]
            items = [r if isinstance(r, dict) else {"input_ids": r, "labels": r} for r in rows]
            items += [_ignored(dataset[0])] * (batch_size - len(items))  # every batch of the one shape
            batch = _pad_to(collate(items, pad_id=pad_id, length=seq_len, rows=True), seq_len, pad_id)
            totals[1] += int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
            loss = pipeline.step({k: v.to(device) for k, v in batch.items()}, 1, train=False)
            comm.all_reduce(loss, mesh["pp"].get_group(), phase="eval")  # held by the last stage's ranks
            totals[0] += loss
    finally:
        model.train(was_training)
    return _summed(totals, dp)


def _summed(totals: torch.Tensor, dp: Any) -> dict[str, float]:
    """The metrics of every data-parallel rank's (loss sum, target tokens)."""
    comm.all_reduce(totals, dp.get_group(), phase="eval")
    if totals[1] == 0:
        raise ValueError("the eval set has no target token (every label is -100); check eval_dataset")
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(totals[1].item())}


def _pad_to(batch: dict[str, torch.Tensor], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad every row to `seq_len` tokens: pad ids, ignored labels, positions continuing the last document."""
    extra = seq_len - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    out = {"input_ids": torch.nn.functional.pad(batch["input_ids"], (0, extra), value=pad_id),
           "labels": torch.nn.functional.pad(batch["labels"], (0, extra), value=IGNORE_INDEX)}
    if batch.get("position_ids") is not None:
        last = batch["position_ids"][:, -1:]
        out["position_ids"] = torch.cat([batch["position_ids"], last + torch.arange(1, extra + 1)], dim=1)
    return out
