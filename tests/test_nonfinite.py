"""Non-finite steps (training/nonfinite.py): a step whose loss or gradient norm is NaN or inf is never applied.

* on_nonfinite="stop" (the default): NonFiniteStepError on every rank naming the step, the ranks and the first
  non-finite gradient in backward order (or the loss); the weights stay those of the step before, no checkpoint or
  final/ is written after it, the last finite checkpoint stays (save_total_limit included);
* on_nonfinite="skip": the step's update is skipped (weights and AdamW state equal those before it, the schedule not
  advanced, also across a resume), at most max_nonfinite_skips in a row;
* no checkpoint or final model is written from non-finite weights;
* `tptrain train --lr 1e4 --max-steps 12 --save-steps 4 --save-total-limit 2` (the bundled model diverges at step 5)
  exits 1 naming step 5, keeps checkpoint-4 and writes no final/, at 1 process and 2 ranks.

Faults are caused by a gradient hook (a NaN in one parameter's gradient, on one rank) or a forward hook (an inf in
the logits of one rank's batch), from the step they are to happen on.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_nonfinite.py -q
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.nonfinite import NonFiniteStepError
from tptrain.training.trainer import Trainer

POISONED = "model.layers.1.self_attn.q_proj.weight"  # colwise: a shard of it on every TP rank


def _trainer(output_dir, *, tp: int = 1, shard: int | None = None, **kw) -> Trainer:
    model = tiny_model()
    if tp > 1:
        model.parallelize(DistributedConfig(tp_size=tp))
    kw = {"max_steps": 6, "save_steps": 2, "save_total_limit": 1, "logging_steps": 1, **kw}
    args = training_args(output_dir, parallelism_config=ParallelismConfig(tp, dp_shard_size=shard), **kw)
    return Trainer(model=model, args=args, train_dataset=tiny_dataset())


def _poison_gradient(trainer: Trainer, steps: set[int], name: str = POISONED) -> None:
    """A NaN in `name`'s gradient (this rank's piece) during the optimizer steps `steps` (1-based)."""
    param = dict(trainer.inner.named_parameters())[name]
    param.register_hook(lambda g: g * float("nan") if trainer.global_step + 1 in steps else g)


def _poison_loss(trainer: Trainer, steps: set[int]) -> None:
    """An inf in the final hidden states of this rank's batch during `steps`: its loss, so the global one, is NaN."""
    def hook(module, args, output):
        return output + float("inf") if trainer.global_step + 1 in steps and module.training else output

    trainer.inner.model.norm.register_forward_hook(hook)


def _record_weights(trainer: Trainer) -> dict[int, dict[str, torch.Tensor]]:
    """{step: this rank's parameters and AdamW moments after it}, filled as the trainer runs."""
    after: dict[int, dict[str, torch.Tensor]] = {}
    original = trainer.training_step

    def training_step(indices):
        out = original(indices)
        state = {f"param {n}": p.detach().clone() for n, p in trainer.inner.named_parameters()}
        for n, p in trainer.inner.named_parameters():
            for k, v in trainer.optimizer.state.get(p, {}).items():
                state[f"{k} {n}"] = v.detach().clone()
        after[trainer.global_step + 1] = state
        return out

    trainer.training_step = training_step
    return after


def _checkpoints(output_dir) -> list[str]:
    return sorted(p.name for p in Path(output_dir).iterdir() if p.name.startswith(("checkpoint-", "final", ".")))


