"""Single-device model code against transformers 5.23 as the oracle (tiny random checkpoints, CPU, fp32).

    .venv/bin/python -m pytest tests/test_models.py -q
"""
from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import safetensors.torch
import torch
import transformers
from torch import nn

from tests.helpers.batches import labelled_batch
from tests.helpers.checkpoints import TransformersCheckpoints, randomize
from tptrain.models import MODEL_REGISTRY, AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config
from tptrain.models.rope import rope_inv_freq

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256)
CASES = {
    # llama3 rope scaling (all three frequency bands hit at head_dim 16) and tied embeddings
    "llama": dict(TINY, model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True, rope_scaling={
                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # 4:1 GQA, q/k/v bias
    "qwen2": dict(TINY, model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6),
    # q/k norm, head_dim (24) != hidden_size / heads (16)
    "qwen3": dict(TINY, model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}
ATOL = RTOL = 1e-5
# {arch: (directory of a transformers-written checkpoint, the transformers model)}, every parameter random (norms
# around 1), so zero-init biases and unit norms are tested too
CHECKPOINTS = TransformersCheckpoints({arch: (kw["model_type"], {k: v for k, v in kw.items() if k != "model_type"})
                                       for arch, kw in CASES.items()}, reference=lambda hf: hf)
# every row's first 3 labels and 3 of row 1's last 5 ignored
_batch = partial(labelled_batch, TINY["vocab_size"], s=24, ignored=((slice(None), slice(None, 3)), (1, slice(-5, -2))))


def load_weights(model: nn.Module, checkpoint_dir) -> None:
    """Stand-in for the sharded loader (tptrain.modeling.from_pretrained): one full state dict."""
    state = safetensors.torch.load_file(checkpoint_dir / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (missing, unexpected)


def _load_tptrain(path) -> nn.Module:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    load_weights(model, path)
    return model.eval()


@pytest.mark.parametrize("arch", sorted(CASES))
def test_logits_loss_and_grads_match_transformers(checkpoints, arch):
    path, hf = checkpoints[arch]
    model = _load_tptrain(path)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids, labels = _batch()

    out, ref = model(input_ids, labels=labels, return_logits=True), hf(input_ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=RTOL)

    n_items = torch.tensor(50)  # e.g. real tokens over several micro-batches
    out = model(input_ids, labels=labels, num_items_in_batch=n_items)
    ref = hf(input_ids, labels=labels, num_items_in_batch=n_items)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=RTOL)
    model.zero_grad(), hf.zero_grad()
    out.loss.backward(), ref.loss.backward()
    ref_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_rope_inv_freq_is_transformers(checkpoints, arch):
    path, hf = checkpoints[arch]
    assert torch.equal(rope_inv_freq(AutoConfig.from_pretrained(path)), hf.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_left_padding_mask(checkpoints, arch):
    path, hf = checkpoints[arch]
    model = _load_tptrain(path)
    input_ids, _ = _batch(s=12)
    mask = torch.ones_like(input_ids)
    mask[0, :5] = 0  # row 0 left-padded by 5
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()

    out = model(input_ids, attention_mask=mask, position_ids=position_ids).logits
    ref = hf(input_ids, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=RTOL)
    assert torch.isfinite(out).all()
    alone = model(input_ids[:1, 5:]).logits  # the same sequence without its padding
    torch.testing.assert_close(out[0, 5:], alone[0], atol=ATOL, rtol=RTOL)
    # Gradients stay finite although padded queries see no key at all.
    out = model(input_ids, labels=input_ids.masked_fill(~real, -100), attention_mask=mask)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", sorted(CASES))
def test_saved_config_builds_identical_transformers_model(arch, tmp_path):
    kwargs = dict(CASES[arch])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.save_pretrained(tmp_path)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model)

    hf.load_state_dict(model.state_dict())  # strict: same names, same shapes
    assert torch.equal(rope_inv_freq(config), hf.model.rotary_emb.inv_freq)
    input_ids, labels = _batch()
    out, ref = model(input_ids, labels=labels, return_logits=True), hf(input_ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=RTOL)
    assert AutoConfig.from_pretrained(tmp_path) == config


# Llama-3.2-1B's config.json as published (legacy rope keys, torch_dtype, transformers 4 keys).
LLAMA32_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_published_legacy_config_round_trips(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA32_CONFIG))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, LlamaConfig)
    assert (config.rope_theta, config.rope_type, config.torch_dtype) == (500000.0, "llama3", "bfloat16")
    assert config.extra["transformers_version"] == "4.45.0.dev0"
    written = config.to_dict()
    assert {k: written[k] for k in LLAMA32_CONFIG} == LLAMA32_CONFIG
    hf_config = transformers.LlamaConfig.from_dict(LLAMA32_CONFIG)
    ref, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    assert torch.equal(rope_inv_freq(config), ref)


def test_transformers5_rope_parameters_and_dtype():
    config = Qwen3Config.from_dict({
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}})
    assert (config.rope_theta, config.rope_scaling, config.torch_dtype) == (1000000, None, "bfloat16")
    assert config.head_dim == 128  # transformers' Qwen3 default, not hidden_size // heads
    scaled = LlamaConfig.from_dict({"rope_parameters": dict(CASES["llama"]["rope_scaling"], rope_theta=5e5)})
    assert scaled.rope_theta == 5e5 and scaled.rope_type == "llama3"
    assert "rope_theta" not in scaled.rope_scaling


