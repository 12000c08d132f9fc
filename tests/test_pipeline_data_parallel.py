"""Pipeline parallelism composed with data parallelism (FSDP2 over each stage's modules, DDP, HSDP by the same code)
and with expert parallelism: the Trainer at pp 2 x dp 2 and pp 2 x ep 2 against plain single-device training in
fp64 (losses of 3 AdamW steps, and the parameters after them, read back from final/), DCP resume across pp sizes
with dp, and the refusals. The CLI with --pp-size and data parallelism: tests/test_pipeline_parallel.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.checkpoints import save_family
from tests.helpers.pipeline import pipeline_trainer as _trainer, train_cases
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM

TOL = dict(rtol=1e-10, atol=1e-10)


def _run(root: str, out: str, *, pp: int, steps: int, resume: str | None = None) -> list[float]:
    """`steps` steps of the tied Qwen3 at pp x dp_shard 2 (x tp 2 at pp 1: the 4 ranks and the global batch of 4
    stay), constant lr (a shorter run's steps are a longer one's), a checkpoint every 2 steps."""
    trainer = _trainer(root, "qwen3_tied", out, pp=pp, dp_shard=2, tp=4 // (2 * pp), steps=steps,
                       lr_scheduler_type="constant", warmup_steps=0, save_steps=2)
    return trainer.train(resume_from_checkpoint=resume).losses


def _resume(root: str) -> None:
    """Saved at pp 2 x dp_shard 2, resumed at pp 1 x dp_shard 2 (x tp 2), and that run's checkpoint resumed at
    pp 2 x dp_shard 2 (DCP reshards model and AdamW state): the resumed steps' losses are those of uninterrupted
    one-process training."""
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64).train()
    args = training_args(root, max_steps=5, per_device_train_batch_size=2, lr_scheduler_type="constant",
                         warmup_steps=0)
    expected = reference_losses(ref, tiny_dataset(), args, global_batch=4)
    first = _run(root, "pp2", pp=2, steps=2)
    second = _run(root, "pp1", pp=1, steps=4, resume=os.path.join(root, "pp2", "checkpoint-2"))
    third = _run(root, "pp2-again", pp=2, steps=5, resume=os.path.join(root, "pp1", "checkpoint-4"))
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(expected), **TOL)


def _cases(root: str, cases: list[tuple], resume: bool = False) -> None:
    train_cases(root, cases)
    if resume:
        _resume(root)


def _v_resume(root: str) -> None:
    """ZBVZeroBubble at pp 2 x dp_shard 2 on the tied Qwen3: saved after 2 steps and resumed (DCP loads the model's
    weight; rank 0's last stage module's copy takes it before the next step) to the losses of one process."""
    def run(out, steps, resume=None):
        return _trainer(root, "qwen3_tied", out, schedule="ZBVZeroBubble", dp_shard=2, steps=steps, microbatches=4,
                        lr_scheduler_type="constant", warmup_steps=0, save_steps=2).train(resume).losses
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64).train()
    args = training_args(root, max_steps=4, per_device_train_batch_size=4, lr_scheduler_type="constant",
                         warmup_steps=0)
    expected = reference_losses(ref, tiny_dataset(), args, global_batch=8)
    first = run("v-first", 2)
    second = run("v-resumed", 4, os.path.join(root, "v-first", "checkpoint-2"))
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(expected), **TOL)


@pytest.mark.distributed
def test_pp2_fsdp2_ddp_and_ep_equal_one_process(tmp_path):
    for family in ("qwen3_tied", "llama", "qwen3_moe"):
        save_family(family, tmp_path)
    cases = [("qwen3_tied", "1F1B", dict(dp_shard=2, accumulation=2)),
             ("llama", "Interleaved1F1B", dict(dp_shard=2, evaluate=True)),
             ("llama", "ZBVZeroBubble", dict(dp_shard=2, microbatches=4)),  # two stage modules per rank
             ("qwen3_tied", "1F1B", dict(dp_replicate=2)),
             ("qwen3_moe", "1F1B", dict(dp_shard=2, ep=2))]
    run_distributed(_cases, 4, str(tmp_path), cases, True, timeout=600)


def test_refusals_with_data_and_expert_parallelism(tmp_path, monkeypatch):
    """Before any process group: a V schedule with tied embeddings and data parallelism is a layout (its rank 0's last
    stage module holds its own copy of the head, tests below); sequence and context parallelism with pp compose
    (tests/test_pipeline_context.py)."""
    from tptrain.distributed.state import ParallelState
    from tptrain.layout import ParallelDims
    from tptrain.parallel import pipeline_parallel as pp
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.mesh import resolve_parallelism

    path = save_family("qwen3_tied", tmp_path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), device="meta")
    model.parallel = ParallelState(dims=ParallelDims(pp=2),
                                   pp=pp.plan_pipeline(model, pp=2, pp_rank=0, schedule="ZBVZeroBubble"))
    config = ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble", tp_size=1)
    assert resolve_parallelism(model, config, world_size=4).dp == 2
    assert resolve_parallelism(model, config, world_size=2).dp == 1
    # 4 ranks, whatever process group an earlier test in this process left open (env_world_size reads it first)
    monkeypatch.setattr("tptrain.distributed.env_world_size", lambda: 4)
    for extra in (dict(enable_sequence_parallel=True, tp_size=2), dict(cp_size=2, tp_size=1)):
        meta = AutoModelForCausalLM.from_config(model.config, device="meta")
        meta._check_plan(DistributedConfig(pp_size=2, **extra))


@pytest.mark.distributed
def test_v_schedules_with_a_tied_head_and_data_parallelism_equal_one_process(tmp_path):
    """A V schedule puts the first and the last stage on rank 0, where the tied embedding and head are one parameter
    of two stage modules; FSDP2 wraps a parameter in one module only, so rank 0's last stage module holds its own copy
    (its gradient added to the weight's, its values refreshed from it each step): under FSDP2 (ZBVZeroBubble) and DDP
    (DualPipeV) the losses (clipped: the norm counts the weight once) and parameters after 3 steps
    equal one process's, and a checkpoint resumes to them."""
    save_family("qwen3_tied", tmp_path)
    cases = [("qwen3_tied", "ZBVZeroBubble", dict(dp_shard=2, microbatches=4)),
             ("qwen3_tied", "DualPipeV", dict(dp_replicate=2, microbatches=4))]
    run_distributed(_v_cases, 4, str(tmp_path), cases, timeout=600)


def _v_cases(root: str, cases: list[tuple]) -> None:
    _cases(root, cases)
    _v_resume(root)
