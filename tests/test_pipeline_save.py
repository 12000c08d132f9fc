"""Saving under pipeline parallelism (parallel/pipeline_checkpoint.py), LoRA on the stages, ZBVZeroBubble at pp 4.

save_pretrained at pp 2 x tp 2: each stage's first TP rank writes its own shard files and global rank 0 the one
index, last; transformers loads the result with the single-process logits, tptrain reloads it at pp 1 and pp 2 x tp 2;
a stage failing half-way is raised on every rank and leaves the checkpoint that was there. LoRA at pp 2 and pp 2 x
tp 2: a random adapter loaded onto the stages trains 3 AdamW steps as one process does (fp64, losses and adapter at
1e-10), and the one adapter_model.safetensors gathered from the stages gives in peft + transformers that process's
logits.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.helpers.checkpoints import save_family
from tests.helpers.lora import random_lora
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM

SHARD = 40_000  # bytes: a few files per stage for the tiny models


@contextlib.contextmanager
def _record_files(log: list[tuple[str, list[str]]], *, fail_on: int | None = None):
    """Note every file this rank's writer finishes (name, tensor names); with `fail_on`, fail that safetensors file."""
    from tptrain.io import writer

    save_file, write_file = writer.save_file, writer._write_file

    def saved(tensors, path, **kw):
        if fail_on is not None and sum(name.endswith(".safetensors") for name, _ in log) + 1 == fail_on:
            raise OSError("disk full (injected)")
        save_file(tensors, path, **kw)
        log.append((Path(path).name, sorted(tensors)))

    def wrote(path, content):
        write_file(path, content)
        log.append((Path(path).name, []))

    writer.save_file, writer._write_file = saved, wrote
    try:
        yield
    finally:
        writer.save_file, writer._write_file = save_file, write_file


def _layers(names: list[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}


def _check_parts(family: str, written: list[list[tuple[str, list[str]]]], out: str) -> None:
    """Ranks 0 and 2 (tp rank 0 of stages 0 and 1) wrote their stage's tensors; rank 0 the index and config last."""
    assert written[1] == [] and written[3] == [], written
    first, second = ([(f, names) for f, names in written[r] if f.endswith(".safetensors")] for r in (0, 2))
    assert len(first) > 1 and len(second) > 1 and [f for f, _ in written[2]] == [f for f, _ in second]
    total = len(first) + len(second)
    assert [f for f, _ in first + second] == [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)]
    assert [f for f, _ in written[0][-2:]] == ["model.safetensors.index.json", "config.json"]  # last
    stage0 = [n for _, names in first for n in names]
    stage1 = [n for _, names in second for n in names]
    assert _layers(stage0) == {0, 1} and _layers(stage1) == {2, 3}
    assert "model.embed_tokens.weight" in stage0 and "model.norm.weight" in stage1
    assert ("lm_head.weight" in stage1) == (family == "llama")  # a tied head is the embedding, saved once
    index = json.loads(Path(out, "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: f for f, names in first + second for n in names}


def _compare_with_transformers(path: str, out: str) -> None:
    import transformers

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # transformers computes RoPE in fp32 (~1e-7 apart); the weights themselves are compared exactly below
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-6, atol=1e-6)
    if ref.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    reloaded = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).named_parameters())  # pp 1
    for name, p in ref.named_parameters():
        torch.testing.assert_close(reloaded[name], p, rtol=0, atol=0)


