"""--async-checkpoint: DCP async_save writes while training goes on; the next save (and the end of the run)
waits for it; a crash while it is written leaves the last complete checkpoint to resume from.

TP 2 on 2 CPU/gloo ranks, the tiny fp64 Qwen3 of tests/test_trainer.py. The writer is held (a patched
FileSystemWriter.write_data waits for an event) to show the save returning and a training step running
before any tensor is on disk.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.training.checkpoint.dirs import MARKER, resolve_resume
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed


def _trainer(output_dir, **kw) -> Trainer:
    model = tiny_model().parallelize(DistributedConfig(tp_size=2))
    args = training_args(output_dir, **{"max_steps": 6, "save_steps": 2, "save_total_limit": 2, **kw})
    return Trainer(model=model, args=args, train_dataset=tiny_dataset())


def _hold_writer() -> threading.Event:
    """Every DCP write on this rank waits until the returned event is set."""
    release, write_data = threading.Event(), FileSystemWriter.write_data

    def held(self, plan, planner):
        release.wait()
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = held
    return release


def _async_worker(tmp: str) -> None:
    sync = _trainer(f"{tmp}/sync").train()
    run = _trainer(f"{tmp}/async", async_checkpoint=True).train()
    assert run.losses == sync.losses  # the staged copy is the state of the save's step
    assert sorted(p.name for p in Path(f"{tmp}/async").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    resumed = _trainer(f"{tmp}/resumed", async_checkpoint=True).train(resume_from_checkpoint=f"{tmp}/async/checkpoint-4")
    assert resumed.losses == sync.losses[4:]

    trainer = _trainer(f"{tmp}/held", async_checkpoint=True, max_steps=10, save_steps=0)
    release = _hold_writer()
    trainer.training_step(trainer.data_order.next_batch())
    trainer.global_step = 1
    first = trainer.save_checkpoint()  # returns while its tensors wait to be written
    assert not first.exists() and not (first.parent / f".{first.name}.tmp" / MARKER).exists()
    trainer.training_step(trainer.data_order.next_batch())  # training goes on meanwhile
    trainer.global_step = 2
    threading.Timer(1.0, release.set).start()
    second = trainer.save_checkpoint()  # waits for the first, publishes it, then starts its own
    assert (first / MARKER).is_file() and not second.exists()
    trainer.finish_checkpoint()
    assert (second / MARKER).is_file()


def test_async_checkpoint_same_losses_and_overlap(tmp_path):
    run_distributed(_async_worker, 2, str(tmp_path), timeout=400)


def _crash_worker(tmp: str) -> None:
    trainer = _trainer(tmp, async_checkpoint=True)
    for step in (1, 2):
        trainer.training_step(trainer.data_order.next_batch())
        trainer.global_step = step
    trainer.save_checkpoint()
    trainer.finish_checkpoint()  # checkpoint-2: complete
    for step in (3, 4):
        trainer.training_step(trainer.data_order.next_batch())
        trainer.global_step = step
    _hold_writer()
    trainer.save_checkpoint()  # checkpoint-4: being written ...
    os._exit(3)  # ... when every rank dies


def _resume_worker(tmp: str, expected: list[float]) -> None:
    out = _trainer(tmp, async_checkpoint=True).train(resume_from_checkpoint=True)
    assert out.losses == expected, (out.losses, expected)


def _reference_worker(tmp: str) -> None:
    losses = _trainer(tmp).train().losses
    if torch.distributed.get_rank() == 0:
        Path(tmp, "losses.json").write_text(json.dumps(losses))


def test_crash_during_async_save_keeps_last_checkpoint(tmp_path):
    with pytest.raises(AssertionError, match="exit code 3"):
        run_distributed(_crash_worker, 2, str(tmp_path / "run"), timeout=300)
    run = tmp_path / "run"
    assert (run / "checkpoint-2" / MARKER).is_file()
    assert not (run / "checkpoint-4").exists() and not (run / ".checkpoint-4.tmp" / MARKER).exists()
    assert resolve_resume(True, run) == run / "checkpoint-2"
    run_distributed(_reference_worker, 2, str(tmp_path / "ref"), timeout=300)
    expected = json.loads((tmp_path / "ref" / "losses.json").read_text())
    run_distributed(_resume_worker, 2, str(run), expected[2:], timeout=300)


def test_cli_async_checkpoint_flag(tmp_path):
    run = tptrain_train("--output-dir", str(tmp_path / "run"), "--async-checkpoint")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert all((p / MARKER).is_file() for p in (tmp_path / "run").glob("checkpoint-*"))
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]
