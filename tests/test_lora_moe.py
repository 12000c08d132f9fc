"""LoRA on mixture-of-experts models: attention, router and the stacked experts (peft's target_parameters), against
peft 0.21 + transformers 5.23 at one device and against one device under expert TP and expert parallelism (fp64).

    .venv/bin/python -m pytest tests/test_lora_moe.py -q
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.configs import VOCAB
from tests.helpers.lora import adapter_keys_and_shapes, random_lora
from tests.helpers.ranks import run_distributed
from tests.helpers.references import transformers_fp64
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM
from tptrain.parallel.tensor_parallel import gather_full
from tptrain.peft import LoraConfig, PeftModel, get_peft_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
HF_TOL = dict(rtol=1e-5, atol=1e-5)  # transformers normalises and routes in fp32 even in an fp64 model
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, eos_token_id=2, pad_token_id=0)
FAMILIES = {  # model_type: (transformers config class, model class, family keys)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=16, head_dim=8)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Attention (colwise and rowwise), the router as a parameter target, both fused expert parameters.
SETTINGS = dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS + ["mlp.gate.weight"])


# {model_type: directory of a random tiny checkpoint written by transformers}
CHECKPOINTS = TransformersCheckpoints({t: (t, dict(TINY, **keys)) for t, (_, _, keys) in FAMILIES.items()})


# ------------------------------------------------------------------ (a) peft is the oracle, one device


@pytest.mark.parametrize("model_type", FAMILIES)
def test_adapters_cross_between_peft_and_tptrain(checkpoints, model_type, tmp_path):
    ids = batch()[0]
    hf = peft.get_peft_model(transformers_fp64(checkpoints[model_type]),
                             peft.LoraConfig(task_type="CAUSAL_LM", **SETTINGS))
    random_lora(hf, seed=1)
    hf.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = hf(ids).logits
    keys = adapter_keys_and_shapes(tmp_path / "peft")
    assert keys["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"] == (2 * 4, 32)  # r*E, hidden

    # peft's file into tptrain
    base = AutoModelForCausalLM.from_pretrained(checkpoints[model_type], dtype=F64)
    with torch.no_grad():
        plain = base(ids).logits
    loaded = PeftModel.from_pretrained(base, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, **HF_TOL)
    assert (want - plain).abs().max() > 1e-1  # the adapter moves the logits far more than the tolerance

    # tptrain's file into peft: the same keys and shapes, the same logits
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints[model_type], dtype=F64),
                          LoraConfig(**SETTINGS))
    random_lora(ours, seed=2)
    ours.save_pretrained(tmp_path / "ours")
    assert adapter_keys_and_shapes(tmp_path / "ours") == keys
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == SETTINGS["target_parameters"]
    with torch.no_grad():
        mine = ours(ids).logits
        reloaded = peft.PeftModel.from_pretrained(transformers_fp64(checkpoints[model_type]), tmp_path / "ours")
        torch.testing.assert_close(reloaded(ids).logits, mine, **HF_TOL)
        merged = ours.merge_and_unload()  # s * B_e @ A_e folded into the stacked weights
        torch.testing.assert_close(merged(ids).logits, mine, **TOL)
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())


@pytest.mark.parametrize("targets", [["mlp.experts.gate_up_proj"], ["experts.down_proj"], EXPERTS[::-1]])
def test_key_nesting_follows_peft(checkpoints, targets, tmp_path):
    """peft nests one ParamWrapper per parameter (down_proj outermost): the keys depend on which are targeted."""
    settings = dict(r=3, lora_alpha=3, target_parameters=targets)
    hf = peft.get_peft_model(transformers_fp64(checkpoints["qwen3_moe"]),
                             peft.LoraConfig(task_type="CAUSAL_LM", **settings))
    hf.save_pretrained(tmp_path / "peft")
    get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"]),
                   LoraConfig(**settings)).save_pretrained(tmp_path / "ours")
    assert adapter_keys_and_shapes(tmp_path / "ours") == adapter_keys_and_shapes(tmp_path / "peft")


# ------------------------------------------------------------------ (b) TP and EP equal one device


def _lora_grads(model) -> dict[str, torch.Tensor]:
    """{name: full gradient} of every LoRA factor (gathered from this rank's shard under TP)."""
    base = model.get_base_model()
    layout = base.parallel.tp
    return {n: (p.grad if layout is None else gather_full(p.grad, layout.spec(n), layout.ctx))
            for n, p in base.named_parameters() if ".lora_" in n}


def _lora_params(model) -> dict[str, torch.Tensor]:
    base = model.get_base_model()
    layout = base.parallel.tp
    return {n: (p.detach() if layout is None else gather_full(p.detach(), layout.spec(n), layout.ctx))
            for n, p in base.named_parameters() if ".lora_" in n}


def _worker(base_dir, adapter_dir, tp: int, out) -> None:
    ids, labels = batch(seed=2)
    layouts = {"etp": DistributedConfig(tp_size=tp), "ep": DistributedConfig(tp_size=tp, enable_expert_parallel=True),
               "all_to_all": DistributedConfig(tp_size=tp, tp_plan={"layers.*.mlp.experts": "expert_parallel_all_to_all"})}
    for layout, config in layouts.items():
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64), adapter_dir,
                                        is_trainable=True)
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64, distributed_config=config), adapter_dir,
            is_trainable=True)
        experts = model.get_base_model().model.layers[0].mlp.experts
        shards = {"etp": (4, 4, 32), "ep": (4 // tp, 4, 32), "all_to_all": (4 // tp, 4, 32)}[layout]
        assert tuple(experts.lora_gate_up_A.default.shape) == shards, (layout, experts.lora_gate_up_A.default.shape)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, **TOL)
        trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
        ref_opt, opt = torch.optim.AdamW(trained(ref), lr=1e-2), torch.optim.AdamW(trained(model), lr=1e-2)
        for step in range(3):
            ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
            torch.testing.assert_close(loss, ref_loss, **TOL)
            ref_loss.backward(), loss.backward()
            if step == 0:
                got, want = _lora_grads(model), _lora_grads(ref)
                assert got.keys() == want.keys() and any("lora_down_B" in n for n in got)
                for name in want:
                    torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{layout} {name}: {m}")
            ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        got, want = _lora_params(model), _lora_params(ref)
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{layout} 3 steps {name}: {m}")
        model.save_pretrained(out / f"{layout}-tp{tp}")  # full tensors in peft's layout, whatever the split
        if torch.distributed.get_rank() == 0:
            ref.save_pretrained(out / f"{layout}-ref")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_expert_tp_and_expert_parallel_equal_one_device(checkpoints, tp, tmp_path):
    # gate_up_proj at another rank and alpha than down_proj (peft's rank_pattern)
    settings = {**SETTINGS, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "rank_pattern": {r".*\.gate_up_proj": 4}, "alpha_pattern": {r".*\.gate_up_proj": 6}}
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=F64),
                             LoraConfig(**settings))
    random_lora(adapter, seed=3)
    adapter.save_pretrained(tmp_path / "adapter")
    run_distributed(_worker, tp, checkpoints["qwen3_moe"], tmp_path / "adapter", tp, tmp_path, timeout=600)
    for layout in ("etp", "ep", "all_to_all"):
        with safe_open(str(tmp_path / f"{layout}-tp{tp}" / "adapter_model.safetensors"), "pt") as f, \
                safe_open(str(tmp_path / f"{layout}-ref" / "adapter_model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())
            for key in f.keys():
                torch.testing.assert_close(f.get_tensor(key), g.get_tensor(key), **TOL)


# ------------------------------------------------------------------ (c) what tptrain refuses


@pytest.mark.parametrize("model_type, settings, message", [
    ("qwen3_moe", dict(target_parameters=["mlp.experts.gate_proj"]), "gate_up_proj"),
    ("qwen3_moe", dict(target_parameters=["input_layernorm.weight"]), "supports the MoE experts"),
    ("qwen3_moe", dict(target_parameters=["mlp.experts.gate_down"]), "matches no parameter"),
    ("mixtral", dict(target_modules=["q_proj", "w1"]), "names 'w1' without 'w3'"),
    ("qwen3_moe", dict(target_modules=["up_proj", "down_proj"]), "names 'up_proj' without 'gate_proj'"),
    ("olmoe", dict(target_modules=r".*\.(q|gate|up)_proj"), "per-expert module"),
    ("qwen3_moe", dict(target_modules=["experts"]), "target_parameters="),
    ("qwen2_moe", dict(target_modules=["shared_expert_gate"], target_parameters=["mlp.shared_expert_gate.weight"]),
     "both target_modules"),
])
def test_unsupported_expert_targets_say_what_to_write(checkpoints, model_type, settings, message):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[model_type])
    with pytest.raises(ValueError, match=message):
        get_peft_model(model, LoraConfig(**settings))


def test_expert_dropout_is_refused():
    with pytest.raises(ValueError, match="lora_dropout"):  # as peft's lora.ParamWrapper
        LoraConfig(target_parameters=EXPERTS, lora_dropout=0.1)


@pytest.mark.parametrize("model_type, target_modules", [
    ("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]), ("qwen3_moe", "all-linear"),
    ("mixtral", ["q_proj", "w1", "w2", "w3", "gate"]), ("olmoe", "all-linear"),
    ("qwen2_moe", "all-linear"), ("qwen2_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"])])
def test_transformers_4_names_are_rewritten_as_peft_does(checkpoints, model_type, target_modules, tmp_path):
    """peft rewrites transformers 4's MoE names (and "all-linear") per model type into target_parameters on the fused
    experts and the router, gate_up_proj at rank 2r (rank_pattern); on Qwen2-MoE they match only the shared expert.
    The same LoraConfig in tptrain writes peft's file (keys, shapes, targets), and peft's adapter loads into tptrain."""
    ids = batch()[0]
    hf = peft.get_peft_model(transformers_fp64(checkpoints[model_type]), peft.LoraConfig(
        r=2, lora_alpha=3, task_type="CAUSAL_LM", target_modules=target_modules))
    random_lora(hf, seed=4)
    hf.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = hf(ids).logits
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoints[model_type], dtype=F64),
                                       tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, **HF_TOL)
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints[model_type]),
                          LoraConfig(r=2, lora_alpha=3, target_modules=target_modules))
    ours.save_pretrained(tmp_path / "ours")
    assert adapter_keys_and_shapes(tmp_path / "ours") == adapter_keys_and_shapes(tmp_path / "peft")
    written = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft")]
    for key in ("target_parameters", "rank_pattern", "alpha_pattern"):
        assert sorted(written[0][key] or []) == sorted(written[1][key] or []), key
    assert sorted(written[0]["target_modules"] or []) == sorted(written[1]["target_modules"] or [])


