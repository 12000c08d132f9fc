"""Several machines: `tptrain train --nnodes 2 --rdzv-endpoint HOST:PORT` on each node, through torchrun's c10d
rendezvous, tested on this machine as two "nodes" of one process each (two launchers):

* TP 2 across the two nodes: metrics.jsonl equals a one-node TP 2 run's, bit for bit;
* that run resumed across the two as TP 1 x FSDP 2 (resharded): equals the same resume on one node.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_multinode.py -q
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, finish, metrics
from tests.helpers.ranks import reserved_port

pytestmark = pytest.mark.distributed


def _train(out: Path, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "tptrain", "train", "--smoke-test", "--output-dir", str(out),
                             *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_nodes(out: Path, port: int, *flags: str) -> list[subprocess.Popen]:
    node = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}")
    return [_train(out, *node, *flags) for _ in range(2)]


def _succeed(*procs: subprocess.Popen) -> list[str]:
    outputs = []
    for proc in procs:
        code, stdout, stderr = finish(proc, timeout=400)
        assert code == 0, stdout + stderr
        outputs.append(stdout)
    return outputs


def test_tp2_across_two_nodes_then_resumed_as_fsdp2_across_them(tmp_path):
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    resume = ("--tp-size", "1", "--batch-size", "1", "--resume", "--max-steps", "6")  # the same global batch of 2
    # The one-node reference and the two-node run at once: one thread per rank, so the figures do not depend on it.
    with reserved_port() as port:  # node 0's launcher serves the c10d rendezvous on it
        outputs = _succeed(_train(one, "--tp-size", "2"), *_two_nodes(two, port, "--tp-size", "2"))
    assert "world size 2, tp 2" in outputs[1] + outputs[2], outputs
    assert metrics(two) == metrics(one) and len(metrics(one)) == 4
    with reserved_port() as port:
        outputs = _succeed(_train(one, "--nproc-per-node", "2", *resume), *_two_nodes(two, port, *resume))
    assert "world size 2, tp 1" in outputs[1] + outputs[2], outputs
    assert metrics(two) == metrics(one) and [r["step"] for r in metrics(two)] == [1, 2, 3, 4, 5, 6]
    assert (two / "final" / "model.safetensors").is_file()
