"""Train / eval mode as transformers hands it out: `from_pretrained` returns eval mode (dropout off), `from_config`
train mode; the Trainer runs each step in train mode and evaluates in eval mode.

    .venv/bin/python -m pytest tests/test_model_mode.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.configs import TRAINER_TINY as TINY
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.models import AutoConfig
from tptrain.training.trainer import Trainer


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY), dtype=torch.float64).save_pretrained(path)
    return path


def _modes(model: torch.nn.Module) -> set[bool]:
    return {m.training for m in model.modules()}


def test_from_pretrained_is_eval_and_from_config_train_as_in_transformers(qwen3_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert not hf.training and transformers.AutoModelForCausalLM.from_config(hf.config).training  # the oracle
    assert _modes(AutoModelForCausalLM.from_pretrained(qwen3_dir)) == {False}
    sharded = AutoModelForCausalLM.from_pretrained(qwen3_dir, distributed_config=DistributedConfig(tp_size=1))
    assert _modes(sharded) == {False}
    assert _modes(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(qwen3_dir))) == {True}


def test_transformers_backend_with_dropout_gives_transformers_eval_logits(tmp_path):
    """seed_oss has attention and residual dropout 0.1 in its config: in train mode every forward differs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("seed_oss", **{**TINY, "attention_dropout": 0.1,
                                                               "residual_dropout": 0.1})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.backend == "transformers" and not model.training and not model.hf_model.training
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-6, atol=1e-6)
        assert not torch.equal(model.train()(ids).logits, model(ids).logits)  # the dropout is there: train mode


def test_trainer_steps_in_train_mode_and_evaluates_in_eval_mode(qwen3_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float64)
    seen = []  # (train mode, grad enabled) of each forward
    model.register_forward_pre_hook(lambda m, args: seen.append((m.training, torch.is_grad_enabled())))
    args = training_args(tmp_path, max_steps=2, save_steps=0, eval_steps=1, eval_split=0.25)
    Trainer(model=model, args=args, train_dataset=tiny_dataset(16)).train()
    steps, evals = [t for t, grad in seen if grad], [t for t, grad in seen if not grad]
    assert len(steps) == 2 and len(evals) >= 2, seen  # one forward per step; the eval set after each step
    assert all(steps) and not any(evals), seen