def _assert_stopped_at_3(out: str, *, tp: int, poisoned: bool, rank_words: str) -> None:
    """A NaN gradient in step 3 (on this rank if `poisoned`) stops the run at step 3 without applying it:
    checkpoint-2 alone on disk, no final/, the weights and AdamW state those of step 2."""
    trainer = _trainer(out, tp=tp)
    if poisoned:
        _poison_gradient(trainer, {3})
    after = _record_weights(trainer)
    with pytest.raises(NonFiniteStepError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith(f"step 3 is not finite: the gradient norm is nan; first non-finite gradient in "
                              f"backward order: {POISONED}{rank_words} (1 of the "), message
    assert "Training stopped (on_nonfinite='stop') without applying it: the weights are those of step 2" in message
    assert f"{Path(out) / 'checkpoint-2'} is the latest checkpoint" in message, message
    assert _checkpoints(out) == ["checkpoint-2"]  # no checkpoint-4 (save_steps 2), no final/, nothing half-written
    for key, value in after[2].items():  # the step was not applied: the weights and AdamW state of step 2
        torch.testing.assert_close(after[3][key], value, rtol=0, atol=0, msg=key)
    assert trainer.global_step == 3 and trainer.scheduler.last_epoch == 2


def test_stop_names_the_step_and_the_first_nonfinite_gradient(tmp_path):
    _assert_stopped_at_3(str(tmp_path / "run"), tp=1, poisoned=True, rank_words="")


def _two_rank_stop_worker(tmp: str) -> None:
    # Only rank 1's shard of the gradient is NaN: the norm (summed over TP) is NaN on both, which both stop on.
    _assert_stopped_at_3(f"{tmp}/run", tp=2, poisoned=os.environ["RANK"] == "1", rank_words=" on rank 1")


def _two_rank_loss_worker(tmp: str) -> None:
    trainer = _trainer(f"{tmp}/loss", shard=2)  # dp 2: each rank its own batch
    if os.environ["RANK"] == "0":
        _poison_loss(trainer, {2})
    with pytest.raises(NonFiniteStepError, match=r"^step 2 is not finite: the loss is (nan|inf) \(from the batches of "
                                                 r"rank 0\); the gradient norm is nan; first non-finite gradient"):
        trainer.train()
    assert not Path(f"{tmp}/loss").joinpath("checkpoint-2").exists() and not Path(f"{tmp}/loss/final").exists()


@pytest.mark.distributed
def test_two_ranks_stop_together_naming_the_rank(tmp_path):
    run_distributed(_two_rank_stop_worker, 2, str(tmp_path), timeout=300)
    run_distributed(_two_rank_loss_worker, 2, str(tmp_path), timeout=300)


def test_skip_leaves_weights_optimizer_and_schedule_as_they_were(tmp_path):
    trainer = _trainer(tmp_path / "skip", on_nonfinite="skip", save_total_limit=None)
    _poison_gradient(trainer, {3})
    after = _record_weights(trainer)
    lrs = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *a: lrs.append(opt.param_groups[0]["lr"]))
    out = trainer.train()
    assert out.global_step == 6 and out.skipped_steps == [3] and out.final_dir is not None
    for key, value in after[2].items():
        torch.testing.assert_close(after[3][key], value, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(after[4][k], v) for k, v in after[3].items())  # and step 4 updates again
    # The schedule skipped with it: 5 updates, with the lrs of the first 5 steps of a run without a skip.
    args = trainer.args
    expected = [trainer.scheduler.lr_lambdas[0](i) * args.learning_rate for i in range(5)]
    assert lrs == pytest.approx(expected, rel=1e-12), (lrs, expected)
    # Resumed from checkpoint-4 (written after the skip), steps 5 and 6 are the same, bit for bit: the skip is in
    # the checkpoint's state, so the schedule resumes where it was.
    resumed = _trainer(tmp_path / "resumed", on_nonfinite="skip",
                       resume_from_checkpoint=str(tmp_path / "skip" / "checkpoint-4")).train()
    assert resumed.losses == out.losses[4:] and resumed.skipped_steps == [3], (resumed.losses, out.losses)


