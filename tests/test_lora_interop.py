"""LoRA adapters cross between tptrain (tp 2) and peft 0.21 + transformers 5.23 (test-only oracles), fp64.

    .venv/bin/python -m pytest tests/test_lora_interop.py -q
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tptrain.peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

# transformers runs RMSNorm and RoPE in fp32 even for an fp64 model: the base models alone differ by ~1e-6.
TOL = dict(rtol=1e-5, atol=1e-5)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
# Rowwise o_proj / down_proj included: what peft + transformers TP cannot do on CPU.
EVERYTHING = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]


def ids(seed: int = 3):
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


def hf_base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _worker(base_dir, peft_dir, out) -> None:
    config = DistributedConfig(tp_size=2)
    # 1. peft's adapter onto a tp 2 base.
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64, distributed_config=config), peft_dir)
    logits = model(ids()).logits
    # 2. A tptrain-trained adapter (three AdamW steps from peft's init, so B is no longer zero).
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64, distributed_config=config)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=EVERYTHING))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(ids(4), labels=ids(4)).loss.backward()
        opt.step(), opt.zero_grad()
    model.save_pretrained(out / "tptrain_adapter")
    model.eval()
    trained = model(ids()).logits
    model.merge_and_unload().save_pretrained(out / "merged")
    if torch.distributed.get_rank() == 0:
        torch.save({"peft_adapter": logits, "tptrain_adapter": trained}, out / "logits.pt")


@pytest.mark.distributed
def test_adapters_cross_between_tptrain_and_peft(tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY), dtype=torch.float64)
    base.save_pretrained(tmp_path / "base")
    hf = peft.get_peft_model(hf_base(tmp_path / "base"),
                             peft.LoraConfig(r=4, lora_alpha=8, target_modules=EVERYTHING, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    hf.save_pretrained(tmp_path / "peft_adapter")
    with torch.no_grad():
        peft_logits = hf(ids()).logits

    run_distributed(_worker, 2, tmp_path / "base", tmp_path / "peft_adapter", tmp_path)
    logits = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(logits["peft_adapter"], peft_logits, **TOL)
    with torch.no_grad():
        reloaded = peft.PeftModel.from_pretrained(hf_base(tmp_path / "base"), tmp_path / "tptrain_adapter")
        torch.testing.assert_close(reloaded(ids()).logits, logits["tptrain_adapter"], **TOL)
        merged = hf_base(tmp_path / "merged")
        torch.testing.assert_close(merged(ids()).logits, logits["tptrain_adapter"], **TOL)
    with torch.no_grad():  # both adapters move the logits far more than the tolerance
        plain = base(ids()).logits
        assert (logits["tptrain_adapter"] - plain).abs().max() > 1e-2
        assert (peft_logits - plain).abs().max() > 1e-2


def test_bias_and_modules_to_save_match_peft(tmp_path):
    """Single device: the same config gives peft's key set, and peft's file loads with the same logits."""
    torch.manual_seed(0)
    kw = dict(model_type="qwen2", **{**TINY, "tie_word_embeddings": False})
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw), dtype=torch.float64)
    base.save_pretrained(tmp_path / "base")
    settings = dict(r=2, lora_alpha=4, target_modules=r".*\.(q|o)_proj", bias="all", modules_to_save=["lm_head"])
    hf = peft.get_peft_model(hf_base(tmp_path / "base"), peft.LoraConfig(task_type="CAUSAL_LM", **settings))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.requires_grad:  # adapters, every bias, the trained copy of lm_head
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
        expected = hf(ids()).logits
    hf.save_pretrained(tmp_path / "peft")
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(**settings))
    ours.save_pretrained(tmp_path / "ours")
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "ours" / "adapter_model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, expected, **TOL)