def _save_cases(root: str) -> None:
    import torch.distributed as dist

    from tptrain.distributed import comm

    for family, schedule in (("qwen3_tied", "1F1B"), ("llama", "Interleaved1F1B")):
        path, out = os.path.join(root, family), os.path.join(root, f"{family}-saved")
        config = DistributedConfig(pp_size=2, tp_size=2, pp_schedule=schedule)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=config)
        log: list = []
        with _record_files(log):
            model.save_pretrained(out, max_shard_size=SHARD)
        if schedule == "1F1B":  # one stage per rank: the parts are the stages
            _check_parts(family, comm.all_gather_object(log), out)
        if dist.get_rank() == 0:
            _compare_with_transformers(path, out)
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, distributed_config=config)  # pp 2
        mine = dict(again.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(mine[name], p, rtol=0, atol=0)
        # A stage failing on its second file: raised on every rank, the checkpoint saved above left whole.
        with _record_files([], fail_on=2 if dist.get_rank() == 2 else None), \
                pytest.raises(OSError, match=r"disk full \(injected\).*\(on rank 2 of 4\)"):
            model.save_pretrained(out, max_shard_size=SHARD)
        dist.barrier()
        assert os.path.isdir(out) and not [n for n in os.listdir(root) if n.startswith(".")]  # no staging left
        if dist.get_rank() == 0:
            _compare_with_transformers(path, out)
    # A stage's writer on another filesystem (it cannot see rank 0's staging directory): said, on every rank.
    is_dir = Path.is_dir
    hidden = (lambda self: ".tmp-" not in self.name and is_dir(self)) if dist.get_rank() == 2 else is_dir
    with mock.patch.object(Path, "is_dir", hidden), \
            pytest.raises(OSError, match=r"staging directory .* is not visible on this rank: .* on a filesystem all "
                                         r"ranks share.*\(on rank 2 of 4\)"):
        model.save_pretrained(os.path.join(root, "elsewhere"))
    dist.barrier()  # rank 0 removes its staging directory as it raises
    assert not [n for n in os.listdir(root) if n.startswith(".") or n == "elsewhere"]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


def _lora_case(root: str, family: str, schedule: str, tp: int) -> None:
    """A random adapter (saved by one process) loaded onto the stages, 3 Trainer steps, the final adapter."""
    import torch.distributed as dist

    from tptrain.distributed import init_distributed
    from tptrain.peft import LoraConfig, PeftModel, get_peft_model
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    init_distributed()
    path, init = os.path.join(root, family), os.path.join(root, f"{family}-adapter-{tp}")
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64),
                         LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    random_lora(ref, seed=1)  # the same on every rank; B not zero
    ref.save_pretrained(init)  # rank 0 writes
    dist.barrier()
    config = DistributedConfig(pp_size=2, tp_size=tp, pp_schedule=schedule)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                                           distributed_config=config), init,
                                      is_trainable=True)
    out = os.path.join(root, f"{family}-lora-{tp}")
    args = training_args(out, max_steps=3, parallelism_config=ParallelismConfig(
        tp_size=tp, pp_size=2, pp_schedule=schedule, pp_microbatches=4))
    data = tiny_dataset()
    losses = Trainer(model, args=args, train_dataset=data).train().losses
    stages = len(model.parallel.pp.stages)
    # a dropout mask per stage forward (and one per stage for the schedule's shape inference, on meta)
    assert 3 * 4 * stages <= model.runtime.step <= 3 * 4 * stages + stages, model.runtime.step
    expected = reference_losses(ref.train(), data, args, global_batch=4)
    what = f"LoRA {family} {schedule} pp 2 x tp {tp}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-10, atol=1e-10,
                               msg=lambda m: f"{what} losses: {m}")
    if dist.get_rank() == 0:
        _cross_with_peft(path, os.path.join(out, "final", "adapter"), ref, what)
    dist.barrier()


