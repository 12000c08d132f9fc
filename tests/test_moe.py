"""Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) against transformers 5.23, and their experts
over the TP group: split inside each expert (`expert_tensor_parallel`, the default) or by expert
(`enable_expert_parallel`: summed by the layer's all-reduce, or dispatched and combined by all-to-all).

Tiny random checkpoints written by transformers (hub layout: one tensor per expert), 4 experts, top-2, router aux
loss on, fp64. One spawned job per world size.

    .venv/bin/python -m pytest tests/test_moe.py -q
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import (MOE_HF_TOL as HF_TOL, TOL, assert_grads_match, assert_params_match, check_against_hf,
                                   hf_grad, route_to_first_rank)
from tests.helpers.configs import F64, MOE_FAMILIES as FAMILIES, MOE_TINY as TINY
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference, hf_reference, transformers_fp64
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.distributed.comm import CommTracker
from tptrain.models import AutoConfig, Qwen3MoeConfig
from tptrain.parallel.expert_parallel import all_to_all_wins

EP_STYLES = ("expert_parallel_all_reduce", "expert_parallel_all_to_all")


# {model_type: (directory written by transformers, its fp64 logits and loss on batch())}
CHECKPOINTS = TransformersCheckpoints({t: (t, dict(TINY, **keys)) for t, (_, _, keys) in FAMILIES.items()},
                                      reference=fp64_reference)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tp1_logits_loss_aux_loss_and_grads_match_transformers(checkpoints, model_type):
    path, expected = checkpoints[model_type]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    assert model.config.model_type == model_type and model.config.num_experts == 4
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_proj.shape == (4, model.config.moe_intermediate_size, 64)  # stacked in memory
    check_against_hf(model, expected, model_type, HF_TOL)

    hf = transformers_fp64(path)
    ids, labels = batch()
    out, hf_out = model(ids, labels=labels), hf(ids, labels=labels)
    torch.testing.assert_close(out.aux_loss, hf_out.aux_loss, **HF_TOL)  # fp32, as transformers
    assert out.aux_loss > 0
    out.loss.backward()
    hf_out.loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in model.named_parameters():
        want = hf_grad(hf_grads, name, model.config.moe_intermediate_size)
        torch.testing.assert_close(p.grad, want, **HF_TOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_bf16_arithmetic_is_transformers(checkpoints, model_type):
    """Routing (fp32 softmax, weights cast back, or kept fp32 for Mixtral) and expert sums, bit for bit in bf16."""
    path, _ = checkpoints[model_type]
    import transformers
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf.set_experts_implementation("eager")
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_layers_follow_decoder_sparse_step_and_mlp_only_layers(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"][0], dtype=F64)
    assert hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[1].mlp, "gate_proj")
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 4, "decoder_sparse_step": 2})
    assert config.layer_is_moe == [False, True]
    assert "layers.*.mlp.gate_proj" in config.base_model_tp_plan  # a dense layer keeps the dense MLP's rules


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_save_pretrained_writes_the_hubs_per_expert_layout(checkpoints, model_type, tmp_path):
    path, expected = checkpoints[model_type]
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path)
    theirs, ours = safe_open(path / "model.safetensors", "pt"), safe_open(tmp_path / "model.safetensors", "pt")
    assert set(ours.keys()) == set(theirs.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in ours.keys() or model_type != "mixtral"
    for key in theirs.keys():
        torch.testing.assert_close(ours.get_tensor(key), theirs.get_tensor(key), rtol=0, atol=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config[{"mixtral": "num_local_experts"}.get(model_type, "num_experts")] == 4
    got = hf_reference(transformers_fp64(tmp_path))
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("key, value", [("router_jitter_noise", 0.1), ("scoring_func", "sigmoid"),
                                        ("topk_method", "group_limited_greedy"), ("num_experts_per_tok", 5)])
def test_unsupported_router_options_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        Qwen3MoeConfig.from_dict({**TINY, "num_experts": 4, "model_type": "qwen3_moe", key: value})


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_keys_the_family_ignores_build_nothing(model_type):
    """transformers keeps any keyword in config.json; these families' models never read this one, nor does tptrain."""
    from tests.helpers.configs import DEEPSEEK_TINY

    tiny = DEEPSEEK_TINY if model_type == "deepseek_v3" else {**TINY, "num_experts": 4, "moe_intermediate_size": 16}
    config_class = type(AutoConfig.for_model(model_type))
    config = config_class.from_dict({**tiny, "model_type": model_type, "shared_expert_intermediate_size": 32})
    assert config.shared_expert_intermediate_size is None
    if model_type in ("mixtral", "olmoe"):  # Mixtral's and OLMoE's experts are intermediate_size wide whatever else it says
        assert config.moe_intermediate_size == config.intermediate_size and config.extra["moe_intermediate_size"] == 16
    assert not any(".shared_expert." in k for k in config.base_model_tp_plan)  # (DeepSeek has .shared_experts.)


