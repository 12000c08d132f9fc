"""Faults at launch and while running, each reported as what it is, promptly, on every rank:

* `tptrain train` refuses bad flags, models, data and output directories before any worker starts;
* a load error seen by one rank only reaches the other rank too, also without torchrun (RANK set by hand),
  even one met before the checkpoint's config.json is read (no such checkpoint);
* a rank that is never started makes the others fail after TPTRAIN_RENDEZVOUS_TIMEOUT, saying so;
* a rank killed mid-run is named with its signal, not hidden behind the survivor's "Connection closed";
* --seq-len beyond max_position_embeddings, impossible layouts and config-only directories say what is wrong;
* the default run is deterministic: two smoke runs write the same metrics.jsonl.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_launch_faults.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, tptrain_train
from tests.helpers.ranks import reserved_port
from tptrain import AutoConfig, AutoModelForCausalLM
from tptrain.cli import main
from tptrain.cli import train as train_cli
from tptrain.distributed.state import ParallelState
from tptrain.layout import ParallelDims
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.mesh import resolve_parallelism
from tptrain.training.reporting import read_metrics
from tptrain.training.trainer import Trainer

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
TIMING_FIELDS = ("step_time", "tokens_per_second",  # measured, so never the same twice
                 "peak_memory", "planned_peak_memory", "peak_memory_kind")


def _save(path: Path, **kwargs) -> Path:
    config = AutoConfig.for_model("qwen3", **TINY)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, **kwargs)
    return path


# ------------------------------------------------------------------ checks before any worker starts


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker was started")


def test_train_refuses_bad_inputs_before_starting_workers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_cli, "_launch", _no_workers)
    monkeypatch.setattr(train_cli, "_worker", _no_workers)
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "acme_lm", "hidden_size": 64}))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf".encode() + "é".encode("latin-1") * 100)
    out = ["--output-dir", str(tmp_path / "run")]
    cases = [
        (["--model", str(gpt)], "model_type 'acme_lm' is not supported"),
        (["--data", str(tmp_path / "missing.txt")], "missing.txt does not exist"),
        (["--data", str(latin1)], "not valid UTF-8: byte offset 3"),
        (["--tp-size", "3"], "--tp-size 3 cannot shard Qwen3ForCausalLM: num_attention_heads=4 is not divisible"),
        (["--tp-size", "0"], "--tp-size must be a positive integer, got 0"),
        (["--nproc-per-node", "3"], "--nproc-per-node 3 is not a multiple of --tp-size 2"),
        (["--seq-len", "2048"], "--seq-len=2048 exceeds the model's max_position_embeddings=1024"),
        (["--max-steps", "0"], "TrainingArguments.max_steps must be a positive int, got 0"),
    ]
    for flags, expected in cases:
        # Refused before any heavy work: in under 5 s of this process's CPU time, which a loaded machine does not
        # inflate as it does wall time (the first case also pays the CLI's imports: ~1 s).
        start = time.process_time()
        code = main(["train", "--smoke-test", *out, *flags])
        cpu = time.process_time() - start
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expected in err, (flags, code, err)
        assert err.startswith("tptrain train: error: ") and cpu < 5, (flags, cpu, err)
    (tmp_path / "file").write_text("")
    assert main(["train", "--smoke-test", "--output-dir", str(tmp_path / "file" / "run")]) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_seq_len_beyond_max_positions_is_refused_by_the_trainer(tmp_path):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY))
    args = TrainingArguments(output_dir=str(tmp_path), seq_len=128, max_steps=1)
    with pytest.raises(ValueError, match=r"TrainingArguments.seq_len=128 exceeds the model's "
                                         r"max_position_embeddings=64 .*set rope_scaling in config.json"):
        Trainer(model=model, args=args, train_dataset=["text " * 100])


def test_layout_errors_state_the_sizes_and_the_world_size():
    tp2_model = types.SimpleNamespace(parallel=ParallelState(dims=ParallelDims(tp=2)))  # laid out at tp 2
    with pytest.raises(ValueError) as info:
        resolve_parallelism(tp2_model, ParallelismConfig(dp_shard_size=2), world_size=2)
    assert str(info.value).startswith("ParallelismConfig(tp_size=2 (the model's), dp_shard_size=2, "
                                      "dp_replicate_size=1) needs 2 x 2 x 1 = 4 processes (tp x dp_shard x "
                                      "dp_replicate), but the world size is 2"), info.value


def test_config_only_directory_points_to_from_config(tmp_path):
    AutoConfig.for_model("qwen3", **TINY).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (f"checkpoint directory {tmp_path} holds config.json but no weights" in str(info.value)
            and f"AutoModelForCausalLM.from_config(AutoConfig.from_pretrained('{tmp_path}')) (what "
                f"`tptrain train --model {tmp_path}` does)" in str(info.value)), info.value


# ------------------------------------------------------------------ ranks started by hand (no torchrun)

LOAD = "import sys, torch; from tptrain import AutoModelForCausalLM, DistributedConfig; " \
       "AutoModelForCausalLM.from_pretrained(sys.argv[1], distributed_config=DistributedConfig(tp_size=2)); " \
       "print('loaded OK')"


def _start_rank(rank: int, port: int, checkpoint: Path, rendezvous_timeout: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", TPTRAIN_RENDEZVOUS_TIMEOUT=str(rendezvous_timeout))
    return subprocess.Popen([sys.executable, "-c", LOAD, str(checkpoint)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"a rank was still running after {timeout} s") from None
    return proc.returncode, out + err


@pytest.mark.distributed
def test_one_rank_load_error_reaches_every_rank_and_a_missing_rank_times_out(tmp_path):
    good = _save(tmp_path / "good", max_shard_size="40KB")
    broken = _save(tmp_path / "broken", max_shard_size="40KB")  # this node's copy lost a shard
    sorted(broken.glob("model-*.safetensors"))[1].unlink()
    start = time.monotonic()
    with reserved_port() as port, reserved_port() as lonely_port:  # rank 0 serves the rendezvous on it
        ranks = [_start_rank(0, port, good, 60), _start_rank(1, port, broken, 60)]
        lonely = _start_rank(0, lonely_port, good, 3)  # its rank 1 is never started
        results = [_finish(p, timeout=90) for p in (*ranks, lonely)]
    for code, output in results[:2]:  # each rank raises rank 1's error, none says "loaded OK"
        assert code != 0 and "loaded OK" not in output, output
        assert "FileNotFoundError" in output and "model-00002-of-" in output and "(on rank 1 of 2)" in output, output
    code, output = results[2]
    assert code != 0 and ("TimeoutError: rank 0 waited 3 s for WORLD_SIZE=2 processes at 127.0.0.1:" in output
                          and "are all ranks started" in output), output
    assert time.monotonic() - start < 60


@pytest.mark.distributed
def test_a_rank_given_a_missing_checkpoint_stops_the_others_at_once(tmp_path):
    """Rank 1's checkpoint does not exist, so AutoModelForCausalLM cannot even read its config.json: rank 0 still
    fails within seconds with rank 1's error (the path, "(on rank 1 of 2)"), not after the rendezvous timeout."""
    good, missing = _save(tmp_path / "good"), tmp_path / "no-such-checkpoint"
    start = time.monotonic()
    with reserved_port() as port:
        ranks = [_start_rank(0, port, good, 120), _start_rank(1, port, missing, 120)]
        results = [_finish(p, timeout=180) for p in ranks]
    elapsed = time.monotonic() - start
    for code, output in results:
        assert code != 0 and "loaded OK" not in output, output
        assert "FileNotFoundError" in output and str(missing) in output and "(on rank 1 of 2)" in output, output
        assert "waited 120 s" not in output, output
    assert elapsed < 60, f"rank 0 learnt of rank 1's error after {elapsed:.0f} s"


