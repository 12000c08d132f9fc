"""LoRA in the tests: random adapter tensors (peft starts lora_B at zero, which would hide a layout bug), a saved
adapter's tensor shapes, a random peft adapter (test_family_olmo2.py, test_family_olmo3.py, test_family_phi3.py), and
OLMo's adapters crossed between peft and tptrain at tp 2."""
from __future__ import annotations

import torch

from tests.helpers.batches import batch
from tests.helpers.configs import F64
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TOL = dict(rtol=1e-5, atol=1e-5)  # the bases differ by transformers' fp32 RoPE (~1e-6)


def random_lora(model, seed: int) -> None:
    """Every LoRA tensor random (peft starts lora_B at zero, which would hide a layout bug)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def adapter_keys_and_shapes(path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the adapter_model.safetensors in `path`."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def peft_adapter(path, out_dir, targets: list[str] = LORA_TARGETS):
    """A random peft adapter on `targets` of transformers' model at `path` (OLMo's, Phi-3's fused projections),
    saved to `out_dir`; returns its logits on batch()."""
    import peft
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
        model.save_pretrained(out_dir)
        return model(batch()[0]).logits


def lora_crossing(path, peft_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """peft's adapter on a tp 2 base, and a tptrain-trained adapter (2 AdamW steps) saved for peft."""
    from tptrain.peft import LoraConfig, PeftModel, get_peft_model
    config = DistributedConfig(tp_size=2)
    ids = batch()[0]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=F64,
                                                                            distributed_config=config), peft_dir)
    with torch.no_grad():
        peft_logits = loaded(ids).logits
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config),
                           LoraConfig(r=4, lora_alpha=16, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_ids, labels = batch(seed=4)
    for _ in range(2):
        model(train_ids, labels=labels).loss.backward()
        opt.step(), opt.zero_grad()
    model.save_pretrained(adapter_dir)
    model.eval()
    with torch.no_grad():
        return {"peft_adapter": peft_logits, "tptrain_adapter": model(ids).logits}


def assert_lora_crossed(path, result, peft_logits, adapter_dir) -> None:
    """LoRA on every linear layer crossed both ways: peft's adapter on the tp 2 model gave peft's logits, and the
    tptrain-trained adapter in `adapter_dir` gives in peft + transformers what it gave at tp 2; both change the model."""
    import peft
    import transformers
    torch.testing.assert_close(result["peft_adapter"], peft_logits, **LORA_TOL)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    with torch.no_grad():
        plain = base(batch()[0]).logits
        reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)(batch()[0]).logits
    torch.testing.assert_close(reloaded, result["tptrain_adapter"], **LORA_TOL)
    assert (result["tptrain_adapter"] - plain).abs().max() > 1e-2 and (peft_logits - plain).abs().max() > 1e-2
