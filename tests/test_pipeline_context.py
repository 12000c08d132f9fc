"""Pipeline parallelism composed with context parallelism and with sequence parallelism: the Trainer at pp 2 x cp 2,
pp 2 x SP tp 2 (4 ranks), pp 2 x cp 2 x tp 2 and pp 2 x cp 2 x dp_shard 2 (8 ranks) against plain single-device
training in fp64 (losses of 3 AdamW steps with clipping, and the parameters after them, read back from the final/
checkpoint the stages write), on packed rows under a sliding window (the masks' rows from global positions) and with
a looped and a V schedule; a checkpoint resumed across pp x cp and pp 1; LoRA at pp 2 x cp 2; and `tptrain train
--pp-size 2 --cp-size 2` against a one-process run.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.checkpoints import save_perturbed
from tests.helpers.configs import TRAINER_TINY
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM

TOL = dict(rtol=1e-10, atol=1e-10)
FAMILIES = {  # 4 layers: 2 stages of 2, or 4 stages of 1 (two per rank)
    "qwen3_tied": ("qwen3", dict(TRAINER_TINY, tie_word_embeddings=True, num_hidden_layers=4)),
    # a window of 3 keys, shorter than most packed documents; untied (a V schedule with data parallelism)
    "mistral": ("mistral", dict(TRAINER_TINY, sliding_window=3, num_hidden_layers=4)),
}


def save_family(family: str, root: str) -> str:
    model_type, kw = FAMILIES[family]
    return save_perturbed(model_type, kw, os.path.join(root, family))


def packed_rows(seed: int = 3):
    """Rows of 16 tokens packed from documents of 3-9 tokens (position ids restarting inside a row, each document's
    first token no target): an SFTDataset, as instruction data becomes."""
    from tptrain.training.sft_data import Sample, SampleTable, SFTDataset

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(48):
        ids = torch.randint(0, TRAINER_TINY["vocab_size"], (int(torch.randint(3, 10, (), generator=g)),),
                            generator=g).tolist()
        samples.append(Sample(ids, [-100] + ids[1:]))
    return SFTDataset(SampleTable.of(samples), seq_len=16, packing=True, truncation="error", pad_id=0,
                      name="packed")


def _collated(rows) -> dict:
    """The model's inputs from rows as the Trainer's collator makes them (padding, labels, restarting positions)."""
    from tptrain.training.sft_data import collate

    batch = collate(rows, pad_id=0)
    return dict(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch.get("position_ids"))


def _train_case(root: str, family: str, schedule: str, *, cp: int = 1, tp: int = 1, sp: bool = False,
                dp_shard: int = 1, dp_replicate: int = 1, packed: bool = False, microbatches: int = 2,
                accumulation: int = 1, checkpointing: bool = False, evaluate: bool = False, **extra) -> None:
    import torch.distributed as dist

    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    what = (f"{family} {schedule} pp 2 x cp {cp} x tp {tp}{' (SP)' if sp else ''} x dp_replicate {dp_replicate} x "
            f"dp_shard {dp_shard}" + "".join(f" {k}={v}" for k, v in extra.items()))
    out = os.path.join(root, "".join(c if c.isalnum() or c in "._=" else "_" for c in what))
    path = os.path.join(root, family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=DistributedConfig(
        pp_size=2, cp_size=cp, tp_size=tp, enable_sequence_parallel=sp, pp_schedule=schedule))
    config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=microbatches, cp_size=cp,
                               dp_shard_size=dp_shard, dp_replicate_size=dp_replicate)
    args = training_args(out, max_steps=3, per_device_train_batch_size=microbatches, parallelism_config=config,
                         gradient_accumulation_steps=accumulation, gradient_checkpointing=checkpointing, **extra)
    data = packed_rows() if packed else tiny_dataset()
    held = packed_rows(seed=4) if evaluate else None
    trainer = Trainer(model, args=args, train_dataset=data, eval_dataset=held)
    sent = []  # what each stage sends on: this rank's tokens (/ tp under SP), (batch, seq / cp / tp, hidden)
    for stage in trainer.pipeline.stages:
        if not stage.is_last:
            stage.submod.register_forward_hook(lambda module, args, out: sent.append(tuple(out.shape)))
    keeping = []  # under SP: whether each layer's forward runs with SP's shard-keeping saved-tensor hooks on
    for layer in model.model.layers.values() if sp else ():
        layer.register_forward_pre_hook(lambda module, args: keeping.append(model.parallel.tp.ctx.keeps_shards()))
    losses = trainer.train().losses
    assert not sp or all(keeping) and len(keeping) >= 3 * len(model.model.layers), (what, keeping)
    if not all(stage.is_last for stage in trainer.pipeline.stages):
        assert set(sent) == {(1, 16 // cp // (tp if sp else 1), TRAINER_TINY["hidden_size"])}, (what, sent)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).train()
    expected = reference_losses(ref, data, args, global_batch=microbatches * dp_shard * dp_replicate * accumulation,
                                collate_rows=_collated)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL,
                               msg=lambda m: f"{what} losses: {m}")
    if evaluate:  # eval_loss: the token mean over the whole eval set, as one process computes it
        from tptrain.training.sft_data import collate

        rows = collate([held[i] for i in range(len(held))], pad_id=0)
        with torch.no_grad():
            want = ref.eval()(rows["input_ids"], labels=rows["labels"], position_ids=rows["position_ids"]).loss
        torch.testing.assert_close(trainer.evaluate()["eval_loss"], want.item(), **TOL)
    if dist.get_rank() == 0:  # final/: one ordinary checkpoint written from the stages
        saved = dict(AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), **TOL,
                                       msg=lambda m: f"{what}: {name} after 3 steps: {m}")
    dist.barrier()


def _run(root: str, out: str, *, pp: int, steps: int, resume: str | None = None) -> list[float]:
    """`steps` steps of the tied Qwen3 at pp 2 x cp 2, or pp 1 x cp 2 x tp 2 (4 ranks, the global batch of 2 either
    way), constant lr (a shorter run's steps are a longer one's), a checkpoint every 2 steps."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    sizes = dict(pp_size=pp, cp_size=2, tp_size=4 // (2 * pp))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64,
                                                 distributed_config=DistributedConfig(**sizes))
    config = ParallelismConfig(**sizes, pp_microbatches=2 if pp > 1 else None)
    args = training_args(os.path.join(root, out), max_steps=steps, per_device_train_batch_size=2, save_steps=2,
                         lr_scheduler_type="constant", warmup_steps=0, parallelism_config=config)
    return Trainer(model, args=args, train_dataset=tiny_dataset()).train(resume_from_checkpoint=resume).losses


