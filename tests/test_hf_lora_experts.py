"""LoRA on the transformers backend's stacked experts (peft's `target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]`, held as peft's ParamWrapper holds them: tptrain/peft/lora_experts.py LoraFusedExperts):
qwen3_moe and mixtral forced onto the backend, tiny checkpoints written by transformers. One process: an adapter
written by peft loads with peft's logits, and tptrain's adapter loads in peft with tptrain's logits (the same keys
and shapes as peft's file). At tp 2 (experts split inside, and by expert under enable_expert_parallel) and at ep 2
(an ep axis: each rank its own batch): logits, gradients and 3 AdamW steps equal one process, and the adapter saved
equals one process's. fp64.

    .venv/bin/python -m pytest tests/test_hf_lora_experts.py -q
"""
from __future__ import annotations


import pytest
import torch
from safetensors import safe_open

from tests.helpers.batches import batch, dp_batches
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import step_both
from tests.helpers.lora import adapter_keys_and_shapes, random_lora
from tests.helpers.ranks import run_distributed
from tests.helpers.references import transformers_fp64
from tptrain.parallel.tensor_parallel import gather_full
from tptrain.peft import LoraConfig, PeftModel, get_peft_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

F64 = torch.float64
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' norms and routers compute in fp32 in an fp64 model
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, eos_token_id=2,
            pad_token_id=0, num_experts=4, num_local_experts=4, num_experts_per_tok=2)
TYPES = ("qwen3_moe", "mixtral")
SETTINGS = dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _ours(path, **distributed):
    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    config = DistributedConfig(backend="transformers", **distributed) if distributed else None
    return TransformersCausalLM.from_pretrained(path, dtype=F64, distributed_config=config)


CHECKPOINTS = TransformersCheckpoints({t: (t, TINY) for t in TYPES})  # {model_type: directory}


@pytest.mark.parametrize("model_type", TYPES)
def test_adapters_cross_between_peft_and_the_backend(checkpoints, model_type, tmp_path):
    ids = batch()[0]
    hf = peft.get_peft_model(transformers_fp64(checkpoints[model_type]),
                             peft.LoraConfig(task_type="CAUSAL_LM", **SETTINGS))
    random_lora(hf, seed=1)  # peft starts B at zero, which would hide a layout bug
    hf.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = hf(ids).logits
    loaded = PeftModel.from_pretrained(_ours(checkpoints[model_type]), tmp_path / "peft")
    experts = loaded.get_base_model().model.layers[0].mlp.experts
    assert tuple(experts.lora_gate_up_A.default.shape) == (4, 2, 32) and "gate_up_proj" in experts.pairs
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, **TOL)

    ours = get_peft_model(_ours(checkpoints[model_type]), LoraConfig(**SETTINGS))
    random_lora(ours, seed=2)
    ours.save_pretrained(tmp_path / "ours")
    assert adapter_keys_and_shapes(tmp_path / "ours") == adapter_keys_and_shapes(tmp_path / "peft")
    reloaded = peft.PeftModel.from_pretrained(transformers_fp64(checkpoints[model_type]), tmp_path / "ours")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ours(ids).logits, **TOL)
        merged = ours.merge_and_unload()(ids).logits  # folded into the stacks: the same function
        torch.testing.assert_close(merged, reloaded(ids).logits, **TOL)


def _lora(model, what: str) -> dict[str, torch.Tensor]:
    base = model.get_base_model()
    layout = base.parallel.tp
    return {n: getattr(p, what) if layout is None else gather_full(getattr(p, what), layout.spec(n), layout.ctx)
            for n, p in base.named_parameters() if ".lora_" in n}


def _trains_like(model, ref, what: str, dp=None) -> None:
    """LoRA gradients and 3 AdamW steps equal one process's. `dp` (an ep axis): each rank its own batch (seed 10 +
    rank), `ref` the concatenation, the losses normalised by the global token count, the factors not split by expert
    summed over dp (as data parallelism does)."""
    batches = ids, labels, all_ids, all_labels, count = dp_batches(dp)
    base = model.get_base_model()
    with torch.no_grad():
        want = ref(all_ids).logits.chunk(1 if dp is None else dp.size())[0 if dp is None else dp.get_local_rank()]
        torch.testing.assert_close(model(ids).logits, want, **TOL, msg=lambda m: f"{what}: {m}")
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, model)]
    for step in range(3):
        loss, ref_loss = step_both(ref, model, batches, dp, summed=lambda n: not base.parallel.tp.spec(
            n.removeprefix("base_model.model.")).ep_split)
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{what} loss {step}: {m}")
        if step == 0:
            got, want = _lora(model, "grad"), _lora(ref, "grad")
            assert got.keys() == want.keys() and any("lora_down_B" in n for n in got), what
            for n in want:
                torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m: f"{what} grad {n}: {m}")
        for opt in opts:
            opt.step(), opt.zero_grad()
    got, want = _lora(model, "data"), _lora(ref, "data")
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m: f"{what} {n} after 3 steps: {m}")


LAYOUTS = {"etp": dict(tp_size=2),  # experts split inside (moe_tp_experts), gate_up's B by packed rows
           "ep": dict(tp_size=2, enable_expert_parallel=True,  # split by expert over tp, dispatched by all-to-all
                      tp_plan={"layers.*.mlp.experts": "ep_dispatch_experts_all_to_all"}),
           "ep_axis": dict(tp_size=1, ep_size=2)}  # an ep axis: each rank its own batch and 2 of the 4 experts


def _worker(checkpoints: dict, adapters, out) -> None:
    from tptrain.distributed.topology import dp_mesh
    for model_type, path in checkpoints.items():
        for name, distributed in LAYOUTS.items():
            what = f"{model_type} {name}"
            ref = PeftModel.from_pretrained(_ours(path), adapters / model_type, is_trainable=True)
            model = PeftModel.from_pretrained(_ours(path, **distributed), adapters / model_type, is_trainable=True)
            experts = model.get_base_model().model.layers[0].mlp.experts
            want = (4, 2, 32) if name == "etp" else (2, 2, 32)  # gate_up's A: every expert, or this rank's 2 of 4
            assert tuple(experts.lora_gate_up_A.default.shape) == want, (what, experts.lora_gate_up_A.default.shape)
            _trains_like(model, ref, what, dp=dp_mesh(model.device_mesh) if name == "ep_axis" else None)
            model.save_pretrained(out / f"{model_type}-{name}")
            if torch.distributed.get_rank() == 0:
                ref.save_pretrained(out / f"{model_type}-{name}-ref")


@pytest.mark.distributed
def test_expert_lora_at_tp_2_and_ep_2_equals_one_process(checkpoints, tmp_path):
    for model_type, path in checkpoints.items():
        adapter = get_peft_model(_ours(path), LoraConfig(**SETTINGS))
        random_lora(adapter, seed=3)
        adapter.save_pretrained(tmp_path / model_type)
    run_distributed(_worker, 2, checkpoints, tmp_path, tmp_path, timeout=600)
    for model_type in checkpoints:
        for name in LAYOUTS:
            with safe_open(str(tmp_path / f"{model_type}-{name}" / "adapter_model.safetensors"), "pt") as f, \
                    safe_open(str(tmp_path / f"{model_type}-{name}-ref" / "adapter_model.safetensors"), "pt") as g:
                assert set(f.keys()) == set(g.keys())
                for key in f.keys():
                    torch.testing.assert_close(f.get_tensor(key), g.get_tensor(key), **TOL)
