"""Nothing over a size-1 axis that one rank does not need: no collective, no autograd boundary, no hook.

At tp 1 a model loaded with `DistributedConfig(tp_size=1)` is the single-device model: no style, hook or replaced
forward on any module, the single-device loss functions, no tensor hook on any parameter, and a forward + backward +
AdamW step (and the Trainer at world size 1, save included) issues nothing and equals the plain model's bit for bit;
`comm_report` says so; LoRA on it is LoRA on the plain model. At 2 ranks no collective runs over a size-1 axis: dp
at tp 2, tp at (tp 1, ep 2).

    .venv/bin/python -m pytest tests/test_size_one_axes.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, tiny_moe, training_args
from tptrain import DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.distributed.comm import CommTracker
from tptrain.losses import causal_lm_loss, chunked_causal_lm_loss
from tptrain.models import AutoModelForCausalLM
from tptrain.peft import LoraConfig, PeftModel
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def installed(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, what) of every hook, replaced forward (or norm statistic) and local-output list on the modules, and every
    tensor hook on the parameters."""
    out = [(name, what) for name, m in model.named_modules() for what in _MODULE_HOOKS if getattr(m, what)]
    out += [(name, what) for name, m in model.named_modules()
            for what in ("forward", "mean_square", "_local_output_hooks") if what in vars(m)]
    return out + [(name, "tensor hook") for name, p in model.named_parameters() if p._backward_hooks]


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    """(loss, gradients, parameters after one AdamW step) of a forward + backward + step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{what} of {name} differs from the single-device model's"


def _tp1_is_single_device(tmp: str, name: str, make) -> None:
    make().save_pretrained(f"{tmp}/{name}")
    plain = AutoModelForCausalLM.from_pretrained(f"{tmp}/{name}")
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/{name}", distributed_config=DistributedConfig(tp_size=1))
    assert model.parallel.tp is not None and model.tp_plan  # the layout is recorded (saving, DCP, LoRA read it)
    assert installed(model) == [], installed(model)
    assert model.loss_function is causal_lm_loss and model.head_loss_function is chunked_causal_lm_loss
    ids = tiny_dataset()[0][None].repeat(2, 1)
    with CommTracker() as tracker:
        loss, grads, params = _step(model, ids)
    assert tracker.records == [], tracker.records
    want_loss, want_grads, want_params = _step(plain, ids)
    assert torch.equal(loss, want_loss), (loss, want_loss)
    _assert_equal(grads, want_grads, f"{name}: gradient")
    _assert_equal(params, want_params, f"{name}: parameter after AdamW")
    model.zero_grad(set_to_none=True)
    report = comm_report(model, ids, ids)
    assert report.rows == [] and "tp 1: no collectives (single-device computation)" in report.table(), report.table()


def _lora_at_tp1(tmp: str, name: str, config: LoraConfig) -> None:
    """LoRA (its hooks are LoRA's own: a module without a style) on a tp-1 model: the plain model's, bit for bit; its
    forward, backward and save issue nothing."""
    ids = tiny_dataset()[0][None].repeat(2, 1)
    results = []
    for distributed_config in (None, DistributedConfig(tp_size=1)):
        model = PeftModel(AutoModelForCausalLM.from_pretrained(f"{tmp}/{name}", distributed_config=distributed_config),
                          config, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at zero: random factors, so every adapter term counts
            for p in (p for n, p in model.named_parameters() if ".lora_" in n):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
        with CommTracker() as tracker:
            loss = model(ids, labels=ids).loss
            loss.backward()
            model.save_pretrained(f"{tmp}/{name}-adapter-{len(results)}")
        assert distributed_config is None or tracker.records == [], tracker.records
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(results[1][0], results[0][0]) and results[0][1]
    _assert_equal(results[1][1], results[0][1], f"{name} LoRA: gradient")


def _trainer_losses(tmp: str, model: torch.nn.Module, run: str) -> tuple[list[float], list]:
    args = training_args(f"{tmp}/{run}", max_steps=3, logging_steps=1, save_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=tiny_dataset())
    assert installed(model) == [], installed(model)  # no FSDP at dp 1, no TP hook at tp 1
    with CommTracker() as tracker:
        losses = trainer.train().losses
    return losses, tracker.records


def _one_process_worker(tmp: str) -> None:
    _tp1_is_single_device(tmp, "dense", tiny_model)  # q/k norms: partial-gradient parameters at tp > 1
    _tp1_is_single_device(tmp, "moe", tiny_moe)  # the experts' style is not installed either
    _lora_at_tp1(tmp, "dense", LoraConfig(r=2, target_modules=["embed_tokens", "q_proj", "o_proj", "down_proj"]))
    _lora_at_tp1(tmp, "moe", LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))  # the experts' term: their loop
    tp1 = AutoModelForCausalLM.from_pretrained(f"{tmp}/dense", dtype=torch.float64,
                                               distributed_config=DistributedConfig(tp_size=1))
    losses, records = _trainer_losses(tmp, tp1, "tp1")
    assert records == [], records  # steps, checkpoint and final save: nothing issued
    want, _ = _trainer_losses(tmp, AutoModelForCausalLM.from_pretrained(f"{tmp}/dense", dtype=torch.float64), "plain")
    assert losses == want, (losses, want)


@pytest.mark.distributed
def test_tp1_is_the_single_device_computation(tmp_path):
    run_distributed(_one_process_worker, 1, str(tmp_path), timeout=600)


def _step_records(tmp: str, model: torch.nn.Module, run: str, **parallelism) -> list:
    args = training_args(f"{tmp}/{run}", parallelism_config=ParallelismConfig(**parallelism))
    trainer = Trainer(model=model, args=args, train_dataset=tiny_dataset())
    with CommTracker() as tracker:
        trainer.training_step(trainer.data_order.next_batch())
    return tracker.records


def _two_ranks_worker(tmp: str) -> None:
    records = _step_records(tmp, tiny_model().parallelize(DistributedConfig(tp_size=2)), "tp2", tp_size=2)
    assert [r for r in records if r.ranks == 1] == [], records
    phases = {r.phase for r in records}  # dp 1: no token count or loss reduction; the norm over tp
    assert "token_count" not in phases and "loss" not in phases and "grad_norm" in phases, phases

    model = tiny_moe().parallelize(DistributedConfig(tp_size=1, ep_size=2))
    experts = [n for n, m in model.named_modules() if n.endswith(".experts")]
    assert experts and installed(model) == [(n, "forward") for n in experts], installed(model)  # ep's exchange only
    records = _step_records(tmp, model, "ep2", ep_size=2)
    assert [r for r in records if r.ranks == 1] == [], records
    assert {r.op for r in records if r.phase in ("forward", "backward")} == {"all_to_all"}, records  # none over tp
    assert {r.phase for r in records} == {"forward", "backward", "token_count", "loss", "grad_norm"}, records


@pytest.mark.distributed
def test_no_collective_over_a_size_one_axis_at_two_ranks(tmp_path):
    run_distributed(_two_ranks_worker, 2, str(tmp_path), timeout=600)
