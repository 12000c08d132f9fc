"""What the transformers backend refuses, each with a clear error, and what `tptrain plan` says about backends.
No process group: the plan check is pure, and every refusal happens before any collective.

    .venv/bin/python -m pytest tests/test_hf_errors.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.cli import main as cli_main
from tptrain.models.auto import select_backend
from tptrain.parallel.plan import check_plan

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config_dir(tmp_path, model_type: str, **extra):
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **TINY, **extra}))
    return path


def _meta_model(model_type: str, **extra):
    from tptrain.hf.model import load_config
    return AutoModelForCausalLM.from_config(load_config({"model_type": model_type, **TINY, **extra}), device="meta")


def test_remote_code_is_out_of_scope(tmp_path):
    path = _config_dir(tmp_path, "starcoder2", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(ValueError, match="auto_map.*trust_remote_code.*Out of scope"):
        AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="trust_remote_code is out of scope"):
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def test_a_checkpoint_transformers_converts_on_load_loads_through_its_rules(tmp_path):
    """Was refused (issue 21): transformers' own rules (MergeModulelist + Concatenate) now build the experts."""
    import transformers
    config = transformers.MixtralConfig(**TINY, num_local_experts=2, num_experts_per_tok=1)
    hf = transformers.MixtralForCausalLM(config)
    hf.save_pretrained(tmp_path)  # written in the hub's per-expert layout
    assert AutoModelForCausalLM.from_pretrained(tmp_path).backend == "native"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, backend="transformers")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in list(model.checkpoint_keys()[
        "model.layers.0.mlp.experts.gate_up_proj"].keys())
    expected = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_transformers_style_tptrain_lacks_is_named():
    # glm's rowwise_split_input and inkling_text's all_reduce, named here before tptrain had them, now load
    # (tests/test_hf_styles.py, tests/test_hf_survey_types.py); transformers' embedding_colwise is refused, named
    from tptrain.hf.plan import translate_plan
    model = _meta_model("starcoder2")
    problems = check_plan(model, translate_plan({"model.embed_tokens": "embedding_colwise"}), 2).problems
    assert any("unknown style 'embedding_colwise'" in p and "model.embed_tokens" in p for p in problems), problems
    assert not check_plan(_meta_model("glm", partial_rotary_factor=0.5), "auto", 2).problems
    assert not check_plan(_meta_model("inkling_text", swa_num_attention_heads=4, swa_num_key_value_heads=2),
                          "auto", 2).problems


def test_a_weight_between_split_projections_without_a_rule_is_a_problem():
    model = _meta_model("cohere", use_qk_norm=True)  # LayerNorm over (heads, head_dim): not in transformers' plan
    problems = check_plan(model, "auto", 2).problems
    assert any("model.layers.*.self_attn.q_norm (CohereLayerNorm" in p and "no rule" in p for p in problems), problems
    assert not check_plan(_meta_model("cohere"), "auto", 2).problems
    assert not check_plan(model, "auto", 1).problems  # on one device it is simply transformers' model


def test_backend_choices_and_sequence_parallel():
    with pytest.raises(ValueError, match="backend must be one of auto, native, transformers"):
        DistributedConfig(tp_size=1, backend="hf").sizes(1)
    with pytest.raises(ValueError, match="model_type 'starcoder2' is not supported by tptrain"):
        select_backend("starcoder2", "native")
    model = _meta_model("starcoder2")
    with pytest.raises(ValueError, match="sequence parallelism is not supported on the transformers backend"):
        model._check_plan(DistributedConfig(tp_size=1, enable_sequence_parallel=True))


def test_the_backends_are_one_list_everywhere(capsys):
    import tptrain.distributed
    from tptrain.backends import BACKENDS
    assert tptrain.distributed.BACKENDS is BACKENDS
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'native' or 'transformers', got 'hf'"):
        select_backend("llama", "hf")
    with pytest.raises(SystemExit):
        cli_main(["plan", "x", "--tp-size", "1", "--backend", "hf"])
    err = capsys.readouterr().err
    assert "invalid choice" in err and all(backend in err.rpartition("choose from")[2] for backend in BACKENDS)
    assert BACKENDS == ("auto", "native", "transformers")


def test_plan_cli_says_which_backend(tmp_path, capsys):
    starcoder, llama = _config_dir(tmp_path, "starcoder2"), _config_dir(tmp_path, "llama")
    assert cli_main(["plan", str(starcoder), "--tp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "Starcoder2ForCausalLM" in out and "backend: transformers" in out and "layout OK" in out, out
    k_proj = next(line.split() for line in out.splitlines() if line.startswith("model.layers.[0-1].self_attn.k_proj"))
    assert k_proj[1] == "colwise" and out.count("each chunk on 2 ranks") == 4, out  # k/v weight and bias
    assert cli_main(["plan", str(llama), "--tp-size", "2"]) == 0
    assert "backend: native" in capsys.readouterr().out
    assert cli_main(["plan", str(llama), "--tp-size", "2", "--backend", "transformers"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "backend: transformers" in out, out
    assert cli_main(["plan", str(starcoder), "--tp-size", "2", "--backend", "native"]) == 1
    assert "not supported by tptrain" in capsys.readouterr().err


def test_meta_build_reads_nothing_and_random_init_is_transformers():
    model = _meta_model("starcoder2")
    assert all(p.device.type == "meta" for p in model.parameters()) and model.backend == "transformers"
    from tptrain.hf.model import load_config
    model = AutoModelForCausalLM.from_config(load_config({"model_type": "helium", **TINY}), dtype=torch.float64)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())
    assert model(torch.randint(0, 128, (1, 5)), labels=torch.randint(0, 128, (1, 5))).loss.isfinite()


def test_per_parameter_moe_styles_are_named():
    # Under an owner ruled 'moe_tp_experts' (mixtral's experts) the per-parameter rules apply (each packed half of
    # gate_up split alone); under any other owner they are refused, naming the rule and the owner's style.
    model = _meta_model("mixtral", num_local_experts=2, num_experts_per_tok=1)
    assert not check_plan(model, "auto", 2).problems
    assert model.get_submodule("model.layers.0.mlp.experts").tp_param_specs["gate_up_proj"].segments == ((96, 1),) * 2
    from tptrain.hf.plan import parameter_rules
    _, problems = parameter_rules(model, {"model.layers.*.mlp.experts.gate_up_proj": "colwise",
                                          "model.layers.*.mlp.experts": "rowwise"})
    assert any("'model.layers.*.mlp.experts.gate_up_proj' ('colwise') names a parameter" in p
               and "has 'rowwise'" in p for p in problems.values()), problems
