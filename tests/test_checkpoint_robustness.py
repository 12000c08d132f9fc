"""Nothing a user saved is lost (issue 9): an earlier run in output_dir, a kill at any instant of a save
or a prune, corrupt or truncated files, a full disk, and the schedule after raising max_steps.

Fault injection runs in this process (world size 1: the save protocol is rank-independent); the
manifest, rng-file and fallback checks also at world size 2."""
from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.cli import main
from tptrain.training.checkpoint import dirs as ckpt
from tptrain.training.args import ParallelismConfig
from tptrain.training.reporting import read_metrics
from tptrain.training.trainer import Trainer


class Killed(BaseException):
    """Stands for SIGKILL at an instant of the save protocol: nothing after it runs."""


def _trainer(output_dir, **kw) -> Trainer:
    kw = {"max_steps": 2, "save_steps": 1, "logging_steps": 1, "per_device_train_batch_size": 2, **kw}
    return Trainer(model=tiny_model(), args=training_args(output_dir, **kw), train_dataset=tiny_dataset(16))


def _steps(output_dir) -> list[int]:
    return [int(p.name.split("-")[1]) for p in ckpt.complete_checkpoints(output_dir)]


def _assert_all_intact(output_dir) -> None:
    for path in ckpt.complete_checkpoints(output_dir):
        ckpt.verify_checkpoint(path)


# ------------------------------------------------------------------ 1: an earlier run in output_dir


def test_earlier_run_is_refused_overwritten_or_resumed_and_never_pruned(tmp_path):
    a = tmp_path / "a"
    _trainer(a, max_steps=5, save_total_limit=2).train()  # an earlier run: checkpoints 4, 5, final, metrics
    final = a / "final" / "model.safetensors"
    before = final.stat().st_mtime_ns
    with pytest.raises(ValueError, match=r"holds an earlier run \(checkpoint-4, checkpoint-5, final, loss.png, ...\)"
                                         r".*--resume.*--overwrite-output-dir"):
        _trainer(a).train()
    with pytest.raises(ValueError, match=r"checkpoint-5 is at step 5 and max_steps=2: nothing is left to train; "
                                         r"raise max_steps \(--max-steps\) above 5"):
        _trainer(a).train(resume_from_checkpoint=True)
    assert final.stat().st_mtime_ns == before and _steps(a) == [4, 5]  # nothing touched

    # A run resumed from another run's checkpoint into `a` prunes only its own lineage ...
    _trainer(tmp_path / "b", max_steps=1).train()
    other = tmp_path / "b" / "checkpoint-1"
    _trainer(a, max_steps=3, save_total_limit=1).train(resume_from_checkpoint=other)
    assert _steps(a) == [3, 4, 5], "another run's checkpoint was pruned"
    with pytest.raises(OSError, match=r"checkpoint-4 belongs to another run .* would be replaced"):
        _trainer(a, max_steps=4).train(resume_from_checkpoint=other)  # ... and never replaces its steps
    assert _steps(a) == [2, 3, 4, 5]  # its own 2 and 3, the other run's 4 and 5
    _assert_all_intact(a)

    out = _trainer(a, max_steps=1, overwrite_output_dir=True).train()
    assert _steps(a) == [1] and [r["step"] for r in read_metrics(a / "metrics.jsonl")] == [1]
    assert out.global_step == 1


def test_cli_messages(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["train", "--output-dir", str(tmp_path)]) == 2
    assert "holds an earlier run (metrics.jsonl)" in capsys.readouterr().err
    for resume in ("--resume", f"--resume={tmp_path / 'checkpoint-3'}"):
        assert main(["train", "--output-dir", str(tmp_path), resume, "--overwrite-output-dir"]) == 2
        assert "would delete: pass only one of them" in capsys.readouterr().err


# ------------------------------------------------------------------ 2, 3: a kill at any instant


