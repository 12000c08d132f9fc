"""`tptrain train --config`: a run file's keys and values, the flags given over it, `--print-config` read back to
the same run, its errors before anything starts; `--report-to wandb` (offline: WANDB_MODE=offline, no network) with
the resolved configuration as the W&B run's config, read back from the run's own files; one real 2-rank run from a
run file."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.launch import ROOT, finish_tptrain_train, start_tptrain_train
from tptrain.cli import main
from tptrain.cli.run_file import RUN_CONFIG
from tptrain.training.reporting import Reporter, read_metrics, wandb_run

RUN_FILE = """\
max-steps: 7
max_new_tokens: 3     # underscores work too
lr: 3e-4              # YAML reads this as a string: --lr's own parsing
bf16: true
packing: false        # --no-packing
resume: true          # --resume (the latest checkpoint)
dtype: bfloat16
report-to: wandb
"""


def _print_config(capsys, *flags: str) -> str:
    capsys.readouterr()
    assert main(["train", *flags, "--print-config"]) == 0
    return capsys.readouterr().out


def _help_options(capsys) -> list[str]:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    flags = re.findall(r"^  (--[\w-]+)", capsys.readouterr().out, re.MULTILINE)
    return [flag[2:] for flag in flags if flag not in ("--help", "--config", "--print-config")]


def test_run_file_values_and_the_flags_over_them(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(RUN_FILE)
    config = yaml.safe_load(_print_config(capsys, "--config", str(run_file), "--max-steps", "9", "--dtype", "float16"))
    assert config["max-steps"] == 9 and config["dtype"] == "float16"  # the flags given win
    assert (config["max-new-tokens"], config["lr"], config["bf16"], config["packing"], config["resume"],
            config["report-to"]) == (3, 3e-4, True, False, True, "wandb")
    # what neither says: the defaults, the default run's sizes filled in (warmup: 10% of the 9 steps)
    assert (config["tp-size"], config["batch-size"], config["seq-len"], config["warmup-steps"]) == (2, 16, 128, 0)
    assert list(config) == _help_options(capsys)  # every option, in --help's order
    assert not (tmp_path / "runs").exists()  # printed, nothing run
    run_file.write_text("dtype: bf16\n")  # a flag's own aliases, as on the command line
    assert yaml.safe_load(_print_config(capsys, "--config", str(run_file)))["dtype"] == "bfloat16"


def test_print_config_reads_back_to_the_same_run(tmp_path, capsys):
    flags = ("--smoke-test", "--num-epochs", "2", "--lora-r", "4", "--prompt", "one\ntwo", "--resume", "ckpt/x",
             "--lr", "1e-3", "--no-assistant-only-loss", "--output-dir", str(tmp_path / "out"))
    printed = _print_config(capsys, *flags)
    config = yaml.safe_load(printed)
    # --num-epochs: --max-steps stays unset (a value would be refused next to it when read back)
    assert (config["num-epochs"], config["max-steps"], config["batch-size"], config["prompt"]) == (2.0, None, 2,
                                                                                                  "one\ntwo")
    again = tmp_path / "again.yaml"
    again.write_text(printed)
    assert _print_config(capsys, "--config", str(again)) == printed
    toml = tmp_path / "run.toml"  # the same run as TOML (which has no null: unset options are left out)
    toml.write_text("\n".join(f"{key} = {json.dumps(value)}" for key, value in config.items() if value is not None))
    assert _print_config(capsys, "--config", str(toml)) == printed


def test_print_config_from_the_command_line_imports_no_torch(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(RUN_FILE)
    as_m = "import runpy, sys; sys.argv[0] = 'tptrain'; runpy.run_module('tptrain', run_name='__main__')"  # -m
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", as_m, "train", "--config", str(run_file),
                          "--print-config"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == _print_config(capsys, "--config", str(run_file))
    imported = re.findall(r"\|\s+([\w.]+)$", run.stderr, re.MULTILINE)
    assert "yaml" in imported and "torch" not in imported, imported


@pytest.mark.parametrize("text, message", [
    ("max_step: 3", r"unknown key 'max_step'; did you mean 'max-steps'\?"),
    ("lora-rank: 8", r"unknown key 'lora-rank'; did you mean 'lora-r'\?"),
    ("max-steps: three", r"max-steps must be an integer, got 'three' \(str\)"),
    ("lora-r: 2.5", r"lora-r must be an integer, got 2.5 \(float\)"),
    ("bf16: 1", r"bf16 must be true or false, got 1 \(int\)"),
    ("lr: fast", r"lr must be a number, got 'fast'"),
    ("tp-size: null", r"tp-size must be an integer, got None"),
    ("dtype: float8", r"dtype must be one of 'float32', 'float64', 'bfloat16', 'float16', got 'float8'"),
    ("text-column: yes", r"text-column must be a string \(quote it"),
    ("resume: 3", r"resume must be true or a path"),
    ("tp-size: 2\ntp_size: 2", r"'tp_size' sets tp-size, which the file sets already"),
    ("config: other.yaml", r"'config' is a command-line flag only"),
    ("- max-steps", r"a run file maps options to values .* got a list"),
    ("max-steps: [", r"not valid YAML at line 2, column 1"),
])
def test_run_file_errors_name_the_key_before_anything_runs(tmp_path, capsys, text, message):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(text + "\n")
    capsys.readouterr()
    assert main(["train", "--config", str(run_file), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tptrain train: error: --config {run_file}: ") and re.search(message, err), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists(), err


def test_a_toml_syntax_error_and_a_missing_file(tmp_path, capsys):
    bad = tmp_path / "run.toml"
    bad.write_text("max-steps = \n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "not valid TOML: Invalid value (at line 1, column 13)" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read the run file (No such file or directory)" in capsys.readouterr().err


# ------------------------------------------------------------------ --report-to wandb, offline


def _wandb_records(run_dir: Path, timeout: float = 60) -> dict[str, list]:
    """The records of a finished offline W&B run, by kind ("run", "config", "history", ..., "exit"). wandb's service
    process may still be writing them when run.finish() returns: read again until the exit record is there."""
    deadline = time.monotonic() + timeout
    while "exit" not in (records := _read_wandb_log(next(run_dir.glob("run-*.wandb")))):
        assert time.monotonic() < deadline, f"{run_dir}: no exit record after {timeout} s: {sorted(records)}"
        time.sleep(0.1)
    return records


def _read_wandb_log(path: Path) -> dict[str, list]:
    """A run-<id>.wandb file: wandb's LevelDB-style log (a 7-byte header ":W&B" + magic + version, then 32 KiB
    blocks of chunks, each crc32c:4 length:2 type:1 (1 full, 2 first, 3 middle, 4 last) + data) of protobuf
    Records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    records, pos, pending = {}, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.setdefault(record.WhichOneof("record_type"), []).append(record)
            pending = b""
    return records


