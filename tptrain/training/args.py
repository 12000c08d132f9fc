"""TrainingArguments and ParallelismConfig: everything a training run is told, as typed dataclasses.

    args = TrainingArguments(output_dir="run", per_device_train_batch_size=8, max_steps=1000,
                             parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))

Values are checked when the dataclass is built, so a bad argument fails on every rank before any
process group exists.
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from tptrain.checks import check_positive_int
from tptrain.distributed import DistributedConfig, ParallelDims

SCHEDULERS = ("linear", "cosine", "constant")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")


@dataclass
class ParallelismConfig:
    """How the ranks of a training run are laid out: mesh axes ("dp_replicate", "dp_shard", "cp", "tp"; "pp"
    outermost when pp > 1), and "ep" inside dp_shard (DistributedConfig.ep_size). The Trainer's view of the one
    layout (tptrain/layout), DistributedConfig the library's: a model's tp, ep, cp and pipeline are fixed when it is
    loaded, so the Trainer takes them from the model and this config adds the rest (the data-parallel sizes, the
    microbatches); a size given here that is not the model's is refused (the rule table's `model_layout`).

    tp_size: tensor-parallel degree; must equal the model's `tp_size` (None: take the model's).
    ep_size: expert-parallel degree (experts split by expert over that many of the dp_shard ranks); must equal the
        one the model was loaded with (None: take the model's).
    dp_shard_size: FSDP2 degree (parameters, gradients and optimizer state sharded over it);
        None: whatever WORLD_SIZE leaves over.
    dp_replicate_size: replicated data-parallel degree (DDP when dp_shard_size is 1, HSDP otherwise).
    cp_size: context-parallel degree (accelerate's name): each sequence split over that many ranks, which share
        one data-parallel rank's batch; must equal the model's (None: take the model's). FSDP2 then shards over
        dp_shard x cp.
    pp_size: pipeline stages (the outermost axis; the dp sizes then lay out each stage's ranks, FSDP2 wrapping each
        stage module); must equal the model's DistributedConfig(pp_size=) (None: the model's).
    pp_schedule: torch.distributed.pipelining's schedule ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", ...); must be
        the one the model was cut for (None: the model's).
    pp_microbatches: microbatches each micro-batch of per_device_train_batch_size rows is split into for the
        pipeline (None: as many as pipeline ranks, the fewest 1F1B runs).
    """

    tp_size: int | None = None
    dp_shard_size: int | None = None
    dp_replicate_size: int = 1
    ep_size: int | None = None
    cp_size: int | None = None
    pp_size: int | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None

    def distributed_config(self) -> DistributedConfig:
        """The equivalent DistributedConfig: it owns size validation and mesh construction."""
        return DistributedConfig(tp_size=self.tp_size, dp_shard_size=self.dp_shard_size,
                                 dp_replicate_size=self.dp_replicate_size, ep_size=self.ep_size,
                                 cp_size=self.cp_size or 1, pp_size=self.pp_size or 1,
                                 pp_schedule=self.pp_schedule or "1F1B")

    def parallel_dims(self, world_size: int | None = None, *, tp_note: str = "") -> ParallelDims:
        """The sizes resolved against the world size; ValueError if impossible.
        `tp_note` follows tp_size in that error, e.g. " (the model's)"."""
        described = (f"ParallelismConfig(tp_size={self.tp_size or 'auto'}{tp_note}, dp_shard_size="
                     f"{self.dp_shard_size or 'auto'}, dp_replicate_size={self.dp_replicate_size}"
                     + (f", ep_size={self.ep_size}" if self.ep_size else "")
                     + (f", cp_size={self.cp_size}" if (self.cp_size or 1) > 1 else "")
                     + (f", pp_size={self.pp_size}" if (self.pp_size or 1) > 1 else "") + ")")
        return self.distributed_config().parallel_dims(world_size, described=described, owner="ParallelismConfig")

    def sizes(self, world_size: int | None = None) -> dict[str, int]:
        """{"dp_replicate", "dp_shard", "tp"} (and "ep" when > 1) of `parallel_dims()`."""
        return self.parallel_dims(world_size).sizes()


@dataclass
class TrainingArguments:
    """What to train for and how.

    output_dir: where checkpoints (checkpoint-<step>/), metrics and the final model (final/) go.
    per_device_train_batch_size: sequences per micro-batch on one data-parallel rank (every rank of a
        TP group processes the same sequences).
    gradient_accumulation_steps: micro-batches per optimizer step. The global batch is
        per_device_train_batch_size x gradient_accumulation_steps x (dp_replicate x dp_shard).
    max_steps: number of optimizer steps.
    seq_len: tokens per training sequence (when the Trainer packs raw text itself).
    learning_rate: peak learning rate, reached after warmup.
    weight_decay: AdamW decoupled weight decay; never applied to norms or biases.
    adam_beta1, adam_beta2, adam_epsilon: AdamW hyper-parameters.
    optim: "adamw_torch_fused" (torch's fused AdamW kernel: one pass over each parameter, ~3x faster than the
        per-tensor loop on CPU) or "adamw_torch" (that loop); transformers' names. The same update up to rounding.
    max_grad_norm: clip the global gradient norm (over all shards) to this; 0 disables clipping.
    optim_in_backward: step each parameter (or FSDP2 shard) in its gradient hook during backward and free its
        gradient at once (training/optim_in_backward.py): the whole model's gradients are never held together.
        Same updates as the ordinary step; needs max_grad_norm=0 and gradient_accumulation_steps=1, and no
        grad_norm is logged.
    lr_scheduler_type: "linear" (decay to 0 at max_steps), "cosine" (to 0) or "constant", after warmup.
    warmup_steps: linear warmup from 0 to learning_rate over this many steps.
    bf16: bfloat16 compute with float32 gradient reduction (FSDP2 mixed precision, or autocast
        without data parallelism). Parameters stay in the dtype the model was loaded in.
    gradient_checkpointing: recompute each decoder layer in backward to save activation memory.
    torch_compile: torch.compile each decoder layer on its own (after TP and activation checkpointing,
        before FSDP2); the TP collectives compile into the layer's graph. Inductor needs a C++ compiler
        on CPU (Triton on CUDA): without one the Trainer refuses it with a ValueError.
    torch_compile_backend: the torch.compile backend ("inductor"; "aot_eager" compiles without codegen).
    seed: seeds the data order and torch's RNG.
    logging_steps: report loss / lr / tokens per second every this many steps.
    save_steps: write a resumable checkpoint every this many steps; 0 disables.
    save_total_limit: keep at most this many checkpoints (oldest pruned after a new one is complete);
        None keeps all.
    async_checkpoint: write checkpoints in the background (DCP async_save from a copy of each rank's
        shards, so a save costs training a copy, not the write): the next save, and the end of train(),
        wait for it; until it is complete it is a hidden .tmp and resume uses the previous checkpoint.
    overwrite_output_dir: start fresh in an output_dir that holds an earlier run, deleting its checkpoints
        and metrics (its final/ is replaced when this run ends). Without it (or resume_from_checkpoint)
        such an output_dir is refused.
    resume_from_checkpoint: True resumes from the latest complete checkpoint in output_dir, a path
        from that checkpoint; None/False starts fresh.
    parallelism_config: the rank layout; None: the model's tp_size, remaining ranks FSDP2 dp_shard.

    Fine-tuning data and evaluation (tptrain/training/sft_data.py, evaluation.py):
    num_train_epochs: train this many passes over the data instead of max_steps (None: max_steps).
    packing: pack instruction samples into rows of seq_len tokens (document-masked); False: one sample
        per row, padded to the longest of its micro-batch. Plain text is always cut into blocks. None (the
        default): packed, but image-text rows (a vision-language model's), which are one record per row and
        refuse True (training/vision_data.py says why).
    assistant_only_loss: a "messages" record trains only on its assistant turns; False: on every token.
    truncation: "truncate" (cut samples longer than seq_len; the count is reported once) or "error".
    chat_template: a Jinja file rendering "messages" records instead of the checkpoint's template.
    eval_steps: evaluate every this many steps (0: only at the end), when there is an eval set.
    eval_split: hold out this fraction of the training rows as the eval set (0: none).
    per_device_eval_batch_size: eval rows per forward on one data-parallel rank (None: the train size).
    save_best: after each evaluation with the lowest eval loss so far, write output_dir/best (the model,
        or the adapter) and best/eval_results.json.
    report_to: None, "tensorboard" (scalars also written to output_dir/runs; needs `tensorboard`) or "wandb" (the
        same to a Weights & Biases run with these arguments as its config, or to the run already active; needs
        `wandb`; WANDB_PROJECT, WANDB_DIR, WANDB_MODE=offline as wandb reads them), from rank 0.
    data_cache_dir: where .txt / .jsonl data is tokenized once and memory-mapped by every rank
        (training/token_cache.py); None: $TPTRAIN_CACHE, else ~/.cache/tptrain/data.

    Faults (tptrain/training/preemption.py):
    preemption_grace: seconds allowed from a SIGTERM / SIGINT (Ctrl-C) to the end of training: the ranks
        finish the current step, agree to stop (one all-reduce of an int per step), write a checkpoint and
        return (`TrainOutput.stopped`); a rank still running after this long exits 1. None (the
        default): the signals keep their usual effect and no per-step agreement runs. `tptrain train`: 60.
    on_nonfinite: what a step whose loss or global gradient norm is NaN or inf does (training/nonfinite.py): it
        never updates the weights, the optimizer state or the schedule; "stop" (the default) then raises
        NonFiniteStepError on every rank, naming the step, the ranks and the first non-finite gradient (or the loss),
        with no checkpoint or final model written after it; "skip" goes on with the next batch (said in the log).
        With optim_in_backward only the loss is checked (the weights are stepped during backward) and "skip" is
        refused.
    max_nonfinite_skips: with on_nonfinite="skip", this many non-finite steps in a row are skipped; one more stops
        as "stop" does.
    hang_timeout: a training step running longer than this on some rank ends the job (training/watchdog.py): the
        ranks still alive name the ones that stopped responding (or sit elsewhere), print their Python stacks and
        exit with code 124 (the elastic agent then restarts the group, under --max-restarts). "auto" (the default):
        10 x the median step time, at least 60 s, on more than one rank; seconds: that, at any world size; None:
        off. Armed after the first 3 steps of a process (compilation, first allocations).
    """

    output_dir: str
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = 100
    seq_len: int = 512
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch_fused"
    max_grad_norm: float = 1.0
    optim_in_backward: bool = False
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    torch_compile_backend: str = "inductor"
    seed: int = 42
    logging_steps: int = 1
    save_steps: int = 0
    save_total_limit: int | None = None
    async_checkpoint: bool = False
    overwrite_output_dir: bool = False
    resume_from_checkpoint: bool | str | os.PathLike | None = None
    parallelism_config: ParallelismConfig | None = None
    # fine-tuning data and evaluation
    num_train_epochs: float | None = None
    packing: bool | None = None
    assistant_only_loss: bool = True
    truncation: str = "truncate"
    chat_template: str | os.PathLike | None = None
    eval_steps: int = 0
    eval_split: float = 0.0
    per_device_eval_batch_size: int | None = None
    save_best: bool = False
    report_to: str | None = None
    data_cache_dir: str | os.PathLike | None = None
    preemption_grace: float | None = None
    on_nonfinite: str = "stop"
    max_nonfinite_skips: int = 5
    hang_timeout: float | str | None = "auto"

    def __post_init__(self) -> None:
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "seq_len",
                    "logging_steps")
        for name in positive:
            check_positive_int(getattr(self, name), f"TrainingArguments.{name}")
        for name in ("warmup_steps", "save_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainingArguments.{name} must be an int >= 0, got {value!r}")
        if self.save_total_limit is not None and (not isinstance(self.save_total_limit, int)
                                                  or self.save_total_limit < 1):
            raise ValueError(f"TrainingArguments.save_total_limit must be None or an int >= 1, "
                             f"got {self.save_total_limit!r}")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainingArguments.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"TrainingArguments.optim={self.optim!r} is not one of {OPTIMIZERS}")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"TrainingArguments.lr_scheduler_type={self.lr_scheduler_type!r} is not one of "
                             f"{SCHEDULERS}")
        self._check_finetuning()
        self._check_compile()
        self._check_optim_in_backward()
        self._check_faults()
        grace = self.preemption_grace
        if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0):
            raise ValueError(f"TrainingArguments.preemption_grace must be None or a positive number of seconds, "
                             f"got {grace!r}")
        if self.parallelism_config is not None and not isinstance(self.parallelism_config, ParallelismConfig):
            raise TypeError(f"TrainingArguments.parallelism_config must be a ParallelismConfig, got "
                            f"{type(self.parallelism_config).__name__}")

    def _check_faults(self) -> None:
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"TrainingArguments.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.on_nonfinite == "skip" and self.optim_in_backward:
            raise ValueError("TrainingArguments.on_nonfinite='skip' (--on-nonfinite skip) cannot skip a step with "
                             "optim_in_backward=True (--optim-in-backward): each parameter is stepped during backward, "
                             "before the step's loss is known; use on_nonfinite='stop', or drop optim_in_backward")
        skips = self.max_nonfinite_skips
        if isinstance(skips, bool) or not isinstance(skips, int) or skips < 1:
            raise ValueError(f"TrainingArguments.max_nonfinite_skips must be an int >= 1, got {skips!r}")
        hang = self.hang_timeout
        if hang not in (None, "auto") and (isinstance(hang, bool) or not isinstance(hang, (int, float))
                                           or not hang > 0):
            raise ValueError(f"TrainingArguments.hang_timeout must be 'auto', None (off) or a positive number of "
                             f"seconds, got {hang!r}")

    def _check_optim_in_backward(self) -> None:
        if not isinstance(self.optim_in_backward, bool):
            raise TypeError(f"TrainingArguments.optim_in_backward must be True or False, got {self.optim_in_backward!r}")
        if not self.optim_in_backward:
            return
        # A parameter is stepped as soon as its gradient exists: nothing later in backward can change it.
        if self.max_grad_norm > 0:
            raise ValueError(f"TrainingArguments.optim_in_backward=True (--optim-in-backward) cannot clip gradients "
                             f"(max_grad_norm={self.max_grad_norm}): the global norm needs every gradient before any "
                             "parameter is stepped; set max_grad_norm=0 (--max-grad-norm 0) to train without "
                             "clipping, or drop optim_in_backward")
        if self.gradient_accumulation_steps > 1:
            raise ValueError(f"TrainingArguments.optim_in_backward=True (--optim-in-backward) cannot accumulate "
                             f"gradients (gradient_accumulation_steps={self.gradient_accumulation_steps}): each "
                             "micro-batch's backward would step the parameters; set gradient_accumulation_steps=1 "
                             "(--grad-accum 1) and raise per_device_train_batch_size (--batch-size) instead, or drop "
                             "optim_in_backward")

    def _check_compile(self) -> None:
        if not isinstance(self.torch_compile, bool):
            raise TypeError(f"TrainingArguments.torch_compile must be True or False, got {self.torch_compile!r}")
        if not self.torch_compile:
            return
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.torch_compile_backend not in backends:
            raise ValueError(f"TrainingArguments.torch_compile_backend={self.torch_compile_backend!r} is not a "
                             f"torch.compile backend; use one of {', '.join(backends)} (default: 'inductor')")

    def _check_finetuning(self) -> None:
        if self.num_train_epochs is not None and not self.num_train_epochs > 0:
            raise ValueError(f"TrainingArguments.num_train_epochs must be > 0 (or None), got {self.num_train_epochs!r}")
        if self.truncation not in ("truncate", "error"):
            raise ValueError(f"TrainingArguments.truncation must be 'truncate' or 'error', got {self.truncation!r}")
        if not isinstance(self.eval_steps, int) or self.eval_steps < 0:
            raise ValueError(f"TrainingArguments.eval_steps must be an int >= 0, got {self.eval_steps!r}")
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"TrainingArguments.eval_split must be in [0, 1), got {self.eval_split!r}")
        if self.report_to not in (None, "none", "tensorboard", "wandb"):
            raise ValueError(f"TrainingArguments.report_to must be None, 'tensorboard' or 'wandb', got "
                             f"{self.report_to!r}")
        if self.report_to in ("tensorboard", "wandb") and importlib.util.find_spec(self.report_to) is None:
            raise ValueError(f"report_to='{self.report_to}' (--report-to {self.report_to}) needs the {self.report_to} "
                             f"package, which is not installed: pip install {self.report_to} (or drop the option)")
        if self.per_device_eval_batch_size is not None and self.per_device_eval_batch_size < 1:
            raise ValueError(f"TrainingArguments.per_device_eval_batch_size must be >= 1, got "
                             f"{self.per_device_eval_batch_size!r}")


def check_seq_len(seq_len: int, config: Any, *, what: str) -> None:
    """Refuse sequences longer than the model's `max_position_embeddings`: positions beyond it were never
    trained (RoPE extrapolates badly), and an unbounded length only shows up as a run that never steps. A
    vision-language model's limit is its text decoder's."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return
    if getattr(config, "rope_scaling", None):
        longer = (f"its rope_scaling {config.rope_scaling} already gives that limit; raise the scaling factor and "
                  f"max_position_embeddings in config.json together")
    else:
        longer = (f'to train longer sequences set rope_scaling in config.json, e.g. {{"rope_type": "llama3", '
                  f'"factor": {math.ceil(seq_len / limit)}, "original_max_position_embeddings": {limit}, '
                  f'"low_freq_factor": 1.0, "high_freq_factor": 4.0}}, and max_position_embeddings to {seq_len}')
    raise ValueError(f"{what}={seq_len} exceeds the model's max_position_embeddings={limit} (config.json); "
                     f"use at most {limit}, or {longer}")
