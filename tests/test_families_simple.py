"""Mistral / Ministral / Ministral 3 (sliding windows; YaRN and query scales), Granite (multipliers), SmolLM3 (layers without RoPE) under TP.

transformers 5.23 writes each tiny random checkpoint; tptrain loads it at tp 1, 2 and 4 and must give
transformers' logits and loss; at tp 2 (also with sequence parallelism and activation checkpointing)
gradients and three AdamW steps equal the single-device tptrain model (fp64); what tp 2 saves loads in
transformers with the same logits; a LoRA adapter trained at tp 2 loads in peft with the same logits.
Every distributed check of one world size runs in one spawned job.

    .venv/bin/python -m pytest tests/test_families_simple.py -q
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import assert_trains_like
from tests.helpers.configs import SIMPLE_FAMILIES as FAMILIES, SIMPLE_TINY as TINY
from tests.helpers.lora import LORA_TARGETS
from tests.helpers.ranks import run_distributed
from tests.helpers.references import logits_and_loss
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.models import AutoConfig

TOL = dict(rtol=2e-5, atol=2e-5)  # tptrain vs transformers (fp32 checkpoints)
EXACT = dict(rtol=1e-10, atol=1e-10)  # tptrain at tp 2 vs tptrain on one device (fp64)
# transformers runs RMSNorm and RoPE in fp32 even for an fp64 model: ~1e-6 apart (as tests/test_lora_interop.py).
LORA_TOL = dict(rtol=1e-5, atol=1e-5)


# {family: (directory written by transformers, its logits and loss on _batch())}: every parameter random (norms
# around 1), as tests/test_models.py
CHECKPOINTS = TransformersCheckpoints({name: (name, kw) for name, kw in FAMILIES.items()}, seed=None,
                                      reference=lambda hf: logits_and_loss(hf, *_batch()))


def _check(model, expected, what: str) -> float:
    """Asserts transformers' logits and loss; returns max |logits - transformers|."""
    got = logits_and_loss(model, *_batch())
    torch.testing.assert_close(got["logits"], expected["logits"], **TOL, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(got["loss"], expected["loss"], **TOL, msg=lambda m: f"{what} loss: {m}")
    return (got["logits"] - expected["logits"]).abs().max().item()


def test_tp1_matches_transformers_and_the_window_matters(checkpoints, tmp_path):
    import transformers
    for name, (path, expected) in checkpoints.items():
        _check(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), expected, f"{name} tp=1")
    # Without its window the same mistral checkpoint gives other logits: the window is really applied.
    full = tmp_path / "mistral_full"
    shutil.copytree(checkpoints["mistral"][0], full)
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    got = logits_and_loss(AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32), *_batch())["logits"]
    assert (got - checkpoints["mistral"][1]["logits"]).abs().max() > 1e-2
    # Ministral 3's YaRN and its query scale change the logits: both are really applied.
    path, expected = checkpoints["ministral3"]
    config = json.loads((path / "config.json").read_text())
    for change in ({"llama_4_scaling_beta": 0.0}, {"rope_type": "default"}):
        changed = tmp_path / f"ministral3_{next(iter(change))}"
        shutil.copytree(path, changed)
        (changed / "config.json").write_text(json.dumps(
            {**config, "rope_parameters": {**config["rope_parameters"], **change}}))
        got = logits_and_loss(AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32), *_batch())["logits"]
        assert (got - expected["logits"]).abs().max() > 1e-3, change
    # Left padding combined with the window, as transformers masks it.
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["mistral"][0], dtype=torch.float32).eval()
        ref = hf(ids, attention_mask=mask, position_ids=position_ids).logits
        ours = AutoModelForCausalLM.from_pretrained(checkpoints["mistral"][0], dtype=torch.float32)
        out = ours(ids, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], **TOL)


def _train_equivalence(ref, model, what: str) -> None:
    """Loss, every gradient and 3 AdamW steps of a TP model equal its single-device copy."""
    assert_trains_like(model, ref, *_batch(seed=5), tol=EXACT, what=what)


def _tp2_worker(checkpoints, out) -> None:
    from tptrain.peft import LoraConfig, get_peft_model
    tp2, sp2 = DistributedConfig(tp_size=2), DistributedConfig(tp_size=2, enable_sequence_parallel=True)
    errors = {}
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=tp2)
        errors[name] = _check(model, expected, f"{name} tp=2")
        model.save_pretrained(out / "saved" / name)

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=tp2)
        _train_equivalence(ref, model, f"{name} tp=2")
        if name in ("mistral", "ministral", "ministral3"):  # windows (and query scales) under sequence parallelism and activation checkpointing
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=sp2)
            ref.gradient_checkpointing_enable(), model.gradient_checkpointing_enable()
            ref.train(), model.train()
            _train_equivalence(ref, model, f"{name} tp=2 sp+checkpointing")

        torch.manual_seed(0)  # LoRA on every linear layer, trained 3 steps so B is no longer zero
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=tp2)
        lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=LORA_TARGETS))
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
        ids, labels = _batch(seed=4)
        for _ in range(3):
            lora(ids, labels=labels).loss.backward()
            opt.step(), opt.zero_grad()
        lora.save_pretrained(out / "lora" / name)
        lora.eval()
        with torch.no_grad():
            logits = lora(_batch()[0]).logits
        if torch.distributed.get_rank() == 0:
            torch.save(logits, out / "lora" / name / "logits.pt")
    if torch.distributed.get_rank() == 0:
        (out / "tp2_errors.json").write_text(json.dumps(errors))