# ------------------------------------------------------------------ a rank dies mid-run

# Test-only: a sitecustomize (on PYTHONPATH of this test's run only) in every worker interpreter, that
# SIGKILLs rank $KILL_RANK as soon as $KILL_WHEN exists (rank 0 has logged step 1: training is under way).
KILLER = textwrap.dedent("""\
    import os, signal, threading, time

    def _watch():
        while True:
            if os.environ.get("RANK") == os.environ["KILL_RANK"] and os.path.exists(os.environ["KILL_WHEN"]):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)

    if os.environ.get("KILL_RANK"):
        threading.Thread(target=_watch, daemon=True).start()
""")


@pytest.mark.distributed
def test_a_killed_rank_is_named_with_its_signal(tmp_path, monkeypatch):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(KILLER)
    out = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "hook"), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("KILL_RANK", "1")
    monkeypatch.setenv("KILL_WHEN", str(out / "metrics.jsonl"))
    run = tptrain_train("--output-dir", str(out), "--max-steps", "200", "--save-steps", "0", timeout=120)
    assert run.returncode == 1
    assert "tptrain train: error: rank 1 exited with signal 9 (SIGKILL)" in run.stderr, run.stderr
    assert "error on rank 0" not in run.stderr, run.stderr  # the survivor's connection error is only a note


# ------------------------------------------------------------------ determinism


@pytest.mark.distributed
def test_default_run_is_deterministic(tmp_path):
    runs = [tptrain_train("--output-dir", str(tmp_path / name), "--save-steps", "0") for name in ("a", "b")]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "initialised at random (seed 0)" in run.stdout and "1 thread per rank" in run.stdout, run.stdout
    a, b = ([{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(tmp_path / n / "metrics.jsonl")]
            for n in ("a", "b"))
    assert a == b and len(a) == 4, (a, b)  # bit for bit: JSON floats round-trip exactly
    # The console states the final figure loss.png's title states.
    from PIL import Image

    headline = runs[0].stdout.split("trained to step 4: ")[1].split(";")[0]
    assert Image.open(tmp_path / "a" / "loss.png").text["Title"] == f"{headline}, step 4", headline
    mean = sum(r["loss"] for r in a) / 4
    assert headline == f"loss {a[0]['loss']:.3f} -> {mean:.3f} (mean of the last 4 steps)"
    text = [run.stdout.split("greedy continuation")[1] for run in runs]
    assert text[0] == text[1]
