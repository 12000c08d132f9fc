"""Pipeline parallelism on the transformers backend (tptrain/hf/stages.py): transformers' module tree cut into stages
(the embedding on the first, the final norm and head on the last, consecutive decoder layers on each, each keeping its
own index and layer type), each stage running transformers' own forward over what it holds. Tiny random checkpoints
written by transformers (hub layout), fp64: the stages one after another on one process against the whole model
(logits and every gradient); the Trainer at pp 2, at tp 2 x pp 2 (also with enable_expert_parallel on an MoE type,
and with its experts over an ep axis),
at pp 2 x dp 2 (FSDP2), with LoRA, at pp 2 x cp 2 and (slow) tp 2 x cp 2 x pp 2, against one process, a checkpoint
resumed across pp sizes, its final checkpoint (written from the stages) reloaded by
transformers; `tptrain train --pp-size 2`; the refusals of what cannot be cut.

    .venv/bin/python -m pytest tests/test_hf_pipeline.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.backend import (AXES_CHECKPOINTS, AXES_TINY as TINY, AXES_TYPES as TYPES, axes_config as config,
                                   eager_experts, one_process)
from tests.helpers.configs import F64
from tests.helpers.ranks import run_distributed

TP_PP = ("gpt_neox", "gemma", "cohere2", "deepseek_v2", "qwen3_next")  # also at tp 2 x pp 2
TOL = dict(rtol=1e-10, atol=1e-10)
TRAIN_TOL = dict(rtol=1e-7, atol=1e-7)  # the routers' fp32 islands in an fp64 model, through AdamW


CHECKPOINTS = AXES_CHECKPOINTS  # {model_type: directory}


# ------------------------------------------------------------------ no process group


@pytest.mark.parametrize("model_type", TYPES)
def test_stages_in_turn_equal_the_whole_model(model_type):
    """Stage 0 (embedding, layer 0) then stage 1 (layer 1, norm, head), as views of one model on one process: the
    logits and every gradient of the whole model's forward."""
    from tptrain.hf.model import TransformersCausalLM
    from tptrain.parallel.pipeline_parallel import StageModule

    torch.manual_seed(0)
    model = TransformersCausalLM.from_config(config(model_type), dtype=F64).train()
    eager_experts(model)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, -1)  # two documents per row
    whole = model(ids, position_ids=positions).logits
    whole.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    stages = [StageModule(model, [0], first=True, last=False), StageModule(model, [1], first=False, last=True)]
    assert model.pp_layers.endswith(".layers") and "lm_head" in model.pp_last
    logits = stages[1](stages[0](ids, position_ids=positions), position_ids=positions)
    torch.testing.assert_close(logits, whole, **TOL)
    logits.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **TOL, msg=lambda m: f"{model_type} grad {name}: {m}")


REFUSED = {  # model_type: (its tiny config's keys, what the refusal says)
    "gemma3n_text": (dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                          vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, laurel_rank=4),
                     r"its decoder layers take inputs beside the hidden states, computed by "
                     r"model.embed_tokens_per_layer \(Gemma3nTextScaledWordEmbedding\) \(per-layer inputs\)"),
    "hrm_text": ({}, r"its base model HrmTextModel holds no list of its decoder layers"),
}


@pytest.mark.parametrize("model_type", REFUSED)
def test_what_cannot_be_cut_is_refused_naming_why(model_type):
    import transformers

    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    from tptrain.parallel import parallelize

    keys, why = REFUSED[model_type]
    model = TransformersCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **{**TINY, **keys}),
                                             device="meta")
    with pytest.raises(ValueError, match=rf"\({model_type}\) cannot be cut into pipeline stages \(pp_size=2\): .*"
                                         rf"{why}.*load it with pp_size=1"):
        parallelize.check(model, DistributedConfig(pp_size=2, tp_size=1), world_size=2)


# ------------------------------------------------------------------ the Trainer against one process


def _train(path: str, out: str, *, layout: dict, parallelism: dict | None = None, lora: bool = False,
           steps: int = 3) -> list[float]:
    """`steps` Trainer steps of the backend laid out as `layout`, global batch 4; the one-process losses checked."""
    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, training_args
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.peft import LoraConfig, get_peft_model
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    def maybe_lora(model):
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["dense_h_to_4h", "dense"])) \
            if lora else model

    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
        backend="transformers", **layout))
    eager_experts(model)
    dp = 2 if parallelism and parallelism.get("dp_shard_size") == 2 else 1
    args = training_args(out, max_steps=steps, per_device_train_batch_size=4 // dp, parallelism_config=(
        ParallelismConfig(pp_microbatches=2, **(parallelism or {}))))
    losses = Trainer(maybe_lora(model), args=args, train_dataset=tiny_dataset()).train().losses
    expected = reference_losses(maybe_lora(one_process(path)), tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TRAIN_TOL,
                               msg=lambda m: f"{path} {layout} {parallelism} lora={lora}: {m}")
    return losses


