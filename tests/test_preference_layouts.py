"""DPO at every layout equals one process (fp64): tp 2, tp 2 x dp 2 (FSDP2, with sequence parallelism), cp 2, pp 2
(whole pairs per microbatch), LoRA at tp 2 (the reference: the adapters off), precompute_ref_log_probs at tp 2
(no reference held: the same run as one process's frozen copy) and a mixture-of-experts model with expert
parallelism (its router aux loss in the objective). Each step's loss, TRL's reward metrics, every
gradient (gathered before each of the 3 AdamW steps) and every parameter after them."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.preference import checkpoint, load_at_layout, plain_records, train_and_save
from tests.helpers.ranks import run_distributed

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-9, atol=1e-10)
OPTIM = dict(learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, seed=3)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
# name: (DistributedConfig, ParallelismConfig, per-device pairs, DPOConfig options, LoRA)
RUNS = {
    "one": (dict(), dict(), 4, dict(), False),
    "one_lora": (dict(), dict(), 4, dict(), True),
    "tp2": (dict(tp_size=2), dict(), 4, dict(), False),
    "tp2_precompute": (dict(tp_size=2), dict(), 4, dict(precompute_ref_log_probs=True), False),
    "tp2_lora": (dict(tp_size=2), dict(), 4, dict(), True),
    "cp2": (dict(cp_size=2), dict(), 4, dict(), False),
    "pp2": (dict(pp_size=2), dict(pp_microbatches=2), 4, dict(), False),
    "tp2_dp2_sp": (dict(tp_size=2, enable_sequence_parallel=True), dict(dp_shard_size=2), 2, dict(), False),
    # Qwen3-MoE, its router aux loss on: the experts split by expert over the two ranks (ep = tp)
    "moe_one": (dict(), dict(), 4, dict(), False),
    "moe_ep2": (dict(tp_size=2, enable_expert_parallel=True), dict(), 4, dict(), False),
}


def _run(tmp: str, name: str) -> None:
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.preference import DPOConfig, DPOTrainer

    layout, parallel, batch, options, lora = RUNS[name]
    model = load_at_layout(tmp, name, layout, LORA if lora else None)
    args = DPOConfig(output_dir=f"{tmp}/{name}", per_device_train_batch_size=batch, max_steps=3, max_length=32,
                     beta=0.5, data_cache_dir=f"{tmp}/cache", parallelism_config=ParallelismConfig(**parallel),
                     **OPTIM, **options)
    train_and_save(DPOTrainer(model, args=args, train_dataset=plain_records(12)), tmp, name)


def _worker(tmp: str, names: list[str]) -> None:
    for name in names:
        _run(tmp, name)


def _merged(tmp_path, name: str) -> dict:
    """Every rank's tensors merged (a pipeline's stages hold different parameters)."""
    out = {"grads": [{}, {}, {}], "params": {}}
    for path in sorted(tmp_path.glob(f"{name}-*.pt")):
        part = torch.load(path)
        for step, grads in enumerate(part["grads"]):
            out["grads"][step].update(grads)
        out["params"].update(part["params"])
    return out


def _metrics(tmp_path, name: str) -> list[dict]:
    keep = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "num_tokens")
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in keep} for line in lines]


def _assert_equal(tmp_path, name: str, ref: str) -> None:
    torch.testing.assert_close(json.loads((tmp_path / f"{name}.json").read_text()),
                               json.loads((tmp_path / f"{ref}.json").read_text()), **TOL)
    for got, want in zip(_metrics(tmp_path, name), _metrics(tmp_path, ref), strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name} metrics: {m}")
    got, want = _merged(tmp_path, name), _merged(tmp_path, ref)
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
    run_distributed(_worker, 2, str(tmp_path), ["tp2", "tp2_precompute", "tp2_lora", "cp2", "pp2", "moe_ep2"])
    run_distributed(_worker, 4, str(tmp_path), ["tp2_dp2_sp"])
    for name in ("tp2", "tp2_precompute", "cp2", "pp2", "tp2_dp2_sp"):
        _assert_equal(tmp_path, name, "one")
    _assert_equal(tmp_path, "tp2_lora", "one_lora")
    _assert_equal(tmp_path, "moe_ep2", "moe_one")
    # the policies moved away from their references (the rewards are 0 at the first step only)
    for name in ("one", "one_lora", "moe_one"):
        first, last = _metrics(tmp_path, name)[0], _metrics(tmp_path, name)[-1]
        assert first["rewards/chosen"] == 0.0 and abs(last["rewards/chosen"]) > 1e-3, (name, first, last)
