"""Pipeline parallelism (parallel/pipeline_parallel.py): the stage split, the bad-input errors, and the Trainer at
pp 2, pp 2 x tp 2 and pp 4 against plain single-device training in fp64 (losses of 3 steps, and the parameters after
them, read back from the final/ checkpoint that save_pretrained writes from the stages, in tptrain and transformers).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.checkpoints import save_family
from tests.helpers.configs import PIPELINE_FAMILIES as FAMILIES
from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM
from tptrain.parallel import pipeline_parallel as pp


# ------------------------------------------------------------------ the split and the errors (no process group)


def test_even_split_counts_embedding_and_head():
    assert pp.split_layers(4, 2) == [[0, 1], [2, 3]]  # 6 units: embedding + 2 layers | 2 layers + head
    assert pp.split_layers(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert pp.split_layers(4, 4) == [[0], [1, 2], [3], []]  # 6 units over 4: the extra ones to the first stages
    assert pp.split_layers(5, 2, [[0], [1, 2, 3, 4]]) == [[0], [1, 2, 3, 4]]
    assert pp.rank_stages("1F1B", 4, 1) == (1,)
    assert pp.rank_stages("Interleaved1F1B", 4, 1) == (1, 5)
    assert pp.rank_stages("ZBVZeroBubble", 4, 1) == (1, 6)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="5 pipeline stages for a model of 4 decoder layers"):
        pp.split_layers(4, 5)
    with pytest.raises(ValueError, match=r"consecutive decoder layers covering 0\.\.3"):
        pp.split_layers(4, 2, [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="unknown pipeline schedule 'Zigzag'.*1F1B, Interleaved1F1B"):
        pp.schedule_name("Zigzag")
    assert pp.schedule_name("interleaved1f1b") == "Interleaved1F1B"
    with pytest.raises(ValueError, match="1F1B at pp_size=4 needs at least 4 microbatches"):
        pp.check_microbatches("1F1B", 4, 2, 8)
    with pytest.raises(ValueError, match="ZBVZeroBubble at pp_size=2 needs at least 4 microbatches"):
        pp.check_microbatches("ZBVZeroBubble", 2, 2, 8)
    with pytest.raises(ValueError, match="per_device_train_batch_size=6 does not split into pp_microbatches=4"):
        pp.check_microbatches("1F1B", 2, 4, 6)
    with pytest.raises(ValueError, match="pp_size=3 must divide the world size 4"):
        DistributedConfig(pp_size=3).parallel_dims(4)
    assert DistributedConfig(pp_size=2, tp_size=2).sizes(4) == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2}


def test_refusals_before_any_collective(tmp_path, monkeypatch):
    path = save_family("qwen3_tied", tmp_path)
    with pytest.raises(ValueError, match="device_map cannot be combined with DistributedConfig\\(pp_size=2\\)"):
        AutoModelForCausalLM.from_pretrained(path, device_map="cpu", distributed_config=DistributedConfig(pp_size=2))


# ------------------------------------------------------------------ the Trainer against one process


def _train_case(root: str, family: str, schedule: str, *, pp_size: int, tp: int, accumulation: int = 1,
                checkpointing: bool = False, evaluate: bool = False) -> None:
    import torch.distributed as dist

    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    path = os.path.join(root, family)
    out = os.path.join(root, f"{family}-{schedule}-pp{pp_size}-tp{tp}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=DistributedConfig(
        pp_size=pp_size, tp_size=tp, pp_schedule=schedule))
    config = ParallelismConfig(pp_size=pp_size, pp_schedule=schedule, pp_microbatches=4)
    args = training_args(out, max_steps=3, gradient_accumulation_steps=accumulation, parallelism_config=config,
                         gradient_checkpointing=checkpointing)
    data = tiny_dataset()
    held = tiny_dataset(6, seed=2) if evaluate else None  # 6 rows: the second batch of 4 is padded
    trainer = Trainer(model, args=args, train_dataset=data, eval_dataset=held)
    losses = trainer.train().losses
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).train()
    expected = reference_losses(ref, data, args, global_batch=4 * accumulation)
    if evaluate:  # eval_loss: the token mean over the whole eval set, as one process computes it
        rows = torch.stack([held[i] for i in range(len(held))])
        with torch.no_grad():
            want = ref.eval()(rows, labels=rows).loss.item()
        torch.testing.assert_close(trainer.evaluate()["eval_loss"], want, rtol=1e-10, atol=1e-10)
    what = f"{family} {schedule} pp {pp_size} x tp {tp}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-10, atol=1e-10,
                               msg=lambda m: f"{what} losses: {m}")
    if dist.get_rank() == 0:  # final/: one ordinary checkpoint written from the stages
        saved = dict(AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{what}: {name} after 3 steps: {m}")
    dist.barrier()


def _run(root: str, out: str, *, pp_size: int, steps: int, resume: str | None = None) -> list[float]:
    """`steps` steps of the tied Qwen3 at pp_size x tp 2 (the rest of the 4 ranks FSDP), global batch 4, constant
    lr (so a shorter run's steps are a longer one's), a checkpoint every 2 steps."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64,
                                                 distributed_config=DistributedConfig(pp_size=pp_size, tp_size=2))
    config = ParallelismConfig(pp_size=pp_size, pp_microbatches=2) if pp_size > 1 else None
    args = training_args(os.path.join(root, out), max_steps=steps, per_device_train_batch_size=4 // (4 // pp_size // 2),
                         lr_scheduler_type="constant", warmup_steps=0, save_steps=2, parallelism_config=config)
    return Trainer(model, args=args, train_dataset=tiny_dataset()).train(resume_from_checkpoint=resume).losses