def test_cli_flags_spell_target_parameters(checkpoints):
    """`tptrain train --lora-target-parameters ...`: the experts without the default 'all-linear' modules."""
    import argparse

    from tptrain.cli.train import add_train_arguments
    from tptrain.cli.finetune import lora_config

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--lora-r", "2", "--lora-target-parameters", ",".join(EXPERTS)])
    config = lora_config(args)
    assert config.target_parameters == EXPERTS and config.target_modules == []
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"]), config)
    assert sorted(model.lora_layers) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    args = parser.parse_args(["--lora-r", "2", "--lora-dropout", "0.1", "--lora-target-parameters", EXPERTS[0]])
    with pytest.raises(ValueError, match="lora_dropout"):
        lora_config(args)
    assert lora_config(parser.parse_args(["--lora-r", "2"])).target_modules == "all-linear"


def _trainer_worker(base_dir, adapter_dir, tmp) -> None:
    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import SEQ, training_args
    from tptrain.distributed import init_distributed
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.data import PackedDataset
    from tptrain.training.trainer import Trainer

    init_distributed()
    data = lambda: PackedDataset(torch.randint(0, VOCAB, (64 * SEQ,), generator=torch.Generator().manual_seed(1)),  # noqa: E731
                                 SEQ)
    single = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64), adapter_dir,
                                       is_trainable=True)

    def tp_peft() -> PeftModel:
        config = DistributedConfig(tp_size=2, enable_expert_parallel=True)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64, distributed_config=config)
        return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)

    args = training_args(f"{tmp}/run", max_steps=4, save_steps=2, parallelism_config=ParallelismConfig(tp_size=2))
    out = Trainer(model=tp_peft(), args=args, train_dataset=data()).train()
    expected = reference_losses(single, data(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)
    again = Trainer(model=tp_peft(), args=args, train_dataset=data()).train(
        resume_from_checkpoint=f"{tmp}/run/checkpoint-2")  # the experts' factors, split by expert, from DCP
    assert again.losses == out.losses[2:], (again.losses, out.losses)
    reloaded = _lora_params(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64),
                                                      out.final_dir))
    for name, p in _lora_params(single).items():
        torch.testing.assert_close(reloaded[name], p, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_trainer_trains_and_resumes_expert_lora_under_expert_parallelism(checkpoints, tmp_path):
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=F64),
                             LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=EXPERTS))
    random_lora(adapter, seed=5)
    adapter.save_pretrained(tmp_path / "adapter")
    run_distributed(_trainer_worker, 2, checkpoints["qwen3_moe"], tmp_path / "adapter", tmp_path, timeout=600)


