"""What one process computes, for the distributed runs to equal: transformers' model, logits and loss; the Trainer's
training written out by hand (the same AdamW, schedule, data order, clipping and microbatches)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from tests.helpers.batches import batch
from tests.helpers.configs import F64
from tests.helpers.trainer import tiny_dataset

if TYPE_CHECKING:
    from tptrain.training.args import TrainingArguments


def transformers_fp64(path):
    """transformers' model from `path` in fp64, eval mode, its experts (if any) through the eager loop."""
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # its grouped_mm kernels take no fp64
    return hf


def logits_and_loss(model, ids, labels) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"logits": model(ids).logits, "loss": model(ids, labels=labels).loss}


def hf_reference(hf) -> dict[str, torch.Tensor]:
    """transformers' logits and loss on `batch()` (its loss is computed in fp32 whatever the model's dtype)."""
    ids, labels = batch()
    with torch.no_grad():
        return {"logits": hf(ids).logits, "loss": hf(ids, labels=labels).loss.to(F64)}


def fp64_reference(hf) -> dict[str, torch.Tensor]:
    """hf_reference of `hf` in fp64."""
    return hf_reference(hf.to(F64))


# ------------------------------------------------------------------ the Trainer written out


def _reference_optimizer(model, args: TrainingArguments):
    """AdamW and its learning-rate schedule as the Trainer builds them from `args`."""
    from tptrain.training.optim import lr_multiplier, param_groups

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(
        args.lr_scheduler_type, warmup_steps=args.warmup_steps, total_steps=args.max_steps))
    return opt, sched


def reference_losses(model, dataset, args: TrainingArguments, global_batch: int, *, collate_rows=None) -> list[float]:
    """Plain single-device training on the same global batches (max_grad_norm 0: no clipping, as the Trainer's).
    collate_rows: a batch's rows -> the model's keyword inputs, as the Trainer's collator makes them (default: the
    rows stacked, their own labels)."""
    from tptrain.training.data import DataOrder

    opt, sched = _reference_optimizer(model, args)
    order = DataOrder(len(dataset), seed=args.seed, dp_rank=0, dp_size=1, global_batch=global_batch)
    losses = []
    for _ in range(args.max_steps):
        rows = [dataset[i] for i in order.next_batch()]
        if collate_rows is None:
            ids = torch.stack(rows)
            loss = model(ids, labels=ids).loss
        else:
            loss = model(**collate_rows(rows)).loss
        loss.backward()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def microbatch_reference(model, args: TrainingArguments, *, global_batch: int, microbatches: int = 1, held=None,
                         eval_at: tuple[int, ...] = ()) -> tuple[list[float], dict[int, float]]:
    """Plain single-device training on tiny_dataset()'s global batches, each split into `microbatches` forwards of
    their own (the router aux loss per pipeline microbatch, as gradient accumulation makes it; the token loss over the
    step's token count), the gradient norm clipped to max_grad_norm: (each step's loss, {step: the loss over every
    row of `held`} at the steps `eval_at` names)."""
    from tptrain.losses import IGNORE_INDEX, shift_labels
    from tptrain.training.data import DataOrder

    data = tiny_dataset()
    opt, sched = _reference_optimizer(model, args)
    order = DataOrder(len(data), seed=args.seed, dp_rank=0, dp_size=1, global_batch=global_batch)
    losses, evals = [], {}
    for step in range(1, args.max_steps + 1):
        ids = torch.stack([data[i] for i in order.next_batch()])
        count, total = int((shift_labels(ids) != IGNORE_INDEX).sum()), 0.0
        for part in ids.chunk(microbatches):
            loss = model(part, labels=part, num_items_in_batch=count).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(total)
        if step in eval_at:
            rows = torch.stack([held[i] for i in range(len(held))])
            with torch.no_grad():
                evals[step] = model.eval()(rows, labels=rows).loss.item()
            model.train()
    return losses, evals

