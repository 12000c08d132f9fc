"""`tptrain train` fine-tuning end to end at tp 2: chat JSONL -> LoRA -> eval -> adapter + merged export, checked
with peft + transformers; resume mid-run gives the same losses; bad flags and records fail clearly; --merge under
FSDP2 (and pp 2 x FSDP2)."""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.chat import (chat_checkpoint, chat_records, exported_logits, sft_checkpoint as _checkpoint,
                                write_jsonl as _jsonl)
from tests.helpers.launch import tptrain_train
from tptrain.training.reporting import read_metrics

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
FLAGS = ("--tp-size", "2", "--max-steps", "4", "--save-steps", "2", "--batch-size", "2", "--grad-accum", "2",
         "--seq-len", "64",
         "--lr", "3e-3", "--warmup-steps", "1", "--eval-steps", "2", "--save-best", "--lora-r", "4",
         "--lora-alpha", "8", "--lora-dropout", "0.05", "--lora-target-modules", "all-linear",
         "--max-new-tokens", "2", "--prompt", "to be")


def test_lora_sft_run_exports_adapter_and_merged_model_and_resumes(tmp_path):
    ckpt = _checkpoint(tmp_path)
    data, evals = _jsonl(tmp_path / "chat.jsonl", chat_records(24, 1)), _jsonl(tmp_path / "eval.jsonl",
                                                                             chat_records(6, 2))
    out = tmp_path / "run"
    common = ("--model", str(ckpt), "--data", str(data), "--eval-data", str(evals), "--output-dir", str(out), *FLAGS)
    run = tptrain_train(*common, "--merge")
    assert run.returncode == 0, run.stdout + run.stderr
    records = read_metrics(out / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals_logged = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and sorted(evals_logged) == [2, 4]
    assert (out / "best" / "adapter_config.json").is_file() and (out / "loss.png").is_file()

    # The adapter in peft + transformers == tptrain's model with it == the merged checkpoint in transformers.
    adapter, merged = out / "final" / "adapter", out / "final" / "merged"
    ids, _, peft_logits, _ = exported_logits(ckpt, adapter, merged)
    from tptrain.models import AutoModelForCausalLM
    from tptrain.peft import PeftModel

    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        our_logits = ours(ids).logits
    torch.testing.assert_close(our_logits, peft_logits, rtol=1e-5, atol=1e-5)
    assert (merged / "tokenizer_config.json").is_file()

    # Resumable checkpoints hold only the adapters (and their AdamW state).
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(out / "checkpoint-4")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]

    # Resume from the middle: steps 3 and 4 again, the same losses and eval loss.
    again = tptrain_train(*common, "--resume", str(out / "checkpoint-2"))
    assert again.returncode == 0, again.stdout + again.stderr
    records = read_metrics(out / "metrics.jsonl")
    resumed = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert resumed[3] == pytest.approx(losses[3], rel=1e-6) and resumed[4] == pytest.approx(losses[4], rel=1e-6)
    assert {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}[4] == pytest.approx(evals_logged[4],
                                                                                              rel=1e-6)


def test_finetune_flags_and_records_fail_clearly(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    bare = chat_checkpoint(tmp_path / "bare", None)  # no chat template
    chat = _jsonl(tmp_path / "chat.jsonl", chat_records(8, 1))
    out = str(tmp_path / "run")
    cases = [
        (("--model", str(bare), "--data", str(chat)), "has no chat template"),
        (("--model", str(ckpt), "--data", str(_jsonl(tmp_path / "odd.jsonl", [{"messages": []}, {"q": 1}]))),
         r"record 1 \(\['q'\]\) matches no format"),
        (("--model", str(ckpt), "--data", str(chat), "--merge"), "--merge and --lora-alpha need --lora-r"),
        (("--model", str(ckpt), "--data", str(chat), "--eval-steps", "2"), "need an eval set"),
        (("--model", str(ckpt), "--data", str(chat), "--num-epochs", "1", "--max-steps", "3"),
         "--max-steps or --num-epochs"),
        (("--model", str(ckpt), "--data", str(chat), "--report-to", "tensorboard"),
         "needs the tensorboard package"),
    ]
    from tptrain.cli import main

    capsys.readouterr()  # the checkpoint writer's progress bars
    for flags, message in cases:  # refused before any worker starts (exit code 2): checked in this process
        code = main(["train", "--smoke-test", *flags, "--output-dir", out])
        stderr = capsys.readouterr().err
        assert code == 2 and re.search(message, stderr) and stderr.count("\n") == 1, (flags, code, stderr)
    # Found while tokenizing, in the workers: raised on every rank, reported once, no hang.
    bad = chat_records(8, 1)
    bad[5] = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}
    run = tptrain_train("--model", str(ckpt), "--data", str(_jsonl(tmp_path / "bad.jsonl", bad)), "--output-dir", out)
    assert run.returncode == 1 and "error on ranks 0, 1: ValueError" in run.stderr, run.stderr
    assert run.stderr.count("record 5: messages[1] has the unknown role 'robot'") == 1, run.stderr
    long = _jsonl(tmp_path / "long.jsonl", [{"prompt": "to be " * 40, "completion": " or not"}] * 4)
    run = tptrain_train("--model", str(ckpt), "--data", str(long), "--output-dir", out, "--truncation", "error")
    assert run.returncode == 1 and "more than seq_len=32" in run.stderr, run.stderr


@pytest.mark.parametrize("layout", [
    pytest.param(("--tp-size", "1", "--nproc-per-node", "2"), id="fsdp2"),
    pytest.param(("--tp-size", "1", "--pp-size", "2", "--pp-microbatches", "2", "--nproc-per-node", "4"),
                 id="pp2_fsdp2", marks=pytest.mark.slow)])
def test_merge_under_fsdp2(tmp_path, layout):
    """--merge where FSDP2 shards the model (tp 1 x dp_shard 2; pp 2 x dp_shard 2): each rank folds its dp shard's rows
    of s * B @ A into its base shard, and the merged checkpoint's logits are peft's with the exported adapter."""
    ckpt = _checkpoint(tmp_path)
    data = _jsonl(tmp_path / "chat.jsonl", chat_records(16, 1))
    out = tmp_path / "run"
    run = tptrain_train("--model", str(ckpt), "--data", str(data), "--output-dir", str(out), *layout, "--batch-size",
                        "2", "--max-steps", "2", "--seq-len", "64", "--lr", "1e-2", "--lora-r", "4", "--merge")
    assert run.returncode == 0, run.stdout + run.stderr
    exported_logits(ckpt, out / "final" / "adapter", out / "final" / "merged")