def _ep_axis_worker(base_dir, adapter_dir, out) -> None:
    """At ep 2 (tp 1): each rank its own batch and 2 of the 4 experts, their factors split by expert as the weights
    are; LoRA gradients and 3 AdamW steps equal one process on the concatenated batch (the factors not split by
    expert summed over dp, as data parallelism sums them); the adapter is saved gathered over ep."""
    from tests.helpers.batches import dp_batches
    from tests.helpers.compare import step_both
    from tptrain.distributed.topology import dp_mesh

    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64), adapter_dir,
                                    is_trainable=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64,
                                                distributed_config=DistributedConfig(tp_size=1, ep_size=2))
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    experts = base.model.layers[0].mlp.experts
    assert tuple(experts.lora_gate_up_A.default.shape) == (2, 4, 32)  # this rank's 2 experts, r 4 (rank_pattern)
    dp = dp_mesh(base.device_mesh)
    batches = dp_batches(dp)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, model)]
    for step in range(3):
        loss, ref_loss = step_both(ref, model, batches, dp, summed=lambda n: not base.parallel.tp.spec(
            n.removeprefix("base_model.model.")).ep_split)
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"ep 2 loss {step}: {m}")
        if step == 0:
            got, want = _lora_grads(model), _lora_grads(ref)
            assert got.keys() == want.keys() and any("lora_down_B" in n for n in got)
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"ep 2 grad {name}: {m}")
        for opt in opts:
            opt.step(), opt.zero_grad()
    got, want = _lora_params(model), _lora_params(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"ep 2 {name} after 3 steps: {m}")
    model.save_pretrained(out / "ep2")  # gathered over ep, in peft's layout
    if torch.distributed.get_rank() == 0:
        ref.save_pretrained(out / "ep2-ref")


