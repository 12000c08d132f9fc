"""Pipeline parallelism composed with data parallelism (FSDP2 over each stage's modules, DDP, HSDP by the same code)
and with expert parallelism: the Trainer at pp 2 x dp 2 and pp 2 x ep 2 against plain single-device training in
fp64 (losses of 3 AdamW steps, and the parameters after them, read back from final/), DCP resume across pp sizes
with dp, and the refusals. The CLI with --pp-size and data parallelism: tests/test_pipeline_parallel.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import reference_losses, tiny_dataset, training_args
from tests.test_pipeline_parallel import save_family
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM

TOL = dict(rtol=1e-10, atol=1e-10)


def _trainer(root: str, family: str, out: str, *, schedule: str = "1F1B", pp: int = 2, dp_shard: int = 1,
             dp_replicate: int = 1, ep: int | None = None, tp: int = 1, steps: int = 3, accumulation: int = 1,
             microbatches: int = 2, **kw):
    """A Trainer of `family` at pp x dp_replicate x dp_shard x tp (ep inside dp_shard), one row per dp rank and
    pipeline microbatch in each micro-batch."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    sizes = dict(dp_shard_size=dp_shard, dp_replicate_size=dp_replicate, ep_size=ep, tp_size=tp)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=torch.float64,
                                                 distributed_config=DistributedConfig(pp_size=pp, pp_schedule=schedule,
                                                                                      **sizes))
    config = ParallelismConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=microbatches if pp > 1 else None,
                               **sizes)
    args = training_args(os.path.join(root, out), max_steps=steps, per_device_train_batch_size=microbatches,
                         gradient_accumulation_steps=accumulation, parallelism_config=config, **kw)
    return Trainer(model, args=args, train_dataset=tiny_dataset())


def _train_case(root: str, family: str, schedule: str, *, dp_shard: int = 1, dp_replicate: int = 1,
                ep: int | None = None, accumulation: int = 1, microbatches: int = 2, evaluate: bool = False) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    import torch.distributed as dist

    what = f"{family} {schedule} pp 2 x dp_replicate {dp_replicate} x dp_shard {dp_shard} (ep {ep})"
    out = what.replace(" ", "_").replace("(", "").replace(")", "")
    trainer = _trainer(root, family, out, schedule=schedule, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep,
                       accumulation=accumulation, microbatches=microbatches)
    assert trainer.fsdp and all(isinstance(m, FSDPModule) for m in trainer.pipeline.modules), what
    losses = trainer.train().losses
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=torch.float64).train()
    expected = reference_losses(ref, tiny_dataset(), trainer.args,
                                global_batch=microbatches * dp_shard * dp_replicate * accumulation)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL,
                               msg=lambda m: f"{what} losses: {m}")
    if evaluate:  # eval_loss over dp and the stages; FSDP2 reshards after a no-grad forward
        held = tiny_dataset(6, seed=2)  # 3 rows per dp rank: the second batch of 2 is padded
        rows = torch.stack([held[i] for i in range(len(held))])
        with torch.no_grad():
            want = ref.eval()(rows, labels=rows).loss.item()
        torch.testing.assert_close(trainer.evaluate(held)["eval_loss"], want, **TOL)
        assert all(isinstance(p, DTensor) for p in trainer.inner.parameters()), what
    if dist.get_rank() == 0:  # final/: one ordinary checkpoint, gathered over dp and sent from the stages
        saved = dict(AutoModelForCausalLM.from_pretrained(os.path.join(root, out, "final")).named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), **TOL,
                                       msg=lambda m: f"{what}: {name} after 3 steps: {m}")
    dist.barrier()


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
    for family, schedule, kw in cases:
        _train_case(root, family, schedule, **kw)
    if resume:
        _resume(root)


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
    """What stays refused, before any process group: a V schedule with tied embeddings and data parallelism (one
    parameter in two stage modules, which FSDP2 cannot wrap), context parallelism included (FSDP2 wraps over dp_shard
    x cp); sequence and context parallelism with pp compose (tests/test_pipeline_context.py)."""
    from tptrain.parallel import pipeline_parallel as pp
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.parallelize import resolve_parallelism

    path = save_family("qwen3_tied", tmp_path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), device="meta")
    model.pp_plan = pp.plan_pipeline(model, pp=2, pp_rank=0, schedule="ZBVZeroBubble")
    config = ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble", tp_size=1)
    with pytest.raises(ValueError, match=r"ZBVZeroBubble' puts the first and the last stage on one rank.*"
                                         r"model.embed_tokens.weight = lm_head.weight.*dp_shard 2.*looped schedule"):
        resolve_parallelism(model, config, world_size=4)
    assert resolve_parallelism(model, config, world_size=2).dp == 1  # pp x tp only: one parameter, no FSDP
    # 4 ranks, whatever process group an earlier test in this process left open (env_world_size reads it first)
    monkeypatch.setattr("tptrain.distributed.env_world_size", lambda: 4)
    from tptrain.parallel.context_parallel import CPContext

    model.cp_context = CPContext("cp", size=2, rank=0)  # as from_pretrained(DistributedConfig(cp_size=2)) records it
    with pytest.raises(ValueError, match=r"dp_shard 1 x cp 2\) cannot wrap one parameter in two FSDP2 modules"):
        resolve_parallelism(model, ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble", cp_size=2), world_size=4)
    for extra in (dict(enable_sequence_parallel=True, tp_size=2), dict(cp_size=2, tp_size=1)):
        meta = AutoModelForCausalLM.from_config(model.config, device="meta")
        meta._check_plan(DistributedConfig(pp_size=2, **extra))


def test_cli_refuses_a_v_schedule_with_tied_embeddings_and_data_parallel(tmp_path, monkeypatch, capsys):
    """The same refusal before any worker starts: the bundled tiny Qwen3 ties its embeddings."""
    from tptrain.cli import main
    from tptrain.cli import train as train_cli

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(train_cli, "_launch", no_workers)
    monkeypatch.setattr(train_cli, "_worker", no_workers)
    code = main(["train", "--smoke-test", "--output-dir", str(tmp_path / "run"), "--tp-size", "1", "--pp-size", "2",
                 "--pp-schedule", "ZBVZeroBubble", "--pp-microbatches", "4", "--batch-size", "4",
                 "--nproc-per-node", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tptrain train: error: pp_schedule='ZBVZeroBubble' puts the first and the "
                                        "last stage on one rank"), err
