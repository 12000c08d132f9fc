"""The core imports and runs with transformers absent: a fresh interpreter whose import system refuses
transformers and peft (a meta-path finder), as in an install without the `tptrain[hf]` extra."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "peft"):
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)")

sys.meta_path.insert(0, Refuse())
import torch
import tptrain
import tptrain.training, tptrain.peft, tptrain.cli
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.models import LlamaConfig
from tptrain.diagnostics.plan_report import plan_report

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config)
ids = torch.randint(0, 64, (2, 8))
model(ids, labels=ids).loss.backward()
assert model.backend == "native"
assert not plan_report(config, 2).problems
for backend, path in (("auto", sys.argv[1]), ("transformers", sys.argv[2])):
    try:
        AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=1, backend=backend))
    except ValueError as exc:
        print("ERROR:", exc)
    else:
        raise AssertionError("loaded without transformers")
assert not any(m.split(".")[0] in ("transformers", "peft") or m.startswith("tptrain.hf") for m in sys.modules)
print("OK")
'''


def test_core_runs_without_transformers(tmp_path):
    starcoder, llama = tmp_path / "starcoder2", tmp_path / "llama"
    for path, model_type in ((starcoder, "starcoder2"), (llama, "llama")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(starcoder), str(llama)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2 and proc.stdout.rstrip().endswith("OK"), proc.stdout
    for line in errors:  # both fixes named: the extra, and the native model types
        assert 'pip install "tptrain[hf]"' in line and "llama" in line and "qwen3" in line, line
    assert "'starcoder2' is not implemented natively" in errors[0]
    assert "'llama' was asked for backend='transformers'" in errors[1]
