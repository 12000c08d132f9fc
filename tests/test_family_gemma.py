"""Gemma 2 and Gemma 3 (text) against transformers 5.23, and under tensor parallelism.

What they add to the one decoder: (1 + weight) RMSNorms before and after each sublayer, embeddings times
sqrt(hidden_size), a tanh-GELU MLP, softmax scale query_pre_attn_scalar**-0.5, soft-capped attention scores
(Gemma 2) and logits, sliding-window and full layers, two RoPE bases (Gemma 3: `rope_local_base_freq` on sliding
layers, linear scaling on full ones) and per-head (1 + weight) q/k norms (Gemma 3), tied embeddings.

Tiny random checkpoints written by transformers (2 KV heads, so tp 4 replicates KV; windows of 4 < 12 tokens;
caps of 5 so that they bite), fp64. One spawned job per world size for both families.

    .venv/bin/python -m pytest tests/test_family_gemma.py -q
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import assert_trains_like, check_against_hf
from tests.helpers.configs import GEMMA_FAMILIES as FAMILIES, GEMMA_TINY as TINY
from tests.helpers.lora import LORA_TARGETS
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference, hf_reference as _hf_reference, logits_and_loss
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.models import MODEL_REGISTRY, AutoConfig, Gemma2Config, Gemma3TextConfig

F64 = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-10)  # tptrain at tp 2/4 vs tptrain on one device: a layout bug is O(1)
# transformers runs its RMSNorms (and Gemma 2's softmax) in fp32 even in an fp64 model: ~1e-6 apart.
HF_TOL = dict(rtol=1e-5, atol=1e-5)
LORA_TOL = dict(rtol=1e-5, atol=1e-5)
B, S = 2, 12


# {family: (directory written by transformers, its fp64 logits and loss on _batch())}: every parameter random; the
# (1 + w) norms' weights around 0
CHECKPOINTS = TransformersCheckpoints({name: (name, kw) for name, kw in FAMILIES.items()}, seed=None,
                                      norm_weights=dict.fromkeys(FAMILIES, 0.0), reference=fp64_reference)


def _check_against_hf(model, expected, what: str) -> float:
    """Asserts logits and loss equal transformers'; returns max |logits - transformers|."""
    return check_against_hf(model, expected, what, HF_TOL)


def test_tp1_logits_loss_and_grads_match_transformers(checkpoints):
    import transformers
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        assert type(model.config) is {"gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}[name]
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
        layer = model.model.layers[0]
        assert {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"} <= set(dict(layer.named_children()))
        assert hasattr(layer.self_attn, "q_norm") == (name == "gemma3_text")
        _check_against_hf(model, expected, f"{name} tp=1")

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
        ids, labels = _batch()
        model(ids, labels=labels).loss.backward()
        hf(ids, labels=labels).loss.backward()
        hf_grads = dict(hf.named_parameters())
        for pname, p in model.named_parameters():
            torch.testing.assert_close(p.grad, hf_grads[pname].grad, **HF_TOL, msg=lambda m: f"{name} {pname}: {m}")


def _edited(path, tmp_path, **changes):
    """A copy of checkpoint `path` with config.json keys changed."""
    out = tmp_path / f"{path.name}_{'_'.join(changes)}"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize("name, changes", [
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(sliding_window=64)),
    ("gemma3_text", dict(final_logit_softcapping=None)),
    ("gemma3_text", dict(sliding_window=64)),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e5}})),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
])
def test_caps_windows_and_rope_bases_matter(checkpoints, tmp_path, name, changes):
    """Without a cap, a window, the local RoPE base or the linear scaling, the same weights give other logits --
    in transformers and in tptrain alike."""
    import transformers
    path, expected = checkpoints[name]
    edited = _edited(path, tmp_path, **changes)
    got = logits_and_loss(AutoModelForCausalLM.from_pretrained(edited, dtype=F64), *_batch())["logits"]
    assert (got - expected["logits"]).abs().max() > 1e-2, changes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(edited, dtype=F64).eval()
    torch.testing.assert_close(got, _hf_reference(hf)["logits"], **HF_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_arithmetic_is_transformers_bit_for_bit(checkpoints, dtype):
    """(1 + w) scaled in fp32, sqrt(hidden) rounded to the weights' dtype, the capped scores' fp32 softmax: the
    same bits as transformers, also with left padding (rows that see no key included)."""
    import transformers
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    for name, (path, _) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=0)
            padded = model(ids, attention_mask=mask, position_ids=position_ids).logits
            ref = hf(ids, attention_mask=mask, position_ids=position_ids).logits
            torch.testing.assert_close(padded, ref, rtol=0, atol=0, msg=lambda m: f"{name} left padding: {m}")


