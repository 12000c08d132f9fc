"""A resumable checkpoint costs each rank at most one tensor beyond the memory of training.

TP 2 x FSDP 2 on 4 ranks, a ~150 MB fp32 model (params + 2 AdamW moments: ~115 MB per rank). Each rank
samples its private resident memory (RssAnon, tests/test_load_memory.py's PeakSampler) during its second
save (the first pays one-time imports) and asserts the rise stays within its largest local tensor + 10%
of its training state. Gathering over dp (the earlier format) costs every rank its whole TP shard of
params and moments again, ~115 MB, and fails this. glibc's dynamic mmap threshold is pinned in each rank
(tests.helpers.pin_mmap_threshold) so freed tensors go back to the OS and cannot hide a later allocation.

    .venv/bin/python -m pytest tests/test_checkpoint_memory.py -q -s   # -s prints the measured numbers
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import BIG
from tests.helpers.memory import PeakSampler, pin_mmap_threshold, rss_anon
from tests.helpers.ranks import run_distributed
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.data import PackedDataset
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed

MB = 2**20


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _save_worker(tmp: str) -> None:
    pin_mmap_threshold()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **BIG), dtype=torch.float32)
    model.parallelize(DistributedConfig(tp_size=2))
    args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=1, max_steps=3, seq_len=16,
                             parallelism_config=ParallelismConfig(2, dp_shard_size=2))
    data = PackedDataset(torch.randint(0, BIG["vocab_size"], (16 * 16,), generator=torch.Generator().manual_seed(1)), 16)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.training_step(trainer.data_order.next_batch())
    trainer.global_step = 1
    trainer.save_checkpoint()  # warm-up
    trainer.global_step = 2
    tensors = [t for p in trainer.inner.parameters() for t in (p, *trainer.optimizer.state[p].values())]
    state = sum(_local_bytes(t) for t in tensors)
    largest = max(_local_bytes(t) for t in tensors)
    before = rss_anon()
    with PeakSampler() as sampler:
        trainer.save_checkpoint()
    rank = torch.distributed.get_rank()
    Path(tmp, f"rank{rank}.txt").write_text(f"{sampler.peak - before} {state} {largest}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_save_stays_at_training_memory(tmp_path):
    run_distributed(_save_worker, 4, str(tmp_path), timeout=400)
    measured = [tuple(map(int, (tmp_path / f"rank{rank}.txt").read_text().split())) for rank in range(4)]
    for rank, (rise, state, largest) in enumerate(measured):
        print(f"rank {rank}: training state {state / MB:.0f} MiB, largest local tensor {largest / MB:.0f} MiB, "
              f"peak private rise while saving {rise / MB:.1f} MiB (bound {(largest + 0.1 * state) / MB:.1f} MiB)")
    for rank, (rise, state, largest) in enumerate(measured):
        assert rise < largest + 0.1 * state, f"rank {rank}: saving raised private memory by {rise / MB:.0f} MiB"
    assert os.listdir(tmp_path / "checkpoint-2")
