"""`tptrain plan`: the dry-run layout report (no process group), in-process and as `python -m tptrain plan`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tptrain.cli import main
from tptrain.models import AutoConfig
from tptrain.diagnostics.plan_report import plan_report

ROOT = Path(__file__).resolve().parent.parent
V, H, I, L, HEADS, KV, D = 128, 64, 96, 2, 4, 2, 16  # noqa: E741 - vocab, hidden, intermediate, layers, heads, kv, head_dim


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A config-only checkpoint directory (plan reads nothing else), saved as bfloat16."""
    path = tmp_path_factory.mktemp("qwen3")
    AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                         torch_dtype="bfloat16").save_pretrained(path)
    return path


def _row(text: str, module: str, param: str = "weight") -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.startswith(module + " ")]
    rows = [r for r in rows if r[2] == param]
    assert len(rows) == 1, f"no single row for {module}.{param} in:\n{text}"
    return rows[0]


def _expected_numel_per_rank(tp: int) -> int:
    kv_chunks = min(tp, KV)  # beyond KV heads, KV chunks are replicated
    per_layer = (HEADS * D * H // tp) * 2 + (KV * D * H // kv_chunks) * 2 + 3 * I * H // tp + 2 * D + 2 * H
    return 2 * V * H // tp + L * per_layer + H


@pytest.mark.parametrize("tp", [2, 4])
def test_report_at_tp_2_and_4(qwen3_dir, tp):
    report = plan_report(AutoConfig.from_pretrained(qwen3_dir), tp)
    text = report.text
    assert report.problems == [] and text.rstrip().endswith("layout OK")
    assert report.bytes_per_rank == 2 * _expected_numel_per_rank(tp)  # bfloat16, the config's dtype
    assert report.total_bytes == 2 * _expected_numel_per_rank(1)
    assert _row(text, "model.embed_tokens")[1:5] == ["embedding_rowwise", "weight", f"({V},", "64)"]
    q = _row(text, "model.layers.[0-1].self_attn.q_proj")
    assert q[1] == "colwise" and " ".join(q[3:7]) == f"(64, 64) ({64 // tp}, 64)"
    k = " ".join(_row(text, "model.layers.[0-1].self_attn.k_proj"))
    down = " ".join(_row(text, "model.layers.[0-1].mlp.down_proj"))
    assert f"rowwise weight (64, 96) (64, {96 // tp}) dim 1 split in {tp}" in down
    q_norm = " ".join(_row(text, "model.layers.[0-1].self_attn.q_norm"))
    assert "replicated_with_grad_allreduce weight (16,) (16,) whole on every rank; gradient all-reduced" in q_norm
    assert _row(text, "lm_head")[1] == "colwise_gather_output"
    if tp == 2:
        assert "colwise weight (32, 64) (16, 64) dim 0 split in 2" in k and "KV heads replicated" not in text
    else:  # 2 KV heads over 4 ranks: each KV head (16 rows) held by 2 ranks
        assert "colwise weight (32, 64) (16, 64) dim 0 split in 2, each chunk on 2 ranks" in k
        assert "each KV head is held by 2 consecutive ranks (rank r holds KV head r // 2)" in text


def test_main_happy_path_with_sequence_parallel_and_dtype(qwen3_dir, capsys):
    assert main(["plan", str(qwen3_dir), "--tp-size", "2", "--sequence-parallel", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "tp_size=2, dtype=float32, sequence_parallel=True" in out
    assert _row(out, "model.norm")[1] == "sequence_parallel"
    assert f"parameter bytes per rank: {4 * _expected_numel_per_rank(2) / 1e3:.2f} KB" in out


def test_impossible_layout_exits_2_and_lists_every_problem(qwen3_dir):
    """As a user runs it: `python -m tptrain plan DIR --tp-size 3`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tptrain", "plan", str(qwen3_dir), "--tp-size", "3"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    problems = run.stdout.split("IMPOSSIBLE LAYOUT: ")[1]
    assert problems.startswith("8 problem(s):")  # heads, KV heads, q/k/v/o widths (all layers at once), vocab x2
    for fragment in ("num_attention_heads=4 is not divisible by tp_size=3",
                     "tp_size=3 exceeds num_key_value_heads=2 and is not a multiple of it",
                     "model.layers.*.self_attn.o_proj.weight has shape (64, 64): dim 1",
                     "model.embed_tokens.weight has shape (128, 64)", "lm_head.weight has shape (128, 64)",
                     "pad the vocabulary"):
        assert fragment in problems, run.stdout
    assert "<-- 128 is not divisible by 3" in " ".join(_row(run.stdout, "lm_head"))


def test_overrides_and_bad_arguments(qwen3_dir, tmp_path, capsys):
    overrides = json.dumps({"layers.*.mlp.down_proj": None, "layers.*.mlp.upproj": "colwise"})
    assert main(["plan", str(qwen3_dir), "--tp-size", "2", "--tp-plan", overrides]) == 2
    out = capsys.readouterr().out
    assert "'model.layers.*.mlp.upproj' matches no module" in out
    down = " ".join(_row(out, "model.layers.[0-1].mlp.down_proj")[1:])
    assert down == "replicated weight (64, 96) (64, 96) whole on every rank"  # its rule removed
    # ... which leaves gate/up's split output feeding a replicated down_proj: impossible, with the fix
    assert "model.layers.*.mlp.down_proj (no rule (replicated)) reads the whole width" in out
    assert "make model.layers.*.mlp.down_proj 'rowwise'" in out and "layout OK" not in out
    mlp = json.dumps({f"layers.*.mlp.{m}": None for m in ("gate_proj", "up_proj", "down_proj")})
    assert main(["plan", str(qwen3_dir), "--tp-size", "2", "--tp-plan", mlp]) == 0  # all replicated: shapes meet
    assert "layout OK" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:  # argparse: usage error, exit 2
        main(["plan", str(qwen3_dir), "--tp-size", "2", "--tp-plan", "{not json"])
    assert exit_info.value.code == 2 and "--tp-plan: not valid JSON" in capsys.readouterr().err

    assert main(["plan", str(tmp_path / "nowhere"), "--tp-size", "2"]) == 1
    assert "tptrain plan: error: checkpoint" in capsys.readouterr().err
    assert main(["plan", str(qwen3_dir), "--tp-size", "0"]) == 1
    assert "--tp-size must be a positive integer, got 0" in capsys.readouterr().err


def test_plan_builds_on_meta_and_starts_no_process_group(qwen3_dir):
    had_group = torch.distributed.is_initialized()  # another test of this session may have started one
    report = plan_report(AutoConfig.from_pretrained(qwen3_dir), 4, dtype=torch.float32)
    assert torch.distributed.is_initialized() == had_group
    assert report.bytes_per_rank == 4 * _expected_numel_per_rank(4)


def test_train_is_imported_only_when_it_is_the_command(qwen3_dir, monkeypatch, capsys):
    import tptrain.cli

    monkeypatch.setitem(sys.modules, "tptrain.cli.train", None)  # as if the training stack were broken
    monkeypatch.delattr(tptrain.cli, "train", raising=False)  # imported by an earlier test
    assert main(["plan", str(qwen3_dir), "--tp-size", "2"]) == 0
    assert main(["train", "--max-steps", "1"]) == 1
    assert "tptrain train: error: the training stack cannot be imported (ModuleNotFoundError" in capsys.readouterr().err


def test_a_size_that_does_not_divide_lists_the_sizes_that_do(qwen3_dir, tmp_path, capsys):
    """Every constraint counts: heads and KV heads (with replication), widths, vocab; experts with --expert-parallel."""
    assert main(["plan", str(qwen3_dir), "--tp-size", "3"]) == 2
    assert "\nsizes that work: 1, 2, 4\n" in capsys.readouterr().out
    moe = tmp_path / "moe"  # 6 experts: with --expert-parallel only 1 and 2 also split the experts evenly
    AutoConfig.for_model("qwen3_moe", vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=32).save_pretrained(moe)
    assert main(["plan", str(moe), "--tp-size", "4"]) == 0
    assert main(["plan", str(moe), "--tp-size", "4", "--expert-parallel"]) == 2
    out = capsys.readouterr().out
    assert "num_experts=6 must be a multiple of 4" in out, out
    assert "\nsizes that work: 1, 2\n" in out, out

    # `tptrain train` runs the same check before starting any worker: its one line names the sizes too.
    assert main(["train", "--model", str(qwen3_dir), "--tp-size", "3", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--tp-size 3 cannot shard Qwen3ForCausalLM: num_attention_heads=4 is not divisible by tp_size=3" in err, err
    assert "; sizes that work: 1, 2, 4; `tptrain plan" in err, err
