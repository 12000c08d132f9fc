"""The Trainer's set-up: one ordered pass of stages, each a function of what the stages before produced.

    dims = resolve_parallelism(model, config, args=args)              # 1. the layout, the rule   no collective
                                                                       #    table checked
    data = training_data(args, dims, train, eval, build=...)           # 2. rows, global batch,   no collective
                                                                       #    max_steps
    placement = place(model, args, dims, data)                         # 3. the mesh: the first collective
    fsdp, pipe = apply_training_steps(model, args, placement)          # 4. agreements, then the one parallelize's
                                                                       #    training steps: activation checkpointing
                                                                       #    -> compile -> (pp: the schedule) -> FSDP2
    optimizer, scheduler = optimizer_and_schedule(model, args, data.max_steps, pipeline=pipe)    # 5.

Stages 1 and 2 are pure, so whatever one rank can get wrong there (the layout, the sequence length, a data file, the
eval options) is raised on every rank before any collective could hang; stage 4 agrees on what only one rank
checks (final/ writable, the compiler) before it wraps the model. No stage rewrites another's result: the run's
max_steps (num_train_epochs resolved against the data) is stage 2's value, which the schedule reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tptrain.distributed import ParallelDims, raise_on_any_rank
from tptrain.distributed.topology import dp_mesh
from tptrain.io import writable_error
from tptrain.layout import Case, Features, Spelling
from tptrain.layout import check as check_rule
from tptrain.distributed.state import state_of
from tptrain.parallel.facts import model_facts
from tptrain.parallel.parallelize import ParallelOptions, check, parallelize
from tptrain.parallel.pipeline_grads import when_complete
from tptrain.parallel.pipeline_parallel import Pipeline
from tptrain.training.args import TrainingArguments
from tptrain.training.data import DataOrder
from tptrain.training.evaluation import split_dataset
from tptrain.training.optim import build_optimizer, build_scheduler
from tptrain.training.optim_in_backward import OptimizerInBackward
from tptrain.training.mesh import compile_error, training_mesh
from tptrain.training.streaming import StreamOrder, TextStream, check_streaming


@dataclass(frozen=True)
class TrainingData:
    """Stage 2: the rows to train (and evaluate) on and the optimizer steps they make."""

    train: Any  # a PackedDataset, SFTDataset or TextStream
    eval: Any  # the same, or None: no eval set
    global_batch: int  # sequences (dataset items) per optimizer step over all dp ranks
    max_steps: int  # args.max_steps, or num_train_epochs passes over `train` in whole global batches


@dataclass(frozen=True)
class Placement:
    """Stage 3: the run's one mesh, this rank's device and rank, and its share of the data order."""

    mesh: DeviceMesh
    device: torch.device
    rank: int
    data_order: DataOrder | StreamOrder


def check_run(model: nn.Module, distributed_config, args: TrainingArguments, world_size: int, *,
              seq_len_name: str = "TrainingArguments.seq_len") -> None:
    """Stage 1 before any process exists (`tptrain train`'s checks before a worker starts): what
    `from_pretrained(distributed_config=)` and then a Trainer with `args` would refuse of this layout, on the whole
    model (on meta): the rule table, the training run's rows included. The plan's own problems are the caller's to
    report (ResolvedPlan.problems)."""
    config = args.parallelism_config
    training = dict(batch_size=args.per_device_train_batch_size, seq_len=args.seq_len,
                    pp_microbatches=config.pp_microbatches if config is not None else None)
    check(model, distributed_config, world_size=world_size, training=training,
          spelling=Spelling(seq_len=seq_len_name), plan_problems=False)


def training_data(args: TrainingArguments, dims: ParallelDims, train_source: Any, eval_source: Any, *,
                  build: Callable[[Any], Any], rows_per_item: int = 1) -> TrainingData:
    """The training rows (`build(train_source)`), the eval rows (`build(eval_source)`, or args.eval_split of the
    training rows) and the steps they make at `dims`' data parallelism (an epoch: the rows that fill whole global
    batches). `rows_per_item`: the rows each dataset item makes (GRPO's prompts: num_generations completions), so
    the global batch counts items. No collective."""
    check_streaming(args, train_source, eval_source)
    train = build(train_source)
    check_eval_set(args, eval_source)
    held = None
    if args.eval_split:
        train, held = split_dataset(train, args.eval_split, args.seed)
    elif eval_source is not None:
        held = build(eval_source)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dims.dp // rows_per_item
    max_steps = args.max_steps
    if args.num_train_epochs is not None:
        max_steps = max(1, math.ceil(args.num_train_epochs * (len(train) // max(1, global_batch))))
    return TrainingData(train, held, global_batch, max_steps)


def refuse_evaluation(workflow: str, args: TrainingArguments, eval_source: Any) -> None:
    """A workflow's Trainer that evaluates no held-out set yet (DPOTrainer, GRPOTrainer): any eval option refused."""
    if eval_source is not None or args.eval_split or args.eval_steps or args.save_best:
        raise ValueError(f"{workflow} evaluates no held-out set yet: drop eval_dataset / eval_split / eval_steps / "
                         "save_best (--eval-data, --eval-split, --eval-steps, --save-best)")


def check_eval_set(args: TrainingArguments, eval_source: Any) -> None:
    """Stage 2's eval options against the eval set given (None: none), pure: `tptrain train`'s preflight runs it
    too, so both raise the same message."""
    if args.eval_split and eval_source is not None:
        raise ValueError("pass either eval_dataset or TrainingArguments.eval_split (--eval-data or "
                         "--eval-split), not both")
    if not args.eval_split and eval_source is None and (args.eval_steps or args.save_best):
        raise ValueError("TrainingArguments.eval_steps / save_best need an eval set: pass "
                         "Trainer(eval_dataset=...) or set eval_split (--eval-data / --eval-split)")


def check_packed_documents(model: nn.Module, packing: bool) -> None:
    """The rule table's `packed_documents` on the run's rows: `packing`, rows of packed documents (samples one after
    another, position ids restarting: instruction data with TrainingArguments.packing) on a model that cannot keep
    them apart is refused, before any collective (the Trainer: on the rows stage 2 made, `packs_documents`;
    `tptrain train`: on its data file, before a worker starts)."""
    check_rule("packed_documents", Case(features=Features(packing=packing), facts=model_facts(model)))


def packs_documents(rows: Any) -> bool:
    """Whether the rows of a dataset stage 2 made are packed documents (an SFTDataset with packing, or a view of one;
    plain-text blocks carry no position ids: nothing restarts in them)."""
    return bool(getattr(rows, "packing", False))


def place(model: nn.Module, args: TrainingArguments, dims: ParallelDims, data: TrainingData) -> Placement:
    """The run's one mesh (the model's own, or the one it moves onto), this rank's device, its share of the data
    order. The first collective: the rendezvous, when loading the model started none, and the mesh's groups."""
    mesh, device = training_mesh(model, dims)
    shares = dict(dp_rank=dp_mesh(mesh).get_local_rank(), dp_size=dims.dp, global_batch=data.global_batch)
    order = data.train.order(**shares) if isinstance(data.train, TextStream) else \
        DataOrder(len(data.train), seed=args.seed, data_key=getattr(data.train, "data_key", None), **shares)
    return Placement(mesh, device, dist.get_rank(), order)


def apply_training_steps(model: nn.Module, args: TrainingArguments, placement: Placement, *, on_forward=None
                         ) -> tuple[bool, Pipeline | None]:
    """What every rank must agree on first (final/ writable on rank 0, the compiler on every rank), then the one
    parallelize's training steps (the structural ones were applied when the model was loaded): the model on this
    rank's device -> activation checkpointing -> compile -> (a cut model: its pipeline's schedule) -> FSDP2 (of each
    stage under pipeline parallelism). Returns whether FSDP2 wraps the model, and the pipeline (None without pp;
    `on_forward`: called before each stage's forward, a PeftModel's dropout-mask count, which the whole model's
    forward, never run under pp, advances otherwise)."""
    raise_on_any_rank(writable_error(Path(args.output_dir) / "final") if placement.rank == 0 else None)
    if args.torch_compile:  # the same machine image on every rank, but say which rank lacks the compiler
        raise_on_any_rank(compile_error(args.torch_compile_backend, placement.device), exc_type=ValueError)
    torch.manual_seed(args.seed)
    config = args.parallelism_config
    options = ParallelOptions(train=True, gradient_checkpointing=args.gradient_checkpointing, bf16=args.bf16,
                              compile_backend=args.torch_compile_backend if args.torch_compile else None,
                              pp_microbatches=config.pp_microbatches if config is not None else None,
                              on_forward=on_forward)
    done = parallelize(model, placement.mesh, options, device=placement.device)
    return done.fsdp, done.pipeline


def optimizer_and_schedule(model: nn.Module, args: TrainingArguments, max_steps: int, *,
                           pipeline: Pipeline | None = None
                           ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the (wrapped) model's parameters, and its schedule to 0 at the run's `max_steps`. With
    `optim_in_backward`, one AdamW per parameter stepped by its gradient hook, or under pipeline parallelism when its
    stage's backward of the step is over; TP partial gradients and a pipeline's tied weight are held back for the
    Trainer to sum and step after backward."""
    if args.optim_in_backward:
        layout = state_of(model).tp
        held = set(layout.partial_grad_specs() if layout else ()) | (pipeline.ties.summed_after() if pipeline else set())
        optimizer = OptimizerInBackward(model, args, held_back=held, hooks=pipeline is None)
        if pipeline is not None:
            when_complete(pipeline.stages, optimizer.step_complete)
    else:
        optimizer = build_optimizer(model, args)
    return optimizer, build_scheduler(optimizer, args, total_steps=max_steps)


def report_inputs(tokenizer: Any, datasets: dict[str, Any], *, seq_len: int) -> None:
    """Rank 0's lines on the run's inputs: which tokenizer its ids come from (path and kind, or the byte-level
    fallback), and how many samples of each dataset ({"train": ..., "eval": ...}) were truncated to seq_len."""
    if tokenizer is not None:
        kind = getattr(tokenizer, "description", f"{type(tokenizer).__name__} (given to the Trainer)")
        print(f"tptrain: tokenizer {kind}", flush=True)
    for name, data in datasets.items():
        cut = getattr(data, "num_truncated", 0)
        if cut:
            print(f"tptrain: {cut} of {data.num_samples} {name} samples of {data.name} were longer than "
                  f"seq_len={seq_len} and were truncated (truncation='error' / --truncation error refuses them "
                  "instead)", flush=True)