@pytest.mark.distributed
def test_expert_lora_over_an_ep_axis_equals_one_process_and_peft(checkpoints, tmp_path):
    """LoRA on the experts at ep 2 equals one process (gradients, 3 AdamW steps), and the adapter it saves is one
    process's tensors in peft's file: peft loads it onto transformers with the logits tptrain gives it."""
    settings = {**SETTINGS, "rank_pattern": {r".*\.gate_up_proj": 4}, "alpha_pattern": {r".*\.gate_up_proj": 6}}
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=F64),
                             LoraConfig(**settings))
    random_lora(adapter, seed=6)
    adapter.save_pretrained(tmp_path / "adapter")
    run_distributed(_ep_axis_worker, 2, checkpoints["qwen3_moe"], tmp_path / "adapter", tmp_path, timeout=600)
    with safe_open(str(tmp_path / "ep2" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "ep2-ref" / "adapter_model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for key in f.keys():
            torch.testing.assert_close(f.get_tensor(key), g.get_tensor(key), **TOL)
    ids = batch()[0]
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=F64),
                                     tmp_path / "ep2")
    theirs = peft.PeftModel.from_pretrained(transformers_fp64(checkpoints["qwen3_moe"]), tmp_path / "ep2")
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, **HF_TOL)


def _merge_worker(base_dir, adapter_dir, tmp) -> None:
    from tests.helpers.trainer import SEQ, training_args
    from tptrain.distributed import init_distributed
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.data import PackedDataset
    from tptrain.training.trainer import Trainer

    init_distributed()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64), adapter_dir,
                                      is_trainable=True)
    args = training_args(f"{tmp}/run", max_steps=1, parallelism_config=ParallelismConfig(
        tp_size=1, dp_replicate_size=2, dp_shard_size=2))
    data = PackedDataset(torch.randint(0, VOCAB, (16 * SEQ,), generator=torch.Generator().manual_seed(1)), SEQ)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    final = trainer.train().final_dir  # the trained adapter
    trainer.model = trainer.model.merge_and_unload()  # each rank folds its HSDP shard's rows
    merged = trainer.save_model(f"{tmp}/merged")
    if torch.distributed.get_rank() == 0:
        ids, _ = batch(seed=3)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64), final)
        with torch.no_grad():
            want = adapted.eval()(ids).logits
            got = AutoModelForCausalLM.from_pretrained(merged, dtype=F64).eval()(ids).logits
            assert (want - AutoModelForCausalLM.from_pretrained(base_dir, dtype=F64)(ids).logits).abs().max() > 1e-6
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.distributed
def test_merge_under_hsdp(checkpoints, tmp_path):
    """merge_and_unload on a model HSDP shards (dp_replicate 2 x dp_shard 2): attention and expert adapters folded
    into each rank's shard, the merged checkpoint computes what the adapter does."""
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=F64),
                             LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                                        target_parameters=EXPERTS))
    random_lora(adapter, seed=5)
    adapter.save_pretrained(tmp_path / "adapter")
    run_distributed(_merge_worker, 4, checkpoints["qwen3_moe"], tmp_path / "adapter", tmp_path, timeout=400)