def _tp4_worker(checkpoints, out) -> None:
    errors = {}
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_size=4))
        assert model.parallel.tp.specs["model.layers.0.self_attn.k_proj.weight"].replicas == 2
        errors[name] = _check(model, expected, f"{name} tp=4 (KV heads replicated)")
    if torch.distributed.get_rank() == 0:
        (out / "tp4_errors.json").write_text(json.dumps(errors))


@pytest.mark.distributed
def test_tp2_training_saving_and_lora_match(checkpoints, tmp_path):
    import peft
    import transformers
    run_distributed(_tp2_worker, 2, checkpoints, tmp_path)
    print("max |logits - transformers| at tp 2:", (tmp_path / "tp2_errors.json").read_text())
    ids, labels = _batch()
    for name, (path, expected) in checkpoints.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved" / name,
                                                                   dtype=torch.float32).eval()
            got = logits_and_loss(hf, ids, labels)
            torch.testing.assert_close(got["logits"], expected["logits"], **TOL, msg=lambda m: f"{name} saved: {m}")
            base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
            lora = peft.PeftModel.from_pretrained(base, tmp_path / "lora" / name).eval()
            with torch.no_grad():
                peft_logits = lora(ids).logits
        ours = torch.load(tmp_path / "lora" / name / "logits.pt")
        torch.testing.assert_close(peft_logits, ours, **LORA_TOL, msg=lambda m: f"{name} LoRA in peft: {m}")
        assert (ours - expected["logits"].double()).abs().max() > 1e-2, f"{name}: the adapter changes nothing"


@pytest.mark.distributed
def test_tp4_matches_transformers_with_kv_replication(checkpoints, tmp_path):
    run_distributed(_tp4_worker, 4, checkpoints, tmp_path)
    print("max |logits - transformers| at tp 4:", (tmp_path / "tp4_errors.json").read_text())


def test_configs_round_trip_through_transformers(tmp_path):
    import transformers
    for name, kwargs in FAMILIES.items():
        config = AutoConfig.for_model(name, **kwargs)
        config.save_pretrained(tmp_path / name)
        hf_config = transformers.AutoConfig.from_pretrained(tmp_path / name)
        for key in ("sliding_window", "layer_types", "no_rope_layers", "embedding_multiplier",
                    "residual_multiplier", "attention_multiplier", "logits_scaling", "head_dim"):
            if key in kwargs:
                assert getattr(hf_config, key) == kwargs[key], (name, key)
        if "rope_parameters" in kwargs:  # written as rope_theta + rope_scaling, read back by transformers 5 as given
            assert hf_config.rope_parameters == kwargs["rope_parameters"], (name, hf_config.rope_parameters)
        hf_config.save_pretrained(tmp_path / f"{name}_hf")
        assert AutoConfig.from_pretrained(tmp_path / f"{name}_hf").layer_sliding_windows == config.layer_sliding_windows
        assert AutoConfig.from_pretrained(tmp_path / f"{name}_hf").layer_uses_rope == config.layer_uses_rope


@pytest.mark.parametrize("model_type, kwargs, key", [
    ("ministral", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    ("ministral", dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    ("ministral", dict(sliding_window=None, layer_types=["sliding_attention"] * 2), "sliding_window"),
    ("mistral", dict(sliding_window=0), "sliding_window"),
    ("mistral", dict(extra={"layer_types": ["full_attention", "sliding_attention"]}), "layer_types"),
    ("smollm3", dict(no_rope_layers=[1, 2]), "no_rope_layers"),
    ("smollm3", dict(no_rope_layers=[1]), "no_rope_layers"),
    ("smollm3", dict(extra={"use_sliding_window": True, "sliding_window": 4}), "use_sliding_window"),
    ("qwen3", dict(extra={"layer_types": ["sliding_attention", "full_attention"]}), "layer_types"),
    ("granite", dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling"),
    ("ministral3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
])
def test_unsupported_config_values_name_the_key(model_type, kwargs, key):
    with pytest.raises(ValueError, match=key):
        AutoConfig.for_model(model_type, **{**TINY, **kwargs})
