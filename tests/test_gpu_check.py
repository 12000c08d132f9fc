"""benchmarks/gpu_check.sh --dry-run: the GPU check's code at tiny sizes on 2 CPU ranks (gloo, fp32, no compile), so
that it cannot rot before a GPU runs it: every part runs and passes, and the table has a row for each check. Five
launches of torch.distributed.run, about 60 s of CPU time: ~40 s on 2 idle cores, ~3 minutes on 2 busy ones.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
COLLECTIVES = ("copy_to_tp", "reduce_from_tp", "sum_over_tp", "gather_from_tp", "split_to_tp", "gather_to_sp",
               "reduce_scatter_to_sp", "dispatch_to_ranks (uneven)", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all (uneven)", "start_all_reduce", "start_all_gather", "start_reduce_scatter")
AGREEMENT = ("exchange_counts int64", "any_rank (default group)", "any_rank (gloo group)", "raise_on_any_rank",
             "all_gather_object, barrier")


def _table(stdout: str) -> dict[tuple[str, str, str], list[str]]:
    """{(part, case, ranks): the row's other cells} of the printed table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "part":
            rows[tuple(cells[:3])] = cells[3:]
    return rows


@pytest.mark.distributed
def test_dry_run():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    env.update(PYTHONPATH=str(ROOT), PYTHON=sys.executable)  # the script's python: this one, with tptrain on its path
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--peak-tflops", "0.05"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "| part | case | ranks | check | max abs err | step ms | tokens/s | MFU | peak GiB/rank (max) | " \
           "loss step 0 |" in proc.stdout
    assert "all checks passed" in proc.stdout and "FAILED" not in proc.stdout
    rows = _table(proc.stdout)
    comm = [(case, "2") for case in AGREEMENT] + \
        [(f"{name} {dtype}", "2") for name in COLLECTIVES for dtype in ("float32", "bfloat16")]
    for case, ranks in comm:
        assert rows[("comm", case, ranks)][0] == "ok", (case, rows.get(("comm", case, ranks)))
    peer = "transformers" if importlib.util.find_spec("transformers") else None
    for case, ranks in [("tptrain", "1"), ("tptrain", "2")] + ([(peer, "1")] if peer else []):
        check, err, step_ms, _, mfu, peak, loss0 = rows[("train", case, ranks)]
        assert check == "ok" and float(err) < 1e-4 and float(step_ms) > 0 and float(mfu) > 0, (case, ranks)
        assert peak == "-" and abs(float(loss0) - math.log(512)) < 0.1  # no CUDA memory; random init: log(vocab)
    assert rows[("train", "tptrain + torch.compile (inductor)", "1")][0] == "skipped: dry run"
    fused = [cells for (part, _, ranks), cells in rows.items() if part == "fused" and ranks == "2"]
    assert len(fused) == 3 and all(cells[0].startswith("ok") and float(cells[2]) > 0 for cells in fused), fused
    assert fused[0][0] == "ok (10 of 10 colwise outputs from fused blocks)"  # 2 layers x (q, k, v; gate, up)
    assert fused[2][:2] == ["ok (bit-identical)", "0"]  # the overlap changes no bit
