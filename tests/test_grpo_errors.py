"""GRPO's bad inputs, each a clear error before training naming the function, row or setting: a reward function
that raises, returns the wrong count or a non-number; num_generations below 2 or not dividing a rank's batch; a
prompt longer than max_prompt_length (refused, not cut); max_completion_length past the model's positions;
stop_strings without a tokenizer; an unknown module:function; and the options GRPOConfig checks."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.grpo import letter_e, prompt_records
from tptrain.training.rl.prompts import build_prompts
from tptrain.training.rl.rewards import advantages, load_reward_func, load_reward_funcs, score


class _Chars:
    eos_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]


def _config(**options):
    from tptrain import GRPOConfig

    return GRPOConfig(**{"output_dir": "unused", "per_device_train_batch_size": 8, "num_generations": 4, **options})


@pytest.mark.parametrize("options, message", [
    (dict(num_generations=1), r"num_generations must be an int >= 2"),
    (dict(num_generations=3), r"num_generations=3 does not divide .* 8"),
    (dict(loss_type="ppo"), r"loss_type 'ppo' is not one of dapo, grpo, dr_grpo, bnpo, cispo"),
    (dict(scale_rewards="groups"), r"scale_rewards 'groups'"),
    (dict(temperature=0.0), r"temperature must be > 0"),
    (dict(top_p=0.0), r"top_p in \(0, 1\]"),
    (dict(max_completion_length=0), r"max_completion_length must be an int >= 1"),
    (dict(stop_strings="###"), r"stop_strings must be a list"),
    (dict(beta=-1.0), r"beta, epsilon and epsilon_high must be >= 0"),
])
def test_config_refuses(options, message):
    with pytest.raises(ValueError, match=message):
        _config(**options)


def test_config_takes_trl_spellings():
    args = _config(scale_rewards=False, epsilon=0.3, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert args.scale_rewards == "none" and args.upper_epsilon == 0.3 and args.loss_type == "dapo"
    assert args.learning_rate == 1e-6 and args.beta == 0.0 and args.num_generations == 4


def _raises(prompts, completions, **kw):
    raise KeyError("answer")


def _two(prompts, completions, **kw):
    return [1.0, 2.0]


def _text(prompts, completions, **kw):
    return ["1.0"] * len(completions)


def _nan(prompts, completions, **kw):
    return [math.nan] * len(completions)


@pytest.mark.parametrize("func, message", [
    (_raises, r"reward function '_raises' raised KeyError: 'answer' \(called with 3 completions"),
    (_two, r"reward function '_two' returned 2 rewards for 3 completions"),
    (_text, r"reward function '_text' returned '1.0' for completion 0; return a finite number"),
    (_nan, r"reward function '_nan' returned nan for completion 0"),
])
def test_reward_function_errors_name_the_function(func, message):
    with pytest.raises(ValueError, match=message):
        score([func], ["p"] * 3, ["a", "b", "c"], [[1], [2], [3]], {})


def test_none_is_not_scored_and_advantages_are_trls():
    def partial(prompts, completions, **kw):
        return [None, 1.0, 0.0, None]

    rewards = score([partial], ["p"] * 4, list("abcd"), [[1]] * 4, {})
    assert math.isnan(rewards[0, 0]) and rewards[1, 0] == 1.0
    adv = advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), group=2, scale="group")
    std = torch.tensor([1.0, 3.0]).std()
    torch.testing.assert_close(adv, torch.tensor([-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0, 0.0]))
    torch.testing.assert_close(advantages(torch.tensor([1.0, 3.0]), group=2, scale="none"), torch.tensor([-1.0, 1.0]))


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
    ("math:no_such_function", r"module 'math' .* has no function 'no_such_function'"),
    ("letter_e", r"give a callable or 'module:function'"),
])
def test_unknown_reward_function(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_func(spec)


def test_reward_functions_load_from_a_module_or_a_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def five(prompts, completions, **kw):\n    return [5.0] * len(completions)\n")
    func = load_reward_func(f"{tmp_path}/my_rewards.py:five")
    assert func(prompts=["p"], completions=["c"]) == [5.0]
    assert load_reward_funcs(["tests.helpers.grpo:letter_e"])[0] is letter_e
    with pytest.raises(ValueError, match="at least one reward function"):
        load_reward_funcs([])


def test_prompt_rows_refused_with_their_place(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "short"}\n{"prompt": "a much longer prompt than that"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl line 2: the prompt has 30 tokens, more than "
                                         r"max_prompt_length=10 .* refused, not cut"):
        build_prompts(str(path), _Chars(), model_dir=None, max_prompt_length=10)
    with pytest.raises(ValueError, match=r"record 1: a GRPO record needs a \"prompt\" field"):
        build_prompts([{"prompt": "a"}, {"question": "b"}], _Chars(), model_dir=None)
    with pytest.raises(ValueError, match=r"mixes plain-text and conversational prompts"):
        build_prompts([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}], _Chars(), model_dir=None)
    data = build_prompts([{"prompt": "ab", "answer": 3}], _Chars(), model_dir=None, max_prompt_length=2)
    assert data[0] == {"prompt": "ab", "prompt_ids": [97, 98], "columns": {"answer": 3}}


def _trainer_errors(tmp: str) -> None:
    from tptrain import GRPOTrainer
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tests.helpers.grpo import BUNDLED, bundled_model

    def expect(message, **kwargs):
        model = kwargs.pop("model", None) or AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64)
        options = {"output_dir": f"{tmp}/run", "max_steps": 1, **kwargs.pop("options", {})}
        with pytest.raises(ValueError, match=message):
            GRPOTrainer(model, kwargs.pop("funcs", letter_e), args=_config(**options),
                        train_dataset=prompt_records(4), **kwargs)

    expect(r"max_completion_length=125 after the longest prompt of .* \(record \d+, \d+ tokens\) reaches \d+ "
           r"positions, past the model's max_position_embeddings=128", options=dict(max_completion_length=125))
    expect(r"GRPOConfig: max_prompt_length=8 \+ max_completion_length=121 reach 129 positions, past the model's "
           r"max_position_embeddings=128", options=dict(max_completion_length=121, max_prompt_length=8))
    no_tokenizer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED))
    expect(r"stop_strings=\['###'\] need the model's tokenizer", model=no_tokenizer,
           options=dict(stop_strings=["###"]))
    expect(r"beta=0.1 needs a reference model, and this model has no checkpoint", model=bundled_model()[0],
           tokenizer=bundled_model()[1], options=dict(beta=0.1))
    expect(r"reward_weights has 2 weights for 1 reward functions", options=dict(reward_weights=[1.0, 2.0]))
    expect(r"cannot import module 'nope'", funcs="nope:f")

    def raises(prompts, completions, **kw):
        raise RuntimeError("no answer column")

    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64)
    trainer = GRPOTrainer(model, raises, args=_config(output_dir=f"{tmp}/run2", max_steps=1, max_completion_length=3),
                          train_dataset=prompt_records(4))
    with pytest.raises(ValueError, match=r"reward function 'raises' raised RuntimeError: no answer column"):
        trainer.train()


@pytest.mark.distributed
def test_trainer_refuses_before_training(tmp_path):
    from tests.helpers.preference import checkpoint

    checkpoint(tmp_path / "ckpt")
    run_distributed(_trainer_errors, 1, str(tmp_path))


def _raises_on_one_rank(tmp: str) -> None:
    import torch.distributed as dist

    from tptrain import GRPOTrainer
    from tptrain.models import AutoModelForCausalLM
    from tptrain.training.args import ParallelismConfig

    def only_rank_1(prompts, completions, **kw):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1's reward failed")
        return [0.0] * len(completions)

    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64)
    args = _config(output_dir=f"{tmp}/run", max_steps=1, max_completion_length=3, per_device_train_batch_size=4,
                   parallelism_config=ParallelismConfig(dp_shard_size=2))
    trainer = GRPOTrainer(model, only_rank_1, args=args, train_dataset=prompt_records(4))
    with pytest.raises(ValueError, match=r"reward function 'only_rank_1' raised RuntimeError: rank 1's reward"):
        trainer.train()


@pytest.mark.distributed
def test_a_reward_error_on_one_dp_rank_reaches_every_rank(tmp_path):
    from tests.helpers.preference import checkpoint

    checkpoint(tmp_path / "ckpt")
    run_distributed(_raises_on_one_rank, 2, str(tmp_path))


def test_prompts_from_a_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"prompt": "ab", "answer": "x"}, {"prompt": "cde", "answer": "y"}])
    data = build_prompts(rows, _Chars(), model_dir=None)
    assert len(data) == 2 and data[1]["prompt_ids"] == [99, 100, 101] and data[1]["columns"] == {"answer": "y"}
    assert data.longest == 3 and not data.conversational


@pytest.mark.parametrize("option", [dict(eval_steps=5), dict(eval_split=0.1), dict(save_best=True), "eval_dataset"])
def test_the_workflows_refuse_evaluation_before_anything(tmp_path, option):
    """GRPOTrainer and DPOTrainer evaluate no held-out set: every eval option is refused, naming the flags, before
    the model or the data is read."""
    from tests.helpers.grpo import bundled_model
    from tptrain import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    model, _ = bundled_model()
    options = {} if option == "eval_dataset" else option
    extra = {"eval_dataset": prompt_records(2)} if option == "eval_dataset" else {}
    with pytest.raises(ValueError, match=r"GRPOTrainer evaluates no held-out set yet: .*--eval-steps"):
        GRPOTrainer(model, letter_e, args=GRPOConfig(output_dir=str(tmp_path / "g"), **options),
                    train_dataset=prompt_records(2), **extra)
    with pytest.raises(ValueError, match=r"DPOTrainer evaluates no held-out set yet: .*--eval-steps"):
        DPOTrainer(model, args=DPOConfig(output_dir=str(tmp_path / "d"), **options),
                   train_dataset=[{"prompt": "a", "chosen": "b", "rejected": "c"}], **extra)
