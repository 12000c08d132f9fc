"""The transformers backend under tptrain's training stack, on StarCoder2 (no native family): the Trainer with
resumable checkpoints against single-device training, LoRA whose adapter loads in peft, and `tptrain train`.

    .venv/bin/python -m pytest tests/test_hf_training.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed

F64 = torch.float64
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' norms run in fp32 even in fp64 (see test_hf_backend.py)


CHECKPOINTS = TransformersCheckpoints({"starcoder2": ("starcoder2", TINY)})  # every parameter random


def _trainer_and_lora_worker(path, tmp) -> None:
    from tptrain.peft import LoraConfig, get_peft_model
    config = DistributedConfig(tp_size=2)
    args = training_args(f"{tmp}/run", max_steps=6, save_steps=3, parallelism_config=ParallelismConfig(tp_size=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config)
    out = Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()
    expected = reference_losses(AutoModelForCausalLM.from_pretrained(path, dtype=F64), tiny_dataset(), args,
                                global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), **TOL)
    again = Trainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config),
                    args=args, train_dataset=tiny_dataset()).train(resume_from_checkpoint=f"{tmp}/run/checkpoint-3")
    assert again.losses == out.losses[3:], (again.losses, out.losses)  # resumed: bit for bit

    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config),
                          LoraConfig(r=4, lora_alpha=16, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    ids, labels = batch(seed=4)
    for _ in range(2):
        lora(ids, labels=labels).loss.backward()
        opt.step(), opt.zero_grad()
    lora.save_pretrained(f"{tmp}/adapter")
    lora.eval()
    with torch.no_grad():
        logits = lora(batch()[0]).logits
    if torch.distributed.get_rank() == 0:
        torch.save({"final": str(out.final_dir), "lora_logits": logits, "trained": expected}, f"{tmp}/out.pt")


def test_trainer_resume_and_lora_adapter_for_peft(checkpoint, tmp_path):
    import peft
    import transformers
    run_distributed(_trainer_and_lora_worker, 2, checkpoint, tmp_path, timeout=600)
    out = torch.load(tmp_path / "out.pt")
    # The Trainer's consolidated checkpoint is a transformers StarCoder2 checkpoint.
    final = transformers.AutoModelForCausalLM.from_pretrained(out["final"], dtype=F64)
    assert type(final).__name__ == "Starcoder2ForCausalLM"
    # The adapter tptrain trained at tp 2 loads in peft on transformers' model and gives tptrain's logits.
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=F64).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    with torch.no_grad():
        adapted = with_adapter(batch()[0]).logits
        torch.testing.assert_close(adapted, out["lora_logits"], **TOL)
        with with_adapter.disable_adapter():
            assert (adapted - with_adapter(batch()[0]).logits).abs().max() > 1e-3  # the adapter was trained


def test_tptrain_train_on_a_transformers_model(tmp_path):
    """`tptrain train` (its 2-rank launcher) initialises a StarCoder2 config at random and trains it."""
    model_dir = tmp_path / "starcoder2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "starcoder2", **TINY, "vocab_size": 4096,
                                                       "max_position_embeddings": 256, "eos_token_id": 0}))
    run = tptrain_train("--model", str(model_dir), "--output-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stdout + run.stderr
    import transformers
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert type(final).__name__ == "Starcoder2ForCausalLM"
    assert "greedy continuation" in run.stdout
