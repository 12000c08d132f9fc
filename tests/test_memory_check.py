"""Every run checks the planner (training/memory_check.py): the measured peak per rank beside the plan's, in
metrics.jsonl; freed tensors leave the resident set (so max RSS is what the plan predicts); and, slow, the plan
against real `tptrain train` runs' max RSS, big model minus tiny (benchmarks/bench_rss.py's measure)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.launch import ROOT, tptrain_train
from tptrain.training.memory_check import measured_peak, release_freed_memory, runtime_memory
from tptrain.training.reporting import Reporter, read_metrics

MiB = 2**20

# Blocks of 4 MiB, every other one freed: below glibc's grown mmap threshold they sit in the heap, and the kept ones
# between them stop it from shrinking. Prints how much the resident set fell when the freed half went.
FRAGMENT = textwrap.dedent("""
    import sys, torch
    from tptrain.training.memory_check import _status, release_freed_memory
    if sys.argv[1] == "fixed":
        assert release_freed_memory()
    torch.empty(16 * 2**20, dtype=torch.uint8).fill_(1)  # one mmapped block freed: glibc's threshold grows to it
    blocks = [torch.ones(2**20) for _ in range(64)]       # 4 MiB each
    before = _status("VmRSS")
    del blocks[::2]
    print((before - _status("VmRSS")) // 2**20)
""")


def _fell(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_leave_the_resident_set():
    assert _fell("fixed") >= 120  # the 128 MiB freed went back to the OS
    assert _fell("default") < 64  # glibc's default keeps them (the cause of RSS 20-40% over the tensors)


def test_release_freed_memory_can_be_declined(monkeypatch):
    monkeypatch.setenv("TPTRAIN_RELEASE_FREED_MEMORY", "0")  # glibc's default kept (faster on CPU)
    assert release_freed_memory() is False
    monkeypatch.delenv("TPTRAIN_RELEASE_FREED_MEMORY")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own setting wins
    assert release_freed_memory() is False


def test_runtime_memory_counts_each_storage_once():
    a = torch.ones(4 * MiB // 4)
    rss_less_a = runtime_memory([a, a[1:], a.view(2, -1)], torch.device("cpu"))
    assert abs((runtime_memory([], torch.device("cpu")) - rss_less_a) - 4 * MiB) < MiB
    assert measured_peak(torch.device("cpu")) >= rss_less_a
    assert runtime_memory([a], torch.device("cuda")) == 0  # the allocator's figures count tensors only


def test_amend_adds_to_the_last_record(tmp_path):
    reporter = Reporter(tmp_path, total_steps=2, enabled=True)
    reporter.amend({"peak_memory": [1]})  # nothing logged yet: a record of its own
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "peak_memory": [1]}]
    (tmp_path / "metrics.jsonl").unlink()
    for step in (1, 2):
        reporter.log(step, {"loss": 1.0 / step})
    reporter.amend({"peak_memory": [5, 6], "planned_peak_memory": [4, None]})
    reporter.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and "peak_memory" not in records[0]
    assert records[1]["peak_memory"] == [5, 6] and records[1]["planned_peak_memory"] == [4, None]


@pytest.mark.distributed
def test_a_run_writes_its_measured_and_planned_peak(tmp_path):
    out = tmp_path / "run"
    run = tptrain_train("--output-dir", str(out), "--max-steps", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last["peak_memory_kind"] == "max_rss"
    assert len(last["peak_memory"]) == len(last["planned_peak_memory"]) == 2  # each rank's
    for measured, planned in zip(last["peak_memory"], last["planned_peak_memory"]):
        assert 100 * MiB < measured < 4096 * MiB
        assert 0.85 < measured / planned < 1.15, (measured, planned)  # the plan + the runtime's own memory
    assert "peak memory per rank, measured (max RSS) vs planned" in run.stdout
    assert run.stdout.count("  rank 1: measured ") == 1  # rank 0 prints every rank's


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp_shard2"])
def test_plan_predicts_max_rss_big_minus_tiny(layout):
    """A 30M-parameter Qwen3 minus a tiny one, 3 steps of 4 x 512 with the final save and sample: the plan's
    difference within 10% of the measured max RSS difference (the plan without the runtime fix: 0.5-0.8)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_rss

    medium = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64)
    row = bench_rss.measure_layout(layout, medium, bench_rss.TINY, "cpu")
    assert row["measured"] > 300 * MiB, json.dumps(row)
    assert 0.9 <= row["ratio"] <= 1.1, json.dumps(row)


@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA caching allocator's reserved peak needs a GPU")
def test_plan_predicts_cuda_reserved(tmp_path):
    """On a GPU the run's own check compares the caching allocator's reserved peak (no runtime in it) with the plan's
    tensors: within 10% for a 30M-parameter Qwen3, one rank."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_rss

    medium = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64)
    model = bench_rss._model_dir(tmp_path, "medium", medium)
    result = bench_rss.run(model, ["--tp-size", "1", "--nproc-per-node", "1"], tmp_path / "run")
    last = result["metrics"][-1]
    assert last["peak_memory_kind"] == "cuda_reserved", last
    (measured,), (planned,) = last["peak_memory"], last["planned_peak_memory"]
    assert 0.9 <= measured / planned <= 1.1, (measured, planned)