def _reloaded_equals_one_process(path: str, out: str) -> None:
    """The Trainer's final checkpoint, written from the stages, is transformers' checkpoint of the trained weights."""
    import torch.distributed as dist
    import transformers

    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, training_args

    if dist.get_rank() == 0:
        ref = one_process(path)
        reference_losses(ref, tiny_dataset(), training_args(out, max_steps=3), global_batch=4)
        saved = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/final", dtype=F64)
        trained = dict(ref.named_parameters())
        for name, p in saved.named_parameters():
            torch.testing.assert_close(p, trained[name].detach(), **TRAIN_TOL, msg=lambda m: f"{path} {name}: {m}")
    dist.barrier()


def _resume_across_pp(path: str, out: str) -> None:
    """A checkpoint saved at pp 2 (tied embeddings: a copy on each stage) resumes at pp 1 x dp_shard 2, and that run's
    at pp 2: the losses are those of uninterrupted one-process training."""
    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, training_args
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    def run(pp: int, where: str, steps: int, resume: str | None = None) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
            pp_size=pp, tp_size=1, backend="transformers"))
        args = training_args(f"{out}/{where}", max_steps=steps, per_device_train_batch_size=4 if pp == 2 else 2,
                             save_steps=2, lr_scheduler_type="constant", warmup_steps=0,
                             parallelism_config=ParallelismConfig(pp_microbatches=2) if pp == 2 else None)
        return Trainer(model, args=args, train_dataset=tiny_dataset()).train(resume_from_checkpoint=resume).losses

    losses = run(2, "pp2", 2) + run(1, "pp1", 4, f"{out}/pp2/checkpoint-2") + run(2, "again", 5,
                                                                                  f"{out}/pp1/checkpoint-4")
    args = training_args(out, max_steps=5, lr_scheduler_type="constant", warmup_steps=0)
    expected = reference_losses(one_process(path), tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TRAIN_TOL)


def _pp2_worker(paths: dict[str, str], out: str) -> None:
    for model_type in TYPES:
        _train(paths[model_type], f"{out}/{model_type}", layout=dict(pp_size=2, tp_size=1))
    for model_type in ("gemma", "deepseek_v2"):  # tied, converted on load (its experts stacked)
        _reloaded_equals_one_process(paths[model_type], f"{out}/{model_type}")
    _resume_across_pp(paths["gemma"], f"{out}/resume")


@pytest.mark.distributed
def test_trainer_pp2_equals_one_process(checkpoints, tmp_path):
    run_distributed(_pp2_worker, 2, checkpoints, str(tmp_path), timeout=1200)


def _four_ranks_worker(paths: dict[str, str], out: str) -> None:
    for model_type in TP_PP:
        _train(paths[model_type], f"{out}/{model_type}", layout=dict(pp_size=2, tp_size=2))
    _train(paths["granitemoe"], f"{out}/ep", layout=dict(pp_size=2, tp_size=2, enable_expert_parallel=True))
    # an ep axis (its stacked experts stored under another name, read by expert), each dp rank its own batch
    _train(paths["granitemoe"], f"{out}/ep-axis", layout=dict(pp_size=2, tp_size=1, ep_size=2),
           parallelism=dict(dp_shard_size=2))
    _train(paths["cohere2"], f"{out}/fsdp", layout=dict(pp_size=2, tp_size=1),
           parallelism=dict(dp_shard_size=2))
    _train(paths["gpt_neox"], f"{out}/lora", layout=dict(pp_size=2, tp_size=2), lora=True)
    for model_type in ("cohere2", "llama4_text"):  # sliding windows, chunks and NoPE temperatures over cp ranks
        _train(paths[model_type], f"{out}/{model_type}-cp", layout=dict(pp_size=2, cp_size=2, tp_size=1))


def _eight_ranks_worker(paths: dict[str, str], out: str) -> None:
    for model_type in TYPES:
        _train(paths[model_type], f"{out}/{model_type}", layout=dict(pp_size=2, cp_size=2, tp_size=2))


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_tp2_cp2_pp2_equals_one_process(checkpoints, tmp_path):
    """tp 2 x cp 2 x pp 2 on 8 ranks, every family of issue 34 and the hybrid (its gated DeltaNet on the whole
    sequence beside the split attention)."""
    run_distributed(_eight_ranks_worker, 8, checkpoints, str(tmp_path), timeout=1800)


@pytest.mark.distributed
def test_trainer_tp2_pp2_ep_fsdp_lora_cp_equal_one_process(checkpoints, tmp_path):
    run_distributed(_four_ranks_worker, 4, checkpoints, str(tmp_path), timeout=1200)


@pytest.mark.distributed
def test_cli_trains_a_transformers_model_with_pp_size(tmp_path):
    """`tptrain train --pp-size 2` on a StarCoder2 config (the transformers backend) trains it and writes one
    checkpoint transformers loads."""
    import transformers

    from tests.helpers.launch import tptrain_train

    model_dir = tmp_path / "starcoder2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "starcoder2", **TINY, "vocab_size": 4096,
                                                       "max_position_embeddings": 256, "eos_token_id": 0}))
    run = tptrain_train("--model", str(model_dir), "--output-dir", str(tmp_path / "run"), "--tp-size", "1",
                        "--pp-size", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pp 2" in run.stdout, run.stdout
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert type(final).__name__ == "Starcoder2ForCausalLM"
