"""Decisions made in one place and read everywhere: dtype names, positive sizes, whether a checkpoint directory has
weights, JSON / JSONL errors, and the checks the CLI shares with the library (issue 32)."""
from __future__ import annotations

import argparse

import pytest
import torch

from tptrain import dtypes
from tptrain.checks import check_positive_int, is_positive_int
from tptrain.cli import main
from tptrain.cli.train_arguments import add_train_arguments
from tptrain.models import AutoConfig

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
