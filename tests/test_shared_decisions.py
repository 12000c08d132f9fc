"""Decisions made in one place and read everywhere: dtype names, positive sizes, whether a checkpoint directory has
weights, JSON / JSONL errors, and the checks the CLI shares with the library (issue 32)."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tptrain import dtypes
from tptrain.checks import check_positive_int, is_positive_int
from tptrain.cli import main
from tptrain.cli.train import _config_only
from tptrain.cli.train_arguments import BUNDLED_DATA, BUNDLED_MODEL, add_train_arguments
from tptrain.distributed import ParallelDims
from tptrain.io import ADAPTER_FILE, INDEX_FILE, SINGLE_FILE, CheckpointReader, save_checkpoint, weights_file
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.text import ByteTokenizer, load_chat_template, load_tokenizer
from tptrain.training.args import TrainingArguments
from tptrain.training.setup import training_data
from tptrain.training.sft_data import read_records, scan_data_file
from tptrain.training.streaming import StreamingText, check_streaming

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


# ------------------------------------------------------------------ dtype names


def test_every_dtype_name_resolves_and_round_trips():
    for name in dtypes.NAMES:
        dtype = dtypes.resolve_dtype(name, None)
        assert isinstance(dtype, torch.dtype) and dtypes.dtype_name(dtype) == name
        assert dtypes.resolve_dtype(f"torch.{name}", None) is dtype
    for alias, name in dtypes.ALIASES.items():
        assert dtypes.resolve_dtype(alias, None) is getattr(torch, name)
    assert dtypes.resolve_dtype(torch.float16, None) is torch.float16
    assert dtypes.resolve_dtype("auto", AutoConfig.for_model("qwen3", **TINY, torch_dtype="bfloat16")) is torch.bfloat16
    assert dtypes.resolve_dtype(None, AutoConfig.for_model("qwen3", **TINY)) is torch.float32
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8'; use one of \['bf16', 'bfloat16', 'float', "
                                         r"'float16', 'float32', 'float64', 'fp16', 'fp32'\] or a torch.dtype"):
        dtypes.resolve_dtype("int8", None)


def test_the_clis_dtype_choices_are_the_table(capsys):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    dtype = next(a for a in parser._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == dtypes.NAMES
    for given in (*dtypes.NAMES, *dtypes.ALIASES):  # what resolve_dtype takes, `tptrain train` takes
        assert parser.parse_args(["--dtype", given]).dtype == dtypes.canonical_name(given)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])
    err = capsys.readouterr().err
    assert "--dtype {float32,float64,bfloat16,float16}" in err and "invalid choice: 'int8'" in err, err
    with pytest.raises(SystemExit):
        main(["plan", "some/dir", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


# ------------------------------------------------------------------ positive sizes


def test_positive_int_is_one_check_everywhere():
    from tptrain.diagnostics.plan_report import plan_report
    from tptrain.peft import LoraConfig
    from tptrain.training.args import TrainingArguments

    assert [is_positive_int(v) for v in (1, 7, 0, -1, True, 2.0, "2", None)] == [True, True] + [False] * 6
    with pytest.raises(ValueError, match=r"^tp_size must be a positive int, got True$"):
        check_positive_int(True, "tp_size")
    # A bool is no size anywhere (True would pass a bare isinstance(value, int)); each message names its argument.
    cases = [(lambda: TrainingArguments(output_dir="x", max_steps=True),
              "TrainingArguments.max_steps must be a positive int, got True"),
             (lambda: plan_report(AutoConfig.for_model("qwen3", **TINY), True), "tp_size must be a positive int, got True"),
             (lambda: LoraConfig(r=True), "LoraConfig.r must be a positive int (the adapter rank), got True"),
             (lambda: AutoConfig.for_model("qwen3", **{**TINY, "hidden_size": True}),
              "hidden_size must be a positive integer, got True")]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert message in str(info.value), info.value


# ------------------------------------------------------------------ does a checkpoint directory have weights


def _checkpoints(root: Path) -> dict[str, Path]:
    """Three directories with a config.json: a LoRA adapter beside it (no model weights), an index whose shards are
    gone, and one model.safetensors."""
    config = AutoConfig.for_model("qwen3", **{**TINY, "vocab_size": 320})  # room for the byte fallback's 257 ids
    dirs = {name: root / name for name in ("adapter", "index", "single")}
    AutoModelForCausalLM.from_config(config).save_pretrained(dirs["single"])
    for name in ("adapter", "index"):
        config.save_pretrained(dirs[name])
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 32)}, dirs["adapter"] / ADAPTER_FILE)
    (dirs["adapter"] / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    weight_map = {"lm_head.weight": "model-00001-of-00002.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (dirs["index"] / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dirs


def test_one_answer_to_whether_a_directory_has_weights(tmp_path):
    dirs = _checkpoints(tmp_path)
    assert {name: weights_file(d) for name, d in dirs.items()} == {
        "adapter": None, "index": dirs["index"] / INDEX_FILE, "single": dirs["single"] / SINGLE_FILE}
    # from_pretrained: an adapter is no model weights (and is named as what it is); the index's shards are named
    with pytest.raises(FileNotFoundError) as info:
        AutoModelForCausalLM.from_pretrained(dirs["adapter"])
    assert (f"{dirs['adapter']} holds config.json but no weights" in str(info.value)
            and f"its {ADAPTER_FILE} is a LoRA adapter: load its base model" in str(info.value)), info.value
    with pytest.raises(FileNotFoundError, match=r"lists shard file\(s\) missing from .*: "
                                                r"model-00001-of-00002.safetensors, model-00002-of-00002.safetensors"):
        AutoModelForCausalLM.from_pretrained(dirs["index"])
    assert isinstance(AutoModelForCausalLM.from_pretrained(dirs["single"]), torch.nn.Module)
    # the CLI: only a directory without weights is initialised at random (a bare *.safetensors glob took the
    # adapter for weights; an index whose shards are gone is an error when loaded, not a model to start afresh)
    assert {name: _config_only(d) for name, d in dirs.items()} == {"adapter": True, "index": False, "single": False}
    # the tokenizer: bytes only for a model without weights
    assert isinstance(load_tokenizer(dirs["adapter"]), ByteTokenizer)
    for name in ("index", "single"):
        with pytest.raises(FileNotFoundError, match=f"the checkpoint {dirs[name]} has weights but no tokenizer"):
            load_tokenizer(dirs[name])
    # the writer replaces each of them (a checkpoint), and refuses a directory a stray *.safetensors is all it has
    for d in dirs.values():
        save_checkpoint({"w": torch.ones(1)}, d)
        assert sorted(p.name for p in d.iterdir()) == [SINGLE_FILE]
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("precious")
    save_file({"x": torch.ones(1)}, stray / "embeddings.safetensors")
    with pytest.raises(ValueError, match="does not look like a checkpoint"):
        save_checkpoint({"w": torch.ones(1)}, stray)


# ------------------------------------------------------------------ JSON and JSONL: the file and the line


def test_a_bad_json_file_is_named_with_its_line(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    bad = '{\n  "eos_token": "<|endoftext|>",\n  "chat_template": oops\n}\n'
    (model / "tokenizer_config.json").write_text(bad)
    for read in (load_tokenizer, load_chat_template):
        with pytest.raises(ValueError, match=f"^{model / 'tokenizer_config.json'} line 3 is not valid JSON: "
                                             "Expecting value \\(column 20\\)$"):
            read(model)
    (model / "config.json").write_text('{"model_type": "qwen3",}')
    for read in (AutoConfig.from_pretrained, load_tokenizer):
        with pytest.raises(ValueError, match=f"^{model / 'config.json'} line 1 is not valid JSON"):
            read(model)
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{model / 'config.json'} holds a JSON list, not an object"):
        AutoConfig.from_pretrained(model)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / INDEX_FILE).write_text('{"weight_map": {\n}\n}}')
    with pytest.raises(ValueError, match=f"index {tmp_path / 'ckpt' / INDEX_FILE} is corrupt .*: .* line 3 is not "
                                         "valid JSON"):
        CheckpointReader(tmp_path / "ckpt")


def test_a_bad_jsonl_line_is_named_by_every_reader(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": }\n')
    for read in (read_records, scan_data_file):  # the records in memory; the launcher's scan (and the token cache)
        with pytest.raises(ValueError, match=f"^{data} line 3 is not valid JSON: Expecting value$"):
            read(data)
    data.write_bytes(b'{"text": "caf\xc3\xa9"}\n{"text": "caf\xe9"}\n')
    for read in (read_records, scan_data_file):
        with pytest.raises(ValueError, match=f"dataset file {data} is not valid UTF-8: byte offset 31 "):
            read(data)


# ------------------------------------------------------------------ the launcher runs the library's checks


def _library_error(args: TrainingArguments, train, eval_source) -> str:
    with pytest.raises(ValueError) as info:
        training_data(args, ParallelDims(dp_replicate=1, dp_shard=1, tp=1), train, eval_source,
                      build=lambda source: list(range(16)))
    return str(info.value)


def test_the_launcher_and_the_trainer_refuse_with_the_same_message(tmp_path, capsys):
    out = str(tmp_path / "run")
    stream = tmp_path / "stream"
    stream.mkdir()
    (stream / "a.jsonl").write_text('{"text": "to be or not to be"}\n')
    cases = [(("--eval-steps", "2"), _library_error(TrainingArguments(out, eval_steps=2), "corpus.txt", None)),
             (("--save-best", "--eval-split", "0.1", "--eval-data", BUNDLED_DATA),
              _library_error(TrainingArguments(out, save_best=True, eval_split=0.1), "corpus.txt", "eval.txt")),
             (("--data", str(stream), "--streaming", "--num-epochs", "1"),
              _library_error(TrainingArguments(out, num_train_epochs=1.0), StreamingText(stream), None)),
             (("--data", str(stream), "--streaming", "--eval-split", "0.1"),
              _library_error(TrainingArguments(out, eval_split=0.1), StreamingText(stream), None))]
    for flags, message in cases:
        code = main(["train", "--smoke-test", *flags, "--output-dir", out])
        assert (code, capsys.readouterr().err) == (2, f"tptrain train: error: {message}\n"), flags
    with pytest.raises(ValueError) as info:  # the Trainer's own streaming check, called alone
        check_streaming(TrainingArguments(out, num_train_epochs=1.0), StreamingText(stream), None)
    assert str(info.value) == cases[2][1]