def _cross_with_peft(path: str, adapter: str, ref, what: str) -> None:
    """The adapter the stages wrote: the single process's tensors, and in peft + transformers its logits."""
    import peft
    import transformers
    from safetensors.torch import load_file

    saved, want = load_file(os.path.join(adapter, "adapter_model.safetensors")), ref.adapter_state_dict()
    assert sorted(saved) == sorted(want), (sorted(saved), sorted(want))
    for key, t in want.items():
        torch.testing.assert_close(saved[key], t, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {key}: {m}")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        ours = ref.eval()(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)


def _zbv_pp4(root: str) -> None:
    """ZBVZeroBubble over 8 stages (two per rank, as a V) of an 8-layer Llama: 3 steps equal one process."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    path = os.path.join(root, "llama8")
    config = DistributedConfig(pp_size=4, pp_schedule="ZBVZeroBubble")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=config)
    assert model.parallel.pp.stages == (model.device_mesh["pp"].get_local_rank(), 7 - model.device_mesh["pp"].get_local_rank())
    args = training_args(os.path.join(root, "zbv"), max_steps=3, per_device_train_batch_size=8, parallelism_config=
                         ParallelismConfig(pp_size=4, pp_schedule="ZBVZeroBubble", pp_microbatches=8))
    data = tiny_dataset()
    losses = Trainer(model, args=args, train_dataset=data).train().losses
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).train()
    expected = reference_losses(ref, data, args, global_batch=8)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-10, atol=1e-10)


def _lora_on_stages(root: str) -> None:
    """Targets a stage may lack: found on another stage they are fine, found on none an error on every rank; a tied
    weight trained on one stage's copy only is refused on every rank."""
    from tptrain.peft import LoraConfig, get_peft_model
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "qwen3_tied"), dtype=torch.float64,
                                                 distributed_config=DistributedConfig(pp_size=2, tp_size=2))
    with pytest.raises(ValueError, match=r"target_modules=\['q_prj'\] matches no module of any pipeline stage"):
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_prj"]))
    with pytest.raises(ValueError, match=r"modules_to_save entries \['nrm'\] match no module of any pipeline stage"):
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["nrm"]))
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["embed_tokens"]))  # on stage 0 only
    assert list(adapted.lora_layers) == (["model.embed_tokens"] if model.parallel.pp.holds(0) else [])
    adapted.unload()
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens"]))
    args = training_args(os.path.join(root, "refused"), max_steps=1, parallelism_config=ParallelismConfig(
        tp_size=2, pp_size=2, pp_microbatches=2))
    with pytest.raises(ValueError, match="only one pipeline stage's copy of the tied weight"):
        Trainer(adapted, args=args, train_dataset=tiny_dataset())


def _world4(root: str) -> None:
    _save_cases(root)
    _lora_case(root, "qwen3_tied", "1F1B", 2)
    _lora_on_stages(root)
    _zbv_pp4(root)


@pytest.mark.distributed
def test_pp2_tp2_save_lora_and_zbv_pp4(tmp_path):
    for family in ("qwen3_tied", "llama", "llama8"):
        save_family(family, tmp_path)
    run_distributed(_world4, 4, str(tmp_path), timeout=400)


@pytest.mark.distributed
def test_lora_pp2_equals_one_process(tmp_path):
    save_family("llama", tmp_path)
    run_distributed(_lora_case, 2, str(tmp_path), "llama", "ZBVZeroBubble", 1, timeout=300)


@pytest.mark.distributed
def test_sft_lora_cli_at_pp2(tmp_path):
    """`tptrain train` fine-tuning (chat records, LoRA, evaluation, --merge) at --pp-size 2: the adapter gathered from
    both stages gives in peft + transformers the logits of the merged checkpoint the stages wrote."""

    from tests.helpers.chat import chat_records, exported_logits, sft_checkpoint as _checkpoint, write_jsonl as _jsonl
    from tests.helpers.launch import tptrain_train
    from tests.helpers.lora import adapter_keys_and_shapes
    from tptrain.training.reporting import read_metrics

    ckpt = _checkpoint(tmp_path)
    data, evals = _jsonl(tmp_path / "chat.jsonl", chat_records(16, 1)), _jsonl(tmp_path / "eval.jsonl",
                                                                             chat_records(4, 2))
    out = tmp_path / "run"
    run = tptrain_train("--model", str(ckpt), "--data", str(data), "--eval-data", str(evals), "--output-dir", str(out),
                        "--tp-size", "1", "--pp-size", "2", "--pp-microbatches", "2", "--batch-size", "2",
                        "--max-steps", "2", "--eval-steps", "2", "--seq-len", "64", "--lr", "1e-2", "--lora-r", "4",
                        "--lora-dropout", "0.05", "--merge")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "world size 2, tp 1, pp 2" in run.stdout, run.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("eval_loss" in r for r in records)
    adapter, merged = out / "final" / "adapter", out / "final" / "merged"
    assert len(list(merged.glob("model-*-of-*.safetensors"))) >= 2  # one part per stage at least
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in adapter_keys_and_shapes(adapter) if ".layers." in k}
    assert layers == {0, 1}, layers  # both stages' adapters, in one file
    exported_logits(ckpt, adapter, merged)  # the adapter trained (on every stage's layers), merged equal