def _wandb_config(records: dict) -> dict:
    items = [item for r in records["run"] for item in r.run.config.update]
    items += [item for r in records.get("config", []) for item in r.config.update]
    return {item.key: json.loads(item.value_json) for item in items if item.key != "_wandb"}


def _wandb_history(records: dict) -> dict[int, dict]:
    history = {}
    for record in records["history"]:
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch) -> Path:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb-dir" / "wandb"


@pytest.mark.distributed  # wandb.init starts its service process (wandb-core)
def test_reporter_logs_to_wandb_what_tensorboard_gets(tmp_path, offline_wandb):
    Reporter(tmp_path / "quiet", total_steps=2, enabled=False, report_to="wandb").close()  # not rank 0
    assert not offline_wandb.exists()
    reporter = Reporter(tmp_path / "out", total_steps=2, enabled=True, report_to="wandb",
                        config={"max_steps": 2, "output_dir": tmp_path / "out"})
    reporter.log(1, {"loss": 3.5, "learning_rate": 1e-3, "grad_norm": 0.25})
    reporter.log(2, {"loss": 2.5, "learning_rate": 5e-4})
    reporter.log(2, {"eval_loss": 2.75, "eval_ppl": 15.6})
    reporter.close()
    (run_dir,) = offline_wandb.glob("offline-run-*")
    records = _wandb_records(run_dir)
    assert _wandb_config(records) == {"max_steps": 2, "output_dir": str(tmp_path / "out")}
    assert _wandb_history(records) == {
        1: {"train/loss": 3.5, "train/learning_rate": 1e-3, "train/grad_norm": 0.25},
        2: {"train/loss": 2.5, "train/learning_rate": 5e-4, "eval/loss": 2.75, "eval/ppl": 15.6}}
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 2]