def _equivalence(model, ref, *, steps: int = 3) -> None:
    """Logits, loss, gradients of every parameter and `steps` AdamW steps equal the single-device `ref`'s."""
    ids, labels = batch(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, **TOL)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_loss.backward(), loss.backward()
        if step == 0:
            assert_grads_match(model, ref)
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    assert_params_match(model, ref, f"{steps} AdamW steps")


def _no_token_on_other_ranks(path, tp: int, style: str) -> None:
    """A batch routed so only rank 0's experts get tokens: no hang, the right result, zero gradients elsewhere."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp, tp_plan={"layers.*.mlp.experts": style}))
    route_to_first_rank(ref, 4 // tp)
    route_to_first_rank(model, 4 // tp)
    _equivalence(model, ref, steps=1)
    ids, labels = batch(seed=2)
    model(ids, labels=labels).loss.backward()
    experts = model.model.layers[0].mlp.experts
    if torch.distributed.get_rank(model.device_mesh["tp"].get_group()) > 0:
        for p in experts.parameters():
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    else:
        assert torch.count_nonzero(experts.down_proj.grad) > 0


def _assert_all_to_all_collectives(model) -> None:
    """Per MoE layer, forward: counts, rows out, rows back (3 all-to-alls) and the shares' all-gather; backward:
    the 2 reverse all-to-alls and the all-gathers of the token share's and routing weights' gradients; bytes: one
    row per (token, expert) assignment each way, as comm_report's minimum counts them from the routing."""
    moe_layers = sum(1 for m in model.modules() if hasattr(m, "route"))
    ids, labels = batch()
    with CommTracker() as t:
        model(ids, labels=labels).loss.backward()
    fwd, bwd = t.counts("forward"), t.counts("backward")
    assert fwd["all_to_all"] == 3 * moe_layers and bwd["all_to_all"] == 2 * moe_layers, t.counts()
    assert fwd["all_gather"] == moe_layers and bwd["all_gather"] == 2 * moe_layers, t.counts()
    model.zero_grad()
    report = comm_report(model, ids, labels)
    assert report.matches_minimum, report.table()
    rows = {(r.phase, r.op): r for r in report.rows}
    assert rows[("forward", "all_to_all")].bytes > 0 and rows[("backward", "all_to_all")].min_count == 2 * moe_layers
    model.zero_grad()


