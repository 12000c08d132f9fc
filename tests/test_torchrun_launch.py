"""Under an external launcher: `torchrun` starting `tptrain train`, and a user script written as the README
shows, each on 2 CPU ranks (gloo). tptrain must join torchrun's workers, not start its own.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tptrain train --smoke-test --output-dir DIR
    python -m torch.distributed.run --standalone --nproc-per-node 2 script.py SRC DST
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.configs import make_config
from tests.helpers.launch import finish
from tptrain.models import AutoModelForCausalLM
from tptrain.training.reporting import read_metrics

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent

# The README's Usage section, verbatim in its calls, on every rank. It simply ends: no teardown ritual.
USER_SCRIPT = textwrap.dedent("""\
    import sys

    import torch
    from tptrain import AutoModelForCausalLM, DistributedConfig

    src, dst, ids = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
    assert DistributedConfig().sizes()["tp"] == 2  # tp_size omitted: WORLD_SIZE from torchrun
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
        distributed_config=DistributedConfig(tp_size=2))
    assert model.tp_size == 2 and torch.distributed.get_world_size() == 2
    out = model(input_ids=ids, labels=ids); out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    if dst != "-":
        model.save_pretrained(dst)
    if torch.distributed.get_rank() == 0:
        print("LOSS", out.loss.item().hex(), flush=True)
""")


def _torchrun(*args: str) -> subprocess.Popen:
    """Start torchrun in a clean environment: no rank variables inherited from whoever runs pytest."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    code, stdout, stderr = finish(proc, timeout)
    assert code == 0, f"exit {code}:\n{stdout}\n{stderr}"
    return stdout


def test_train_cli_and_user_script_under_torchrun(tmp_path):
    # A tiny fp32 Qwen3 checkpoint, and what the single-device model computes on the batch.
    torch.manual_seed(0)
    config = make_config("qwen3")
    original = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    original.save_pretrained(tmp_path / "src")
    ids, _ = batch(config.vocab_size)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected_logits = original(ids).logits
        expected_loss = original(ids, labels=ids).loss
    (tmp_path / "script.py").write_text(USER_SCRIPT)

    # Both launches at once: they share nothing but the 2 cores.
    run = tmp_path / "run"
    train = _torchrun("-m", "tptrain", "train", "--smoke-test", "--output-dir", str(run))
    script = _torchrun(str(tmp_path / "script.py"), str(tmp_path / "src"), str(tmp_path / "dst"),
                       str(tmp_path / "ids.pt"))
    train_out, script_out = _finish(train), _finish(script)

    # tptrain train joined torchrun's 2 ranks as one TP group: one run, printed once by rank 0.
    assert train_out.count("tptrain train:") == 1 and "world size 2, tp 2" in train_out, train_out
    for name in ("config.json", "model.safetensors"):
        assert (run / "final" / name).is_file(), f"{name} missing from {sorted(os.listdir(run / 'final'))}"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    trained = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32)
    assert trained.config.model_type == "qwen3"

    # The user script: the TP loss is the single-device one; the consolidated save reloads to the same model.
    loss = float.fromhex(script_out.split("LOSS ")[1].split()[0])
    torch.testing.assert_close(torch.tensor(loss), expected_loss, rtol=1e-5, atol=1e-6)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected_logits, rtol=0, atol=0)


def test_user_script_that_simply_ends_exits_cleanly(tmp_path):
    """Without a teardown in the script, gloo used to abort about 1 run in 6 at interpreter exit (SIGABRT,
    "terminate called without an active exception"); the library now closes the process group at exit."""
    torch.manual_seed(0)
    config = make_config("qwen3")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "src")
    torch.save(batch(config.vocab_size)[0], tmp_path / "ids.pt")
    (tmp_path / "script.py").write_text(USER_SCRIPT)
    args = (str(tmp_path / "script.py"), str(tmp_path / "src"), "-", str(tmp_path / "ids.pt"))
    for _ in range(3):  # 6 runs, two at a time
        runs = [_torchrun(*args), _torchrun(*args)]
        for run in runs:
            assert "LOSS" in _finish(run)
