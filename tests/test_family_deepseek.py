"""DeepSeek-V3 natively (MLA, the group-limited sigmoid router with its correction bias, shared experts, the first
layers dense) against transformers 5.23 on tiny random checkpoints it wrote (hub layout: one tensor per expert), with
low-rank q and with one q_proj; and at tp 2 and 4 (MLA heads split over tp, experts tensor-parallel or expert-
parallel, and at 4 ranks over an ep axis of their own) against one process: logits, gradients, 3 AdamW steps, fp64.
One spawned job per world size.

    .venv/bin/python -m pytest tests/test_family_deepseek.py -q
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from tests.helpers.batches import batch
from tests.helpers.checkpoints import DeepSeekCheckpoints
from tests.helpers.compare import MOE_HF_TOL as HF_TOL, TOL, assert_trains_like, check_against_hf, full_grads, hf_grad
from tests.helpers.configs import DEEPSEEK_TINY, F64
from tests.helpers.ranks import run_distributed
from tests.helpers.references import hf_reference, transformers_fp64
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.distributed.topology import dp_mesh
from tptrain.models import AutoConfig, DeepseekV3Config


# {"q_lora": ..., "q_proj": ...}: (directory written by transformers, its fp64 logits and loss on batch()); the
# second also rotates its RoPE features as halves, not interleaved pairs
CHECKPOINTS = DeepSeekCheckpoints({"q_lora": {}, "q_proj": dict(q_lora_rank=None, rope_interleave=False)},
                                  reference=lambda path: hf_reference(transformers_fp64(path)))


def test_logits_loss_and_grads_match_transformers(checkpoints):
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert hasattr(attn, "q_b_proj") == (name == "q_lora") and hasattr(model.model.layers[0].mlp, "gate_proj")
        assert moe.experts.gate_proj.shape == (8, 16, 32) and moe.shared_experts.gate_proj.weight.shape == (16, 32)
        assert not moe.gate.e_score_correction_bias.requires_grad and moe.gate.e_score_correction_bias.abs().sum() > 0
        check_against_hf(model, expected, name, HF_TOL)
        hf = transformers_fp64(path)
        ids, labels = batch()
        model(ids, labels=labels).loss.backward()
        hf(ids, labels=labels).loss.backward()
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
        for n, p in model.named_parameters():
            if p.requires_grad:
                want = hf_grad(hf_grads, n, 16)
                torch.testing.assert_close(p.grad, want, **HF_TOL, msg=lambda m: f"{name}: grad of {n}: {m}")


def test_native_equals_the_transformers_backend(checkpoints):
    """The same checkpoint through tptrain's engine on transformers' DeepSeek-V3 code: logits, loss, gradients."""
    path, _ = checkpoints["q_lora"]
    backend = AutoModelForCausalLM.from_pretrained(path, dtype=F64, backend="transformers")
    backend.hf_model.set_experts_implementation("eager")  # its grouped_mm kernels take no fp64
    native = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    ids, labels = batch()
    theirs, ours = backend(ids, labels=labels, return_logits=True), native(ids, labels=labels, return_logits=True)
    torch.testing.assert_close(ours.logits, theirs.logits, **HF_TOL)
    torch.testing.assert_close(ours.loss, theirs.loss, **HF_TOL)
    theirs.loss.backward(), ours.loss.backward()
    grads = {n: p.grad for n, p in backend.named_parameters()}
    for n, p in native.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, hf_grad(grads, n, 16), **HF_TOL, msg=lambda m: f"grad of {n}: {m}")


def test_bf16_arithmetic_is_transformers(checkpoints):
    """Norms, interleaved RoPE, the MLA softmax scale, fp32 routing and the expert sums, bit for bit in bf16."""
    import transformers
    path = checkpoints["q_lora"][0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32  # as transformers keeps it
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(model(batch()[0]).logits, hf(batch()[0]).logits, rtol=0, atol=0)


def test_routing_is_group_limited_and_biased(checkpoints):
    """Each token's experts lie in topk_group of the n_group groups, picked by score + bias, weighted by the score
    alone (renormalised, times routed_scaling_factor); plain top-k differs on this input, so the limit is real."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints["q_lora"][0], dtype=F64)
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3), dtype=F64)
    logits, weights, ids = model.model.layers[1].mlp.route(x)
    assert logits.dtype == weights.dtype == F64  # at least fp32 (bf16 models route in fp32, as transformers)
    assert all(len(set((row // 2).tolist())) <= 2 for row in ids)  # 4 groups of 2 experts, 2 groups kept
    scores = logits.sigmoid()
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5, dtype=F64))  # renormalised, times 2.5
    torch.testing.assert_close(weights, scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * 2.5)
    plain = (scores + gate.e_score_correction_bias).topk(2, dim=-1).indices
    assert (plain.sort(-1).values != ids.sort(-1).values).any()


def test_save_pretrained_writes_the_hubs_layout(checkpoints, tmp_path):
    path, expected = checkpoints["q_lora"]
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path)
    _assert_same_checkpoint(path, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["n_routed_experts"] == 8 and "num_experts" not in config and "decoder_sparse_step" not in config
    got = hf_reference(transformers_fp64(tmp_path))
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0)


def _assert_same_checkpoint(theirs, ours) -> None:
    a, b = safe_open(theirs / "model.safetensors", "pt"), safe_open(ours / "model.safetensors", "pt")
    assert set(a.keys()) == set(b.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in b.keys()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in b.keys()
    for key in a.keys():  # a model loaded in fp64 writes fp64: transformers' fp32 values exactly
        want = a.get_tensor(key)
        torch.testing.assert_close(b.get_tensor(key).to(want.dtype), want, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("key, value, match", [
    ("num_key_value_heads", 2, "num_key_value_heads=2 must equal"), ("n_group", 3, "n_group=3"),
    ("topk_group", 1, "topk_group=1 groups of 2 experts"), ("output_router_logits", True, "no load-balancing"),
    ("scoring_func", "softmax", "scoring_func='softmax'"), ("quantization_config", {"quant_method": "fp8"},
                                                            "dequantize"),
    ("router_jitter_noise", 0.1, "router_jitter_noise")])
def test_config_errors_name_the_key(key, value, match):
    kw = {k: v for k, v in DEEPSEEK_TINY.items() if k != "rope_parameters"}
    kw["num_experts_per_tok"] = 4 if key == "topk_group" else kw["num_experts_per_tok"]
    with pytest.raises(ValueError, match=match):
        DeepseekV3Config.from_dict({**kw, key: value, "model_type": "deepseek_v3"})


def test_config_round_trip_reads_hub_spellings(checkpoints):
    config = AutoConfig.from_pretrained(checkpoints["q_lora"][0])
    assert (config.num_experts, config.head_dim, config.rotary_dim, config.layer_is_moe) == (8, 8, 8, [False, True])
    hub = {**config.to_dict(), "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1}
    assert type(config).from_dict(hub).to_dict() == hub


def _check_tp(checkpoints, tp: int, save_dir) -> None:
    """Every checkpoint x (expert tensor parallelism, expert parallelism): the local shapes, transformers' logits,
    and one process's logits, gradients and 3 AdamW steps."""
    layouts = {"etp": DistributedConfig(tp_size=tp), "ep": DistributedConfig(tp_size=tp, enable_expert_parallel=True)}
    for name, (path, expected) in checkpoints.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        for layout, config in layouts.items():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config)
            attn, experts = model.model.layers[1].self_attn, model.model.layers[1].mlp.experts
            q = attn.q_b_proj if name == "q_lora" else attn.q_proj
            assert q.weight.shape[0] == 4 // tp * 16 and attn.kv_b_proj.weight.shape[0] == 4 // tp * 20
            assert attn.kv_a_proj_with_mqa.weight.shape == (24, 32) and attn.o_proj.weight.shape == (32, 4 // tp * 12)
            want = (8, 16 // tp, 32) if layout == "etp" else (8 // tp, 16, 32)
            assert tuple(experts.gate_proj.shape) == want, (name, layout, experts.gate_proj.shape)
            assert experts.tp_dispatch == ("all_to_all" if layout == "ep" and tp == 4 else "all_reduce")
            what = f"{name} tp={tp} {layout}"
            check_against_hf(model, expected, what, HF_TOL)
            if tp == 2 and name == "q_lora":  # fp64, from fp32: the values are transformers' exactly
                model.save_pretrained(save_dir / layout)
            assert_trains_like(model, copy.deepcopy(ref), *batch(seed=2), what=what)


def _check_ep_axis(path, tp: int, ep: int) -> None:
    """Experts over an ep axis (each ep rank feeds its own batch): transformers' logits on this rank's batch, and the
    gradients of the summed per-rank losses equal one process's on the concatenated batch."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64,
                                                 distributed_config=DistributedConfig(tp_size=tp, ep_size=ep))
    dp = dp_mesh(model.device_mesh)
    assert tuple(model.model.layers[1].mlp.experts.gate_proj.shape) == (8 // ep, 16 // tp, 32)
    ids, labels = batch(seed=10 + dp.get_local_rank())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, transformers_fp64(path)(ids).logits, **HF_TOL)
    parts = [batch(seed=10 + r) for r in range(dp.size())]
    all_ids, all_labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    count = int((all_labels[:, 1:] != -100).sum())
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    ref(all_ids, labels=all_labels, num_items_in_batch=count).loss.backward()
    model(ids, labels=labels, num_items_in_batch=count).loss.backward()
    for name, p in model.named_parameters():  # dense gradients summed over dp, as FSDP does in training
        if ".experts." not in name and p.requires_grad:
            dist.all_reduce(p.grad, group=dp.get_group())
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"tp {tp} ep {ep} grad of {name}: {m}")


def _worker(checkpoints, world: int, save_dir) -> None:
    _check_tp(checkpoints, world, save_dir)
    if world == 4:
        _check_ep_axis(checkpoints["q_lora"][0], 2, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_mla_and_experts_over_tp_and_ep_equal_one_process(checkpoints, world, tmp_path):
    run_distributed(_worker, world, checkpoints, world, tmp_path, timeout=600)
    if world == 2:  # saved at tp 2 under both expert layouts: the hub's tensors, bit for bit
        for layout in ("etp", "ep"):
            _assert_same_checkpoint(checkpoints["q_lora"][0], tmp_path / layout)


def test_plan_of_the_published_size():
    """`tptrain plan` of DeepSeek-V3 as published (the config's defaults, on meta): 671B parameters, the MLA heads
    split over 8 ranks, the latents whole, 32 of the 256 experts per rank."""
    from tptrain.diagnostics.plan_report import plan_report
    report = plan_report(DeepseekV3Config(), 8, expert_parallel=True)
    assert not report.problems, report.problems
    text = report.text
    assert "of 2684.11 GB in all" in text, text[-300:]  # 671.03e9 fp32 parameters
    assert "32 whole expert(s) per rank" in text and "58 MoE layer(s) x 256 experts" in text
    rows = {tuple(line.split()[:3]) for line in text.splitlines()}
    assert ("model.layers.[0-60].self_attn.kv_a_proj_with_mqa", "mla_kv_a_proj", "weight") in rows
    q_b = next(line.split() for line in text.splitlines() if ".q_b_proj " in line)
    assert " ".join(q_b[3:7]) == "(24576, 1536) (3072, 1536)"  # 128 heads x 192 rows, 16 heads per rank


def test_layouts_that_cannot_work_are_named(checkpoints):
    """Checked on the config alone (what `tptrain plan` and from_pretrained run on every rank before any collective):
    more ranks than heads; under sequence parallelism a latent norm without its SP rule (it would read a sequence
    shard and nothing would sum its weight gradient). With the model's own SP plan, SP composes
    (tests/test_compose_moe.py)."""
    from tptrain.diagnostics.plan_report import plan_report
    config = AutoConfig.from_pretrained(checkpoints["q_lora"][0])
    assert any("num_attention_heads=4 is not divisible by tp_size=8" in p for p in plan_report(config, 8).problems)
    assert not plan_report(config, 2, sequence_parallel=True).problems
    problems = plan_report(config, 2, sequence_parallel=True,
                           tp_plan={"layers.*.self_attn.kv_a_layernorm": None}).problems
    assert problems == ["model.layers.*.self_attn.kv_a_layernorm (no rule (replicated)) before "
                        "model.layers.*.self_attn.kv_b_proj ('colwise') reads a sequence shard under sequence "
                        "parallelism, so its weight gradient is this rank's tokens' only and nothing sums it; give it "
                        "the 'sequence_parallel' style (as the model's base_model_sp_plan does), or disable sequence "
                        "parallelism"], problems
