"""Issue 33's composed layouts end to end, each against one process in fp64 (the Trainer: every step's loss, the
eval loss, the parameters or LoRA adapter it writes at the end):

* pp x cp x ep: pp 2 x cp 2 x ep 2 (ep folded over the cp ranks of each stage) with the router aux loss (4 ranks);
  pp 2 x cp 2 x tp 2 x ep 2 (8 ranks);
* evaluation under the V schedules (torch's eval cannot run their backward bookkeeping: the Pipeline evaluates
  through the forward actions alone), with FSDP2 over dp_shard and over cp, mid-run and at the end;
* tp 2 x cp 2 x pp 2 (SP, tied embeddings, 8 ranks): training with evaluation, and its checkpoint resumed at
  tp 2 x cp 2, at pp 2 x dp_shard 2 and in one process; LoRA at the same layout, its checkpoint resumed in one
  process.

The ranks write what they measured (rank 0's losses and metrics); the one-process references run once, in the test
process. Tiny models (2 layers, hidden 32).

    .venv/bin/python -m pytest tests/test_composed_layouts.py -q
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.checkpoints import save_perturbed
from tests.helpers.configs import MOE_TRAIN_TINY, TRAINER_TINY
from tests.helpers.lora import LORA_TARGETS, random_lora
from tests.helpers.ranks import run_distributed
from tests.helpers.references import microbatch_reference
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM

TOL = dict(rtol=1e-10, atol=1e-10)
F64 = torch.float64
FAMILIES = {
    "tied": ("qwen3", dict(TRAINER_TINY, tie_word_embeddings=True)),  # the tie group between the first and last stage
    "tied4": ("qwen3", dict(TRAINER_TINY, tie_word_embeddings=True, num_hidden_layers=4)),  # a V: 4 stages of 1
    "moe": ("qwen3_moe", dict(MOE_TRAIN_TINY, num_experts_per_tok=2, router_aux_loss_coef=0.5)),
}
EVAL_ROWS = 6  # 3 per dp rank at dp 2: the second batch padded


def save_family(family: str, root: str) -> str:
    model_type, kw = FAMILIES[family]
    return save_perturbed(model_type, kw, os.path.join(root, family))


def eval_set():
    return tiny_dataset(EVAL_ROWS, seed=2)


# ---------------------------------------------------------------- the ranks

def _trainer(root: str, family: str, out: str, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int | None = None,
             sp: bool = False, schedule: str = "1F1B", microbatches: int = 2, dp_shard: int | None = None,
             dp_replicate: int = 1, per_device: int = 2, evaluate: bool = False, adapter: str | None = None, **kw):
    """A Trainer of `family` (read from `root`) laid out as given, writing to `root/out`."""
    from tptrain.peft import PeftModel
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=F64, distributed_config=(
        DistributedConfig(tp_size=tp, cp_size=cp, pp_size=pp, ep_size=ep, enable_sequence_parallel=sp,
                          pp_schedule=schedule)))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, os.path.join(root, adapter), is_trainable=True)
    config = ParallelismConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=microbatches if pp > 1 else None,
                               cp_size=cp, ep_size=ep, dp_shard_size=dp_shard, dp_replicate_size=dp_replicate)
    args = training_args(os.path.join(root, out), per_device_train_batch_size=per_device, parallelism_config=config,
                         **kw)
    return Trainer(model, args=args, train_dataset=tiny_dataset(), eval_dataset=eval_set() if evaluate else None)


def _record(root: str, name: str, trainer, resume: str | None = None) -> None:
    """Train; rank 0 writes the losses, the eval losses logged on the way and a final evaluate() to root/name.pt."""
    from tptrain.training.reporting import read_metrics

    losses = trainer.train(resume_from_checkpoint=resume and os.path.join(root, resume)).losses
    final = trainer.evaluate()["eval_loss"] if trainer.eval_dataset is not None else None
    if dist.get_rank() == 0:
        logged = {r["step"]: r["eval_loss"] for r in read_metrics(os.path.join(trainer.args.output_dir,
                                                                               "metrics.jsonl")) if "eval_loss" in r}
        torch.save({"losses": losses, "eval": logged, "final_eval": final}, os.path.join(root, f"{name}.pt"))
    dist.barrier()


def _four(root: str) -> None:
    """pp 2 x cp 2 x ep 2 with the aux loss; ZBVZeroBubble at pp 2 x dp_shard 2 (the tied head's own copy under
    FSDP2) and DualPipeV at pp 2 x cp 2, each evaluated after step 2 and at the end."""
    _record(root, "pp2cp2ep2", _trainer(root, "moe", "pp2cp2ep2", pp=2, cp=2, ep=2, max_steps=3))
    _record(root, "zbv_dp2", _trainer(root, "tied4", "zbv_dp2", pp=2, schedule="ZBVZeroBubble", microbatches=4,
                                      per_device=4, dp_shard=2, evaluate=True, eval_steps=2, max_steps=3))
    _record(root, "dualpipev_cp2", _trainer(root, "tied4", "dualpipev_cp2", pp=2, cp=2, schedule="DualPipeV",
                                            microbatches=4, per_device=4, evaluate=True, eval_steps=2, max_steps=3))


TP2_CP2_PP2 = dict(tp=2, cp=2, pp=2, sp=True)
RESUMED = dict(max_steps=4, save_steps=2)  # the same schedule of learning rates in every run


def _eight(root: str) -> None:
    """tp 2 x cp 2 x pp 2 (SP): the dense model trained and evaluated (a checkpoint at step 2), LoRA (a checkpoint at
    step 2); pp 2 x cp 2 x tp 2 x ep 2 with the aux loss."""
    _record(root, "tp2cp2pp2", _trainer(root, "tied", "tp2cp2pp2", **TP2_CP2_PP2, evaluate=True, eval_steps=2,
                                        **RESUMED))
    _record(root, "lora_tp2cp2pp2", _trainer(root, "tied", "lora_tp2cp2pp2", **TP2_CP2_PP2, adapter="adapter",
                                             **RESUMED))
    _record(root, "pp2cp2tp2ep2", _trainer(root, "moe", "pp2cp2tp2ep2", pp=2, cp=2, tp=2, ep=2, max_steps=3))


def _resumed_on_four(root: str) -> None:
    """The tp 2 x cp 2 x pp 2 checkpoint at step 2 resumed at tp 2 x cp 2 (SP) and at pp 2 x dp_shard 2 (GPipe, one
    microbatch of one row per dp rank: the global batch of 2 stays)."""
    resume = "tp2cp2pp2/checkpoint-2"
    _record(root, "resumed_tp2cp2", _trainer(root, "tied", "resumed_tp2cp2", tp=2, cp=2, sp=True, **RESUMED), resume)
    _record(root, "resumed_pp2dp2", _trainer(root, "tied", "resumed_pp2dp2", pp=2, schedule="GPipe", microbatches=1,
                                             per_device=1, dp_shard=2, **RESUMED), resume)


def _resumed_in_one(root: str) -> None:
    _record(root, "resumed_one", _trainer(root, "tied", "resumed_one", **RESUMED), "tp2cp2pp2/checkpoint-2")
    _record(root, "lora_resumed_one", _trainer(root, "tied", "lora_resumed_one", adapter="adapter", **RESUMED),
            "lora_tp2cp2pp2/checkpoint-2")


# ---------------------------------------------------------------- one process

def _measured(root: str, name: str) -> dict:
    return torch.load(os.path.join(root, f"{name}.pt"))


def _check_run(root: str, name: str, family: str, *, global_batch: int, steps: int, microbatches: int = 1,
               eval_at: tuple[int, ...] = (), first: int = 0, adapter: str | None = None) -> None:
    """root/name.pt against one process trained `steps` steps (its steps from `first` on: a resumed run), and the
    parameters (or the adapter) root/name/final holds."""
    from safetensors.torch import load_file

    from tptrain.peft import PeftModel

    ref = AutoModelForCausalLM.from_pretrained(os.path.join(root, family), dtype=F64)
    if adapter is not None:
        ref = PeftModel.from_pretrained(ref, os.path.join(root, adapter), is_trainable=True)
    args = training_args(root, max_steps=steps)
    losses, evals = microbatch_reference(ref.train(), args, global_batch=global_batch, microbatches=microbatches,
                                         held=eval_set(), eval_at=eval_at)
    got = _measured(root, name)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses[first:]), **TOL,
                               msg=lambda m: f"{name} losses: {m}")
    assert sorted(got["eval"]) == sorted(evals), (name, got["eval"], evals)
    for step, want in evals.items():
        torch.testing.assert_close(got["eval"][step], want, **TOL, msg=lambda m: f"{name} eval at step {step}: {m}")
    if got["final_eval"] is not None:
        torch.testing.assert_close(got["final_eval"], evals[steps], **TOL, msg=lambda m: f"{name} evaluate(): {m}")
    final = os.path.join(root, name, "final")
    if adapter is not None:
        saved = load_file(os.path.join(final, "adapter", "adapter_model.safetensors"))
        want = ref.adapter_state_dict()
        assert sorted(saved) == sorted(want), (name, sorted(saved), sorted(want))
    else:
        saved = dict(AutoModelForCausalLM.from_pretrained(final, dtype=F64).named_parameters())
        want = {n: p.detach() for n, p in ref.named_parameters()}
    for key, t in want.items():
        torch.testing.assert_close(saved[key], t, **TOL, msg=lambda m: f"{name}: {key} after {steps} steps: {m}")


# ---------------------------------------------------------------- the tests

@pytest.mark.distributed
def test_pp_x_cp_x_ep_and_v_schedule_evaluation_equal_one_process(tmp_path):
    """4 ranks: pp 2 x cp 2 x ep 2 (Qwen3-MoE, the aux loss), ZBVZeroBubble x dp_shard 2 and DualPipeV x cp 2
    (tied embeddings) evaluated mid-run and at the end."""
    root = str(tmp_path)
    for family in FAMILIES:
        save_family(family, root)
    run_distributed(_four, 4, root, timeout=900)
    _check_run(root, "pp2cp2ep2", "moe", global_batch=2, steps=3, microbatches=2)
    _check_run(root, "zbv_dp2", "tied4", global_batch=8, steps=3, eval_at=(2, 3))
    _check_run(root, "dualpipev_cp2", "tied4", global_batch=4, steps=3, eval_at=(2, 3))


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_cp2_pp2_trains_evaluates_and_resumes_at_other_layouts(tmp_path):
    """8 ranks: tp 2 x cp 2 x pp 2 (SP) trains and evaluates as one process, its step-2 checkpoint resumes at
    tp 2 x cp 2, pp 2 x dp_shard 2 and one process to the same losses; LoRA at tp 2 x cp 2 x pp 2, its checkpoint
    resumed in one process; pp 2 x cp 2 x tp 2 x ep 2 with the aux loss."""
    from tptrain.peft import LoraConfig, get_peft_model

    root = str(tmp_path)
    for family in FAMILIES:
        save_family(family, root)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(os.path.join(root, "tied"), dtype=F64),
                         LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    random_lora(ref, seed=1)  # B not zero: every factor has a gradient
    ref.save_pretrained(os.path.join(root, "adapter"))
    run_distributed(_eight, 8, root, timeout=1200)
    run_distributed(_resumed_on_four, 4, root, timeout=600)
    run_distributed(_resumed_in_one, 1, root, timeout=300)
    _check_run(root, "tp2cp2pp2", "tied", global_batch=2, steps=4, eval_at=(2, 4))
    _check_run(root, "lora_tp2cp2pp2", "tied", global_batch=2, steps=4, adapter="adapter")
    _check_run(root, "pp2cp2tp2ep2", "moe", global_batch=2, steps=3, microbatches=2)
    for name in ("resumed_tp2cp2", "resumed_pp2dp2", "resumed_one"):
        _check_run(root, name, "tied", global_batch=2, steps=4, first=2)
    _check_run(root, "lora_resumed_one", "tied", global_batch=2, steps=4, first=2, adapter="adapter")