def test_unknown_model_type_and_unsupported_features(tmp_path):
    supported = ", ".join(sorted(MODEL_REGISTRY))
    assert {"llama", "qwen3", "ministral3", "olmo3", "phi3", "qwen3_moe", "mixtral"} <= set(MODEL_REGISTRY)
    with pytest.raises(ValueError, match=f"'gpt2' is not supported.*{supported}"):
        AutoConfig.for_model("gpt2")
    # Unknown to transformers too (a type only transformers knows runs on the transformers backend: test_hf_*).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "acme_lm"}))
    with pytest.raises(ValueError, match=f"'acme_lm' is not supported.*{supported}"):
        AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="AutoConfig"):
        LlamaConfig.from_dict({"model_type": "qwen2"})
    with pytest.raises(ValueError, match="dynamic"):
        LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="use_sliding_window"):
        AutoConfig.for_model("qwen2", extra={"use_sliding_window": True})
    with pytest.raises(TypeError, match="needs a LlamaConfig, got Qwen3Config"):
        LlamaForCausalLM(Qwen3Config(**TINY, num_attention_heads=4))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        AutoConfig.from_pretrained(tmp_path / "empty")


def test_each_model_class_is_the_decoder_made_from_its_registry_entry(tmp_path):
    import pickle

    import tptrain.models
    from tptrain.models.decoder import DecoderForCausalLM
    from tptrain.models.registry import NATIVE_MODEL_TYPES

    for model_type, (config_name, model_name) in NATIVE_MODEL_TYPES.items():
        cls = getattr(tptrain.models, model_name)
        assert MODEL_REGISTRY[model_type] == (getattr(tptrain.models, config_name), cls), model_type
        assert cls.__name__ == model_name and cls.__mro__[1] is DecoderForCausalLM, cls.__mro__
        assert cls.config_class.model_type == model_type and pickle.loads(pickle.dumps(cls)) is cls
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_attention_heads=4))
    assert type(model).__name__ == "LlamaForCausalLM"
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(AttributeError, match="GPT2ForCausalLM"):
        _ = tptrain.models.GPT2ForCausalLM


