"""The model-engine contract (tptrain/parallel/contract.py): every model tptrain builds, native (a tiny model of each
family) or on transformers' modeling code, satisfies its Protocols on exactly the modules its plan splits; the
accessors give their defaults for what a foreign module leaves out; a module lacking a member is refused, named.
No process group: the models are built on meta.

    .venv/bin/python -m pytest tests/test_contract.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tptrain.models.auto import MODEL_REGISTRY, AutoConfig, AutoModelForCausalLM
from tptrain.models.moe import Experts
from tptrain.parallel import contract
from tptrain.parallel.expert_parallel import TPExpertsStyle
from tptrain.parallel.plan import check_plan
from tptrain.parallel.styles import make_style

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _native(model_type: str) -> nn.Module:
    extra = MOE if model_type in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral") else {}
    if model_type == "mixtral":
        extra = {k: v for k, v in extra.items() if k != "moe_intermediate_size"}
    if model_type == "deepseek_v3":  # MLA: a key and a value per head; 4 experts in 2 groups, the first layer dense
        extra = {**MOE, "num_key_value_heads": 4, "head_dim": None, "n_group": 2, "topk_group": 1,
                 "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                 "qk_rope_head_dim": 8, "v_head_dim": 8}
    config = AutoConfig.for_model(model_type, **{**TINY, **extra})
    return AutoModelForCausalLM.from_config(config, device="meta")


def _check_model(model: nn.Module, tp: int = 2) -> None:
    """The model, its config and every module its plan splits declare what the engine reads of them."""
    assert isinstance(model, contract.TPModel), contract.missing(model, contract.TPModel)
    assert isinstance(model.config, contract.TPConfig), contract.missing(model.config, contract.TPConfig)
    resolved = check_plan(model, "auto", tp)
    assert not resolved.problems, resolved.problems
    head = contract.output_head(model)
    assert resolved.vocab_parallel_loss and any(model.get_submodule(n) is head for n in resolved.styles)
    attention = [m for _, m in model.named_modules() if isinstance(m, contract.TPAttention)]
    assert len(attention) == model.config.num_hidden_layers  # every layer's attention is split by heads
    for module in attention:
        kv = contract.kv_projections(module)
        assert all(hasattr(module, n) for n in kv) and (kv or any(is_kv for _, m in module.named_children()
                                                                  for _, is_kv in contract.segments(m)))
    for name, style in resolved.objects.items():
        module, (parent, _, leaf) = model.get_submodule(name), name.rpartition(".")
        if isinstance(style, TPExpertsStyle):
            assert isinstance(module, contract.TPExperts), (name, contract.missing(module, contract.TPExperts))
        if style.fused:
            assert isinstance(module, contract.FusedProjection) and contract.segments(module), name
        if style.name == "distributed_rmsnorm":
            assert isinstance(module, contract.SplitNorm), name
        if style.name == "rowwise":  # a row-parallel module closes a region its parent declares
            owner = model.get_submodule(parent)
            assert isinstance(owner, contract.TPBlock), (parent, type(owner).__name__)
            assert any(hasattr(owner, p) for p in contract.pairs(owner)[leaf]), (name, contract.pairs(owner))


@pytest.mark.parametrize("model_type", sorted(MODEL_REGISTRY))
def test_native_models_satisfy_the_contract(model_type):
    _check_model(_native(model_type))


@pytest.mark.parametrize("model_type", ["llama", "cohere"])
def test_transformers_backend_models_satisfy_the_contract(model_type):
    pytest.importorskip("transformers")
    from tptrain.hf.model import TransformersCausalLM, load_config

    model = AutoModelForCausalLM.from_config(load_config({"model_type": model_type, **TINY}), device="meta")
    assert isinstance(model, TransformersCausalLM)
    _check_model(model)
    assert contract.base_plan(model) == model.tp_base_plan  # its own plan, in tptrain's names, not the config's


def test_native_module_classes_declare_their_facts():
    moe = _native("qwen3_moe")
    layer = moe.model.layers[0]
    assert isinstance(layer.self_attn, contract.TPBlock) and isinstance(layer.self_attn, contract.TPAttention)
    assert contract.kv_projections(layer.self_attn) == ("k_proj", "v_proj")
    assert isinstance(layer.mlp.experts, contract.TPExperts) and isinstance(layer.self_attn.q_norm, contract.SplitNorm)
    assert not isinstance(layer.self_attn.q_proj, contract.FusedProjection)
    assert contract.has_head_loss(moe) and contract.ep_plan(moe.config) == {"layers.*.mlp.experts": "expert_parallel"}
    phi3 = _native("phi3").model.layers[0]
    assert isinstance(phi3.self_attn.qkv_proj, contract.FusedProjection)
    assert [kv for _, kv in contract.segments(phi3.self_attn.qkv_proj)] == [False, True, True]
    assert contract.kv_projections(phi3.self_attn) == () and isinstance(phi3.self_attn, contract.TPAttention)


def test_accessors_give_the_defaults_of_what_a_module_leaves_out():
    bare = nn.Linear(4, 4)
    assert (contract.pairs(bare), contract.kv_projections(bare), contract.segments(bare)) == ({}, (), ())
    assert not isinstance(bare, contract.TPAttention) and not isinstance(bare, contract.SplitNorm)
    model = nn.Module()
    model.config = SimpleNamespace()
    assert (contract.prefix(model), contract.head_plan(model), contract.base_plan(model)) == ("model", {}, {})
    assert contract.output_head(model) is None and contract.plan_problems(model, {}, 2) == []
    assert not contract.has_head_loss(model) and not isinstance(model, contract.TPModel)
    assert (contract.sp_plan(model.config), contract.ep_plan(model.config)) == ({}, {})
    assert contract.attention_heads(model.config) is None and contract.kv_heads(model.config) is None
    assert contract.kv_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=None)) == 4
    assert contract.kv_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)) == 2
    model.tp_base_plan = {"layers.*.q": "colwise"}
    model.config.base_model_tp_plan = {"layers.*.k": "colwise"}
    assert contract.base_plan(model) == {"layers.*.q": "colwise"}  # the model's own plan wins over its config's


def test_a_module_lacking_a_member_is_refused_naming_it():
    experts = Experts(4, 8, 6, top_k=2)
    assert contract.missing(experts, contract.TPExperts) == []
    assert contract.members(contract.TPExperts) == ("down_proj", "expert_offset", "forward", "gate_proj", "grouped",
                                                    "num_experts", "top_k", "up_proj")
    del experts.top_k
    assert contract.missing(experts, contract.TPExperts) == ["top_k"]
    with pytest.raises(TypeError, match=r"needs a stacked-experts module \(down_proj, .*without \['top_k'\]"):
        make_style("expert_tensor_parallel", where="experts").param_specs(experts)
    with pytest.raises(TypeError, match="needs a module declaring tp_segments"):
        make_style("fused_colwise", where="qkv").param_specs(nn.Linear(4, 12))
    with pytest.raises(TypeError, match="needs a norm with a mean_square"):
        make_style("distributed_rmsnorm", where="norm").install(nn.LayerNorm(4), ctx=None)
    assert contract.missing(torch.nn.Module(), contract.TPBlock) == ["tp_pairs"]
