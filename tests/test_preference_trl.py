"""tptrain's DPOTrainer on one process equals TRL 1.16: its DPOTrainer for every loss type (alone, and all of them
weighted in one list), rpo_alpha (TRL's "sft" term), conversational and implicit-prompt records, truncation; SimPO and
ORPO as trl.experimental's CPOTrainer and ORPOTrainer; reference_free as CPO's reference-free sigmoid. Same checkpoint
(written by transformers), data, batch (every pair each step, so no data order enters) and AdamW.

TRL's fused head computes its log-softmax statistics in fp32 even for an fp64 model and logs float32 values, so the
losses, gradient norms and TRL's metrics agree to ~1e-7 relative at the first step (~1e-5 after), and the parameters
after 3 AdamW steps (which normalise each gradient entry, amplifying rounding in the smallest ones) to 1e-5 on average,
1e-3 at most; a wrong term or scale is O(1)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.preference import OPTIM, chat_records, checkpoint, plain_records, trl_run
from tests.helpers.ranks import run_distributed

pytestmark = pytest.mark.distributed

LOGGED = dict(rtol=2e-6, atol=2e-6)  # TRL logs float32 values: step 1, from the same weights
# later steps start from weights 3 AdamW-normalised float32 roundings apart, which a steep loss (sppo_hard's squares,
# forward_kl's exp) carries to ~1e-5 relative
LATER = dict(rtol=1e-4, atol=1e-5)
# lr 1e-2: a wrong update is O(1e-2) in most entries; AdamW normalises each entry's gradient, so an entry whose
# gradient is near 0 turns TRL's float32 rounding into up to ~5e-4 (a few entries of a steep loss: forward_kl's)
PARAMS = dict(rtol=0.0, atol=1e-3)
PARAMS_MEAN = 1e-5  # the mean |difference| of every tensor
EVERY_DPO_TYPE = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sft", "sigmoid_norm"]
WEIGHTS = [1.0, 0.3, 0.7, 0.5, 0.2, 0.9, 0.4, 0.05, 0.6, 0.8, 0.35, 0.15, 0.45]

# name: (records, TRL trainer and options, tptrain's DPOConfig options)
CASES = {
    "every_type": ("plain", dict(loss_type=EVERY_DPO_TYPE, loss_weights=WEIGHTS, label_smoothing=0.1),
                   dict(loss_type=EVERY_DPO_TYPE, loss_weights=WEIGHTS, label_smoothing=0.1)),
    "rpo_chat_implicit": ("chat_implicit", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], max_length=40),
                          dict(loss_type="sigmoid", rpo_alpha=0.5, max_length=40)),
    "simpo": ("plain", dict(trainer="cpo", loss_type="simpo"), dict(loss_type="simpo")),
    "orpo": ("plain", dict(trainer="orpo"), dict(loss_type="orpo")),
    "reference_free": ("plain", dict(trainer="cpo", loss_type="sigmoid", cpo_alpha=0.0),
                       dict(loss_type="sigmoid", reference_free=True)),
}
SLOW_CASES = {  # each loss type alone, and the f-divergences
    **{name: ("plain", dict(loss_type=[name], label_smoothing=0.1), dict(loss_type=name, label_smoothing=0.1))
       for name in EVERY_DPO_TYPE},
    **{f"sigmoid_{f}": ("chat", dict(loss_type=["sigmoid", "ipo"], f_divergence_type=f),
                        dict(loss_type=["sigmoid", "ipo"], f_divergence_type=f))
       for f in ("forward_kl", "js_divergence")},
}


def _records(kind: str) -> list[dict]:
    if kind == "plain":
        return plain_records(4)
    records = chat_records(4)
    if kind == "chat_implicit":  # the prompt implicit: chosen and rejected are whole conversations
        return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records]
    return records


def _tptrain_runs(tmp: str, cases: dict) -> None:
    from tptrain.models import AutoModelForCausalLM
    from tptrain.training.preference import DPOConfig, DPOTrainer

    for name, (kind, _, options) in cases.items():
        model = AutoModelForCausalLM.from_pretrained(f"{tmp}/ckpt", dtype=torch.float64)
        options = {"max_length": 64, **options}
        args = DPOConfig(output_dir=f"{tmp}/{name}", per_device_train_batch_size=4, max_steps=3,
                         data_cache_dir=f"{tmp}/cache", **OPTIM, **options)
        trainer = DPOTrainer(model, args=args, train_dataset=_records(kind))
        trainer.train()
        torch.save({n: p.detach() for n, p in trainer.inner.named_parameters()}, f"{tmp}/{name}.pt")


def _compare(tmp_path, cases: dict) -> None:
    model_dir = checkpoint(tmp_path / "ckpt")
    run_distributed(_tptrain_runs, 1, str(tmp_path), cases)
    for name, (kind, trl_options, _) in cases.items():
        trl_options = {"max_length": 64, **trl_options}
        expected = trl_run(model_dir, tmp_path / f"trl_{name}", _records(kind), **trl_options)
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == len(expected["logs"]) == 3, name
        for got, want in zip(lines, expected["logs"]):
            for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                        "rewards/margins", "logps/chosen", "logps/rejected"):
                torch.testing.assert_close(got[key], want[key], **(LOGGED if got["step"] == 1 else LATER),
                                           msg=lambda m: f"{name} step {got['step']} {key}: {m}")
        params = torch.load(tmp_path / f"{name}.pt")
        for key, want in expected["params"].items():
            torch.testing.assert_close(params[key], want, **PARAMS, msg=lambda m: f"{name} {key} after 3 steps: {m}")
            assert (params[key] - want).abs().mean() < PARAMS_MEAN, (name, key)


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_equals_trl(tmp_path, name):
    _compare(tmp_path, {name: CASES[name]})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_each_loss_type_equals_trl(tmp_path, name):
    _compare(tmp_path, {name: SLOW_CASES[name]})
