"""TrainingArguments(torch_compile=True): each decoder layer compiled, against the same run uncompiled.

fp64 on CPU/gloo with inductor's C++ backend (skipped where no C++ compiler is found). Inductor may reorder float
ops, so losses and trained weights are compared to a tight tolerance, not bitwise. The TP styles' hooks and
collectives must trace without a graph break (`torch._dynamo.explain` on a sharded layer), and CommTracker must
count a compiled step's collectives as it counts an eager one's.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.distributed.comm import CommTracker
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.mesh import compile_error
from tptrain.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
TOL = dict(rtol=1e-9, atol=1e-9)  # fp64: reordered sums differ by ~1e-15, a wrong layout by O(1)
STEPS = 3
NO_COMPILER = compile_error("inductor", torch.device("cpu"))
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=f"inductor cannot compile here: {NO_COMPILER}")


def _train(output_dir: str, *, tp: int, sp: bool = False, backend: str | None = None, **kw):
    """(losses, {(phase, op): count}, this rank's trained parameters) of STEPS Trainer steps."""
    torch._dynamo.reset()  # each case compiles its own layers, within a fresh recompile budget
    model = tiny_model()
    if tp > 1:
        model.parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
    args = training_args(output_dir, max_steps=STEPS, torch_compile=backend is not None,
                         torch_compile_backend=backend or "inductor", **kw)
    trainer = Trainer(model=model, args=args, train_dataset=tiny_dataset())
    with CommTracker() as tracker:
        losses = trainer.train().losses
    counts: dict[tuple[str, str], int] = {}
    for r in tracker.records:
        counts[(r.phase, r.op)] = counts.get((r.phase, r.op), 0) + 1
    return losses, counts, {n: p.detach().clone() for n, p in model.named_parameters()}


def _graph_breaks(tp: int, sp: bool) -> list[str]:
    """Why dynamo breaks the graph of a TP-sharded decoder layer (fed what the model feeds it)."""
    model = tiny_model().train()
    model.parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
    layer, seen = model.model.layers[0], {}
    handle = layer.register_forward_pre_hook(lambda m, args: seen.setdefault("args", args))
    ids = tiny_dataset()[0][None]
    model(ids, labels=ids)
    handle.remove()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(*seen["args"])
    return [b.reason for b in explained.break_reasons]


def _compiled_matches_eager_worker(tmp: str, cases: list[dict]) -> None:
    for i, case in enumerate(cases):
        # The one (phase, op) whose count a compiled layer changes by design, and whether it goes down or up.
        changed, direction = case.pop("changed", (None, 0))
        if case["tp"] > 1:
            assert _graph_breaks(case["tp"], case.get("sp", False)) == [], case
        losses, counts, params = _train(f"{tmp}/eager{i}", **case)
        c_losses, c_counts, c_params = _train(f"{tmp}/compiled{i}", backend="inductor", **case)
        torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(losses), **TOL,
                                   msg=lambda m: f"losses of {case}: {m}")
        for name, p in params.items():  # the updates, so the gradients, agree too
            torch.testing.assert_close(c_params[name], p, **TOL, msg=lambda m: f"{name} of {case}: {m}")
        # The collectives inside compiled layers are still seen, one record per call.
        for key in set(counts) | set(c_counts):
            if key != changed:
                assert c_counts.get(key) == counts.get(key), (case, key, c_counts, counts)
        if changed is not None:
            assert (c_counts[changed] > counts[changed]) - (c_counts[changed] < counts[changed]) == direction, \
                (case, c_counts, counts)


@pytest.mark.distributed
@pytest.mark.slow
@needs_compiler
def test_single_device_compiled_matches_eager(tmp_path):
    run_distributed(_compiled_matches_eager_worker, 1, str(tmp_path), [dict(tp=1)], timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
@needs_compiler
def test_tp2_and_fsdp2_compiled_match_eager(tmp_path):
    """Plain TP (the same collectives, counted alike); FSDP2 over compiled layers (its hooks run around them); SP (inside a compiled layer the compiler saves the
    gathered input instead of SP's re-gather in backward: fewer backward all-gathers); activation checkpointing
    (a compiled layer's recompute runs all of its forward, so backward issues its last all-reduce again)."""
    run_distributed(_compiled_matches_eager_worker, 2, str(tmp_path), [
        dict(tp=2),
        dict(tp=2, sp=True, changed=(("backward", "all_gather"), -1)),
        dict(tp=2, gradient_checkpointing=True, changed=(("backward", "all_reduce"), +1)),
        dict(tp=1, parallelism_config=ParallelismConfig(tp_size=1, dp_shard_size=2)),
    ], timeout=900)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(TypeError, match="torch_compile must be True or False, got 'yes'"):
        TrainingArguments(output_dir=str(tmp_path), torch_compile="yes")
    with pytest.raises(ValueError, match="torch_compile_backend='nope' is not a torch.compile backend; use one of"):
        TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="nope")
    TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="nope")  # unused without torch_compile


def _missing_compiler_worker(tmp: str) -> None:
    from torch._inductor import config

    if os.environ["RANK"] == "1":  # one machine of the job lacks the compiler: every rank refuses, naming it
        config.cpp.cxx = (None, "/nonexistent/g++")
    model = tiny_model()
    model.parallelize(DistributedConfig(tp_size=2))
    with pytest.raises(ValueError) as raised:
        Trainer(model=model, args=training_args(tmp, torch_compile=True), train_dataset=tiny_dataset())
    message = str(raised.value)
    assert "needs a working C++ compiler" in message and "/nonexistent/g++" in message, message
    assert "apt-get install g++" in message and "CXX=" in message and "(on rank 1 of 2)" in message, message


@pytest.mark.distributed
def test_missing_compiler_is_refused_on_every_rank(tmp_path):
    run_distributed(_missing_compiler_worker, 2, str(tmp_path))


@pytest.mark.distributed
def test_cli_compile_without_compiler_is_refused_up_front(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["CXX"] = "/nonexistent/g++"
    run = subprocess.run([sys.executable, "-m", "tptrain", "train", "--smoke-test", "--compile", "--output-dir",
                          str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--compile: torch_compile=True (inductor) on CPU needs a working C++ compiler" in run.stderr, run.stderr
    assert "/nonexistent/g++" in run.stderr and not (tmp_path / "run").exists()