def _resume(root: str) -> None:
    """Saved at pp 2 x cp 2, resumed at pp 1 x cp 2 x tp 2, and that run's checkpoint resumed at pp 2 x cp 2 (DCP
    reshards model and AdamW state): the resumed steps' losses are those of uninterrupted one-process training."""
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64).train()
    args = training_args(root, max_steps=5, lr_scheduler_type="constant", warmup_steps=0)
    expected = reference_losses(ref, tiny_dataset(), args, global_batch=2, collate_rows=_collated)
    first = _run(root, "resume-pp2", pp=2, steps=2)
    second = _run(root, "resume-pp1", pp=1, steps=4, resume=os.path.join(root, "resume-pp2", "checkpoint-2"))
    third = _run(root, "resume-pp2-again", pp=2, steps=5, resume=os.path.join(root, "resume-pp1", "checkpoint-4"))
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(expected), **TOL)


def _lora(root: str) -> None:
    """A random adapter on every linear layer (saved by one process), loaded onto the stages at pp 2 x cp 2, 3 Trainer
    steps: one process's losses, and the adapter the stages write at the end is one process's after its 3 steps."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tests.helpers.lora import LORA_TARGETS, random_lora
    from tptrain.peft import LoraConfig, PeftModel, get_peft_model
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    path, init, out = (os.path.join(root, name) for name in ("qwen3_tied", "adapter", "lora"))
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64),
                         LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    random_lora(ref, seed=1)  # B not zero: every factor has a gradient
    ref.save_pretrained(init)  # rank 0 writes
    dist.barrier()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, distributed_config=DistributedConfig(pp_size=2, cp_size=2)), init, is_trainable=True)
    args = training_args(out, max_steps=3, per_device_train_batch_size=2, parallelism_config=ParallelismConfig(
        pp_size=2, cp_size=2, pp_microbatches=2))
    losses = Trainer(model, args=args, train_dataset=tiny_dataset()).train().losses
    expected = reference_losses(ref.train(), tiny_dataset(), args, global_batch=2, collate_rows=_collated)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
    if dist.get_rank() == 0:
        saved = load_file(os.path.join(out, "final", "adapter", "adapter_model.safetensors"))
        want = ref.adapter_state_dict()
        assert sorted(saved) == sorted(want), (sorted(saved), sorted(want))
        for key, t in want.items():
            torch.testing.assert_close(saved[key], t, **TOL, msg=lambda m: f"LoRA {key} after 3 steps: {m}")
    dist.barrier()


def _cases(root: str, cases: list[tuple], resume: bool = False) -> None:
    for family, schedule, kw in cases:
        _train_case(root, family, schedule, **kw)
    if resume:
        _resume(root)
        _lora(root)


@pytest.mark.distributed
def test_pp2_cp2_equals_one_process(tmp_path):
    """pp 2 x cp 2 (the Trainer's FSDP2 over dp_shard x cp of 1 x 2): plain rows under 1F1B with gradient
    accumulation and with the optimizer in backward, and under a V schedule with tied embeddings; packed rows under a sliding window, an interleaved schedule (two stages per rank) with activation
    checkpointing and eval; a V schedule; a checkpoint saved at pp 2 x cp 2 resumed at pp 1 x cp 2 x tp 2 and back;
    LoRA."""
    for family in FAMILIES:
        save_family(family, str(tmp_path))
    cases = [("qwen3_tied", "1F1B", dict(cp=2, accumulation=2)),
             ("qwen3_tied", "1F1B", dict(cp=2, optim_in_backward=True, max_grad_norm=0.0)),
             ("qwen3_tied", "ZBVZeroBubble", dict(cp=2, microbatches=4)),  # the tied head's own copy under FSDP2
             ("mistral", "Interleaved1F1B", dict(cp=2, packed=True, checkpointing=True, evaluate=True)),
             ("mistral", "ZBVZeroBubble", dict(cp=2, packed=True, microbatches=4))]
    run_distributed(_cases, 4, str(tmp_path), cases, True, timeout=900)


@pytest.mark.distributed
def test_pp2_sp_tp2_equals_one_process(tmp_path):
    """pp 2 x tp 2 with sequence parallelism: the stages exchange each tp rank's sequence shard; plain rows under
    1F1B, packed rows under a sliding window and a V schedule (the first and the last stage on one rank)."""
    for family in FAMILIES:
        save_family(family, str(tmp_path))
    cases = [("qwen3_tied", "1F1B", dict(tp=2, sp=True)),
             ("mistral", "ZBVZeroBubble", dict(tp=2, sp=True, packed=True, microbatches=4))]
    run_distributed(_cases, 4, str(tmp_path), cases, timeout=900)


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_cp2_with_tp2_and_data_parallel_equal_one_process(tmp_path):
    """8 ranks: pp 2 x cp 2 x tp 2 (with and without SP), pp 2 x cp 2 x dp_shard 2 (FSDP2 over dp_shard x cp) and
    pp 2 x dp_replicate 2 x cp 2 (HSDP: replicas of FSDP2 over cp)."""
    for family in FAMILIES:
        save_family(family, str(tmp_path))
    cases = [("qwen3_tied", "1F1B", dict(cp=2, tp=2, sp=True)),
             ("mistral", "Interleaved1F1B", dict(cp=2, tp=2, packed=True)),
             ("mistral", "1F1B", dict(cp=2, dp_shard=2, packed=True)),
             ("qwen3_tied", "1F1B", dict(cp=2, dp_replicate=2))]
    run_distributed(_cases, 8, str(tmp_path), cases, timeout=1200)


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_trains_at_pp2_cp2_as_one_process(tmp_path):
    """`tptrain train --pp-size 2 --cp-size 2` on 4 ranks (the bundled tiny Qwen3 at random init, fp64): each step's
    logged loss is a one-process run's."""
    from tests.helpers.launch import tptrain_train
    from tptrain.training.reporting import logged_losses, read_metrics

    flags = ("--tp-size", "1", "--dtype", "float64", "--max-steps", "3", "--batch-size", "2", "--save-steps", "0")
    runs = {}
    for name, layout in (("pp2cp2", ("--pp-size", "2", "--cp-size", "2", "--pp-microbatches", "2",
                                     "--nproc-per-node", "4")),
                         ("single", ("--nproc-per-node", "1"))):
        run = tptrain_train(*flags, *layout, "--output-dir", str(tmp_path / name))
        assert run.returncode == 0, run.stdout + run.stderr
        assert name == "single" or "world size 4, tp 1, cp 2, pp 2" in run.stdout, run.stdout
        runs[name] = logged_losses(read_metrics(tmp_path / name / "metrics.jsonl"))
    assert [step for step, _ in runs["pp2cp2"]] == [1, 2, 3], runs
    torch.testing.assert_close(torch.tensor(runs["pp2cp2"]), torch.tensor(runs["single"]), rtol=1e-9, atol=1e-9)
