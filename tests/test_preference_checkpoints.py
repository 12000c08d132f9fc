"""A DPO run's checkpoints: resumed at another layout it continues as uninterrupted (a tp 2 run's checkpoint, resumed
on one process, the frozen reference loaded again); a LoRA DPO adapter trained at tp 2 loads in peft, and the model
merged at tp 2 (`--merge`'s final/merged) equals peft's merge_and_unload of that adapter."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.preference import checkpoint, plain_records
from tests.helpers.ranks import run_distributed

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-9, atol=1e-10)
OPTIM = dict(learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0,
             seed=3)


def _run(tmp: str, name: str, *, tp: int, resume: str | None = None, lora: bool = False) -> None:
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM
    from tptrain.peft import LoraConfig, get_peft_model
    from tptrain.training.preference import DPOConfig, DPOTrainer

    config = DistributedConfig(tp_size=tp) if tp > 1 else None
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64, distributed_config=config)
    if lora:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    args = DPOConfig(output_dir=f"{tmp}/{name}", per_device_train_batch_size=4, max_steps=4, max_length=32,
                     save_steps=2, data_cache_dir=f"{tmp}/cache", resume_from_checkpoint=resume, **OPTIM)
    trainer = DPOTrainer(model, args=args, train_dataset=plain_records(16))
    out = trainer.train()
    if lora:  # what `tptrain dpo --lora-r 4 --merge` writes after training
        trainer.model = trainer.model.merge_and_unload()
        trainer.save_model(f"{tmp}/{name}/final/merged")
    if torch.distributed.get_rank() == 0:
        json.dump(out.losses, open(f"{tmp}/{name}-{'resumed' if resume else 'losses'}.json", "w"))


def _worker(tmp: str, runs: list[dict]) -> None:
    for run in runs:
        _run(tmp, **run)


def test_resume_at_another_layout_and_the_lora_adapter_in_peft(tmp_path):
    import peft
    import transformers
    from safetensors.torch import load_file

    checkpoint(tmp_path / "ckpt")
    run_distributed(_worker, 2, str(tmp_path), [dict(name="full", tp=2), dict(name="lora", tp=2, lora=True)])
    run_distributed(_worker, 1, str(tmp_path), [dict(name="full", tp=1, resume=str(tmp_path / "full/checkpoint-2"))])
    losses = json.loads((tmp_path / "full-losses.json").read_text())
    resumed = json.loads((tmp_path / "full-resumed.json").read_text())
    assert len(losses) == 4 and len(resumed) == 2
    torch.testing.assert_close(resumed, losses[2:], **TOL)

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "lora/final/adapter")
    merged = adapted.merge_and_unload().state_dict()
    ours = load_file(tmp_path / "lora/final/merged/model.safetensors")
    assert set(ours) == set(merged)
    for key, value in merged.items():
        torch.testing.assert_close(ours[key], value, **TOL, msg=lambda m: f"{key}: {m}")
    trained = [k for k in ours if "q_proj" in k]
    base_weights = load_file(tmp_path / "ckpt/model.safetensors")
    assert any((ours[k] - base_weights[k]).abs().max() > 1e-4 for k in trained)  # DPO moved the adapters
