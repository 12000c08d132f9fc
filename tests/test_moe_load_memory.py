"""Loading an MoE checkpoint at ep 2 costs each rank its own experts and its share of the dense part, never the
whole expert set: the loader reads only this rank's experts' per-expert tensors into the stacked parameter. Both at
ep = tp = 2 (`enable_expert_parallel`) and at ep 2 on an axis of its own (`ep_size=2`, tp 1: dense part whole).

    .venv/bin/python -m pytest tests/test_moe_load_memory.py -q -s   # -s prints the measured numbers
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.memory import CONSTANT, MB, PeakSampler, rss_anon
from tests.helpers.ranks import run_distributed
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.io import save_checkpoint
from tptrain.modeling import to_checkpoint_names

pytestmark = pytest.mark.distributed

# 8 experts of 3 x 1024 x 768 fp32 (9.4 MiB each) in 2 layers: 151 MiB of experts, ~45 MiB dense.
CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=768,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=8,
              num_experts_per_tok=2)


LAYOUTS = {"tp": dict(tp_size=2, enable_expert_parallel=True), "ep_axis": dict(tp_size=1, ep_size=2)}


def _load(path, layout: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                distributed_config=DistributedConfig(**LAYOUTS[layout]))


def _worker(path: str, tiny: str, layout: str) -> None:
    _load(tiny, layout)  # one-time costs (lazy imports, process groups)
    rises = []
    # Two loads, the smaller rise judged: an over-read shows in both, while the first load of a large checkpoint also
    # grows the allocator's heaps once (~45 MiB here, which the tiny warm-up does not reach), within 1% of the bound.
    for _ in range(2):
        gc.collect()
        before = rss_anon()
        with PeakSampler() as sampler:
            model = _load(path, layout)
        rises.append(sampler.peak - before)
        experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        local = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
    Path(path, f"rank{torch.distributed.get_rank()}.txt").write_text(f"{min(rises)} {local} {experts} {rises[0]}")


def _save(config, path) -> dict[str, int]:
    """Random weights in the hub's per-expert layout; returns {"total", "experts", "largest"} bytes."""
    meta = AutoModelForCausalLM.from_config(config, device="meta")
    g = torch.Generator().manual_seed(0)
    state = to_checkpoint_names({n: torch.randn(p.shape, generator=g) for n, p in meta.state_dict().items()},
                                meta.checkpoint_keys())
    save_checkpoint(state, path, max_shard_size="100MB", extra_files={"config.json": json.dumps(config.to_dict())})
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    return {"total": sum(sizes.values()), "experts": sum(v for n, v in sizes.items() if ".experts." in n),
            "largest": max(sizes.values())}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_loads_only_its_experts(tmp_path, layout):
    sizes = _save(AutoConfig.for_model("qwen3_moe", **CONFIG), tmp_path / "big")
    _save(AutoConfig.for_model("qwen3_moe", **{**CONFIG, "hidden_size": 64, "intermediate_size": 64,
                                                "moe_intermediate_size": 32, "vocab_size": 64}), tmp_path / "tiny")
    run_distributed(_worker, 2, str(tmp_path / "big"), str(tmp_path / "tiny"), layout, timeout=240)
    dense = sizes["total"] - sizes["experts"]
    bound = 1.1 * (sizes["experts"] / 2 + dense) + CONSTANT  # its own experts + the dense part + 10%
    if layout == "ep_axis":  # at tp 1 the dense tensors are read whole: one of them (<= 16 MiB) in flight too; all
        bound += sizes["largest"]  # (every expert loaded: 196 MiB)
    for rank in range(2):
        rise, local, experts, first = map(int, (tmp_path / "big" / f"rank{rank}.txt").read_text().split())
        print(f"{layout} rank {rank}: checkpoint {sizes['total'] / MB:.0f} MiB ({sizes['experts'] / MB:.0f} MiB "
              f"experts), local params {local / MB:.0f} MiB ({experts / MB:.0f} MiB experts), peak private rise while loading "
              f"{rise / MB:.0f} MiB (first load {first / MB:.0f} MiB; bound {bound / MB:.0f} MiB)")
        assert experts == sizes["experts"] // 2  # half the experts, whole
        assert rise < bound, f"rank {rank}: loading raised private memory by {rise / MB:.0f} MiB"
        assert rise < 1.1 * local + sizes["largest"] + CONSTANT  # no more than what it keeps, plus one tensor