def test_too_many_skips_in_a_row_stop(tmp_path):
    trainer = _trainer(tmp_path / "run", on_nonfinite="skip", max_nonfinite_skips=2)
    _poison_gradient(trainer, {3, 4, 5})
    with pytest.raises(NonFiniteStepError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith("step 5 is not finite: the gradient norm is nan"), message
    assert ("3 steps in a row were not finite, more than max_nonfinite_skips=2 (--max-nonfinite-skips) allows) "
            "without applying it: the weights are those of step 2") in message, message
    # checkpoint-4 was written after the skipped step 4: the weights of step 2 (finite), the data of step 4
    assert _checkpoints(tmp_path / "run") == ["checkpoint-4"]


def test_no_checkpoint_or_final_model_from_nonfinite_weights(tmp_path):
    trainer = _trainer(tmp_path / "run", max_steps=1, save_steps=0)
    trainer.train()
    with torch.no_grad():
        dict(trainer.inner.named_parameters())["model.norm.weight"][3] = float("inf")
    for save, what in ((trainer.save_checkpoint, "checkpoint-1"), (trainer.save_model, str(tmp_path / "run/final"))):
        with pytest.raises(NonFiniteStepError, match=rf"^not writing {what}: parameter model.norm.weight holds NaN or "
                                                     r"inf \(1 of the \d+ parameters this rank holds do\)"):
            save()
    assert _checkpoints(tmp_path / "run") == ["final"]  # train()'s own final/, from the finite weights


def test_with_optim_in_backward_the_loss_is_checked_and_no_save_takes_nonfinite_weights(tmp_path):
    # A NaN gradient in step 2 is applied during backward (no norm exists to refuse it first): its checkpoint is refused.
    trainer = _trainer(tmp_path / "grad", optim_in_backward=True, max_grad_norm=0)
    _poison_gradient(trainer, {2})
    with pytest.raises(NonFiniteStepError, match=rf"^not writing checkpoint-2: parameter {POISONED} holds NaN or inf"):
        trainer.train()
    assert _checkpoints(tmp_path / "grad") == []
    # A NaN loss is caught after the step, and said to have been applied.
    trainer = _trainer(tmp_path / "loss", optim_in_backward=True, max_grad_norm=0)
    _poison_loss(trainer, {3})
    with pytest.raises(NonFiniteStepError, match=r"^step 3 is not finite: the loss is nan. Training stopped "
                                                 r"\(on_nonfinite='stop'\) after its update, which optim_in_backward "
                                                 r"applied during backward: the weights may hold NaN or inf"):
        trainer.train()
    assert _checkpoints(tmp_path / "loss") == ["checkpoint-2"]


def test_arguments_are_checked(tmp_path):
    for kw, match in [
        (dict(on_nonfinite="ignore"), "on_nonfinite must be 'stop' or 'skip', got 'ignore'"),
        (dict(on_nonfinite="skip", optim_in_backward=True, max_grad_norm=0),
         "on_nonfinite='skip' .* cannot skip a step with optim_in_backward=True"),
        (dict(max_nonfinite_skips=0), "max_nonfinite_skips must be an int >= 1, got 0"),
        (dict(hang_timeout=-1), "hang_timeout must be 'auto', None \\(off\\) or a positive number of seconds, got -1"),
        (dict(hang_timeout="soon"), "hang_timeout must be 'auto'"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainingArguments(output_dir=str(tmp_path), **kw)


# ------------------------------------------------------------------ `tptrain train`: the run

DIVERGING = ("--lr", "1e4", "--max-steps", "12", "--save-steps", "4", "--save-total-limit", "2", "--batch-size", "16",
             "--seq-len", "128", "--max-new-tokens", "4")


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_diverging_run_stops_at_its_first_nonfinite_step(tmp_path, ranks):
    out = tmp_path / "run"
    run = tptrain_train(*DIVERGING, "--tp-size", str(ranks), "--output-dir", str(out))
    assert run.returncode == 1, run.stdout + run.stderr
    # The bundled model at lr 1e4: its gradient norm is NaN at step 5 (at 1 and 2 ranks, on this machine's threads)
    found = re.search(r"NonFiniteStepError: step (\d+) is not finite: the gradient norm is nan; first non-finite "
                      r"gradient in backward order: model\.layers\.\d+\.\S+ ", run.stderr)
    assert found and "Traceback" not in run.stderr, run.stderr
    step = int(found.group(1))
    assert 4 < step < 12, step
    last = 4 * ((step - 1) // 4)  # the last checkpoint before it; save_total_limit 2 keeps the one before too
    assert f"{out / f'checkpoint-{last}'} is the latest checkpoint" in run.stderr
    kept = [f"checkpoint-{s}" for s in (last - 4, last) if s > 0]
    assert _checkpoints(out) == kept  # the last finite checkpoints kept; none after the step; no final/
    assert all(os.path.isfile(out / name / "complete") for name in kept)


@pytest.mark.distributed
def test_a_diverging_run_with_skip_ends_with_the_last_finite_weights(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run = tptrain_train(*DIVERGING, "--tp-size", "1", "--on-nonfinite", "skip", "--max-nonfinite-skips", "20",
                        "--output-dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.search(r"(\d+) step\(s\) skipped, their loss or gradient norm not finite: ([\d, ]+)\n", run.stdout)
    assert found and " skipped: the gradient norm is nan; first non-finite gradient" in run.stdout, run.stdout
    skipped = [int(s) for s in found.group(2).split(", ")]
    assert int(found.group(1)) == len(skipped) and skipped == list(range(skipped[0], 13)), skipped  # all from there
    weights = load_file(out / "final" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())  # final/: the last applied step's weights
