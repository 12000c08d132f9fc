"""The model types the checkpoint survey (scripts/hf_checkpoint_survey.py) found failing, fixed: Gemma 3n's buffers
built by its text model's `_init_weights`; Inkling's shared experts ('all_reduce') and its experts' [gate; up]
halved per rank under a plain 'colwise' (Inkling 2's too, stored interleaved: its routing takes no fp64, so only its
layout is checked here; scripts/hf_checkpoint_survey.py runs it in fp32); normed embeddings kept whole; LongCat-Flash's zero experts ('moe_identity_expert'); MiMo-V2-Flash's
value heads (v_head_dim != head_dim) replicated with its KV heads at tp 4. Tiny checkpoints written by transformers
5.23, fp64, against transformers on one process (logits, loss) and tptrain on one process (gradients, 3 AdamW steps).

    .venv/bin/python -m pytest tests/test_hf_survey_types.py -q
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.helpers.backend import STYLES_TINY as TINY, STYLES_TOL as TOL, trains_like_one_process as _trains_like
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import check_against_hf
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference
from tptrain import AutoModelForCausalLM, DistributedConfig

F64 = torch.float64
_SMALL_INKLING = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, n_routed_experts=4,
                      n_shared_experts=1, num_hidden_layers=2)
# model_type: (config beyond TINY, {module or parameter: what tptrain must have made of it}, tp sizes)
ARCHS = {
    "gemma3n_text": (dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                          num_kv_shared_layers=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
                          laurel_rank=8), {}, (2,)),
    "inkling_text": (_SMALL_INKLING, {"model.layers.1.mlp.shared_experts": "all_reduce", "model.embed_tokens": "whole",
                                      "model.layers.1.mlp.experts.gate_up_proj": "halves"}, (2,)),
    "longcat_flash": (dict(num_layers=1, num_hidden_layers=2, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, kv_lora_rank=32, q_lora_rank=32, head_dim=8, n_routed_experts=4, zero_expert_num=4,
                           expert_ffn_hidden_size=32),
                      {"model.layers.0.mlp.experts.identity_expert": "moe_identity_expert"}, (2,)),
    "mimo_v2_flash": (dict(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"], v_head_dim=8,
                           n_routed_experts=4), {"model.layers.0.self_attn.v_proj.weight": "replicated"}, (4,)),
}


# {model_type: (directory written by transformers, its fp64 logits and loss on batch())}
CHECKPOINTS = TransformersCheckpoints({t: (t, {**TINY, **extra}) for t, (extra, _, _) in ARCHS.items()},
                                      norm_weights={"gemma3n_text": 0.0}, reference=fp64_reference)


def _check_layout(model, facts: dict[str, str], what: str) -> None:
    for name, fact in facts.items():
        if fact == "whole":
            assert name not in model.tp_plan, (what, name, model.tp_plan.get(name))
        elif fact == "halves":  # each of gate and up split alone
            owner, _, leaf = name.rpartition(".")
            assert len(model.get_submodule(owner).tp_param_specs[leaf].segments) == 2, (what, name)
        elif fact == "replicated":  # a KV chunk on tp / num_key_value_heads ranks
            assert model.parallel.tp.specs[name].replicas == 2, (what, name, model.parallel.tp.specs[name])
        else:
            assert model.tp_plan[name] == fact, (what, name, model.tp_plan.get(name))


def _worker(tp: int, checkpoints: dict, out) -> None:
    import torch.distributed as dist
    diffs = {}
    for model_type, (path, expected) in checkpoints.items():
        what = f"{model_type} tp={tp}"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp))
        assert model.backend == "transformers", what
        _check_layout(model, ARCHS[model_type][1], what)
        diffs[model_type] = check_against_hf(model, expected, what, TOL)
        _trains_like(model, AutoModelForCausalLM.from_pretrained(path, dtype=F64), what)
    if dist.get_rank() == 0:
        torch.save(diffs, out)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_survey_types_match_transformers_and_one_process(checkpoints, tmp_path, tp):
    chosen = {t: c for t, c in checkpoints.items() if tp in ARCHS[t][2]}
    out = tmp_path / "diffs.pt"
    run_distributed(_worker, tp, tp, chosen, out, timeout=600)
    diffs = torch.load(out)
    print(f"tp={tp}: max |logits - transformers|:", {t: f"{d:.1e}" for t, d in diffs.items()})
    assert set(diffs) == set(chosen) and all(d < 1e-6 for d in diffs.values()), diffs


def test_all_reduce_style_needs_parameter_rules():
    """'all_reduce' sums its module's partial outputs: without per-parameter rules splitting the module, the sum
    would count it tp_size times, so it is refused, naming the module's type."""
    from tptrain.parallel.styles import make_style
    with pytest.raises(TypeError, match="'all_reduce' needs per-parameter rules splitting a Linear"):
        make_style("all_reduce", where="mlp.shared_experts").param_specs(nn.Linear(4, 4))


def test_which_input_embeddings_become_vocab_parallel():
    """Vocab-parallel only for an nn.Embedding (a subclass scaling its rows too) with no plan rule of its own: one
    with its own submodules (a norm over the looked-up row) or one the plan keeps ('replicate') stays whole."""
    from tptrain.hf.plan import vocab_parallel_embedding

    class Normed(nn.Embedding):
        def __init__(self):
            super().__init__(8, 4)
            self.embed_norm = nn.LayerNorm(4)

    assert vocab_parallel_embedding(nn.Embedding(8, 4), "embed_tokens", {"layers.*.mlp": "colwise"})
    assert not vocab_parallel_embedding(nn.Embedding(8, 4), "embed_tokens", {"embed_tokens": "replicate"})
    assert not vocab_parallel_embedding(Normed(), "embed_tokens", {})
    assert not vocab_parallel_embedding(nn.Linear(4, 8), "embed_tokens", {})


def test_inkling2_experts_split_per_half_and_embedding_whole():
    """Inkling 2's plan says 'colwise' on the experts' gate_up_proj, stored interleaved (w13): transformers' TP cuts
    the stored tensor, so each rank holds its rows of gate and of up; tptrain gives the same split (per half), and
    keeps the normed embedding the plan marks 'replicate' whole."""
    import transformers

    from tptrain.hf.model import TransformersCausalLM
    config = transformers.AutoConfig.for_model("inkling2_text", **{**TINY, **_SMALL_INKLING})
    model = TransformersCausalLM.from_config(config, device="meta")
    spec = model.get_submodule("model.layers.1.mlp.experts").tp_param_specs["gate_up_proj"]
    assert spec.dim == 1 and spec.segments == ((config.moe_intermediate_size, 1),) * 2, spec
    assert "embed_tokens" not in model.tp_base_plan, model.tp_base_plan
