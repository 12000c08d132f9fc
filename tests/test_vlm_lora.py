"""LoRA on vision-language models at tp 2 (fp64, CPU/gloo) against peft on transformers' model on one process: an
adapter on every linear layer (text decoder, vision tower, projector: "all-linear") of Qwen2.5-VL (its tower's fused
qkv split part by part) and one on LLaVA's language model only (a regex). From peft's own initial adapter, the loss,
every adapter gradient and 3 AdamW steps equal peft's; the adapter tptrain saves loads in peft
(`peft.PeftModel.from_pretrained` on transformers' model) with peft's outputs, and the merged checkpoint
(`merge_and_unload`, what `--merge` writes) loads in transformers equal to peft's merge.

    .venv-vision/bin/python -m pytest tests/test_vlm_lora.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.vlm import F64, STEP_TOL, TOL, batch, gathered_grads, transformers_model, write_checkpoint

pytestmark = pytest.mark.vision
peft = pytest.importorskip("peft")
TARGETS = {"qwen2_5_vl": "all-linear", "llava": r".*\.language_model\..*\.(q_proj|v_proj|o_proj|down_proj)"}
PEFT = "base_model.model."  # peft's names: the model's under its tuner


def _peft_model(path, model_type: str):
    """peft on transformers' model (fp64, train mode), its adapter random (peft starts B at zero)."""
    model = peft.get_peft_model(transformers_model(path), peft.LoraConfig(r=4, lora_alpha=8,
                                                                          target_modules=TARGETS[model_type]))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model


def _train(model, inputs: dict, grads_of, steps: int = 3) -> tuple[list[float], dict]:
    """3 AdamW steps on the adapter: (each step's loss, `grads_of(model)` after the first backward)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    losses, grads = [], None
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        grads = grads if grads is not None else grads_of(model)
        opt.step(), opt.zero_grad()
    return losses, grads


def _own_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """{model_type: (checkpoint, batch, peft's initial adapter directory)}."""
    out = {}
    for model_type in TARGETS:
        path, hf = write_checkpoint(tmp_path_factory.mktemp(model_type), model_type)
        _peft_model(path, model_type).save_pretrained(path / "initial_adapter")
        out[model_type] = (path, batch(model_type, hf))
    return out


def _worker(cases: dict, out) -> None:
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    from tptrain.peft import PeftModel

    results = {}
    for model_type, (path, inputs) in cases.items():
        base = AutoModelForImageTextToText.from_pretrained(path, dtype=F64,
                                                           distributed_config=DistributedConfig(tp_size=2))
        model = PeftModel.from_pretrained(base, path / "initial_adapter", is_trainable=True).train()
        losses, grads = _train(model, inputs, lambda _: {n: g for n, g in gathered_grads(base).items()
                                                         if g is not None})
        model.save_pretrained(out / model_type / "adapter")
        with torch.no_grad():  # no labels: the whole vocabulary's logits
            logits = model.eval()(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        model.merge_and_unload().save_pretrained(out / model_type / "merged")
        results[model_type] = {"losses": losses, "grads": grads, "logits": logits}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "results.pt")


@pytest.mark.distributed
def test_lora_at_tp2_is_peft_and_saves_for_peft(cases, tmp_path):
    import transformers

    run_distributed(_worker, 2, cases, tmp_path, timeout=600)
    results = torch.load(tmp_path / "results.pt")
    for model_type, (path, inputs) in cases.items():
        got = results[model_type]
        ref = peft.PeftModel.from_pretrained(transformers_model(path), path / "initial_adapter", is_trainable=True)
        losses, grads = _train(ref, inputs, _own_grads)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), **TOL,
                                   msg=lambda m: f"{model_type} losses: {m}")
        assert {PEFT + n for n in got["grads"]} == set(grads), model_type  # the adapter's and nothing else
        tower = [n for n in grads if ".lora_" in n and "language_model" not in n]
        assert bool(tower) == (TARGETS[model_type] == "all-linear"), model_type
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, grads[PEFT + name], **TOL, msg=lambda m: f"{model_type} grad {name}: {m}")
        with torch.no_grad():
            want = ref.eval()(**inputs).logits
            saved = peft.PeftModel.from_pretrained(transformers_model(path), tmp_path / model_type / "adapter").eval()
            torch.testing.assert_close(saved(**inputs).logits, want, **STEP_TOL)
            torch.testing.assert_close(got["logits"].to(F64), want, **STEP_TOL)
            plain = transformers_model(path).eval()(**inputs).logits  # the adapter moves far more than the tolerance
            assert (want - plain).abs().max() > 1e-2, model_type
        merged = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / model_type / "merged", dtype=F64)
        expected = dict(ref.merge_and_unload().named_parameters())
        for name, p in merged.named_parameters():
            torch.testing.assert_close(p, expected[name], **STEP_TOL, msg=lambda m: f"{model_type} merged {name}: {m}")
