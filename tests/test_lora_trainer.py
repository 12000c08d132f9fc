"""The Trainer on a LoRA-adapted TP model: the single-device LoRA curve, adapter-only optimizer state,
resumable checkpoints, and a PEFT-format adapter at the end (fp64, 2 ranks)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.distributed import init_distributed
from tptrain.peft import LoraConfig, PeftModel, get_peft_model
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


def _randomize(peft: PeftModel) -> None:
    # peft's init zeroes B, which would leave half the adapter gradients trivially equal.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)


def _lora_trainer_worker(tmp: str) -> None:
    init_distributed()
    base = tiny_model()
    single = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomize(single)
    if torch.distributed.get_rank() == 0:
        single.save_pretrained(f"{tmp}/init_adapter")
    torch.distributed.barrier()

    def tp_peft() -> PeftModel:
        model = copy.deepcopy(base).parallelize(DistributedConfig(tp_size=2))
        return PeftModel.from_pretrained(model, f"{tmp}/init_adapter", is_trainable=True)

    args = training_args(f"{tmp}/run", max_steps=6, save_steps=3,
                         parallelism_config=ParallelismConfig(tp_size=2))
    trainer = Trainer(model=tp_peft(), args=args, train_dataset=tiny_dataset())
    out = trainer.train()
    expected = reference_losses(single, tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)
    # Frozen base: optimizer state exists only for adapter factors.
    trainable = {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    assert trainable and set(map(id, trainer.optimizer.state)) == trainable
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if ".lora_" not in n)

    again = Trainer(model=tp_peft(), args=args, train_dataset=tiny_dataset()).train(
        resume_from_checkpoint=f"{tmp}/run/checkpoint-3")
    assert again.losses == out.losses[3:], (again.losses, out.losses)

    # The final save is the adapter in PEFT format, equal to the single-device trained adapter.
    assert (out.final_dir / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), out.final_dir)
    trained = dict(single.named_parameters())
    for name, p in reloaded.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(p, trained[name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_trainer_trains_and_resumes_a_tp_lora_model(tmp_path):
    run_distributed(_lora_trainer_worker, 2, str(tmp_path))
