"""Preference data: records tokenized as TRL 1.16's DPOTrainer tokenizes them (plain, conversational, implicit prompt),
truncation, the token cache, the collator's order; and every bad input refused with the file, line and field named,
before any worker starts (`tptrain dpo` exits 2)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.chat import chat_checkpoint
from tests.helpers.preference import chat_records, checkpoint, plain_records
from tptrain.losses import IGNORE_INDEX
from tptrain.text import load_tokenizer
from tptrain.training.preference import DPOConfig
from tptrain.training.preference.data import build_preference_data, collate_pairs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("pref") / "ckpt")


def _trl_rows(ckpt, records: list[dict]) -> list[dict]:
    """TRL 1.16's tokenization of the records (DPOTrainer._prepare_dataset), without training."""
    import datasets
    import transformers
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer as TRLTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    trainer = TRLTrainer.__new__(TRLTrainer)
    trainer._tokenizer = tokenizer
    args = TRLConfig(output_dir="unused", max_length=None, report_to=[], use_cpu=True, bf16=False)
    return list(trainer._prepare_dataset(datasets.Dataset.from_list(records), tokenizer, args, "train"))


@pytest.mark.parametrize("kind", ["plain", "chat", "chat_implicit", "plain_implicit"])
def test_rows_equal_trl_tokenization(ckpt, kind, tmp_path):
    records = plain_records(6) if kind.startswith("plain") else chat_records(6)
    if kind.endswith("implicit"):
        records = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records]
    data = build_preference_data(records, load_tokenizer(ckpt), model_dir=ckpt, max_length=None)
    for i, want in enumerate(_trl_rows(ckpt, records)):
        for key in ("chosen", "rejected"):
            row = data[i][key]
            ids = want["prompt_ids"] + want[f"{key}_ids"]
            assert row["input_ids"].tolist() == ids, (kind, i, key)
            assert row["labels"].tolist() == [IGNORE_INDEX] * len(want["prompt_ids"]) + want[f"{key}_ids"]


def test_truncation_and_the_token_cache(ckpt, tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in plain_records(8)))
    tokenizer = load_tokenizer(ckpt)
    whole = build_preference_data(path, tokenizer, model_dir=ckpt, max_length=None, cache_dir=tmp_path / "cache")
    cut = build_preference_data(path, tokenizer, model_dir=ckpt, max_length=12, max_prompt_length=3,
                                cache_dir=tmp_path / "cache")
    end = build_preference_data(path, tokenizer, model_dir=ckpt, max_length=12, truncation_mode="keep_end",
                                cache_dir=tmp_path / "cache")
    assert whole.data_key == cut.data_key is not None  # one store: cut when read
    for i in range(8):
        for key in ("chosen", "rejected"):
            ids, labels = whole[i][key]["input_ids"], whole[i][key]["labels"]
            prompt = int((labels == IGNORE_INDEX).sum())
            kept = torch.cat([ids[max(0, prompt - 3):prompt], ids[prompt:]])[:12]  # the prompt's last 3, then 12
            assert cut[i][key]["input_ids"].tolist() == kept.tolist()
            assert end[i][key]["input_ids"].tolist() == ids[-12:].tolist()
    assert cut.num_truncated > 0


def test_collated_rows_keep_pairs_together(ckpt):
    data = build_preference_data(plain_records(4), load_tokenizer(ckpt), model_dir=ckpt, max_length=None)
    batch = collate_pairs([data[i] for i in range(4)], pad_id=0, multiple=4, groups=2, whole_chosen=True)
    assert batch["input_ids"].shape[0] == 12 and batch["input_ids"].shape[1] % 4 == 0
    order = [(0, "chosen"), (1, "chosen"), (0, "rejected"), (1, "rejected"), (0, "chosen"), (1, "chosen"),
             (2, "chosen"), (3, "chosen"), (2, "rejected"), (3, "rejected"), (2, "chosen"), (3, "chosen")]
    for r, (pair, key) in enumerate(order):
        ids = data[pair][key]["input_ids"]
        assert batch["input_ids"][r, :ids.numel()].tolist() == ids.tolist()
        whole = r % 6 >= 4  # ORPO's third block: every real token a label
        want = ids if whole else data[pair][key]["labels"]
        assert batch["labels"][r, :ids.numel()].tolist() == want.tolist()
        assert (batch["labels"][r, ids.numel():] == IGNORE_INDEX).all()


# ------------------------------------------------------------------ bad input


def _write(tmp_path, records) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


BAD = {
    "no_rejected": ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": " b"}],
                    'line 2: the record has no "rejected" field'),
    "identical": ([{"prompt": "a", "chosen": " b", "rejected": " b"}], 'line 1: "chosen" is identical to "rejected"'),
    "mixed": ([{"prompt": "a", "chosen": " b", "rejected": " c"}, chat_records(1)[0]],
              "mixes plain-text and conversational records: line 1 is plain text, line 2 is conversational"),
    "wrong_type": ([{"prompt": "a", "chosen": 3, "rejected": " c"}], 'line 1: "chosen" is a int'),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_records_are_named(ckpt, tmp_path, name):
    records, message = BAD[name]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_preference_data(_write(tmp_path, records), load_tokenizer(ckpt), model_dir=ckpt)


