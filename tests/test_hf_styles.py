"""transformers' styles tptrain's transformers backend had not (rowwise_split_input, local_params, moe_tp_experts
with its per-parameter packed_colwise / packed_rowwise rules, mla_kv_a_proj; ep_dispatch_experts under
enable_expert_parallel), what the plans leave without a rule
(hf/probe.py), buffers made at init (Gemma's embed_scale) and configs with special floats (nemotron_h). Tiny random
checkpoints written by transformers 5.23 itself, fp64, compared with transformers on one process (logits, loss) and
with tptrain on one process (gradients, 3 AdamW steps); one spawned job per world size runs every type.

    .venv/bin/python -m pytest tests/test_hf_styles.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.backend import STYLES_TINY as TINY, STYLES_TOL as TOL, trains_like_one_process as _trains_like
from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import check_against_hf
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference
from tptrain import AutoModelForCausalLM, DistributedConfig

F64 = torch.float64
# model_type: (the module whose style (or rule) it shows, that style, config beyond TINY)
ARCHS = {
    "glm": ("model.layers.0.mlp.down_proj", "rowwise_split_input", {}),
    "granite_swa": ("model.layers.0.self_attn", "local_params", {}),  # attention sinks, one per query head
    "granitemoe_swa": ("model.layers.0.block_sparse_moe.experts", "moe_tp_experts", {}),  # + packed_colwise
    "llama4_text": ("model.layers.0.feed_forward.experts", "moe_tp_experts", {}),  # + packed_rowwise
    "minicpm3": ("model.layers.0.self_attn.kv_a_proj_with_mqa", "mla_kv_a_proj",
                 dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=16)),
    "apertus": ("model.layers.0.mlp.act_fn", "replicated_with_grad_allreduce", {}),  # no rule: found by hf/probe.py
    "gemma": ("model.embed_tokens", "embedding_rowwise", {}),  # its embed_scale buffer, built at init
    "qwen3_5_text": ("model.layers.0.linear_attn.out_proj", "colwise_gather_output",
                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])),
}
# A parameter each type must hold split (dim) at tp > 1: the new rule is applied, not skipped.
SPLIT = {"granite_swa": ("model.layers.0.self_attn.sinks", 0),
         "granitemoe_swa": ("model.layers.0.block_sparse_moe.experts.gate_up_proj", 1),
         "llama4_text": ("model.layers.0.feed_forward.experts.gate_up_proj", 2),
         "glm": ("model.layers.0.mlp.down_proj.weight", 1)}
TP4 = ("llama4_text", "minicpm3")  # tp 4: KV heads replicated (2 KV heads), MLA over all 4 heads
EP = "granitemoe_swa"  # also with enable_expert_parallel (transformers' base_model_ep_plan), at tp 2
# comm_report's minimum equals the step's collectives (tp 2): the experts' one sum (moe_tp_experts, and
# ep_dispatch_experts under EP), MLA's three narrow boundaries (no tp_pairs on transformers' modules). Not Llama 4:
# its experts run on every token repeated num_experts times, a (experts x tokens, hidden) boundary.
AT_MINIMUM = ("granitemoe_swa", "minicpm3")

# {model_type: (directory written by transformers, its fp64 logits and loss on batch())}
CHECKPOINTS = TransformersCheckpoints({t: (t, {**TINY, **extra}) for t, (_, _, extra) in ARCHS.items()},
                                      norm_weights={"gemma": 0.0}, reference=fp64_reference)


def _worker(tp: int, checkpoints: dict, out) -> None:
    import torch.distributed as dist
    diffs = {}
    for model_type, (path, expected) in checkpoints.items():
        module, style, _ = ARCHS[model_type]
        what = f"{model_type} tp={tp}"
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp))
        assert model.backend == "transformers" and model.tp_plan[module] == style, (what, model.tp_plan.get(module))
        if model_type in SPLIT:
            name, dim = SPLIT[model_type]
            assert model.parallel.tp.specs[name].dim == dim, (what, model.parallel.tp.specs[name])
            assert dict(model.named_parameters())[name].shape[dim] * tp == model.parallel.tp.global_shapes[name][dim]
        diffs[model_type] = check_against_hf(model, expected, what, TOL)
        if tp == 2 and model_type in AT_MINIMUM:
            _at_minimum(model, what)
        _trains_like(model, ref, what)
        if model_type == EP:  # transformers' base_model_ep_plan: experts split by expert over tp
            _expert_parallel(path, expected, tp)
    if dist.get_rank() == 0:
        torch.save(diffs, out)


def _expert_parallel(path, expected, tp: int) -> None:
    what = f"granitemoe_swa tp={tp} enable_expert_parallel"
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp, enable_expert_parallel=True))
    experts = "model.layers.0.block_sparse_moe.experts"
    assert model.tp_plan[experts] == "ep_dispatch_experts", model.tp_plan[experts]
    assert model.get_submodule(experts).gate_up_proj.shape[0] == TINY["num_local_experts"] // tp  # whole experts
    check_against_hf(model, expected, what, TOL)
    if tp == 2:
        _at_minimum(model, what)
    _trains_like(model, AutoModelForCausalLM.from_pretrained(path, dtype=F64), what)


def _at_minimum(model, what: str) -> None:
    from tptrain.diagnostics.accounting import comm_report

    report = comm_report(model, *batch(seed=3))
    assert report.matches_minimum, f"{what}\n{report.table()}"
    model.zero_grad()


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_new_styles_match_transformers_and_one_process(checkpoints, tmp_path, tp):
    chosen = {t: c for t, c in checkpoints.items() if tp == 2 or t in TP4}
    out = tmp_path / "diffs.pt"
    run_distributed(_worker, tp, tp, chosen, out, timeout=600)
    diffs = torch.load(out)
    print(f"tp={tp}: max |logits - transformers|:", {t: f"{d:.1e}" for t, d in diffs.items()})
    assert set(diffs) == set(chosen) and all(d < 1e-6 for d in diffs.values()), diffs


def test_special_floats_in_config_read_and_written(tmp_path):
    """nemotron_h's time_step_limit holds inf, which transformers writes as {"__float__": "Infinity"}: tptrain
    reads it back as inf and writes it the same way, so transformers reads tptrain's config.json too."""
    import transformers

    from tptrain.hf.model import TransformersCausalLM, load_config
    config = transformers.NemotronHConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                          hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16,
                                          n_groups=2, ssm_state_size=16, num_attention_heads=4, head_dim=16,
                                          num_key_value_heads=2, intermediate_size=96)
    config.save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    loaded = load_config(tmp_path)
    assert list(loaded.time_step_limit) == [0.0, float("inf")]
    model = TransformersCausalLM.from_config(loaded, device="meta")
    written = json.loads(model.config_json(F64))
    assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    (tmp_path / "config.json").write_text(model.config_json(F64))
    assert list(transformers.AutoConfig.from_pretrained(tmp_path).time_step_limit) == [0.0, float("inf")]
