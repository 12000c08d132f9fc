"""DeepSeek-V3 trained natively: LoRA in peft's format (attention's per-head projections and the stacked experts,
peft's target_parameters) crossing both ways with peft 0.21 + transformers 5.23; the Trainer at tp 2 (full fine-tuning
with expert TP, LoRA with expert parallelism) equal to one process, and its DCP checkpoints resumed (the full run under
the other expert layout). fp64, on a tiny checkpoint transformers wrote.

    .venv/bin/python -m pytest tests/test_deepseek_training.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.batches import batch
from tests.helpers.checkpoints import deepseek_checkpoint
from tests.helpers.compare import MOE_HF_TOL as HF_TOL
from tests.helpers.configs import F64
from tests.helpers.lora import adapter_keys_and_shapes, random_lora
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses, transformers_fp64
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM
from tptrain.peft import LoraConfig, PeftModel, get_peft_model

peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SETTINGS = dict(r=2, lora_alpha=4, target_modules=["q_b_proj", "kv_b_proj", "o_proj"], target_parameters=EXPERTS)
LOSS_TOL = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return deepseek_checkpoint(tmp_path_factory.mktemp("deepseek_v3"))


def test_adapters_cross_between_peft_and_tptrain(base, tmp_path):
    ids = batch()[0]
    hf = peft.get_peft_model(transformers_fp64(base), peft.LoraConfig(task_type="CAUSAL_LM", **SETTINGS))
    random_lora(hf, seed=1)
    hf.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = hf(ids).logits
    keys = adapter_keys_and_shapes(tmp_path / "peft")
    assert keys["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"] == (2 * 8, 32)  # r*E, hidden

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=F64)
    with torch.no_grad():
        plain_logits = plain(ids).logits
        torch.testing.assert_close(PeftModel.from_pretrained(plain, tmp_path / "peft")(ids).logits, want, **HF_TOL)
    assert (want - plain_logits).abs().max() > 1e-1  # the adapter moves the logits far more than the tolerance

    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=F64), LoraConfig(**SETTINGS))
    random_lora(ours, seed=2)
    ours.save_pretrained(tmp_path / "ours")
    assert adapter_keys_and_shapes(tmp_path / "ours") == keys
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_parameters"] == EXPERTS
    with torch.no_grad():
        reloaded = peft.PeftModel.from_pretrained(transformers_fp64(base), tmp_path / "ours")
        torch.testing.assert_close(reloaded(ids).logits, ours(ids).logits, **HF_TOL)


def _trainer_worker(base_dir, adapter_dir, tmp) -> None:
    from tptrain.distributed import init_distributed
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    init_distributed()

    def load(ep: bool | None = None):
        config = None if ep is None else DistributedConfig(tp_size=2, enable_expert_parallel=ep)
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64, distributed_config=config)

    # Full fine-tuning at tp 2, experts split inside; resumed with the experts split by expert instead.
    args = training_args(f"{tmp}/full", max_steps=4, save_steps=2, parallelism_config=ParallelismConfig(tp_size=2))
    out = Trainer(model=load(False), args=args, train_dataset=tiny_dataset()).train()
    expected = reference_losses(load(), tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), **LOSS_TOL)
    again = Trainer(model=load(True), args=args, train_dataset=tiny_dataset()).train(
        resume_from_checkpoint=f"{tmp}/full/checkpoint-2")
    torch.testing.assert_close(torch.tensor(again.losses), torch.tensor(out.losses[2:]), **LOSS_TOL)

    # LoRA (peft's adapter) under expert parallelism, resumed from its DCP checkpoint.
    args = training_args(f"{tmp}/lora", max_steps=4, save_steps=2, parallelism_config=ParallelismConfig(tp_size=2))
    lora = Trainer(model=PeftModel.from_pretrained(load(True), adapter_dir, is_trainable=True), args=args,
                   train_dataset=tiny_dataset()).train()
    single = PeftModel.from_pretrained(load(), adapter_dir, is_trainable=True)
    expected = reference_losses(single, tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(lora.losses), torch.tensor(expected), **LOSS_TOL)
    again = Trainer(model=PeftModel.from_pretrained(load(True), adapter_dir, is_trainable=True), args=args,
                    train_dataset=tiny_dataset()).train(resume_from_checkpoint=f"{tmp}/lora/checkpoint-2")
    torch.testing.assert_close(torch.tensor(again.losses), torch.tensor(lora.losses[2:]), **LOSS_TOL)


@pytest.mark.distributed
def test_trainer_full_and_lora_at_tp2_equal_one_process_and_resume(base, tmp_path):
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=F64), LoraConfig(**SETTINGS))
    random_lora(adapter, seed=5)
    adapter.save_pretrained(tmp_path / "adapter")
    run_distributed(_trainer_worker, 2, base, tmp_path / "adapter", tmp_path, timeout=600)
