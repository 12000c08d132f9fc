"""Loading at tp 2 costs each rank about half the checkpoint in private memory, never a full copy.

The checkpoint (~300 MB of fp32, 2 wide layers) is made in the test's tmp dir. Each rank samples its
private (anonymous) resident memory, /proc/self/status RssAnon, in a background thread while
`from_pretrained` runs. File-backed pages of the memory-mapped safetensors files are left out on
purpose: they are shared page cache, not memory the rank owns (they show up in RSS, so RSS/maxrss
would overstate the cost).

    .venv/bin/python -m pytest tests/test_load_memory.py -q -s   # -s prints the measured numbers
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.memory import CONSTANT, MB, PeakSampler, rss_anon
from tests.helpers.ranks import run_distributed
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.io import save_checkpoint

pytestmark = pytest.mark.distributed

CONFIG = dict(vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
              num_attention_heads=16, num_key_value_heads=4, head_dim=128)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                distributed_config=DistributedConfig(tp_size=2))


def _load_worker(path: str, tiny: str) -> None:
    # Warm-up: a tiny checkpoint pays the one-time costs that do not grow with the checkpoint (lazy
    # imports, e.g. torch's Python meta kernels, ~70 MB; the process groups).
    start = rss_anon()
    _load(tiny)
    before = rss_anon()
    with PeakSampler() as sampler:
        model = _load(path)
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    rank = torch.distributed.get_rank()
    Path(path, f"rank{rank}.txt").write_text(f"{sampler.peak - before} {local} {before - start}")


def _save(config, path) -> tuple[int, int]:
    """Random weights for `config` at `path`; returns (total bytes, bytes of the largest tensor)."""
    meta = AutoModelForCausalLM.from_config(config, device="meta")
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(p.shape, generator=g) for n, p in meta.state_dict().items()}
    save_checkpoint(state, path, max_shard_size="200MB", extra_files={"config.json": json.dumps(config.to_dict())})
    sizes = [t.numel() * t.element_size() for t in state.values()]
    return sum(sizes), max(sizes)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_each_rank_loads_about_half_the_checkpoint(tmp_path):
    total, largest = _save(AutoConfig.for_model("llama", **CONFIG), tmp_path / "big")
    _save(AutoConfig.for_model("llama", **{**CONFIG, "hidden_size": 64, "intermediate_size": 64, "vocab_size": 64,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
          tmp_path / "tiny")
    run_distributed(_load_worker, 2, str(tmp_path / "big"), str(tmp_path / "tiny"), timeout=180)
    bound = total / 2 + largest + 0.1 * total / 2 + CONSTANT
    for rank in range(2):
        rise, local, warmup = map(int, (tmp_path / "big" / f"rank{rank}.txt").read_text().split())
        print(f"rank {rank}: checkpoint {total / MB:.0f} MiB, local params {local / MB:.0f} MiB, "
              f"peak private rise while loading {rise / MB:.0f} MiB (bound {bound / MB:.0f} MiB; "
              f"one-time warm-up {warmup / MB:.0f} MiB)")
        assert local < 0.55 * total  # the model really holds only half
        assert rise < bound, f"rank {rank}: loading raised private memory by {rise / MB:.0f} MiB"
        assert rise < 0.8 * total
