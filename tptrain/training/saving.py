"""The Trainer's saving and resuming: its output_dir claimed, resumable checkpoints written (async ones finished) and
loaded, the consolidated model written at the end.

    saves = Checkpointer(model, args=args, optimizer=optimizer, converter=converter, is_rank0=rank == 0)
    saves.claim_output_dir(resume, overwrite)
    saves.save(step, trainer_state)       # output_dir/checkpoint-<step> (DCP; the directory protocol: checkpoint/dirs.py)
    trainer_state = saves.load(path)      # model and optimizer loaded in place; the Trainer restores the rest
    saves.save_model()                    # output_dir/final (a PeftModel's adapter: final/adapter), tokenizer files

Every method is collective: every rank calls it, what one rank fails on is raised on all.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tptrain.distributed import comm, raise_on_any_rank
from tptrain.io.hub import TOKENIZER_PATTERNS
from tptrain.training.args import TrainingArguments
from tptrain.training.checkpoint import dirs
from tptrain.training.checkpoint import state as ckpt
from tptrain.training.nonfinite import NonFiniteStepError, first_nonfinite


class Checkpointer:
    """Writes and reads `model`'s (a PeftModel: its base model's trained tensors) and `optimizer`'s state through
    `converter` (each rank's own shards as global DTensors: checkpoint/state.py)."""

    def __init__(self, model: nn.Module, *, args: TrainingArguments, optimizer: torch.optim.Optimizer,
                 converter: ckpt.StateConverter, is_rank0: bool) -> None:
        self.model, self.args, self.optimizer, self.converter, self.is_rank0 = model, args, optimizer, converter, is_rank0
        self.inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        # --async-checkpoint: DCP's background writes run their collectives on a group of their own.
        self.async_group = comm.side_group() if args.async_checkpoint else None
        self._pending_save: ckpt.PendingSave | None = None

    def claim_output_dir(self, resume: bool | str | os.PathLike | None, overwrite: bool) -> None:
        """Refuse an output_dir holding an earlier run unless told to resume it or overwrite it (then its
        checkpoints and metrics are deleted). Checked on rank 0, raised on every rank."""
        output_dir = self.args.output_dir
        raise_on_any_rank(dirs.earlier_run_error(output_dir, resume=resume, overwrite=overwrite)
                          if self.is_rank0 else None, exc_type=ValueError)
        if overwrite:
            error = None
            if self.is_rank0:
                try:
                    dirs.clear_earlier_run(output_dir)
                except OSError as exc:
                    error = f"overwrite_output_dir=True: cannot delete the earlier run in {output_dir}: {exc}"
            raise_on_any_rank(error)

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write output_dir/checkpoint-<step> with `trainer_state` (trainer_state.json); returns its path. With
        async_checkpoint the tensors are still being written when it returns (the previous save is finished first)."""
        self.finish()
        self.check_finite(self.inner, f"checkpoint-{step}")
        saved = ckpt.save_checkpoint(self.args.output_dir, step, model=self.inner, optimizer=self.optimizer,
                                     conv=self.converter, trainer_state=trainer_state,
                                     save_total_limit=self.args.save_total_limit, async_group=self.async_group)
        self._pending_save = saved if saved.future is not None else None
        return saved.final

    def check_finite(self, model: nn.Module, what: str) -> None:
        """Refuse to write `what` from weights holding a NaN or inf (a step applied in backward with
        optim_in_backward, weights loaded so): NonFiniteStepError on every rank, naming the first such parameter."""
        bad = first_nonfinite(model.named_parameters())
        error = None if bad is None else (
            f"not writing {what}: parameter {bad[0]} holds NaN or inf ({bad[1]} of the {bad[2]} parameters this rank "
            "holds do), so the weights could be neither trained on nor used; the checkpoints already written are "
            "kept")
        raise_on_any_rank(error, exc_type=NonFiniteStepError)

    def finish(self) -> None:
        """Wait for an async checkpoint still being written and publish it (no-op if none)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at `path` into the model and optimizer in place; returns its trainer state. A
        checkpoint at or past max_steps is refused: nothing would be left to train."""
        step = dirs.read_trainer_state(path)["global_step"]  # the same file on every rank: raised on all
        if step >= self.args.max_steps:
            raise ValueError(f"{path} is at step {step} and max_steps={self.args.max_steps}: nothing is left to "
                             f"train; raise max_steps (--max-steps) above {step} to continue this run")
        return ckpt.load_checkpoint(path, model=self.inner, optimizer=self.optimizer, conv=self.converter)

    def save_model(self, output_dir: str | os.PathLike | None, tokenizer_dir: Path | None, *,
                   model: nn.Module | None = None) -> Path:
        """The consolidated HF checkpoint of `model` (default: the model trained; the Trainer's model as it is now,
        e.g. merged by `merge_and_unload`) in output_dir (default output_dir/final; a PeftModel's adapter:
        final/adapter), plus the tokenizer files of `tokenizer_dir`. FSDP and TP shards are gathered, rank 0 writes."""
        model = self.model if model is None else model
        target = Path(output_dir) if output_dir is not None else Path(self.args.output_dir) / "final"
        if output_dir is None and hasattr(model, "get_base_model"):  # a PeftModel: its adapter, in PEFT's format
            target = target / "adapter"
        self.check_finite(model, str(target))
        model.save_pretrained(target)
        if self.is_rank0:
            for pattern in TOKENIZER_PATTERNS if tokenizer_dir is not None else ():
                for path in tokenizer_dir.glob(pattern):
                    if path.is_file():
                        shutil.copy2(path, target / path.name)
        if dist.is_initialized():
            comm.barrier()
        return target
