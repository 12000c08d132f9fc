"""LoRA on tensor-parallel models against the same adapter on one device (fp64), plus every bad input.

    .venv/bin/python -m pytest tests/test_lora.py -q
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from tests.helpers.batches import labelled_batch
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.distributed.comm import CommTracker, all_gather
from tptrain.parallel.tensor_parallel import gather_full
from tptrain.peft import LoraConfig, PeftModel, get_peft_model

TOL = dict(rtol=1e-10, atol=1e-10)
# num_key_value_heads=2: at tp 4 the KV projections (and their LoRA B) are replicated over 2 ranks.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attention_bias=True)
# Every linear layer (colwise, rowwise, the vocab-parallel head) plus the vocab-parallel embedding.
EVERYTHING = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
batch = partial(labelled_batch, TINY["vocab_size"])


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY), dtype=torch.float64)


def randomize_adapter(peft: PeftModel, seed: int = 1) -> None:
    """Non-zero A and B everywhere (peft's init zeroes one factor, which would hide half the gradients)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base checkpoint dir, adapter dir): a tiny base and a random adapter on every module, single device."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_model()
    base.save_pretrained(root / "base")
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=EVERYTHING, bias="lora_only"))
    randomize_adapter(peft)
    peft.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


# ------------------------------------------------------------------ single device


def test_frozen_base_and_peft_names(saved):
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in dict(model.named_parameters())
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)

    with safe_open(str(saved[1] / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_slice("base_model.model.model.embed_tokens.lora_embedding_A").get_shape()) == (4, 128)
        assert tuple(f.get_slice("base_model.model.model.embed_tokens.lora_embedding_B").get_shape()) == (64, 4)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" in keys  # bias="lora_only"
    config = json.loads((saved[1] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["bias"] == "lora_only"


def test_target_matching_follows_peft():
    model = tiny_model()
    config = LoraConfig(target_modules="all-linear")
    peft = get_peft_model(model, config)
    targets = peft.peft_config["default"].target_modules
    assert "lm_head" not in targets and len(targets) == 7 * TINY["num_hidden_layers"]  # peft spares the head
    regex = get_peft_model(tiny_model(), LoraConfig(target_modules=r".*layers\.1\.self_attn\.(q|v)_proj"))
    assert sorted(regex.lora_layers) == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    suffix = get_peft_model(tiny_model(), LoraConfig(target_modules=["self_attn.o_proj"]))
    assert len(suffix.lora_layers) == TINY["num_hidden_layers"]


def test_merge_and_unload_single_device(tmp_path, saved):
    base_dir, adapter_dir = saved
    ids, _ = batch()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    expected = peft(ids).logits
    merged = peft.merge_and_unload()
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(reloaded(ids).logits, expected, **TOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(r=0), "r must be a positive int"),
    (dict(r=-2), "r must be a positive int"),
    (dict(bias="some"), "bias must be one of"),
    (dict(lora_dropout=1.0), "lora_dropout must be in"),
    (dict(target_modules=[]), "non-empty list"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)


def test_model_errors(tmp_path, saved):
    with pytest.raises(ValueError, match=r"matches no module of Qwen2ForCausalLM"):
        get_peft_model(tiny_model(), LoraConfig(target_modules=["qkv_proj"]))
    with pytest.raises(ValueError, match=r"cannot adapt 'model.layers.0.input_layernorm': it is a RMSNorm"):
        get_peft_model(tiny_model(), LoraConfig(target_modules=["input_layernorm"]))
    with pytest.raises(ValueError, match="modules_to_save entries"):
        get_peft_model(tiny_model(), LoraConfig(modules_to_save=["classifier"]))
    with pytest.raises(FileNotFoundError, match="no adapter_config.json.*full model checkpoint"):
        PeftModel.from_pretrained(tiny_model(), saved[0])
    # An adapter for another base: hidden size 32 instead of 64 -> the tensor and both shapes are named.
    small = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **{**TINY, "hidden_size": 32}))
    get_peft_model(small, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "small")
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'.*"
                                         r"shape \(4, 32\), but this model needs \(4, 64\)"):
        PeftModel.from_pretrained(model, tmp_path / "small")
    assert [n for n, _ in model.named_parameters()] == names, "a failed load leaves the base model untouched"
    config = json.loads((tmp_path / "small" / "adapter_config.json").read_text())
    (tmp_path / "small" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="does not implement.*use_dora"):
        PeftModel.from_pretrained(model, tmp_path / "small")
    with pytest.raises(TypeError, match="already has LoRA adapters"):
        get_peft_model(get_peft_model(tiny_model(), LoraConfig()), LoraConfig())


# ------------------------------------------------------------------ tensor parallel == single device


def _adapter_grads(peft: PeftModel) -> dict[str, torch.Tensor]:
    model = peft.get_base_model()
    layout = model.parallel.tp
    return {n: p.grad if layout is None else gather_full(p.grad, layout.specs[n], layout.ctx)
            for n, p in model.named_parameters() if p.requires_grad}


def _adapter_params(peft: PeftModel) -> dict[str, torch.Tensor]:
    model = peft.get_base_model()
    layout = model.parallel.tp
    return {n: p.detach() if layout is None else gather_full(p.detach(), layout.specs[n], layout.ctx)
            for n, p in model.named_parameters() if ".lora_" in n}


