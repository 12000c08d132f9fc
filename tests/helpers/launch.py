"""`tptrain train` and other launchers as subprocesses of a test: started, waited for with a deadline, their
metrics read back without the timings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.ranks import require_distributed_marker

ROOT = Path(__file__).resolve().parents[2]  # the repository
TIMING_FIELDS = ("step_time", "tokens_per_second",  # measured, so never the same twice
                 "peak_memory", "planned_peak_memory", "peak_memory_kind")


def tptrain_train(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return finish_tptrain_train(start_tptrain_train(*flags), timeout)


def start_tptrain_train(*flags: str) -> subprocess.Popen:
    """`tptrain train --smoke-test FLAGS` started, not waited for (finish_tptrain_train collects it)."""
    require_distributed_marker("tptrain train")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "tptrain", "train", "--smoke-test", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_tptrain_train(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, *finish(proc, timeout))


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running after {timeout} s: {proc.communicate()}") from None
    return proc.returncode, out, err


def metrics(out: Path) -> list[dict]:
    from tptrain.training.reporting import read_metrics

    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out / "metrics.jsonl")]