def _worker(checkpoints, tp: int, save_dir) -> None:
    for model_type, (path, expected) in checkpoints.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        inner = ref.config.moe_intermediate_size
        layouts = {"etp": DistributedConfig(tp_size=tp), "ep": DistributedConfig(tp_size=tp,
                                                                                 enable_expert_parallel=True)}
        layouts.update({s: DistributedConfig(tp_size=tp, tp_plan={"layers.*.mlp.experts": s}) for s in EP_STYLES})
        for layout, config in layouts.items():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config)
            experts = model.model.layers[0].mlp.experts
            want = (4, inner // tp, 64) if layout == "etp" else (4 // tp, inner, 64)  # only this rank's slice
            assert tuple(experts.gate_proj.shape) == want, (model_type, layout, experts.gate_proj.shape)
            check_against_hf(model, expected, f"{model_type} tp={tp} {layout}", HF_TOL)
            if tp == 2 and model_type in ("mixtral", "qwen2_moe") and layout in ("etp", "ep"):
                model.save_pretrained(save_dir / f"{model_type}-{layout}")
            if layout == "expert_parallel_all_to_all" or (layout == "ep" and all_to_all_wins(tp, 2)):
                _assert_all_to_all_collectives(model)
                prompt = batch()[0][:1, :9]  # 9 tokens do not split into equal shares: the summing path, exactly
                with torch.no_grad():
                    torch.testing.assert_close(model(prompt).logits, ref(prompt).logits, **TOL)
            else:  # partial outputs summed: the Megatron minimum plus the routing weights' backward all-reduce
                report = comm_report(model, *batch())
                assert report.matches_minimum, f"{model_type} {layout}:\n{report.table()}"
                model.zero_grad()
            _equivalence(model, copy.deepcopy(ref), steps=3 if model_type == "qwen3_moe" else 1)
    for style in EP_STYLES:
        _no_token_on_other_ranks(checkpoints["qwen3_moe"][0], tp, style)
    _bad_layouts_raise_on_every_rank(tp)


def _bad_layouts_raise_on_every_rank(tp: int) -> None:
    """Raised identically on every rank by the plan check, before the mesh's first collective."""
    def config(**kw):
        return AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 4, "moe_intermediate_size": 16, **kw})

    cases = [(config(num_experts=tp + 1, num_experts_per_tok=1), True, "num_experts"),
             (config(moe_intermediate_size=tp * 2 + 1), False, "moe_intermediate_size"),
             (AutoConfig.for_model("qwen3", **{k: v for k, v in TINY.items() if "expert" not in k and "router" not in k}),
              True, "expert parallelism is for mixture-of-experts models")]
    for cfg, ep, match in cases:
        model = AutoModelForCausalLM.from_config(cfg, dtype=F64)
        with pytest.raises(ValueError, match=match):
            model.parallelize(DistributedConfig(tp_size=tp, enable_expert_parallel=ep))
    # SP composes with the expert styles (tests/test_compose_moe.py); a style that needs whole inputs does not
    model = AutoModelForCausalLM.from_config(config(), dtype=F64)
    with pytest.raises(ValueError, match="'moe_identity_expert', which needs its inputs whole: it does not work under "
                                         "sequence parallelism"):
        model.parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=True,
                                            tp_plan={"layers.*.mlp.gate": "moe_identity_expert"}))


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_experts_over_tp_match_transformers_and_a_single_device(checkpoints, tp, tmp_path):
    run_distributed(_worker, tp, checkpoints, tp, tmp_path, timeout=600)
    if tp != 2:
        return
    for model_type in ("mixtral", "qwen2_moe"):  # saved at tp 2 (both layouts): transformers reloads it unchanged
        for layout in ("etp", "ep"):
            got = hf_reference(transformers_fp64(tmp_path / f"{model_type}-{layout}"))
            torch.testing.assert_close(got["logits"], checkpoints[model_type][1]["logits"], rtol=0, atol=0)


def test_plan_shows_experts_per_rank_their_bytes_and_the_dispatch():
    from tptrain.diagnostics.plan_report import plan_report
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 8, "moe_intermediate_size": 16})
    ep2 = plan_report(config, 2, expert_parallel=True).text
    assert "style expert_parallel_all_reduce: 4 whole expert(s) per rank" in ep2, ep2
    assert "expert bytes per rank: 98.30 KB of 196.61 KB" in ep2, ep2  # 2 layers x 4 of 8 experts x 3 x 16 x 64 fp32
    ep4 = plan_report(config, 4, expert_parallel=True).text
    assert "style expert_parallel_all_to_all: 2 whole expert(s) per rank" in ep4 and "3 all-to-alls" in ep4, ep4
    etp = plan_report(config, 4).text
    assert "each split 1/4 along moe_intermediate_size" in etp and "49.15 KB of 196.61 KB" in etp, etp
    bad = plan_report(AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 6}), 4, expert_parallel=True)
    assert any("num_experts=6 must be a multiple of 4" in p for p in bad.problems), bad.problems
