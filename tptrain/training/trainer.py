"""Trainer: tensor parallel x FSDP2 / HSDP / DDP training with resumable, layout-independent checkpoints.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
    args = TrainingArguments(output_dir="run", per_device_train_batch_size=8, max_steps=1000, save_steps=200)
    Trainer(model=model, args=args, train_dataset="corpus.txt").train()

    torchrun --nproc-per-node 4 train.py     # tp 2 x dp_shard 2

The Trainer runs the loop: its set-up is one ordered pass (setup.py), each optimizer step a TrainStep (step.py: the
update equals one step on the whole global batch on one device), its saves and resume a Checkpointer (saving.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tptrain.distributed import ParallelDims
from tptrain.distributed.state import state_of
from tptrain.parallel.context_parallel import check_sequence_length as check_cp_sequence_length
from tptrain.parallel.sequence_parallel import check_sequence_length
from tptrain.training.checkpoint import dirs as dirs
from tptrain.training.checkpoint import state as ckpt
from tptrain.training.args import TrainingArguments, check_seq_len
from tptrain.text import load_tokenizer
from tptrain.training.data import PackedDataset
from tptrain.training.evaluation import evaluate_loss, evaluate_pipeline
from tptrain.training.memory_check import MemoryCheck
from tptrain.training.nonfinite import NonFiniteGuard, NonFiniteStepError, StepResult, Verdict
from tptrain.training.sft_data import SFTDataset, build_training_data, collate
from tptrain.training.mesh import resolve_parallelism
from tptrain.training.preemption import StopOnSignal
from tptrain.training.saving import Checkpointer
from tptrain.training.setup import (apply_training_steps, check_packed_documents, optimizer_and_schedule,
                                    packs_documents, place, report_inputs, training_data)
from tptrain.training.step import TrainStep
from tptrain.training.vision_data import VisionDataset, takes_images, vision_rows
from tptrain.training.watchdog import HangWatchdog


@dataclass
class TrainOutput:
    global_step: int
    losses: list[float]  # the global-batch loss of every step this call ran
    final_dir: Path | None  # the consolidated HF checkpoint; None when stopped
    stopped: str | None = None  # the signal that stopped training early, with a checkpoint (preemption_grace)
    skipped_steps: list[int] = dataclasses.field(default_factory=list)  # not applied: not finite (on_nonfinite="skip")


class Trainer:
    """Trains `model` (already tensor-parallel if tp_size > 1) on `train_dataset`.

    train_dataset: a PackedDataset, or anything `build_dataset` accepts (a .txt/.jsonl path, a list of strings, a
        `datasets.Dataset`), tokenized with `tokenizer` (default: the checkpoint's); instruction records ("messages",
        "prompt"/"completion": a .jsonl, a list of dicts, a `datasets.Dataset`) become an SFTDataset (sft_data.py,
        options in TrainingArguments); a `StreamingText` is read while training (streaming.py; needs max_steps); a
        vision-language model's image-text chats go through its checkpoint's processor (vision_data.py).
    eval_dataset: the same kinds of source, evaluated every `args.eval_steps` and at the end (or `args.eval_split` of
        the training rows).
    Every rank constructs the Trainer and calls `train()`; all validation happens in the constructor, identically
    on every rank, before any collective, in one ordered pass (setup.py): layout, data, mesh, parallelisms,
    optimizer. `args`: as run (max_steps from num_train_epochs). The Trainer runs the loop; `step` (a TrainStep)
    does each optimizer step, `checkpoints` (a Checkpointer) the saves and the resume.
    """

    rows_per_item = 1  # the training rows one dataset item makes in a step (GRPO: a prompt's num_generations)

    def __init__(self, model: nn.Module, *, args: TrainingArguments, train_dataset: Any, tokenizer: Any = None,
                 eval_dataset: Any = None) -> None:
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be a TrainingArguments, got {type(args).__name__}")
        self.args, self.model, self.tokenizer = args, model, tokenizer
        # A PeftModel wraps the TP model: parameter names, layouts and sharding are the inner model's,
        # while forward and the final save (which then writes the adapter) go through the wrapper.
        self.inner = model = model.get_base_model() if hasattr(model, "get_base_model") else model
        # Stages 1 and 2 are pure: what one rank can get wrong is raised on every rank before any collective.
        self.dims = resolve_parallelism(model, args.parallelism_config, args=args)  # the rule table: every refusal
        self._check_sequence_length(self.dims)
        data = training_data(args, self.dims, train_dataset, eval_dataset, build=self._dataset,
                             rows_per_item=self.rows_per_item)
        check_packed_documents(model, any(packs_documents(rows) for rows in (data.train, data.eval)))
        self.dataset, self.eval_dataset, self.global_batch = data.train, data.eval, data.global_batch
        if data.max_steps != args.max_steps:
            self.args = args = dataclasses.replace(args, max_steps=data.max_steps)
        placement = place(model, args, self.dims, data)  # the first collective
        self.mesh, self.device, self.rank = placement.mesh, placement.device, placement.rank
        self.is_rank0, self.data_order = self.rank == 0, placement.data_order
        self.memory = MemoryCheck(self.model, args, self.dims, self.device, mesh=self.mesh)  # frees pages to the OS
        self.fsdp, self.pipeline = apply_training_steps(model, args, placement,
                                                        on_forward=getattr(self.model, "count_forward", None))
        self.optimizer, self.scheduler = optimizer_and_schedule(model, args, data.max_steps, pipeline=self.pipeline)
        self.step = TrainStep(self.model, args=args, mesh=self.mesh, device=self.device, pipeline=self.pipeline,
                              fsdp=self.fsdp)
        self.converter = ckpt.StateConverter(model, self.mesh)
        self.checkpoints = Checkpointer(self.model, args=args, optimizer=self.optimizer, converter=self.converter,
                                        is_rank0=self.is_rank0)
        self.nonfinite = NonFiniteGuard(args.on_nonfinite, args.max_nonfinite_skips, args.optim_in_backward)
        self.global_step, self.best_eval_loss = 0, None  # the best: a float once the run has evaluated
        if self.is_rank0:
            report_inputs(self.tokenizer, {"train": self.dataset, "eval": self.eval_dataset}, seq_len=args.seq_len)
        self.run_id = uuid.uuid4().hex  # marks this run's checkpoints (rank 0's is the one written); kept on resume

    # ------------------------------------------------------------------ set-up checks (no collectives)

    def _dataset(self, source: Any) -> PackedDataset | SFTDataset | VisionDataset:
        if takes_images(self.inner):  # through the checkpoint's processor, loaded once
            self.tokenizer, rows = vision_rows(source, self.tokenizer, self.args, model=self.inner)
            return rows
        if not isinstance(source, (PackedDataset, SFTDataset)):  # already tokenized: only seq_len is checked
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(model_dir(self.inner))
            vocab = self.inner.config.vocab_size
            if self.tokenizer.vocab_size > vocab:
                raise ValueError(f"the tokenizer produces ids up to {self.tokenizer.vocab_size - 1} but the model's "
                                 f"vocab_size is {vocab}; pass the model's own tokenizer")
        a = self.args
        return build_training_data(source, self.tokenizer, a.seq_len, model_dir=model_dir(self.inner),
                                   chat_template=a.chat_template, packing=a.packing,
                                   assistant_only_loss=a.assistant_only_loss, truncation=a.truncation,
                                   cache_dir=a.data_cache_dir, vocab_size=self.inner.config.vocab_size)

    def _check_sequence_length(self, dims: ParallelDims) -> None:
        check_seq_len(self.args.seq_len, self.inner.config, what="TrainingArguments.seq_len")
        if state_of(self.inner).sequence_parallel:  # SP splits each cp rank's seq_len / cp tokens
            check_sequence_length(type(self.inner).__name__, self.args.seq_len // dims.cp, dims.tp,
                                  what=f"TrainingArguments.seq_len={self.args.seq_len}"
                                       + (f" / cp_size {dims.cp}" if dims.cp > 1 else ""))
        if dims.cp > 1:  # rows of other lengths are padded to a multiple of 2 x cp (`_padding`)
            check_cp_sequence_length(self.args.seq_len, dims.cp, what="TrainingArguments.seq_len (--seq-len)")

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: bool | str | os.PathLike | None = None) -> TrainOutput:
        """Run to `args.max_steps`; save checkpoints every `save_steps`; end with the consolidated model.
        With `args.preemption_grace`, a SIGTERM / SIGINT stops it after the current step with a checkpoint
        instead (`TrainOutput.stopped`, no final model). Restarted by torchrun's elastic agent, it continues
        from the latest complete checkpoint in output_dir (`dirs.resume_after_restart`). Non-finite steps:
        `args.on_nonfinite` (nonfinite.py); a step past `args.hang_timeout` ends the process (watchdog.py)."""
        with StopOnSignal(self.args.preemption_grace) as stop, HangWatchdog(self.args.hang_timeout) as watchdog:
            return self._train(resume_from_checkpoint, stop, watchdog)

    def _train(self, resume_from_checkpoint: bool | str | os.PathLike | None, stop: StopOnSignal,
               watchdog: HangWatchdog) -> TrainOutput:
        args = self.args
        resume = args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        resume, overwrite = dirs.resume_after_restart(resume, args.overwrite_output_dir, args.output_dir)
        self.checkpoints.claim_output_dir(resume, overwrite)
        path = dirs.resolve_resume(resume, args.output_dir)
        if path is not None:
            self._load(path)
            if self.is_rank0:
                print(f"tptrain: resuming from {path} (step {self.global_step})", flush=True)
        reporter = self._reporter()
        losses, failed = self._run(reporter, stop, watchdog)
        final_eval = not (stop.stopped or failed or args.eval_steps and self.global_step % args.eval_steps == 0)
        if self.eval_dataset is not None and final_eval:
            self._evaluate_and_log(reporter)  # the final evaluation
        self.finish_checkpoint()  # an async checkpoint still being written (a finite step's) is published
        if reporter is not None:
            reporter.close()
        if failed:  # a non-finite step: nothing is written after it
            raise NonFiniteStepError(failed.message)
        final = None if stop.stopped else self.save_model()
        self.memory.report(reporter, self.optimizer)  # each rank's peak (the final save's included) beside the plan's
        return TrainOutput(self.global_step, losses, final, stopped=stop.stopped, skipped_steps=self.nonfinite.skipped)

    def _run(self, reporter, stop: StopOnSignal, watchdog: HangWatchdog) -> tuple[list[float], Verdict | None]:
        """The steps to max_steps or a stop signal: (their losses, why a non-finite step stopped the run, or None)."""
        args, losses = self.args, []
        while self.global_step < args.max_steps:
            start, lr = time.perf_counter(), self.scheduler.get_last_lr()[0]  # the lr this step uses
            with watchdog.step(self.global_step + 1):
                result = self.training_step(self.data_order.next_batch())
                stopping = stop.agreed()  # every rank stops after this same step, with a checkpoint of it
            self.global_step += 1
            losses.append(result.loss)
            if reporter is not None and (self.global_step % args.logging_steps == 0
                                         or self.global_step == args.max_steps or result.nonfinite):
                metrics = {"loss": result.loss, "learning_rate": lr, "grad_norm": result.grad_norm,
                           "num_tokens": self.global_batch * args.seq_len, "step_time": time.perf_counter() - start,
                           **self.step.metrics}
                reporter.log(self.global_step, {k: v for k, v in metrics.items() if v is not None})
            verdict = self.nonfinite.verdict(self.global_step, result.nonfinite, output_dir=args.output_dir)
            if verdict is not None and verdict.stop:
                return losses, verdict
            if verdict is not None and reporter is not None:  # skipped
                reporter.message(f"tptrain: {verdict.message}")
            if self.eval_dataset is not None and args.eval_steps and self.global_step % args.eval_steps == 0:
                self._evaluate_and_log(reporter)
            if (args.save_steps and self.global_step % args.save_steps == 0) or stopping:
                saved = self.save_checkpoint()
                if reporter is not None:
                    reporter.message(f"saved {saved}")
            if stopping:
                break
        return losses, None

    def training_step(self, indices: list[Any]) -> StepResult:
        """One optimizer step on this dp rank's `indices` (into the dataset; a stream's order gives the rows
        themselves): its StepResult (loss, grad norm: None with optim_in_backward, what was not finite)."""
        self.model.train()  # as transformers' Trainer: from_pretrained hands out eval mode, evaluation leaves it
        b = self.args.per_device_train_batch_size
        rows = [self.dataset[i] if isinstance(i, int) else i for i in indices]
        micro = [self._batch(rows[k:k + b]) for k in range(0, len(rows), b)]
        return self.step(micro, self.optimizer, self.scheduler)

    def _reporter(self):
        try:
            from tptrain.training.reporting import Reporter
        except ImportError:
            return None
        return Reporter(self.args.output_dir, total_steps=self.args.max_steps, enabled=self.is_rank0,
                        report_to=self.args.report_to, config=dataclasses.asdict(self.args))

    # ------------------------------------------------------------------ fine-tuning data and evaluation

    def _padding(self) -> dict[str, int]:
        """How `collate` pads a micro-batch: with eos, to a multiple of tp_size under sequence parallelism and of
        2 x cp_size under context parallelism (its load balancing's chunks; both: each cp rank's share splits over
        tp)."""
        sp = self.dims.tp if state_of(self.inner).sequence_parallel else 1
        return {"pad_id": getattr(self.tokenizer, "eos_token_id", 0),
                "multiple": math.lcm(sp * self.dims.cp, 2 * self.dims.cp if self.dims.cp > 1 else 1)}

    def _batch(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        """The micro-batch of `rows` on this rank's device; under pp of the one shape the stages exchange (seq_len
        tokens), its images' rows per sample given (each pipeline microbatch takes its own)."""
        staged = dict(length=self.args.seq_len, rows=True) if self.pipeline is not None else {}
        return {k: v.to(self.device) for k, v in collate(rows, **self._padding(), **staged).items()}

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        """{"eval_loss", "eval_ppl", "eval_tokens"} over all of `eval_dataset` (default: the Trainer's);
        the token mean over the whole set, identical at every layout. Collective."""
        data = self.eval_dataset if eval_dataset is None else self._dataset(eval_dataset)
        if data is None:
            raise ValueError("Trainer.evaluate: no eval set; pass eval_dataset (--eval-data) or set eval_split")
        batch_size = self.args.per_device_eval_batch_size or self.args.per_device_train_batch_size
        if self.pipeline is not None:  # the stages exchange the training shape: batches padded to it
            return evaluate_pipeline(self.pipeline, data, batch_size=self.args.per_device_train_batch_size,
                                     seq_len=self.args.seq_len, mesh=self.mesh, device=self.device,
                                     pad_id=self._padding()["pad_id"])
        return evaluate_loss(self.model, data, batch_size=batch_size, mesh=self.mesh, device=self.device,
                             autocast=self.step.autocast, **self._padding())

    def _evaluate_and_log(self, reporter) -> dict[str, float]:
        metrics = self.evaluate()
        if reporter is not None:
            reporter.log(self.global_step, {k: metrics[k] for k in ("eval_loss", "eval_ppl")})
            reporter.message(f"step {self.global_step}: eval_loss {metrics['eval_loss']:.4f}, "
                             f"eval_ppl {metrics['eval_ppl']:.2f}")
        if self.args.save_best and (self.best_eval_loss is None or metrics["eval_loss"] < self.best_eval_loss):
            self.best_eval_loss = metrics["eval_loss"]
            best = self.save_model(Path(self.args.output_dir) / "best")
            if self.is_rank0:
                (best / "eval_results.json").write_text(json.dumps({"step": self.global_step, **metrics}) + "\n")
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-<step> (collective); returns its path. With async_checkpoint the
        tensors are still being written when it returns (the previous save is finished first)."""
        state = {"global_step": self.global_step, "run_id": self.run_id, "data_order": self.data_order.state_dict(),
                 "layout": self.dims.sizes(), "best_eval_loss": self.best_eval_loss,
                 "skipped_steps": self.nonfinite.skipped}
        runtime = getattr(self.model, "runtime", None)  # a PeftModel's dropout-mask stream (seed, forward count)
        if runtime is not None:
            state["lora_runtime"] = {"seed": runtime.seed, "step": runtime.step}
        return self.checkpoints.save(self.global_step, state)

    def finish_checkpoint(self) -> None:
        """Wait for an async checkpoint still being written and publish it (collective; no-op if none)."""
        self.checkpoints.finish()

    def _load(self, path: Path) -> None:
        state = self.checkpoints.load(path)
        self.global_step, self.run_id = state["global_step"], state["run_id"]
        self.best_eval_loss = state.get("best_eval_loss")
        self.nonfinite.skipped = list(state.get("skipped_steps", []))
        if "lora_runtime" in state and getattr(self.model, "runtime", None) is not None:
            runtime = state["lora_runtime"]
            self.model.runtime.seed, self.model.runtime.step = runtime["seed"], runtime["step"]
        self.data_order.load_state_dict(state["data_order"])
        # The schedule of THIS run's arguments at the saved step (a resume may raise max_steps), as if the
        # run had started with them: rebuilt from the step, not restored (the saved last lr may be 0). Skipped
        # (non-finite) steps did not advance it.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.scheduler.lr_lambdas,
                                                           last_epoch=self.global_step - len(self.nonfinite.skipped) - 1)

    def save_model(self, output_dir: str | os.PathLike | None = None) -> Path:
        """The consolidated HF checkpoint (default output_dir/final; a PeftModel's adapter: final/adapter),
        loadable by transformers (and peft), plus the source model's tokenizer files. Collective: FSDP and TP
        shards are gathered, rank 0 writes."""
        return self.checkpoints.save_model(output_dir, self._tokenizer_dir() if self.is_rank0 else None,
                                           model=self.model)

    def _tokenizer_dir(self) -> Path | None:
        path = getattr(self.tokenizer, "path", None)  # an HFTokenizer knows its tokenizer.json
        return Path(path).parent if path is not None else model_dir(self.inner)


def model_dir(model: nn.Module) -> Path | None:
    """The checkpoint directory `model` was loaded from (its tokenizer and chat template live there), or None."""
    name = getattr(model, "name_or_path", None)
    if name is None:
        return None
    from tptrain.io import resolve_checkpoint

    return resolve_checkpoint(name)