def _kill_when(monkeypatch, name: str, hit) -> None:
    """Raise Killed instead of calling os.rename / shutil.rmtree when `hit(path)` says so."""
    module = ckpt.os if name == "rename" else ckpt.shutil
    real = getattr(module, name)

    def fake(path, *args, **kw):
        if hit(Path(path)):
            raise Killed(path)
        return real(path, *args, **kw)

    monkeypatch.setattr(module, name, fake)


@pytest.mark.parametrize("instant", ["rename old aside", "rename new into place", "delete old"])
def test_kill_while_replacing_a_step_keeps_it(tmp_path, monkeypatch, instant):
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.train()
    saved = (tmp_path / "checkpoint-1" / ckpt.MARKER).read_text()
    hits = {"rename old aside": ("rename", lambda p: p.name == "checkpoint-1"),
            "rename new into place": ("rename", lambda p: p.name == ".checkpoint-1.tmp"),
            "delete old": ("rmtree", lambda p: p.name.endswith(".deleting") and p.exists())}
    with monkeypatch.context() as m:
        _kill_when(m, *hits[instant])
        torch.manual_seed(5)  # a different rng state: tells the new checkpoint from the old
        with pytest.raises(Killed):
            trainer.save_checkpoint()  # the same step again (a resumed branch of the same run)
    assert ckpt.resolve_resume(True, tmp_path) == tmp_path / "checkpoint-1"  # intact (verified), and in place
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert (tmp_path / "checkpoint-1" / ckpt.MARKER).read_text() != saved  # the newest save of the step won


def test_kill_while_pruning_never_leaves_a_partial_complete_checkpoint(tmp_path, monkeypatch):
    real = shutil.rmtree

    def partial(path, *args, **kw):  # deletes 3 files, then the process dies
        path = Path(path)
        if not path.is_dir():
            return real(path, *args, **kw)
        for f in [f for f in sorted(path.iterdir()) if f.name != ckpt.MARKER][:3]:
            f.unlink()
        raise Killed(path)

    trainer = _trainer(tmp_path, max_steps=2, save_total_limit=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda p, *a, **kw: (partial if "checkpoint-1" in str(p) else real)(
        p, *a, **kw))
    with pytest.raises(Killed):
        trainer.train()
    monkeypatch.undo()
    assert _steps(tmp_path) == [2]
    _assert_all_intact(tmp_path)
    assert ckpt.resolve_resume(True, tmp_path) == tmp_path / "checkpoint-2"
    assert not (tmp_path / ".checkpoint-1.deleting").exists()  # cleaned up by the resume


# ------------------------------------------------------------------ 5, 7: full disk, corrupt shard under DCP


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.train()

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer.global_step = 2
    with monkeypatch.context() as m:
        m.setattr(torch, "save", full)  # DCP's writer and the RNG file both write through it
        with pytest.raises(OSError, match=r"cannot write checkpoint .*checkpoint-2: .*No space left on device"):
            trainer.save_checkpoint()
    assert not (tmp_path / ".checkpoint-2.tmp").exists() and _steps(tmp_path) == [1]
    _assert_all_intact(tmp_path)
    resumed = _trainer(tmp_path, max_steps=2).train(resume_from_checkpoint=True)
    assert resumed.global_step == 2 and len(resumed.losses) == 1


