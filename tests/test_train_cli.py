"""`tptrain train` end to end: its own 2-rank launcher, a few steps, the files it promises, resume, errors."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.launch import tptrain_train
from tptrain.models import AutoModelForCausalLM
from tptrain.training.reporting import read_metrics

pytestmark = pytest.mark.distributed


def test_smoke_run_writes_everything_and_resumes(tmp_path):
    out = tmp_path / "run"
    run = tptrain_train("--output-dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    final = out / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).is_file(), f"{name} missing from {sorted(os.listdir(final))}"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert model.config.model_type == "qwen3"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 for r in records)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "greedy continuation" in run.stdout and run.stdout.count("tptrain train:") == 1  # rank 0 only

    resumed = tptrain_train("--output-dir", str(out), "--resume", "--max-steps", "6")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.count("resuming from") == 1, resumed.stdout  # rank 0 only
    assert f"tptrain: resuming from {out / 'checkpoint-4'} (step 4)" in resumed.stdout, resumed.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]


def test_errors_are_reported_once_for_all_ranks(tmp_path):
    short = tmp_path / "short.txt"  # found only once tokenized, so in the workers: every rank raises it
    short.write_text("Too short.")
    run = tptrain_train("--output-dir", str(tmp_path / "run"), "--data", str(short))
    assert run.returncode == 1
    assert "error on ranks 0, 1: ValueError" in run.stderr and run.stderr.count("is too short") == 1, run.stderr
    assert "Traceback" not in run.stderr


def test_sequence_parallel_flag_gives_the_losses_of_plain_tp(tmp_path, capsys):
    """--sequence-parallel at --tp-size 2 (fp64): the norms and the activations between the blocks split along the
    sequence, the same losses and greedy continuation (its context padded to split) as without it; a sequence length
    that does not split is refused before any worker starts."""
    losses, texts = {}, {}
    for sp in (False, True):
        out = tmp_path / f"sp{int(sp)}"
        run = tptrain_train("--output-dir", str(out), "--dtype", "float64", *(["--sequence-parallel"] if sp else []))
        assert run.returncode == 0, run.stdout + run.stderr
        assert ("(sequence parallel)" in run.stdout) == sp, run.stdout
        losses[sp] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
        texts[sp] = run.stdout.split("greedy continuation of")[1]
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], rel=1e-10, abs=1e-10), losses
    assert texts[True] == texts[False]
    from tptrain.cli import main

    capsys.readouterr()
    code = main(["train", "--smoke-test", "--output-dir", str(tmp_path / "odd"), "--sequence-parallel", "--seq-len",
                 "31"])
    err = capsys.readouterr().err
    assert code == 2 and "sequence parallelism splits the sequence over tp_size=2" in err and "--seq-len" in err, err