def _train_and_compare(ref: PeftModel, model: PeftModel, steps: int = 3) -> None:
    ids, labels = batch()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_loss.backward()
        loss.backward()
        if step == 0:
            grads, ref_grads = _adapter_grads(model), _adapter_grads(ref)
            assert grads.keys() == ref_grads.keys() and len(grads) > 30
            for n, g in ref_grads.items():
                torch.testing.assert_close(grads[n], g, **TOL, msg=lambda m: f"grad of {n}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = _adapter_params(model)
    for n, p in _adapter_params(ref).items():
        torch.testing.assert_close(params[n], p, **TOL, msg=lambda m: f"{n} after {steps} AdamW steps: {m}")


def _replicated_factors_agree(peft: PeftModel) -> None:
    layout = peft.get_base_model().parallel.tp
    for n, p in peft.get_base_model().named_parameters():
        if ".lora_" in n and layout.specs[n].dim is None:
            every = all_gather(p.detach()[None], layout.ctx.group, dim=0)
            assert all(torch.equal(every[i], every[0]) for i in range(layout.ctx.size)), n


def _equivalence_worker(tp: int, base_dir, adapter_dir, out_dir) -> None:
    config = DistributedConfig(tp_size=tp)
    # 1. A saved adapter loaded onto a sharded base (each rank reads its slice) trains like one device.
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir, is_trainable=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, distributed_config=config)
    with CommTracker() as plain:
        base(*batch()[:1], labels=batch()[1]).loss.backward()
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    base.zero_grad(set_to_none=True)
    with CommTracker() as lora:
        model(*batch()[:1], labels=batch()[1]).loss.backward()
    assert all((p.grad is None) != p.requires_grad for p in model.parameters()), "frozen base: no gradients"
    # LoRA adds no activation collective: the same ops and bytes forward and backward as the base model,
    # and all partial adapter gradients travel in the one bucketed grad-sync all-reduce.
    for phase in ("forward", "backward"):
        assert [(r.op, r.bytes) for r in lora.records if r.phase == phase] == \
               [(r.op, r.bytes) for r in plain.records if r.phase == phase], phase
    assert lora.counts("grad_sync") == {"all_reduce": 1}
    model.zero_grad(set_to_none=True)
    _train_and_compare(ref, model)
    _replicated_factors_agree(model)
    if tp == 2:  # under sequence parallelism the adapters ride the SP gather / reduce-scatter instead
        sp = DistributedConfig(tp_size=tp, enable_sequence_parallel=True)
        _train_and_compare(
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir, is_trainable=True),
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, distributed_config=sp),
                                      adapter_dir, is_trainable=True), steps=1)

    # 2. save (gathered, peft keys) -> equals the single-device adapter; merge -> same logits as the adapter.
    model.save_pretrained(out_dir / f"adapter_tp{tp}")
    ref.save_pretrained(out_dir / f"ref_tp{tp}") if dist.get_rank() == 0 else None
    ids, _ = batch(seed=2)
    expected = ref(ids).logits
    merged = model.merge_and_unload()
    assert not any("lora" in n or "base_layer" in n for n in merged.parallel.tp.specs)
    torch.testing.assert_close(merged(ids).logits, expected, **TOL)
    merged.save_pretrained(out_dir / f"merged_tp{tp}")

    # 3. Fresh adapters with dropout: identical init to one device, masks agree across ranks (and equal
    #    the single-device masks, so even with dropout the runs match), replicated factors stay identical.
    torch.manual_seed(5)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                         LoraConfig(r=4, target_modules=EVERYTHING, lora_dropout=0.3, use_rslora=True))
    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, distributed_config=config),
                           LoraConfig(r=4, target_modules=EVERYTHING, lora_dropout=0.3, use_rslora=True))
    for n, p in _adapter_params(ref).items():
        torch.testing.assert_close(_adapter_params(model)[n], p, rtol=0, atol=0)
    _train_and_compare(ref, model, steps=2)
    _replicated_factors_agree(model)

    # 4. The per-optimizer-step sync mode (the Trainer's) holds when adapters change what requires grad:
    #    nothing is recorded per backward (it would never be summed), and one sync sums the accumulation.
    sync = model.get_base_model().parallel.grad_sync
    sync.set_mode("step")
    model.set_trainable(True)
    ids, labels = batch()
    with CommTracker() as t:
        for _ in range(2):
            model(ids, labels=labels).loss.backward()
            ref(ids, labels=labels).loss.backward()
        assert not sync._pending and t.counts("grad_sync") == {}
        sync.sync_grads(model.get_base_model())
    assert t.counts("grad_sync") == {"all_reduce": 1}
    grads = _adapter_grads(model)
    for n, g in _adapter_grads(ref).items():
        torch.testing.assert_close(grads[n], g, **TOL, msg=lambda m: f"accumulated grad of {n}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_matches_single_device(tp, saved, tmp_path):
    run_distributed(_equivalence_worker, tp, tp, *saved, tmp_path)
    with safe_open(str(tmp_path / f"adapter_tp{tp}" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / f"ref_tp{tp}" / "adapter_model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for k in g.keys():
            torch.testing.assert_close(f.get_tensor(k), g.get_tensor(k), **TOL)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged_tp{tp}")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved[0]), tmp_path / f"adapter_tp{tp}")
    ids, _ = batch(seed=2)
    torch.testing.assert_close(merged(ids).logits, peft(ids).logits, **TOL)