@pytest.fixture
def small_fs(tmp_path):
    """(a directory on a 16 MiB tmpfs of its own, leave_free(n): fill it up to n free bytes). Mounting needs root:
    skipped where it is refused."""
    path = tmp_path / "fs"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")

    def leave_free(n: int) -> None:
        ballast = path / "ballast"
        ballast.unlink(missing_ok=True)
        ballast.write_bytes(bytes(max(0, shutil.disk_usage(path).free - n)))

    yield path, leave_free
    subprocess.run(["umount", "-l", str(path)], check=True)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_full_device_refuses_a_checkpoint_before_writing_and_names_a_full_one_while_writing(small_fs, monkeypatch):
    fs, leave_free = small_fs
    out = fs / "run"
    trainer = _trainer(out, max_steps=1)
    trainer.train()  # checkpoint-1 and final/
    size = _size(out / "checkpoint-1")
    trainer.global_step = 2
    leave_free(size // 2)  # known before writing: refused, nothing written
    with pytest.raises(OSError, match=rf"^cannot write checkpoint {re.escape(str(out))}/checkpoint-2: not enough space "
                                      r"on the device for checkpoint .*checkpoint-2: it needs (\d+\.\d) KiB and the "
                                      rf"filesystem holding {re.escape(str(out))} has .* free; nothing was written and "
                                      r"what is already there is intact; free some space, lower save_total_limit"):
        trainer.save_checkpoint()
    assert not (out / ".checkpoint-2.tmp").exists() and _steps(out) == [1]
    # The size unknown beforehand (or another writer filling the device meanwhile): the device fills while DCP writes.
    monkeypatch.setattr(ckpt, "space_error", lambda *args, **kw: None)
    leave_free(size // 3)
    with pytest.raises(OSError, match=rf"^cannot write checkpoint {re.escape(str(out))}/checkpoint-2: the device "
                                      rf"holding {re.escape(str(out))} is full \(.* free\) while writing checkpoint "
                                      r".*checkpoint-2, which needs .* in all: the partial copy is removed and what "
                                      r"was there before is intact; free some space or write elsewhere \(the write "
                                      r"failed with "):
        trainer.save_checkpoint()
    assert not (out / ".checkpoint-2.tmp").exists() and _steps(out) == [1]
    _assert_all_intact(out)
    leave_free(1 << 30)
    resumed = _trainer(out, max_steps=2).train(resume_from_checkpoint=True)
    assert resumed.global_step == 2 and _steps(out) == [1, 2]


def test_a_full_device_keeps_the_previous_final_model(small_fs, monkeypatch):
    from tptrain.io import writer
    from tptrain.models import AutoModelForCausalLM

    fs, leave_free = small_fs
    out = fs / "run"
    trainer = _trainer(out, max_steps=1, save_steps=0)
    trainer.train()
    final = out / "final"
    weights = (final / "model.safetensors").read_bytes()
    trainer.model.train()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # what a second save would write: different weights
    leave_free(len(weights) // 2)
    with pytest.raises(OSError, match=rf"saving to {re.escape(str(final))} failed: OSError: \[Errno 28\] not enough "
                                      rf"space on the device for checkpoint {re.escape(str(final))}: it needs "):
        trainer.save_model()
    monkeypatch.setattr(writer, "space_error", lambda *args, **kw: None)  # the device fills while it writes
    with pytest.raises(OSError, match=rf"saving to {re.escape(str(final))} failed: OSError: \[Errno 28\] the device "
                                      rf"holding {re.escape(str(out))} is full \(.* free\) while writing checkpoint "
                                      rf"{re.escape(str(final))}, which needs .* in all: the partial copy is removed"):
        trainer.save_model()
    assert (final / "model.safetensors").read_bytes() == weights  # the previous final/, intact and loadable
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    AutoModelForCausalLM.from_pretrained(final)


def test_dcp_failure_on_load_is_an_oserror_naming_the_checkpoint(tmp_path):
    _trainer(tmp_path / "a", max_steps=1).train()
    path = tmp_path / "a" / "checkpoint-1"
    shard = path / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    ckpt.write_manifest(path, world_size=1)  # the manifest agrees: only DCP itself can notice
    with pytest.raises(OSError, match=r"cannot read checkpoint .*checkpoint-1: .*\(rank 0\)"):
        _trainer(tmp_path / "b").train(resume_from_checkpoint=path)


# ------------------------------------------------------------------ 13: the schedule after raising max_steps


def test_resume_with_more_steps_follows_the_new_schedule(tmp_path):
    args = dict(warmup_steps=1, save_steps=4)
    _trainer(tmp_path / "short", max_steps=4, **args).train()
    _trainer(tmp_path / "long", max_steps=8, **args).train(resume_from_checkpoint=tmp_path / "short" / "checkpoint-4")
    _trainer(tmp_path / "straight", max_steps=8, **args).train()
    resumed = [r["learning_rate"] for r in read_metrics(tmp_path / "long" / "metrics.jsonl")]
    straight = [r["learning_rate"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")]
    assert resumed[0] > 0 and resumed == straight[4:], (resumed, straight)


# ------------------------------------------------------------------ 4, 6: manifest, rng files, fallback (2 ranks)


def _damage(path: Path, how: str) -> bytes:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif how == "zero":
        path.write_bytes(data[:8] + bytes(len(data) - 16) + data[-8:])
    else:
        path.unlink()
    return data


def test_resume_names_its_checkpoint_and_a_fallback_names_both(tmp_path, capsys):
    _trainer(tmp_path, max_steps=2).train()  # checkpoints 1 and 2
    _trainer(tmp_path, max_steps=3).train(resume_from_checkpoint=True)
    assert f"tptrain: resuming from {tmp_path / 'checkpoint-2'} (step 2)\n" in capsys.readouterr().out
    _damage(tmp_path / "checkpoint-3" / "trainer_state.json", "truncate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=True)
    out = capsys.readouterr().out
    assert out.count("resuming from") == 1 and f"resuming from {tmp_path / 'checkpoint-2'} (step 2)\n" in out, out
    messages = [str(w.message) for w in caught if "resuming" in str(w.message)]
    assert len(messages) == 1, messages
    skipped = tmp_path / "checkpoint-3"
    assert messages[0].startswith(f"not resuming from {skipped} ({skipped / 'trainer_state.json'} has "), messages
    assert "it is truncated" in messages[0], messages
    assert messages[0].endswith(f"falling back to {tmp_path / 'checkpoint-2'}, the latest intact checkpoint"), messages


def _integrity_worker(tmp: str) -> None:
    def run(output_dir, **kw):
        model = tiny_model().parallelize(DistributedConfig(tp_size=2))
        args = training_args(output_dir, max_steps=4, save_steps=2, parallelism_config=ParallelismConfig(2), **kw)
        return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()

    full = run(f"{tmp}/a")
    rank = dist.get_rank()
    latest = Path(f"{tmp}/a/checkpoint-4")
    assert json.loads((latest / ckpt.MARKER).read_text())["world_size"] == 2
    cases = [(".metadata", "truncate"), ("__1_0.distcp", "truncate"), ("trainer_state.json", "truncate"),
             ("rng_state_1.pth", "truncate"), ("__1_0.distcp", "zero"), ("rng_state_1.pth", "delete")]
    for name, how in cases:
        dist.barrier()
        data = _damage(latest / name, how) if rank == 0 else None
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ckpt.resolve_resume(True, f"{tmp}/a") == latest.parent / "checkpoint-2"
        if rank == 0:
            assert len(caught) == 1 and name in str(caught[0].message), [str(w.message) for w in caught]
        with pytest.raises(ValueError, match=rf"cannot resume from .*checkpoint-4: .*{name.replace('.', '[.]')} "):
            ckpt.resolve_resume(latest, f"{tmp}/a")
        dist.barrier()
        if rank == 0 and how != "delete":
            (latest / name).write_bytes(data)
    dist.barrier()
    # Saved by fewer ranks than resume it (here: a manifest of world size 1): rank 1 takes rank 0's stream.
    one = Path(f"{tmp}/one/checkpoint-2")
    if rank == 0:
        shutil.copytree(latest.parent / "checkpoint-2", one)
        (one / "rng_state_1.pth").unlink()
        ckpt.write_manifest(one, world_size=1)
    dist.barrier()
    assert run(f"{tmp}/c", resume_from_checkpoint=one).global_step == 4
    # checkpoint-4 now lacks rank 1's rng file: --resume falls back to checkpoint-2 and retrains 3 and 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = run(f"{tmp}/a", resume_from_checkpoint=True)
    assert again.losses == full.losses[2:], (again.losses, full.losses)


@pytest.mark.distributed
def test_manifest_rng_files_and_fallback_at_two_ranks(tmp_path):
    run_distributed(_integrity_worker, 2, str(tmp_path), timeout=200)
