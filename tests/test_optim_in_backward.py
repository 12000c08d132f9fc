"""optim_in_backward: every parameter stepped by its gradient hook, its gradient freed at once.

fp64, against the ordinary optimizer step (the same Trainer with optim_in_backward=False) at TP 2 and at
TP 2 x FSDP2 2, with a warmup + cosine schedule and no clipping; a checkpoint made with it resumes to the same
losses; clipping and accumulation are refused with the flag to change.
"""
from __future__ import annotations

import argparse
import copy

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.parallel.grad_sync import local_tensor
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.optim import build_optimizer, build_scheduler
from tptrain.training.optim_in_backward import OptimizerInBackward
from tptrain.training.reporting import read_metrics
from tptrain.training.trainer import Trainer

EXACT = dict(rtol=1e-12, atol=1e-12)
STEPS = 4  # a checkpoint after step 2; the resumed run trains steps 3 and 4
IN_BWD = dict(max_steps=STEPS, warmup_steps=2, max_grad_norm=0.0, save_steps=2)


def _step_pair(model, args, held_back=()):
    """Three steps of the ordinary AdamW + schedule and of OptimizerInBackward on a copy; (losses, losses,
    the two models). After each backward, the in-backward model's gradients are gone but `held_back`'s."""
    twin = copy.deepcopy(model)
    alive = _count_alive_gradients(model), _count_alive_gradients(twin, ignore=held_back)
    opt, in_bwd = build_optimizer(model, args), OptimizerInBackward(twin, args, held_back=held_back)
    sched, sched_bwd = build_scheduler(opt, args, total_steps=3), build_scheduler(in_bwd, args, total_steps=3)
    ids = torch.stack([tiny_dataset()[i] for i in range(4)])
    losses, losses_bwd = [], []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        loss_bwd = twin(ids, labels=ids).loss
        loss_bwd.backward()
        left = {n for n, p in twin.named_parameters() if p.grad is not None}
        assert left == set(held_back), left
        in_bwd.step(), sched_bwd.step(), in_bwd.zero_grad()
        losses.append(loss.item()), losses_bwd.append(loss_bwd.item())
    # The memory saving: the ordinary backward ends holding every gradient; in backward each is freed before
    # the next one is accumulated.
    assert max(alive[0]) == len(list(model.parameters())) and max(alive[1]) == 1, (max(alive[0]), max(alive[1]))
    return losses, losses_bwd, model, twin, opt, in_bwd


def _count_alive_gradients(model, ignore=()) -> list[int]:
    """Whenever a gradient is accumulated, how many parameters (but `ignore`'s) hold one; hooks registered
    before any optimizer's, so they see the model just before a step."""
    counts: list[int] = []
    params = [p for n, p in model.named_parameters() if n not in set(ignore)]
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: counts.append(sum(q.grad is not None for q in params)))
    return counts


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_single_device_equals_adamw_and_frees_every_gradient(tmp_path, optim):
    """One device: the same three updates as torch AdamW with a warmup schedule and weight-decay groups; no
    gradient survives backward except a held-back one, which `step()` then steps; the state table is AdamW's."""
    args = training_args(tmp_path, optim=optim, warmup_steps=2, max_grad_norm=0.0)
    losses, losses_bwd, model, twin, opt, in_bwd = _step_pair(tiny_model(), args, held_back=["model.norm.weight"])
    torch.testing.assert_close(torch.tensor(losses_bwd), torch.tensor(losses), **EXACT)
    assert losses[0] != losses[-1]  # it did train
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=lambda m: f"{name}: {m}")
        assert set(in_bwd.state[q]) == set(opt.state[p]) and float(in_bwd.state[q]["step"]) == 3.0
    assert [g["lr"] for g in in_bwd.param_groups] == [g["lr"] for g in opt.param_groups]
    # torch's state_dict round trip (the Trainer's checkpoints use DCP on `state` instead) keeps stepping alike.
    in_bwd.load_state_dict(copy.deepcopy(in_bwd.state_dict()))
    ids = torch.stack([tiny_dataset()[i] for i in range(4, 8)])
    model(ids, labels=ids).loss.backward(), opt.step()
    twin(ids, labels=ids).loss.backward(), in_bwd.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=lambda m: f"after load_state_dict, {name}: {m}")
        # ... and the table checkpoints read is the one the steps wrote
        assert float(in_bwd.state[q]["step"]) == 4.0
        torch.testing.assert_close(in_bwd.state[q]["exp_avg"], opt.state[p]["exp_avg"], **EXACT)


def _trainer(tmp: str, tp: int, shard: int | None, **kw) -> Trainer:
    model = tiny_model().parallelize(DistributedConfig(tp_size=tp))
    args = training_args(tmp, parallelism_config=ParallelismConfig(tp, dp_shard_size=shard), **{**IN_BWD, **kw})
    return Trainer(model=model, args=args, train_dataset=tiny_dataset())


def _grads_after_backward(trainer: Trainer) -> set[str]:
    """The parameters still holding a gradient after one more backward (the hooks step the rest)."""
    batch = trainer._batch([trainer.dataset[i] for i in range(4)])
    trainer.model(batch["input_ids"], labels=batch["labels"]).loss.backward()
    return {n for n, p in trainer.inner.named_parameters() if p.grad is not None}


