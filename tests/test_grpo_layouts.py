"""GRPO at every layout it generates on equals one process (fp64): tp 2, tp 2 x dp 2 (FSDP2: each dp rank generates
its own prompts' groups), LoRA at tp 2 (the KL's reference: the adapters off) and a Qwen3-MoE with expert parallelism
(its router aux loss in the objective). The same completions are sampled
at every layout (each completion's draws its own seed), so each step's loss, TRL's metrics, every gradient
(gathered before each of the 3 AdamW steps) and every parameter after them agree. The runs read old log-probs
(num_iterations 2: the second step trains on the first step's completions) and a KL to the reference (beta > 0: a
frozen copy for a full fine-tune)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.grpo import letter_e, metrics, prompt_records, short
from tests.helpers.preference import checkpoint, load_at_layout, train_and_save

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-9, atol=1e-10)
OPTIM = dict(learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, seed=3)
GRPO = dict(num_generations=4, max_completion_length=6, beta=0.04, num_iterations=2, epsilon_high=0.28,
            reward_weights=[1.0, 0.5], max_steps=3, logging_steps=1)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
# name: (DistributedConfig, ParallelismConfig, per-device completions, LoRA)
RUNS = {
    "one": (dict(), dict(), 8, False),
    "one_lora": (dict(), dict(), 8, True),
    "tp2": (dict(tp_size=2), dict(), 8, False),
    "tp2_lora": (dict(tp_size=2), dict(), 8, True),
    "tp2_dp2": (dict(tp_size=2), dict(dp_shard_size=2), 4, False),
    # Qwen3-MoE, its router aux loss in the objective: the experts split by expert over the two ranks (ep = tp)
    "moe_one": (dict(), dict(), 8, False),
    "moe_ep2": (dict(tp_size=2, enable_expert_parallel=True), dict(), 8, False),
}
LOGGED = ("loss", "grad_norm", "reward", "reward_std", "rewards/letter_e/mean", "rewards/short/mean", "kl",
          "clip_ratio/region_mean", "completions/mean_length", "num_tokens")


def _run(tmp: str, name: str) -> None:
    from tptrain import GRPOConfig, GRPOTrainer
    from tptrain.training.args import ParallelismConfig

    layout, parallel, batch, lora = RUNS[name]
    model = load_at_layout(tmp, name, layout, LORA if lora else None)
    args = GRPOConfig(output_dir=f"{tmp}/{name}", per_device_train_batch_size=batch,
                      parallelism_config=ParallelismConfig(**parallel), **OPTIM, **GRPO)
    train_and_save(GRPOTrainer(model, [letter_e, short], args=args, train_dataset=prompt_records(8)), tmp, name)


def _worker(tmp: str, names: list[str]) -> None:
    for name in names:
        _run(tmp, name)


def _logged(tmp_path, name: str) -> list[dict]:
    return [{k: v for k, v in line.items() if k in LOGGED} for line in metrics(tmp_path / name)]


def _assert_equal(tmp_path, name: str, ref: str) -> None:
    torch.testing.assert_close(json.loads((tmp_path / f"{name}.json").read_text()),
                               json.loads((tmp_path / f"{ref}.json").read_text()), **TOL)
    for got, want in zip(_logged(tmp_path, name), _logged(tmp_path, ref), strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name} metrics: {m}")
    got, want = torch.load(tmp_path / f"{name}-0.pt"), torch.load(tmp_path / f"{ref}-0.pt")
    for step in range(3):
        assert set(got["grads"][step]) == set(want["grads"][step]), name
        for key, g in want["grads"][step].items():
            torch.testing.assert_close(got["grads"][step][key], g, **TOL, msg=lambda m: f"{name} step {step} {key}: {m}")
    for key, p in want["params"].items():
        torch.testing.assert_close(got["params"][key], p, **TOL, msg=lambda m: f"{name} {key} after 3 steps: {m}")


def test_every_layout_equals_one_process(tmp_path):
    checkpoint(tmp_path / "ckpt")
    checkpoint(tmp_path / "moe", moe=True)
    run_distributed(_worker, 1, str(tmp_path), ["one", "one_lora", "moe_one"])
    run_distributed(_worker, 2, str(tmp_path), ["tp2", "tp2_lora", "moe_ep2"])
    run_distributed(_worker, 4, str(tmp_path), ["tp2_dp2"])
    for name in ("tp2", "tp2_dp2"):
        _assert_equal(tmp_path, name, "one")
    _assert_equal(tmp_path, "tp2_lora", "one_lora")
    _assert_equal(tmp_path, "moe_ep2", "moe_one")
    for name in ("one", "one_lora"):  # the runs did something: a KL away from the reference, clipped ratios
        lines = metrics(tmp_path / name)
        assert lines[0]["kl"] == 0.0 and lines[1]["kl"] > 0 and lines[1]["clip_ratio/region_mean"] > 0, lines
        assert all(abs(line["loss"]) > 0 or line["step"] == 1 for line in lines), lines
