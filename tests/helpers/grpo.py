"""What the GRPO tests share: reward functions of toy verifiable tasks, prompt records, the bundled tiny Qwen3 (random
weights, seeded) and a tiny fp64 checkpoint written by transformers, and a GRPOTrainer run recording what it did."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# self-contained (tests/test_grpo_cli.py hands this file to `tptrain grpo --reward-funcs FILE:function`, which imports
# it by its path in the workers): the chat helpers' words and bundled model, restated
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
BUNDLED = str(Path(__file__).resolve().parents[2] / "tptrain" / "data" / "tiny-qwen3")


def letter_e(prompts, completions, **columns):
    """A verifiable toy reward: the share of a completion's characters that are the letter e."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def short(prompts, completions, completion_ids, **columns):
    """Shorter completions score higher (completion_ids: TRL passes them too)."""
    return [-len(ids) / 8 for ids in completion_ids]


def uses_column(prompts, completions, target, **columns):
    """A reward reading a dataset column (TRL passes the row's other fields)."""
    return [float(t in c) for t, c in zip(target, completions)]


def prompt_records(n: int, *, chat: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 3))
        prompt = [{"role": "user", "content": text}] if chat else text + ":"
        out.append({"prompt": prompt, "target": WORDS[i % len(WORDS)]})
    return out


def metrics(output_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def bundled_model(dtype=torch.float32):
    """The bundled tiny Qwen3 (no weights: seeded random ones, as `tptrain train --model` starts it) and its
    tokenizer."""
    from tptrain.models import AutoConfig, AutoModelForCausalLM
    from tptrain.text import load_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED)).to(dtype)
    return model, load_tokenizer(BUNDLED)