@pytest.mark.distributed  # wandb.init starts its service process (wandb-core)
def test_reporter_logs_to_the_run_its_caller_started(tmp_path, offline_wandb):
    """`tptrain train`'s rank 0 starts the run with the resolved configuration; the Trainer's Reporter logs to it
    and leaves it to its caller to finish."""
    import wandb

    with wandb_run(tmp_path, {"max-steps": 1, "lr": None}, enabled=True) as run:
        reporter = Reporter(tmp_path, total_steps=1, enabled=True, report_to="wandb", config={"max_steps": 1})
        reporter.log(1, {"loss": 1.25})
        reporter.close()
        assert wandb.run is run  # not finished by the Reporter
    assert wandb.run is None
    (run_dir,) = offline_wandb.glob("offline-run-*")
    records = _wandb_records(run_dir)
    assert _wandb_config(records) == {"max-steps": 1, "lr": None}
    assert _wandb_history(records) == {1: {"train/loss": 1.25}}
    assert records["exit"][0].exit.exit_code == 0


def test_report_to_wandb_without_the_package(tmp_path, monkeypatch, capsys):
    from tptrain.training.args import TrainingArguments

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match=r"report_to='wandb' \(--report-to wandb\) needs the wandb package, which "
                                         r"is not installed: pip install wandb"):
        TrainingArguments(output_dir=str(tmp_path), report_to="wandb")
    out = tmp_path / "out"
    assert main(["train", "--smoke-test", "--report-to", "wandb", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install wandb" in err and err.count("\n") == 1, err
    assert not (out / RUN_CONFIG).exists()  # saved only once the run passed every check


# ------------------------------------------------------------------ a real run


@pytest.mark.distributed
def test_a_run_from_a_run_file_saves_its_configuration_and_reports_to_wandb(tmp_path, offline_wandb, capsys):
    out, data = tmp_path / "out", tmp_path / "small.txt"
    data.write_text((ROOT / "tptrain" / "data" / "corpus.txt").read_text()[:8000])  # tokenized in a moment
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"output-dir: {out}\ndata: {data}\nmax-steps: 3\nmax_new_tokens: 2\nreport-to: wandb\n")
    run = finish_tptrain_train(start_tptrain_train("--config", str(run_file), "--seed", "1"))
    assert run.returncode == 0, run.stdout + run.stderr
    saved = (out / RUN_CONFIG).read_text()
    assert saved == _print_config(capsys, "--smoke-test", "--config", str(run_file), "--seed", "1")
    assert _print_config(capsys, "--config", str(out / RUN_CONFIG)) == saved  # the saved file: the same run
    config = yaml.safe_load(saved)
    assert (config["seed"], config["max-steps"], config["smoke-test"], config["data"]) == (1, 3, True, str(data))

    (run_dir,) = offline_wandb.glob("offline-run-*")  # rank 0's only
    records = _wandb_records(run_dir)
    assert _wandb_config(records) == config
    losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    assert {step: row["train/loss"] for step, row in _wandb_history(records).items()} == losses
    assert list(losses) == [1, 2, 3] and records["exit"][0].exit.exit_code == 0
