"""Resumable checkpoints: stop, resume, get the uninterrupted run's losses; resume at another layout;
and the errors a user can provoke (bad layouts, unwritable output, wrong or missing checkpoints)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer


def _run(output_dir, tp: int, *, shard: int | None = None, **kw):
    model = tiny_model()
    if tp > 1:
        model = model.parallelize(DistributedConfig(tp_size=tp))
    args = training_args(output_dir, max_steps=6, save_steps=2, save_total_limit=2,
                         parallelism_config=ParallelismConfig(tp, dp_shard_size=shard), **kw)
    return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()


def _resume_worker(tmp: str) -> None:
    full = _run(f"{tmp}/a", 2)  # uninterrupted: checkpoints 2, 4, 6; the limit keeps 4 and 6
    names = sorted(p.name for p in Path(f"{tmp}/a").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-4", "checkpoint-6"], names
    assert (Path(f"{tmp}/a/checkpoint-4") / "complete").is_file()
    assert not [p for p in Path(f"{tmp}/a").iterdir() if p.name.startswith(".")]  # no temp dirs left

    same = _run(f"{tmp}/b", 2, resume_from_checkpoint=f"{tmp}/a/checkpoint-4")
    assert same.global_step == 6
    assert same.losses == full.losses[4:], (same.losses, full.losses)  # bit-identical at the same layout

    # tp 2 -> tp 1 x dp_shard 2, the same global batch of 4
    other = _run(f"{tmp}/c", 1, shard=2, per_device_train_batch_size=2,
                 resume_from_checkpoint=f"{tmp}/a/checkpoint-4")
    torch.testing.assert_close(torch.tensor(other.losses), torch.tensor(full.losses[4:]), rtol=1e-6, atol=1e-6)

    final = Path(f"{tmp}/a/final/model.safetensors")
    before = final.stat().st_mtime_ns
    with pytest.raises(ValueError, match=r"checkpoint-6 is at step 6 and max_steps=6: nothing is left to train; "
                                         r"raise max_steps \(--max-steps\) above 6"):
        _run(f"{tmp}/a", 2, resume_from_checkpoint=True)  # picks checkpoint-6: refused, final/ untouched
    assert final.stat().st_mtime_ns == before


@pytest.mark.distributed
def test_resume_same_and_other_layout(tmp_path):
    run_distributed(_resume_worker, 2, str(tmp_path), timeout=400)


def _errors_worker(tmp: str) -> None:
    def trainer(model, **kw):
        return Trainer(model=model, args=training_args(f"{tmp}/err", **kw), train_dataset=tiny_dataset())

    with pytest.raises(ValueError, match=r"ParallelismConfig\(tp_size=1, dp_shard_size=1, dp_replicate_size=1\) "
                                         r"needs 1 x 1 x 1 = 1 process .* but the world size is 2"):
        trainer(tiny_model(), parallelism_config=ParallelismConfig(1, dp_shard_size=1, dp_replicate_size=1))
    tp2 = tiny_model().parallelize(DistributedConfig(tp_size=2))
    with pytest.raises(ValueError, match=r"ParallelismConfig\(tp_size=1\) disagrees with the model.*tp_size=2"):
        trainer(tp2, parallelism_config=ParallelismConfig(1, dp_shard_size=2))
    sp = tiny_model().parallelize(DistributedConfig(tp_size=2, enable_sequence_parallel=True))
    with pytest.raises(ValueError, match="seq_len=15 is not a multiple of 2"):
        Trainer(model=sp, args=training_args(f"{tmp}/err", seq_len=15), train_dataset=list("abc"))
    blocker = Path(tmp) / "a_file"
    if torch.distributed.get_rank() == 0:
        blocker.write_text("not a directory")
    torch.distributed.barrier()
    with pytest.raises(OSError, match="a_file"):
        Trainer(model=tp2, args=training_args(blocker / "run"), train_dataset=tiny_dataset())
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint.*does not exist"):
        trainer(tp2, max_steps=1).train(resume_from_checkpoint=f"{tmp}/no-such-checkpoint")

    trainer(tiny_model().parallelize(DistributedConfig(tp_size=2)), max_steps=1, save_steps=1).train()
    wider = tiny_model(intermediate_size=64).parallelize(DistributedConfig(tp_size=2))
    with pytest.raises(ValueError, match=r"'model.model.layers.0.mlp.gate_proj.weight' with shape \(48, 32\) "
                                         r"but this model's is \(64, 32\)"):
        trainer(wider, max_steps=2).train(resume_from_checkpoint=f"{tmp}/err/checkpoint-1")


@pytest.mark.distributed
def test_bad_input_errors_on_every_rank(tmp_path):
    run_distributed(_errors_worker, 2, str(tmp_path))


def test_latest_complete_checkpoint(tmp_path):
    from tptrain.training.checkpoint.dirs import resolve_resume, write_manifest

    for step, complete in ((9, True), (10, True), (12, False)):  # 12: interrupted while being written
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            write_manifest(tmp_path / f"checkpoint-{step}", world_size=1)
    assert resolve_resume(True, tmp_path) == tmp_path / "checkpoint-10"  # numeric order, incomplete skipped
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(ValueError, match="checkpoint-12 is not a complete training checkpoint"):
        resolve_resume(tmp_path / "checkpoint-12", tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint-<step>"):
        resolve_resume(True, tmp_path / "empty")