def _resume_across_pp(root: str) -> None:
    """Saved at pp 2 x tp 2, resumed at pp 1 x tp 2 (x dp 2), and that run's checkpoint resumed at pp 2 x tp 2: the
    resumed steps' losses are those of uninterrupted one-process training."""
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64).train()
    args = training_args(root, max_steps=5, lr_scheduler_type="constant", warmup_steps=0)
    expected = reference_losses(ref, tiny_dataset(), args, global_batch=4)
    first = _run(root, "pp2", pp_size=2, steps=2)
    second = _run(root, "pp1", pp_size=1, steps=4, resume=os.path.join(root, "pp2", "checkpoint-2"))
    third = _run(root, "pp2-again", pp_size=2, steps=5, resume=os.path.join(root, "pp1", "checkpoint-4"))
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(expected), rtol=1e-10, atol=1e-10)


def _cases(root: str, cases: list[tuple], resume: bool = False) -> None:
    for family, schedule, pp_size, tp, accumulation, *extra in cases:
        _train_case(root, family, schedule, pp_size=pp_size, tp=tp, accumulation=accumulation,
                    checkpointing="activation checkpointing" in extra, evaluate="eval" in extra)
    if resume:
        _resume_across_pp(root)


@pytest.mark.distributed
def test_trainer_pp2_equals_one_process(tmp_path):
    for family in FAMILIES:
        save_family(family, tmp_path)
    cases = [("qwen3_tied", "1F1B", 2, 1, 2, "activation checkpointing"), ("qwen3_tied", "Interleaved1F1B", 2, 1, 1, "eval"),
             ("qwen3_tied", "ZBVZeroBubble", 2, 1, 1), ("llama", "1F1B", 2, 1, 1),
             ("llama", "InterleavedZeroBubble", 2, 1, 1), ("qwen3_moe", "Interleaved1F1B", 2, 1, 1)]
    run_distributed(_cases, 2, str(tmp_path), cases, timeout=600)


@pytest.mark.distributed
def test_trainer_pp2_tp2_and_pp4_equal_one_process(tmp_path):
    for family in FAMILIES:
        save_family(family, tmp_path)
    cases = [("qwen3_tied", "1F1B", 2, 2, 1, "eval"), ("llama", "ZBVZeroBubble", 2, 2, 1), ("qwen3_moe", "1F1B", 2, 2, 1),
             ("qwen3_tied", "1F1B", 4, 1, 1), ("llama8", "Interleaved1F1B", 4, 1, 1)]
    run_distributed(_cases, 4, str(tmp_path), cases, True, timeout=600)


@pytest.mark.distributed
def test_cli_trains_with_pp_size(tmp_path):
    """`tptrain train --pp-size 2 --nproc-per-node 4` on the bundled tiny Qwen3 (tied embeddings): the ranks past
    pp x tp are FSDP2 data-parallel over each stage; the run ends with one ordinary checkpoint that transformers
    loads, equal to tptrain's reading of it."""
    from transformers import AutoModelForCausalLM as HFAutoModel

    out = tmp_path / "run"
    run = tptrain_train("--output-dir", str(out), "--tp-size", "1", "--pp-size", "2", "--pp-schedule",
                        "Interleaved1F1B", "--pp-microbatches", "2", "--nproc-per-node", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "world size 4, tp 1, pp 2" in run.stdout, run.stdout
    ours = dict(AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).named_parameters())
    hf = HFAutoModel.from_pretrained(out / "final", dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p, ours[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_plan_prints_the_stages(tmp_path, capsys):
    from tptrain.cli import main

    path = save_family("qwen3_tied", tmp_path)
    assert main(["plan", path, "--tp-size", "2", "--pp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "pp rank 0: stage 0: embedding, layers 0-1; parameter bytes per rank" in out, out
    assert "pp rank 1: stage 1: layers 2-3, norm, head; parameter bytes per rank" in out, out
    assert main(["plan", path, "--tp-size", "1", "--pp-size", "8"]) == 1
    assert "8 pipeline stages for a model of 4 decoder layers" in capsys.readouterr().err