def _equal_to_ordinary_worker(tmp: str, tp: int, shard: int | None) -> None:
    ordinary = _trainer(f"{tmp}/ordinary", tp, shard)
    expected = ordinary.train().losses
    in_bwd = _trainer(f"{tmp}/in_bwd", tp, shard, optim_in_backward=True)
    out = in_bwd.train()
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), **EXACT)
    for (name, p), q in zip(ordinary.inner.named_parameters(), in_bwd.inner.parameters()):
        torch.testing.assert_close(local_tensor(q), local_tensor(p), **EXACT, msg=lambda m: f"{name}: {m}")
    # Resumed from its own checkpoint: the same losses, bit for bit; the ordinary step resumes from it too.
    ckpt = f"{tmp}/in_bwd/checkpoint-2"
    again = _trainer(f"{tmp}/resumed", tp, shard, optim_in_backward=True).train(resume_from_checkpoint=ckpt)
    assert again.losses == out.losses[2:], (again.losses, out.losses)
    other = _trainer(f"{tmp}/mixed", tp, shard).train(resume_from_checkpoint=ckpt)
    torch.testing.assert_close(torch.tensor(other.losses), torch.tensor(out.losses[2:]), **EXACT)
    # Freed in backward: only the TP partial gradients (Qwen3's q/k norms), held back for the TP sum, remain.
    held = set(in_bwd.inner.parallel.tp.partial_grad_specs())
    assert held and {n.rsplit(".", 2)[-2] for n in held} == {"q_norm", "k_norm"}, held
    assert _grads_after_backward(in_bwd) == held
    assert _grads_after_backward(ordinary) == {n for n, p in ordinary.inner.named_parameters()}
    if torch.distributed.get_rank() == 0:  # no gradient norm exists to log
        assert all("grad_norm" not in r and "loss" in r for r in read_metrics(f"{tmp}/in_bwd/metrics.jsonl"))
        assert all("grad_norm" in r for r in read_metrics(f"{tmp}/ordinary/metrics.jsonl"))


@pytest.mark.distributed
def test_tp2_equals_the_ordinary_step_and_resumes(tmp_path):
    run_distributed(_equal_to_ordinary_worker, 2, str(tmp_path), 2, None)


@pytest.mark.distributed
def test_tp2_fsdp2_equals_the_ordinary_step_and_resumes(tmp_path):
    """FSDP2 runs the sharded parameters' hooks after its reduce-scatter: each shard is stepped on the sum."""
    run_distributed(_equal_to_ordinary_worker, 4, str(tmp_path), 2, 2, timeout=400)


def test_clipping_and_accumulation_are_refused_with_the_setting_to_change(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\).*set max_grad_norm=0 \(--max-grad-norm 0\)"):
        TrainingArguments(output_dir=str(tmp_path), optim_in_backward=True)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2\).*\(--grad-accum 1\)"):
        TrainingArguments(output_dir=str(tmp_path), optim_in_backward=True, max_grad_norm=0,
                          gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="optim_in_backward must be True or False"):
        TrainingArguments(output_dir=str(tmp_path), optim_in_backward="yes", max_grad_norm=0)
    from tptrain.cli.train import add_train_arguments, run_train

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert run_train(parser.parse_args(["--optim-in-backward", "--output-dir", str(tmp_path / "a")])) == 2
    assert "--max-grad-norm 0" in capsys.readouterr().err
    args = parser.parse_args(["--optim-in-backward", "--max-grad-norm", "0"])
    assert args.optim_in_backward and args.max_grad_norm == 0.0


# ------------------------------------------------------------------ under pipeline parallelism

OIB = dict(optim_in_backward=True, max_grad_norm=0.0)


def _pp_cases(root: str, cases: list[tuple]) -> None:
    from tests.helpers.pipeline import train_cases

    train_cases(root, [(family, schedule, {**kw, **OIB}) for family, schedule, kw in cases])


@pytest.mark.distributed
def test_pp2_steps_each_stage_after_its_last_microbatch(tmp_path):
    """pp 2, fp64, against one process (losses, and the parameters after 3 steps): each stage's parameters are stepped
    once its last microbatch's gradients are in (1F1B; InterleavedZeroBubble, whose weight gradients come apart from
    the input gradients; ZBVZeroBubble, where rank 0's one tied weight is in two stage modules), the tied embedding's
    two copies (1F1B) after their gradients are summed; nothing else is left for the optimizer's step()."""
    from tests.helpers.checkpoints import save_family

    for family in ("qwen3_tied", "llama"):
        save_family(family, tmp_path)
    cases = [("qwen3_tied", "1F1B", {}), ("llama", "InterleavedZeroBubble", dict(microbatches=4)),
             ("qwen3_tied", "ZBVZeroBubble", dict(microbatches=4))]
    run_distributed(_pp_cases, 2, str(tmp_path), cases, timeout=600)


@pytest.mark.distributed
def test_pp2_with_fsdp2_and_tp2_steps_each_stage_after_its_last_microbatch(tmp_path):
    """The same at pp 2 x dp_shard 2 (FSDP2's reduce-scatter before the step; ZBVZeroBubble: rank 0's last stage module
    holds its own copy of the tied head, summed into the weight, which is stepped after) and pp 2 x tp 2 (Qwen3's q/k
    norms' partial gradients summed over TP, then stepped)."""
    from tests.helpers.checkpoints import save_family

    save_family("qwen3_tied", tmp_path)
    cases = [("qwen3_tied", "ZBVZeroBubble", dict(dp_shard=2, microbatches=4)),
             ("qwen3_tied", "Interleaved1F1B", dict(tp=2))]
    run_distributed(_pp_cases, 4, str(tmp_path), cases, timeout=600)
