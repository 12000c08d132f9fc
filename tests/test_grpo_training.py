"""GRPO end to end on one process: on a toy verifiable task (the share of a completion's characters that are the
letter e) the bundled tiny Qwen3's mean reward rises over a short run; a checkpoint resumed continues as the
uninterrupted run (the prompt order and the generation seeds are the run's state); chat prompts and dataset columns
reach the reward functions; each completion's draws are its own (a row's completion does not depend on its batch)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.grpo import bundled_model, letter_e, metrics, prompt_records

pytestmark = pytest.mark.distributed

TOY = dict(num_generations=8, per_device_train_batch_size=32, max_completion_length=8, learning_rate=2e-2,
           lr_scheduler_type="constant", logging_steps=1, seed=1)


def _toy(tmp: str, steps: int) -> None:
    from tptrain import GRPOConfig, GRPOTrainer

    model, tokenizer = bundled_model()
    args = GRPOConfig(output_dir=tmp, max_steps=steps, **TOY)
    GRPOTrainer(model, letter_e, args=args, train_dataset=prompt_records(16), tokenizer=tokenizer).train()


def test_mean_reward_rises_on_a_toy_task(tmp_path):
    steps = 15
    run_distributed(_toy, 1, str(tmp_path), steps)
    rewards = [line["reward"] for line in metrics(tmp_path)]
    print(rewards)
    assert len(rewards) == steps
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > 1.5 * first, rewards


def _resumable(tmp: str, name: str, tp: int, resume: str | None) -> None:
    import json

    from tptrain import DistributedConfig, GRPOConfig, GRPOTrainer
    from tptrain.models import AutoModelForCausalLM
    from tests.helpers.grpo import short

    config = DistributedConfig(tp_size=tp) if tp > 1 else None
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64, distributed_config=config)
    args = GRPOConfig(output_dir=f"{tmp}/{name}", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, num_iterations=2, beta=0.04, max_steps=6, save_steps=2,
                      learning_rate=1e-2, seed=3, resume_from_checkpoint=resume)
    out = GRPOTrainer(model, [letter_e, short], args=args, train_dataset=prompt_records(6)).train()
    if torch.distributed.get_rank() == 0:
        json.dump(out.losses, open(f"{tmp}/{name}-{'resumed' if resume else 'losses'}.json", "w"))


def test_resume_continues_as_the_uninterrupted_run_at_another_layout(tmp_path):
    """A tp 2 run's checkpoint after 2 steps, resumed on one process: the prompt order (an epoch of 3 steps' prompts
    is crossed), the batch served num_iterations times and the generation seeds continue, so the 4 steps after it
    equal the uninterrupted run's."""
    import json

    from tests.helpers.preference import checkpoint

    checkpoint(tmp_path / "ckpt")
    run_distributed(_resumable, 2, str(tmp_path), "run", 2, None)
    run_distributed(_resumable, 1, str(tmp_path), "run", 1, str(tmp_path / "run/checkpoint-2"))
    losses = json.loads((tmp_path / "run-losses.json").read_text())
    resumed = json.loads((tmp_path / "run-resumed.json").read_text())
    assert len(losses) == 6 and len(resumed) == 4 and len(set(losses)) > 3
    torch.testing.assert_close(resumed, losses[2:], rtol=1e-9, atol=1e-10)


def _chat(tmp: str) -> None:
    import json

    from tptrain import GRPOConfig, GRPOTrainer
    from tptrain.models import AutoModelForCausalLM

    seen = {}

    def reads_everything(prompts, completions, completion_ids, target, **columns):
        seen.update(prompt=prompts[0], completion=completions[0], target=target, ids=completion_ids[0])
        return [1.0] * len(completions)

    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64)
    args = GRPOConfig(output_dir=f"{tmp}/chat", per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=5, max_steps=1)
    GRPOTrainer(model, reads_everything, args=args, train_dataset=prompt_records(4, chat=True)).train()
    json.dump({k: v for k, v in seen.items()}, open(f"{tmp}/seen.json", "w"))


def test_chat_prompts_and_columns_reach_the_reward_functions(tmp_path):
    import json

    from tests.helpers.preference import checkpoint

    checkpoint(tmp_path / "ckpt")
    run_distributed(_chat, 1, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["prompt"][0]["role"] == "user" and isinstance(seen["prompt"][0]["content"], str)
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    assert len(seen["target"]) == 4 and seen["target"][0] == seen["target"][1]  # each prompt's row, per completion
    assert 1 <= len(seen["ids"]) <= 5


def test_each_row_draws_its_own_completion():
    """generate with one seed per returned sequence: a row's completion is the same alone or batched with others."""
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tests.helpers.grpo import BUNDLED

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED)).double()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    both = model.generate(ids, max_new_tokens=6, do_sample=True, generator=[11, 12, 13, 14], num_return_sequences=2,
                          eos_token_id=None, pad_token_id=0)
    alone = model.generate(ids[1:], max_new_tokens=6, do_sample=True, generator=[13, 14], num_return_sequences=2,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(both[2:], alone) and not torch.equal(both[2], both[3])
    with pytest.raises(ValueError, match="one per returned sequence: 4, got 3"):
        model.generate(ids, max_new_tokens=2, do_sample=True, generator=[1, 2, 3], num_return_sequences=2)
