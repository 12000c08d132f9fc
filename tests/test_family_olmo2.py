"""OLMo 2 (post-sublayer norms, q/k RMSNorm over the whole projected width) against transformers 5.23, and its
tensor-parallel layout: attention stays sharded, the q/k norms sum their squares over TP (`distributed_rmsnorm`).

A tiny random checkpoint written by transformers' Olmo2ForCausalLM (2 KV heads, so tp 4 replicates KV), fp64
throughout. One spawned job per world size.

    .venv/bin/python -m pytest tests/test_family_olmo2.py -q
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import OLMO2_HF_TOL as HF_TOL, check_against_olmo_hf, trains_like_on_batch
from tests.helpers.configs import F64, OLMO2_TINY as TINY
from tests.helpers.lora import assert_lora_crossed, lora_crossing, peft_adapter
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference, hf_reference as _hf_reference
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.diagnostics.plan_report import plan_report
from tptrain.distributed.comm import CommTracker
from tptrain.models import AutoConfig, Olmo2Config
from tptrain.parallel.plan import check_plan

B, S = 2, 12


# (directory written by transformers, its fp64 logits and loss on _batch()): every parameter random, norms around 1
CHECKPOINTS = TransformersCheckpoints({"olmo2": ("olmo2", TINY)}, reference=fp64_reference)


def test_tp1_logits_loss_and_grads_match_transformers(checkpoint):
    import transformers
    path, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    assert type(model.config) is Olmo2Config and model.tp_size == 1
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (64,) and layer.self_attn.k_norm.weight.shape == (32,)
    check_against_olmo_hf(model, expected, "tp=1")

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    ids, labels = _batch()
    model(ids, labels=labels).loss.backward()
    hf(ids, labels=labels).loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name].grad, **HF_TOL, msg=lambda m: f"grad of {name}: {m}")


def test_bf16_arithmetic_is_transformers(checkpoint):
    """Olmo2RMSNorm scales before casting back and RoPE rotates in fp32: bit for bit in bfloat16."""
    import transformers
    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("key, value", [("attention_dropout", 0.1), ("mlp_bias", True), ("hidden_act", "gelu"),
                                        ("use_sliding_window", True)])
def test_unsupported_config_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        Olmo2Config.from_dict({**TINY, "model_type": "olmo2", key: value})


def test_plan_shows_distributed_norms_and_the_pair_check_guards_them():
    config = AutoConfig.for_model("olmo2", **TINY)
    report = plan_report(config, 4)
    assert not report.problems, report.text
    rows = [line.split() for line in report.text.splitlines()]
    q_norm = next(r for r in rows if r and r[0].endswith("self_attn.q_norm"))
    k_norm = next(r for r in rows if r and r[0].endswith("self_attn.k_norm"))
    assert q_norm[1:5] == ["distributed_rmsnorm", "weight", "(64,)", "(16,)"], q_norm
    assert k_norm[1:5] == ["distributed_rmsnorm", "weight", "(32,)", "(16,)"], k_norm  # 2 KV chunks, 2 replicas

    model = AutoModelForCausalLM.from_config(config, device="meta")
    resolved = check_plan(model, "auto", 4)
    spec = resolved.specs["model.layers.0.self_attn.k_norm.weight"]
    assert (spec.dim, spec.replicas, spec.partial_grad) == (0, 2, True)  # laid out like k_proj
    spec = resolved.specs["model.layers.0.self_attn.q_norm.weight"]
    assert (spec.dim, spec.replicas, spec.partial_grad) == (0, 1, False)  # each rank owns its slice
    # A replicated q_norm cannot meet colwise q_proj (its input) nor rowwise o_proj (its reader).
    problems = check_plan(model, {"layers.*.self_attn.q_norm": None}, 2).problems
    assert any("q_norm (no rule (replicated))" in p and "q_proj" in p for p in problems), problems
    assert any("o_proj ('rowwise') expects its input split" in p and "q_norm (no rule (replicated))" in p
               for p in problems), problems


def _assert_communication(model, tp: int) -> None:
    """One training forward + backward sends exactly the Megatron minimum plus one (tokens,) all-reduce per
    q/k norm in forward and one in backward; no q/k/v gather."""
    ids, labels = _batch()
    layers, tokens = TINY["num_hidden_layers"], B * S
    act = tokens * TINY["hidden_size"] * 8  # one fp64 (batch, seq, hidden) activation
    with CommTracker() as t:
        model(ids, labels=labels).loss.backward()
    fwd = sorted(r.bytes for r in t.records if r.phase == "forward")
    bwd = sorted(r.bytes for r in t.records if r.phase == "backward")
    assert {r.op for r in t.records} == {"all_reduce"}, "no all-gather: q and k stay sharded"
    # forward: 2 per layer + the embedding (activations), 2 per layer for the norms, and the vocab-parallel loss
    # fused with the head (issue 24): per chunk (one here) the max, then [target, sum-exp]
    assert fwd == sorted([act] * (2 * layers + 1) + [tokens * 8] * (1 + 2 * layers) + [2 * tokens * 8]), fwd
    # backward: 2 per layer + the head's input boundary, 2 per layer for the norms' sums of squares
    assert bwd == sorted([act] * (2 * layers + 1) + [tokens * 8] * (2 * layers)), bwd
    partial = tp > TINY["num_key_value_heads"]  # only KV-replicated weights (k/v proj, k_norm) hold shares
    assert t.counts("grad_sync") == ({"all_reduce": 1} if partial else {})
    model.zero_grad()
    report = comm_report(model, ids, labels)
    assert report.matches_minimum and report.full_logit_collectives == 0, report.table()
    model.zero_grad()


def _tp2_worker(path, expected, save_dir, out, peft_dir, adapter_dir) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    assert ref.tp_size == 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=2))
    attn = model.model.layers[0].self_attn
    assert model.tp_plan["model.layers.0.self_attn.q_norm"] == "distributed_rmsnorm"
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)
    diff = check_against_olmo_hf(model, expected, "tp=2")
    model.save_pretrained(save_dir)
    _assert_communication(model, 2)
    vs_tp1 = trains_like_on_batch(model, ref)
    # Sequence parallelism: the residual-stream norms hold sequence shards, the q/k norms full sequences.
    sp = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=2, enable_sequence_parallel=True))
    trains_like_on_batch(sp, copy.deepcopy(ref), steps=1)
    report = comm_report(sp, *_batch())
    assert report.matches_minimum, report.table()
    # Activation checkpointing: the recomputed norms sum their squares again, in step on every rank.
    recomputed = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=2))
    recomputed.gradient_checkpointing_enable()
    recomputed.train()
    trains_like_on_batch(recomputed, copy.deepcopy(ref), steps=1)
    lora = lora_crossing(path, peft_dir, adapter_dir)
    if torch.distributed.get_rank() == 0:
        torch.save({"diff": diff, "vs_tp1": vs_tp1, "table": report.table(), **lora}, out)


def _tp4_worker(path, expected, out) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=4))
    specs = model.parallel.tp.specs
    assert specs["model.layers.0.self_attn.k_norm.weight"].replicas == 2  # 2 KV heads over 4 ranks
    assert model.model.layers[0].self_attn.k_norm.weight.shape == (16,)
    diff = check_against_olmo_hf(model, expected, "tp=4 (KV replicated)")
    _assert_communication(model, 4)
    vs_tp1 = trains_like_on_batch(model, ref)
    if torch.distributed.get_rank() == 0:
        torch.save({"diff": diff, "vs_tp1": vs_tp1}, out)


@pytest.mark.distributed
def test_tp2_matches_transformers_single_device_saves_for_transformers_and_crosses_lora_with_peft(checkpoint, tmp_path):
    import transformers
    path, expected = checkpoint
    peft_logits = peft_adapter(path, tmp_path / "peft_adapter")
    run_distributed(_tp2_worker, 2, path, expected, tmp_path / "saved", tmp_path / "tp2.pt",
                    tmp_path / "peft_adapter", tmp_path / "tptrain_adapter")
    result = torch.load(tmp_path / "tp2.pt")
    print(f"\ntp=2 max |logits - transformers| = {result['diff']:.3g}, - tp 1: {result['vs_tp1']:.3g}\n"
          f"{result['table']}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=F64).eval()
    got = _hf_reference(hf)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=0, atol=0)
    assert_lora_crossed(path, result, peft_logits, tmp_path / "tptrain_adapter")


@pytest.mark.distributed
def test_tp4_matches_transformers_and_single_device_with_kv_replication(checkpoint, tmp_path):
    path, expected = checkpoint
    run_distributed(_tp4_worker, 4, path, expected, tmp_path / "tp4.pt")
    result = torch.load(tmp_path / "tp4.pt")
    print(f"\ntp=4 max |logits - transformers| = {result['diff']:.3g}, - tp 1: {result['vs_tp1']:.3g}")