def test_configs_round_trip_through_transformers(tmp_path):
    import transformers
    for name, kwargs in FAMILIES.items():
        config = AutoConfig.for_model(name, **kwargs)
        config.save_pretrained(tmp_path / name)
        hf_config = transformers.AutoConfig.from_pretrained(tmp_path / name)
        for key in ("sliding_window", "layer_types", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping", "hidden_activation"):
            assert getattr(hf_config, key) == getattr(config, key), (name, key)
        hf_config.save_pretrained(tmp_path / f"{name}_hf")
        again = AutoConfig.from_pretrained(tmp_path / f"{name}_hf")
        assert again.layer_ropes == config.layer_ropes and again.layer_sliding_windows == config.layer_sliding_windows
    gemma3 = AutoConfig.for_model("gemma3_text", **FAMILIES["gemma3_text"])
    assert gemma3.layer_ropes[:2] == [(100.0, None), (1e5, {"rope_type": "linear", "factor": 2.0})]
    assert AutoConfig.for_model("gemma2", num_hidden_layers=4).layer_sliding_windows == [4096, None, 4096, None]
    for name, extra in (("gemma2", {}), ("gemma3_text", {}), ("gemma3_text", {"sliding_window_pattern": 3})):
        default = MODEL_REGISTRY[name][0].from_dict({"num_hidden_layers": 7, **extra})  # no layer_types
        hf_default = transformers.AutoConfig.for_model(name, num_hidden_layers=7, **extra)
        assert default.layer_types == hf_default.layer_types, (name, extra)


@pytest.mark.parametrize("model_type, changes, key", [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", dict(layer_types=["chunked_attention", "full_attention"] * 2), "layer_types"),
    ("gemma2", dict(layer_types=["full_attention"]), "layer_types"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
    ("gemma2", dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    ("gemma2", dict(attention_dropout=0.1), "attention_dropout"),
    ("gemma2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(rope_scaling={"rope_type": "linear"}), "rope_scaling"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                          "full_attention": {"rope_type": "default"}}), "sliding_attention"),
])
def test_unsupported_config_values_name_the_key(model_type, changes, key):
    with pytest.raises(ValueError, match=key):
        MODEL_REGISTRY[model_type][0].from_dict({**TINY, "model_type": model_type, **changes})


def _equivalence(model, ref, what: str, *, steps: int = 3) -> float:
    """Logits, every gradient and `steps` AdamW steps of the TP `model` equal the single-device `ref`; returns
    max |logits - single-device logits|."""
    return assert_trains_like(model, ref, *_batch(seed=2), steps=steps, tol=EXACT, what=what)


def _assert_megatron_minimum(model, what: str) -> None:
    """Capping and the extra norms add no collective: one step sends the Megatron minimum, logits stay sharded."""
    report = comm_report(model, *_batch())
    assert report.matches_minimum and report.full_logit_collectives == 0, f"{what}\n{report.table()}"
    model.zero_grad()


def _tp2_worker(checkpoints, out) -> None:
    from tptrain.peft import LoraConfig, get_peft_model
    tp2, sp2 = DistributedConfig(tp_size=2), DistributedConfig(tp_size=2, enable_sequence_parallel=True)
    errors = {}
    for name, (path, expected) in checkpoints.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=tp2)
        errors[name] = _check_against_hf(model, expected, f"{name} tp=2")
        model.save_pretrained(out / "saved" / name)
        _assert_megatron_minimum(model, f"{name} tp=2")
        _equivalence(model, ref, f"{name} tp=2")
        # Sequence parallelism (the four norms per layer hold sequence shards) with activation checkpointing.
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=sp2)
        assert model.tp_plan["model.layers.0.pre_feedforward_layernorm"] == "sequence_parallel"
        _assert_megatron_minimum(model, f"{name} tp=2 sp")
        ref.gradient_checkpointing_enable(), model.gradient_checkpointing_enable()
        ref.train(), model.train()
        _equivalence(model, ref, f"{name} tp=2 sp+checkpointing", steps=1)

        torch.manual_seed(0)  # LoRA on every linear layer, trained 3 steps so B is no longer zero
        base = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=tp2)
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
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=4))
        assert model.parallel.tp.specs["model.layers.0.self_attn.k_proj.weight"].replicas == 2
        errors[name] = _check_against_hf(model, expected, f"{name} tp=4 (KV heads replicated)")
        _equivalence(model, ref, f"{name} tp=4")
    if torch.distributed.get_rank() == 0:
        (out / "tp4_errors.json").write_text(json.dumps(errors))


@pytest.mark.distributed
def test_tp2_training_saving_and_lora_match(checkpoints, tmp_path):
    import peft
    import transformers
    run_distributed(_tp2_worker, 2, checkpoints, tmp_path)
    print("\nmax |logits - transformers| at tp 2:", (tmp_path / "tp2_errors.json").read_text())
    ids, _ = _batch()
    for name, (path, expected) in checkpoints.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved" / name, dtype=F64).eval()
            got = _hf_reference(hf)
            torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
            lora = peft.PeftModel.from_pretrained(base, tmp_path / "lora" / name).eval()
            with torch.no_grad():
                peft_logits = lora(ids).logits
        ours = torch.load(tmp_path / "lora" / name / "logits.pt")
        torch.testing.assert_close(peft_logits, ours, **LORA_TOL, msg=lambda m: f"{name} LoRA in peft: {m}")
        assert (ours - expected["logits"]).abs().max() > 1e-2, f"{name}: the adapter changes nothing"


@pytest.mark.distributed
def test_tp4_matches_transformers_and_single_device_with_kv_replication(checkpoints, tmp_path):
    run_distributed(_tp4_worker, 4, checkpoints, tmp_path)
    print("\nmax |logits - transformers| at tp 4:", (tmp_path / "tp4_errors.json").read_text())
