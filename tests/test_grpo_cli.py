"""`tptrain grpo`: a run at tp 2 from the command line (reward functions from a .py file, TRL's metrics logged, the
final model written), bad input refused before any worker starts (exit 2, naming the function or the line), and run
files (`--print-config` shows the grpo section, a flag over the file)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.grpo import metrics, prompt_records
from tests.helpers.preference import checkpoint

pytestmark = pytest.mark.distributed
REWARDS = f"{Path(__file__).parent / 'helpers' / 'grpo.py'}:letter_e"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("grpo_cli") / "ckpt")


def _prompts(tmp_path: Path, records: list[dict]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _grpo(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tptrain", "grpo", *flags], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # ~1 min: two workers started by the launcher (docs/reinforcement-learning.md's example runs it too)
def test_tptrain_grpo_trains_at_tp2(ckpt, tmp_path):
    out = tmp_path / "run"
    proc = _grpo("--model", str(ckpt), "--data", _prompts(tmp_path, prompt_records(4)), "--reward-funcs", REWARDS,
                 "--tp-size", "2", "--max-steps", "2", "--batch-size", "4", "--num-generations", "2",
                 "--max-completion-length", "4", "--beta", "0.04", "--output-dir", str(out), "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    lines = metrics(out)
    assert len(lines) == 2 and {"reward", "reward_std", "rewards/letter_e/mean", "kl",
                                "completions/mean_length"} <= set(lines[0])
    assert (out / "final" / "model.safetensors").is_file() and (out / "run_config.yaml").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--reward-funcs", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
    ([], "tptrain grpo needs --reward-funcs MODULE:FUNCTION"),
    (["--reward-funcs", REWARDS, "--max-prompt-length", "3"], "prompts.jsonl line 2: the prompt has 4 tokens, more than max_prompt_length=3"),
    (["--reward-funcs", REWARDS, "--max-completion-length", "200"], "--max-completion-length=201 exceeds the "
                                                                    "model's max_position_embeddings=128"),
    (["--reward-funcs", REWARDS, "--num-generations", "3"], "num_generations=3 does not divide"),
    (["--reward-funcs", REWARDS, REWARDS, "--reward-weights", "1"], "--reward-weights has 1 weights for 2"),
])
def test_tptrain_grpo_refuses_before_any_worker(ckpt, tmp_path, flags, message):
    proc = _grpo("--model", str(ckpt), "--data", _prompts(tmp_path, prompt_records(4)), "--output-dir",
                 str(tmp_path / "run"), "--tp-size", "2", "--batch-size", "4", "--num-generations", "2",
                 "--max-completion-length", "8", *flags,
                 timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_tptrain_grpo_run_files(tmp_path):
    import yaml

    run_file = tmp_path / "grpo.yaml"
    run_file.write_text("num-generations: 4\nloss-type: grpo\nreward-funcs: [a:b]\nbeta: 0.1\n")
    proc = _grpo("--config", str(run_file), "--beta", "0.2", "--print-config", timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert proc.stdout.startswith("# tptrain grpo's resolved configuration") and "# grpo" in proc.stdout
    assert (printed["num-generations"], printed["loss-type"], printed["reward-funcs"], printed["beta"]) == \
        (4, "grpo", ["a:b"], 0.2)
