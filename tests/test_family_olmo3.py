"""OLMo 3 (OLMo 2 plus sliding-window / full layers, each layer type with its RoPE) against transformers 5.23.

A tiny random checkpoint written by transformers' Olmo3ForCausalLM: 3 layers (sliding, full, sliding), a window of
4 keys on 12-token sequences, 2 KV heads (tp 4 replicates KV), linear RoPE scaling on the full layer only and
another base on the sliding ones. fp64 throughout; the helpers are OLMo 2's. One spawned job per world size: tp 2
(transformers' logits, single-device gradients and AdamW steps, also with sequence parallelism and activation
checkpointing, the saved checkpoint in transformers, LoRA crossing with peft) and tp 4 (KV replicated).

    .venv/bin/python -m pytest tests/test_family_olmo3.py -q
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import OLMO2_HF_TOL as HF_TOL, check_against_olmo_hf, trains_like_on_batch
from tests.helpers.configs import F64, OLMO3_LAYER_TYPES as LAYER_TYPES, OLMO3_ROPE as ROPE, OLMO3_TINY as TINY
from tests.helpers.lora import assert_lora_crossed, lora_crossing, peft_adapter
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference, hf_reference as _hf_reference
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.models import AutoConfig, Olmo3Config


# (directory written by transformers, its fp64 logits and loss on _batch()): every parameter random, norms around 1
CHECKPOINTS = TransformersCheckpoints({"olmo3": ("olmo3", dict(TINY, rope_parameters=ROPE))}, reference=fp64_reference)


def test_tp1_matches_transformers_and_the_window_matters(checkpoint):
    path, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    config = model.config
    assert type(config) is Olmo3Config and config.layer_sliding_windows == [4, None, 4]
    assert config.layer_ropes == [(1000.0, None), (10000.0, {"rope_type": "linear", "factor": 2.0}), (1000.0, None)]
    check_against_olmo_hf(model, expected, "tp=1")
    # Without the window (every layer full) the logits are another model's.
    full = AutoConfig.from_pretrained(path)
    full.layer_types = ["full_attention"] * 3
    unwindowed = AutoModelForCausalLM.from_config(full, dtype=F64)
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unwindowed(_batch()[0]).logits - expected["logits"]).abs().max() > 1e-2


def test_bf16_is_transformers_bit_for_bit(checkpoint):
    import transformers
    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(_batch()[0]).logits, hf(_batch()[0]).logits, rtol=0, atol=0)


def test_defaults_and_bad_layer_types_name_the_key():
    import transformers
    ours, theirs = Olmo3Config(num_hidden_layers=8), transformers.Olmo3Config(num_hidden_layers=8)
    assert ours.layer_types == theirs.layer_types and ours.sliding_window == theirs.sliding_window
    # A top-level rope_theta is the full layers' only (transformers 5.x); the sliding ones keep 500000.
    legacy = Olmo3Config.from_dict({"model_type": "olmo3", **TINY, "rope_theta": 10000.0})
    assert legacy.layer_ropes[0] == (500000.0, None) and legacy.layer_ropes[1] == (10000.0, None)
    with pytest.raises(ValueError, match="layer_types"):
        Olmo3Config.from_dict({"model_type": "olmo3", **TINY, "layer_types": ["sliding_attention", "chunked", "x"]})
    with pytest.raises(ValueError, match="layer_types"):
        Olmo3Config.from_dict({"model_type": "olmo3", **TINY, "layer_types": LAYER_TYPES[:2]})


def _tp2_worker(path, expected, save_dir, out, peft_dir, adapter_dir) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=2))
    assert model.tp_plan["model.layers.0.self_attn.q_norm"] == "distributed_rmsnorm"
    diff = check_against_olmo_hf(model, expected, "tp=2")
    model.save_pretrained(save_dir)
    vs_tp1 = trains_like_on_batch(model, ref)
    # Windows and per-layer RoPEs under sequence parallelism + activation checkpointing.
    sp = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=2, enable_sequence_parallel=True))
    sp.gradient_checkpointing_enable(), sp.train()
    single = copy.deepcopy(ref)
    single.gradient_checkpointing_enable(), single.train()
    trains_like_on_batch(sp, single, steps=2)
    lora = lora_crossing(path, peft_dir, adapter_dir)
    if torch.distributed.get_rank() == 0:
        torch.save({"diff": diff, "vs_tp1": vs_tp1, **lora}, out)


def _tp4_worker(path, expected, out) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=4))
    assert model.parallel.tp.specs["model.layers.0.self_attn.k_norm.weight"].replicas == 2
    diff = check_against_olmo_hf(model, expected, "tp=4 (KV replicated)")
    vs_tp1 = trains_like_on_batch(model, ref)
    if torch.distributed.get_rank() == 0:
        torch.save({"diff": diff, "vs_tp1": vs_tp1}, out)


@pytest.mark.distributed
def test_tp2_matches_transformers_and_single_device_saves_for_transformers_and_crosses_lora(checkpoint, tmp_path):
    import transformers
    path, expected = checkpoint
    peft_logits = peft_adapter(path, tmp_path / "peft_adapter")
    run_distributed(_tp2_worker, 2, path, expected, tmp_path / "saved", tmp_path / "tp2.pt",
                    tmp_path / "peft_adapter", tmp_path / "tptrain_adapter")
    result = torch.load(tmp_path / "tp2.pt")
    print(f"\ntp=2 max |logits - transformers| = {result['diff']:.3g}, - tp 1: {result['vs_tp1']:.3g}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=F64).eval()
    assert hf.config.rope_parameters == ROPE, hf.config.rope_parameters
    assert hf.config.layer_types == LAYER_TYPES and hf.config.sliding_window == 4
    got = _hf_reference(hf)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=0, atol=0)
    assert_lora_crossed(path, result, peft_logits, tmp_path / "tptrain_adapter")


@pytest.mark.distributed
def test_tp4_matches_transformers_with_kv_replication(checkpoint, tmp_path):
    path, expected = checkpoint
    run_distributed(_tp4_worker, 4, path, expected, tmp_path / "tp4.pt")
    result = torch.load(tmp_path / "tp4.pt")
    print(f"\ntp=4 max |logits - transformers| = {result['diff']:.3g}, - tp 1: {result['vs_tp1']:.3g}")
    assert result["diff"] <= HF_TOL["atol"] * 10