def _shard(linear: nn.Linear, dim: int, chunks: int, index: int) -> nn.Linear:
    """A copy of `linear` holding chunk `index` of its weight (and bias) split along `dim`."""
    shard = copy.deepcopy(linear)
    shard.weight = nn.Parameter(linear.weight.chunk(chunks, dim)[index])
    if linear.bias is not None:
        shard.bias = nn.Parameter(linear.bias.chunk(chunks, 0)[index] if dim == 0 else linear.bias / chunks)
    return shard


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_and_mlp_run_on_sharded_weights(tp):
    """The TP contract: with q/k/v/gate/up split by rows and o/down by columns, the same module code
    runs on local heads, and the shard outputs sum to the full output (tp=4 replicates KV heads)."""
    torch.manual_seed(0)
    config = Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         attention_bias=True)
    model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    randomize(layer)
    x = torch.randn(2, 10, config.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(10)[None])
    kv_replicas = max(1, tp // config.num_key_value_heads)
    attn_parts, mlp_parts = [], []
    for rank in range(tp):
        attn, mlp = copy.deepcopy(layer.self_attn), copy.deepcopy(layer.mlp)
        attn.q_proj = _shard(layer.self_attn.q_proj, 0, tp, rank)
        attn.k_proj = _shard(layer.self_attn.k_proj, 0, tp // kv_replicas, rank // kv_replicas)
        attn.v_proj = _shard(layer.self_attn.v_proj, 0, tp // kv_replicas, rank // kv_replicas)
        attn.o_proj = _shard(layer.self_attn.o_proj, 1, tp, rank)
        mlp.gate_proj, mlp.up_proj = (_shard(m, 0, tp, rank) for m in (mlp.gate_proj, mlp.up_proj))
        mlp.down_proj = _shard(layer.mlp.down_proj, 1, tp, rank)
        attn_parts.append(attn(x, cos, sin, None))
        mlp_parts.append(mlp(x))
    torch.testing.assert_close(sum(attn_parts), layer.self_attn(x, cos, sin, None), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(sum(mlp_parts), layer.mlp(x), atol=ATOL, rtol=RTOL)


def test_meta_build_materialise_and_init():
    config = AutoConfig.for_model("qwen2", **TINY, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, device="meta")
    assert all(p.is_meta for p in model.parameters()) and not list(model.buffers())
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.bias, torch.zeros(64)) and attn.o_proj.bias is None
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert 0.015 < model.model.layers[1].mlp.up_proj.weight.std() < 0.025
    input_ids, labels = _batch()
    assert torch.isfinite(model(input_ids, labels=labels).loss)


def test_gradient_checkpointing_and_bf16():
    torch.manual_seed(0)
    config = Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    model = AutoModelForCausalLM.from_config(config)
    input_ids, labels = _batch()
    model(input_ids, labels=labels).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(input_ids, labels=labels).loss.backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, atol=ATOL, rtol=RTOL)

    bf16 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    out = bf16(input_ids, labels=labels, return_logits=True)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, model(input_ids, labels=labels).loss, atol=2e-2, rtol=0)


@pytest.mark.parametrize("queries, masked", [(24, False), (10, False), (24, True)])
def test_attention_takes_sdpa_own_gqa_where_it_runs(queries, masked, monkeypatch):
    """Plain causal attention (the whole sequence, or on CPU queries at the end of longer keys: context
    parallelism's chunks) gives SDPA the KV heads as they are (`enable_gqa`, no expanded copy of k and v); a
    materialised mask keeps the expansion. Outputs and gradients equal the expanded heads' in fp64."""
    from tptrain.models.decoder import Attention
    from tptrain.models.layers import causal_mask, sdpa

    attn = Attention(Qwen3Config(**dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16)))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, queries, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 24, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = causal_mask(24, device=q.device, sliding_window=8) if masked else None
    calls, sdpa_fn = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((a[1].shape[1], kw.get("enable_gqa"))) or sdpa_fn(*a, **kw))
    out = attn.attend(q, k, v, mask)
    assert calls == [(4, False) if masked else (2, True)], calls
    ref = sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask, scale=attn.scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    mine, theirs = torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