def test_a_chat_without_a_template_and_a_prompt_filling_max_length(ckpt, tmp_path):
    bare = chat_checkpoint(tmp_path / "bare", None)
    with pytest.raises(ValueError, match=r"line 1 is conversational .* cannot be rendered: .*no chat template"):
        build_preference_data(_write(tmp_path, chat_records(2)), load_tokenizer(bare), model_dir=bare)
    long_prompt = [{"prompt": " ".join(["word"] * 40), "chosen": " yes", "rejected": " no"}]
    with pytest.raises(ValueError, match=r"line 1: its prompt has \d+ tokens, max_length=16 leaves no completion"):
        build_preference_data(_write(tmp_path, long_prompt), load_tokenizer(ckpt), model_dir=ckpt, max_length=16)


def test_options_refused_before_anything_runs(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match="reference_free=True takes the reference log-probabilities as 0"):
        DPOConfig(output_dir=out, reference_free=True, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="'aot' sorts the log-ratios across the batch"):
        DPOConfig(output_dir=out, loss_type="aot")
    with pytest.raises(ValueError, match="'simpo' and 'orpo' are objectives of their own"):
        DPOConfig(output_dir=out, loss_type=["simpo", "sigmoid"])
    with pytest.raises(ValueError, match="exo_pair' needs label_smoothing > 0"):
        DPOConfig(output_dir=out, loss_type="exo_pair")
    with pytest.raises(ValueError, match="loss_weights has 1 weights for the 2 loss types"):
        DPOConfig(output_dir=out, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])


def test_a_reference_needed_with_none_available(tmp_path):
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tptrain.training.preference import DPOTrainer

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=16,
                                                                  intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1,
                                                                  head_dim=8))
    args = DPOConfig(output_dir=str(tmp_path / "run"), loss_type="ipo")
    with pytest.raises(ValueError, match="needs a reference model, and this model has no checkpoint"):
        DPOTrainer(model, args=args, train_dataset=plain_records(2))


def test_tptrain_dpo_refuses_bad_data_before_any_worker(ckpt, tmp_path):
    bad = _write(tmp_path, BAD["no_rejected"][0])
    proc = subprocess.run([sys.executable, "-m", "tptrain", "dpo", "--model", str(ckpt), "--data", bad,
                           "--output-dir", str(tmp_path / "run"), "--tp-size", "2", "--max-length", "64"],
                          capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{bad} line 2: the record has no \"rejected\" field" in proc.stderr


def test_the_planner_counts_the_reference():
    from tptrain.diagnostics.device_profiles import device_profile
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_plan import estimate
    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.layout import ParallelDims
    from tptrain.models import AutoConfig

    shapes = ModelShapes.of(AutoConfig.for_model("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=64), dtype=torch.float32)
    layout, profile = ParallelDims(tp=2, dp_shard=2), device_profile("h100")
    plans = {ref: estimate(shapes, layout, TrainSettings(batch_size=8, seq_len=256, reference=ref), profile)
             for ref in (None, "copy", "adapters", "precomputed")}
    params = {ref: plan.worst.terms["parameters"] for ref, plan in plans.items()}
    assert params["copy"] == 2 * params[None] and params["adapters"] == params["precomputed"] == params[None]
    compute = {ref: plan.time.parts["compute"] for ref, plan in plans.items()}
    assert compute["copy"] == compute["adapters"] > compute["precomputed"] == compute[None]


def test_tptrain_dpo_run_files(tmp_path):
    run_file = tmp_path / "dpo.yaml"
    run_file.write_text("beta: 0.3\nloss-type: [sigmoid, sft]\nloss-weights: [1.0, 0.5]\nmax-length: 96\n")
    proc = subprocess.run([sys.executable, "-m", "tptrain", "dpo", "--config", str(run_file), "--beta", "0.2",
                           "--print-config"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import yaml

    printed = yaml.safe_load(proc.stdout)
    assert proc.stdout.startswith("# tptrain dpo's resolved configuration") and "# preference" in proc.stdout
    assert (printed["beta"], printed["loss-type"], printed["loss-weights"], printed["max-length"]) == \
        (0.2, ["sigmoid", "sft"], [1.0, 0.5], 96)  # the flag over the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("betta: 0.3\n")
    proc = subprocess.run([sys.executable, "-m", "tptrain", "dpo", "--config", str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key 'betta'; did you mean 'beta'?" in proc.stderr


def test_per_sequence_losses_of_both_backends_and_both_heads(ckpt):
    """Each row's summed token loss: the chunked head (training mode) equals the whole logits' (return_logits), on
    tptrain's model and on transformers' under tptrain's engine, values and gradients."""
    from tptrain import DistributedConfig
    from tptrain.models import AutoModelForCausalLM

    ids = torch.randint(0, 4000, (3, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(10) < 3, IGNORE_INDEX)
    weights = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    results = []
    for backend, whole in (("native", False), ("native", True), ("transformers", False)):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64,
                                                     distributed_config=DistributedConfig(backend=backend)).train()
        out = model(ids, labels=labels, per_sequence=True, **({"return_logits": True} if whole else {})).loss
        (out * weights).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    # transformers' Qwen3 normalises and rotates in fp32 even in an fp64 model: ~1e-7 apart
    for (out, grads), tol in zip(results[1:], (dict(rtol=1e-10, atol=1e-12), dict(rtol=1e-5, atol=1e-6))):
        torch.testing.assert_close(out, results[0][0], **tol)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(grads[name], grad, **tol)
