"""The `tptrain` command's surface: --version / tptrain.__version__, the sections of `tptrain train --help`, an
unknown model_type refused before torch, transformers or the training stack is imported, and a launcher that
checks a run without the Trainer's imports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import tptrain
from tptrain.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_version() -> str:
    return re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)


def test_version_from_the_installed_metadata_else_pyproject(monkeypatch, capsys):
    try:
        installed = metadata.version("tptrain")
    except metadata.PackageNotFoundError:
        installed = _pyproject_version()
    assert tptrain.__version__ == installed
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"tptrain {installed}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # a source tree that was never pip-installed
    assert tptrain.__version__ == _pyproject_version() == "0.1.0"


def _sections(help_text: str) -> dict[str, str]:
    """{flag: the --help section it is listed under}."""
    section, out = None, {}
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            section = line[:-1]
        elif section and (found := re.match(r"  (-{1,2}[\w-]+)", line)):
            out[found.group(1)] = section
    return out


def test_train_help_lists_every_flag_in_its_section(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    sections = _sections(capsys.readouterr().out)
    expected = {
        "run file": ["--config", "--print-config"],
        "parallelism": ["--tp-size", "--expert-parallel", "--ep-size", "--nproc-per-node"],
        "faults": ["--preemption-grace", "--max-restarts", "--pg-timeout", "--async-checkpoint"],
        "multi-node": ["--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id"],
        "model": ["--model", "--dtype", "--seed"],
        "data": ["--data", "--seq-len", "--streaming", "--text-column", "--packing", "--chat-template"],
        "evaluation": ["--eval-data", "--eval-split", "--eval-steps", "--save-best"],
        "optimisation": ["--max-steps", "--num-epochs", "--grad-accum", "--lr", "--bf16", "--max-grad-norm",
                         "--optim-in-backward"],
        "checkpoints and output": ["--output-dir", "--resume", "--report-to", "--smoke-test"],
        "LoRA": ["--lora-r", "--lora-target-parameters", "--merge"],
    }
    for section, flags in expected.items():
        assert {flag: sections.get(flag) for flag in flags} == dict.fromkeys(flags, section), sections
    assert [flag for flag, section in sections.items() if section == "options"] == ["-h"], sections


UNKNOWN_TYPE = r'''
import contextlib, io, json, sys
from tptrain.cli import main

err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["train", "--model", sys.argv[1]])
heavy = ("torch", "transformers", "tptrain.training.trainer", "tptrain.hf.model", "tptrain.models.decoder")
print(json.dumps({"code": code, "stderr": err.getvalue(), "imported": [m for m in heavy if m in sys.modules]}))
'''


def _fresh_python(code: str, *args: str) -> dict:
    """The JSON that `code` prints last, run in a fresh interpreter (nothing imported yet) on this checkout."""
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_unknown_model_type_is_refused_before_the_heavy_imports(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonexistent_type"}))
    result = _fresh_python(UNKNOWN_TYPE, str(tmp_path))
    assert result["code"] == 2 and result["imported"] == [], result
    assert result["stderr"].startswith("tptrain train: error: model_type 'nonexistent_type' is not supported: "
                                       "tptrain implements deepseek_v3, gemma2, "), result
    assert "qwen3, qwen3_moe, smollm3, and the installed transformers has no causal LM" in result["stderr"], result


LAUNCHER_CHECKS = r'''
import json, sys
import tptrain.cli.launcher
from tptrain.cli import main

tptrain.cli.launcher.launch = lambda args, nproc, worker: 0  # every check before the workers start, then stop
code = main(["train", "--smoke-test", "--output-dir", sys.argv[1]])
heavy = ("tptrain.training.trainer", "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch._dynamo")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
'''


def test_launcher_checks_the_run_without_the_trainers_imports(tmp_path):
    """The launcher reads the config, plan, flags, data and output directory before it starts the workers, without
    the Trainer, DCP, pipelining or torch._dynamo (~2 s more before any worker starts): they load in the workers."""
    assert _fresh_python(LAUNCHER_CHECKS, str(tmp_path / "run")) == {"code": 0, "imported": []}
