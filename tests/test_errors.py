"""Every bad input gives a clear error naming what is wrong and the fix, raised on EVERY rank before
any collective could hang. The distributed cases all run in one spawned tp=2 job: each rank checks
that it raised the expected error itself (a rank that did not would fail the job, or hang it until
run_distributed's deadline).

    .venv/bin/python -m pytest tests/test_errors.py -q
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.io import CheckpointReader, save_checkpoint
from tptrain.models import MODEL_REGISTRY
from tptrain.parallel.tensor_parallel import check_plan

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _save(root, name: str, *, max_shard_size="5GB", **overrides):
    config = AutoConfig.for_model("qwen3", **{**TINY, **overrides})
    path = root / name
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """{case: checkpoint directory}, each broken in one way."""
    root = tmp_path_factory.mktemp("bad")
    paths = {
        "good": _save(root, "good"),
        "heads": _save(root, "heads", num_attention_heads=3, num_key_value_heads=3),
        "kv_heads": _save(root, "kv_heads", num_attention_heads=6, num_key_value_heads=3),
        "intermediate": _save(root, "intermediate", intermediate_size=97),
        "vocab": _save(root, "vocab", vocab_size=127),
        "missing_shard": _save(root, "missing_shard", max_shard_size="40KB"),
        "truncated": _save(root, "truncated", max_shard_size="40KB"),
        "shape": _save(root, "shape"),
        "model_type": _save(root, "model_type"),
        "negative_size": _save(root, "negative_size"),
    }
    sorted(paths["missing_shard"].glob("model-*.safetensors"))[1].unlink()  # model-00002-of-0000N
    shard = sorted(paths["truncated"].glob("model-*.safetensors"))[2]  # model-00003-of-0000N
    shard.write_bytes(shard.read_bytes()[:-100])
    # One tensor transposed: config.json and every other tensor still agree.
    reader = CheckpointReader(paths["shape"])
    state = {n: reader.read(n) for n in reader.keys()}
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"].t()
    save_checkpoint(state, paths["shape"], extra_files={"config.json": (paths["shape"] / "config.json").read_text()})
    config = json.loads((paths["model_type"] / "config.json").read_text())
    (paths["model_type"] / "config.json").write_text(json.dumps({**config, "model_type": "acme_lm"}))
    _edit_config(paths["negative_size"], intermediate_size=-64)
    return paths


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def _load(path, tp_size=2, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                distributed_config=DistributedConfig(tp_size=tp_size, **kwargs))


def _rank() -> int:
    return int(os.environ["RANK"])


def _no_rules_left(path):
    """A plan override removing every rule: nothing left to shard."""
    config = AutoConfig.from_pretrained(path)
    rules = {glob: None for glob in config.base_model_tp_plan}
    return _load(path, tp_plan={**rules, "lm_head": None})


def _empty_base_plan(path):
    """A model whose config declares no base_model_tp_plan (only the head's plan is left)."""
    config = AutoConfig.from_pretrained(path)
    config.base_model_tp_plan = {}
    return AutoModelForCausalLM.from_config(config).parallelize(DistributedConfig(tp_size=2))


# (case, call, exception type, fragments the message must contain)
CASES = [
    ("heads", lambda p: _load(p["heads"]), ValueError,
     ["num_attention_heads=3 is not divisible by tp_size=2"]),
    ("kv_heads", lambda p: _load(p["kv_heads"]), ValueError,
     ["num_key_value_heads=3 is not divisible by tp_size=2", "divides 3, or a multiple of it"]),
    ("intermediate", lambda p: _load(p["intermediate"]), ValueError,
     ["intermediate_size=97", "model.layers.*.mlp.gate_proj.weight", "(97, 64)", "tp_size=2"]),
    ("vocab", lambda p: _load(p["vocab"]), ValueError,
     ["vocab_size=127", "model.embed_tokens.weight", "lm_head.weight", "pad the vocabulary"]),
    ("world_size", lambda p: _load(p["good"], tp_size=4), ValueError,
     ["DistributedConfig(tp_size=4, dp_shard_size=auto, dp_replicate_size=1)", "multiple of tp_size=4",
      "the world size is 2"]),
    ("unknown_style", lambda p: _load(p["good"], tp_plan={"layers.*.mlp.up_proj": "colwize"}), ValueError,
     ["'model.layers.*.mlp.up_proj'", "unknown style 'colwize'", "known styles: all_reduce, colwise"]),
    ("rule_matches_nothing", lambda p: _load(p["good"], tp_plan={"layers.*.mlp.upproj": "colwise"}), ValueError,
     ["'model.layers.*.mlp.upproj' matches no module", "closest module name: 'model.layers.*.mlp.up_proj'",
      "fix or remove the rule"]),
    ("colwise_into_replicated", lambda p: _load(p["good"], tp_plan={"layers.*.mlp.down_proj": None}), ValueError,
     ["model.layers.*.mlp.gate_proj ('colwise'), model.layers.*.mlp.up_proj ('colwise') split their output",
      "model.layers.*.mlp.down_proj (no rule (replicated)) reads the whole width",
      "make model.layers.*.mlp.down_proj 'rowwise'"]),
    ("replicated_into_rowwise", lambda p: _load(p["good"], tp_plan={"layers.*.self_attn.v_proj": None}),
     ValueError, ["model.layers.*.self_attn.o_proj ('rowwise') expects its input split over the tp ranks",
                  "make model.layers.*.self_attn.v_proj 'colwise'"]),
    ("no_rules_left", lambda p: _no_rules_left(p["good"]), ValueError,
     ["nothing to shard", "tp_size=2", "removed every rule"]),
    ("empty_base_plan", lambda p: _empty_base_plan(p["good"]), ValueError,
     ["declares no base_model_tp_plan", "tp_size=2"]),
    ("model_type", lambda p: _load(p["model_type"]), ValueError,
     ["model_type 'acme_lm' is not supported",
      ", ".join(sorted(MODEL_REGISTRY))]),
    ("missing_shard", lambda p: _load(p["missing_shard"]), FileNotFoundError,
     ["model-00002-of-", ".safetensors", "missing"]),
    ("negative_size", lambda p: _load(p["negative_size"]), ValueError,
     ["Qwen3Config: intermediate_size must be a positive integer, got -64 (config.json's \"intermediate_size\")"]),
    ("truncated", lambda p: _load(p["truncated"]), ValueError,
     ["model-00003-of-", ".safetensors is truncated"]),
    ("shape", lambda p: _load(p["shape"]), ValueError,
     ["'model.layers.1.mlp.down_proj.weight'", "shape (96, 64)", "implies (64, 96)"]),
    # Broken on one rank only (one node's copy): that rank's error is raised on every rank, naming it.
    ("one_rank_missing_shard", lambda p: _load(p["missing_shard" if _rank() == 1 else "good"]), FileNotFoundError,
     ["model-00002-of-", "missing", "(on rank 1 of 2)"]),
    ("one_rank_truncated", lambda p: _load(p["truncated" if _rank() == 0 else "good"]), ValueError,
     ["model-00003-of-", "is truncated", "(on rank 0 of 2)"]),
    ("one_rank_shape", lambda p: _load(p["shape" if _rank() == 1 else "good"]), ValueError,
     ["'model.layers.1.mlp.down_proj.weight'", "(on rank 1 of 2)"]),
    ("device_map", lambda p: AutoModelForCausalLM.from_pretrained(
        p["good"], device_map="cpu", distributed_config=DistributedConfig(tp_size=2)), ValueError,
     ["device_map cannot be combined with distributed_config"]),
]


def _check_case(name, call, error, fragments, paths) -> str:
    with pytest.raises(error) as info:
        call(paths)
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"case {name!r}: message lacks {missing}:\n{message}"
    return message


def _errors_worker(paths) -> None:
    messages = {name: _check_case(name, call, error, fragments, paths) for name, call, error, fragments in CASES}
    # Still in lockstep after every failure: a collective completes on all ranks.
    model = _load(paths["good"])
    assert model.tp_size == 2
    if torch.distributed.get_rank() == 0:
        print("\n\n".join(f"[{k}] {v}" for k, v in messages.items()))


@pytest.mark.distributed
def test_bad_inputs_raise_on_every_rank(bad):
    run_distributed(_errors_worker, 2, bad, timeout=120)


def test_kv_heads_neither_divisor_nor_multiple():
    """tp_size=4 with 3 KV heads: needs a world of 4, so checked on the (pure) validation every rank runs."""
    config = AutoConfig.for_model("qwen3", **{**TINY, "num_attention_heads": 12, "num_key_value_heads": 3})
    model = AutoModelForCausalLM.from_config(config, device="meta")
    problems = check_plan(model, "auto", 4).problems
    assert problems == ["tp_size=4 exceeds num_key_value_heads=3 and is not a multiple of it, so KV heads cannot be "
                        "replicated evenly; use a tp_size that divides 3 or is a multiple of it"]


SIZES = [("qwen3", "intermediate_size", -64, ""), ("qwen3", "num_attention_heads", 0, ""),
         ("qwen3", "hidden_size", True, ""), ("qwen3", "vocab_size", 12.5, ""), ("qwen3", "num_hidden_layers", "2", ""),
         ("qwen3", "head_dim", -16, " or null"), ("qwen3_moe", "moe_intermediate_size", -8, " or null"),
         ("qwen3_moe", "num_experts_per_tok", 0, ""), ("mixtral", "num_local_experts", -4, ""),
         ("mistral", "sliding_window", 0, " or null"), ("smollm3", "no_rope_layer_interval", 0, "")]


@pytest.mark.parametrize("model_type, field, value, null", SIZES)
def test_a_size_that_is_not_a_positive_integer_names_the_field(tmp_path, capsys, model_type, field, value, null):
    """Named by the config check, read from config.json (AutoConfig, AutoModelForCausalLM, `tptrain plan`) or given
    as a keyword, instead of torch's "negative dimension" (or a ZeroDivisionError) from inside the model build."""
    AutoConfig.for_model(model_type, **TINY).save_pretrained(tmp_path)
    _edit_config(tmp_path, **{field: value})
    expected = f"{field} must be a positive integer{null}, got {value!r} (config.json's \"{field}\")"
    for load in (AutoConfig.from_pretrained, lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)):
        with pytest.raises(ValueError) as info:
            load(tmp_path)
        assert expected in str(info.value), info.value
    if field != "num_local_experts":  # the keyword is num_experts; config.json's spelling is Mixtral's
        with pytest.raises(ValueError, match=re.escape(expected)):
            AutoConfig.for_model(model_type, **{**TINY, field: value})
    from tptrain.cli import main
    assert main(["plan", str(tmp_path), "--tp-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tptrain plan: error: ") and expected in err and "Traceback" not in err, err
