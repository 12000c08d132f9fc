"""save_pretrained streams: gathered tensor by tensor, written shard file by shard file.

At TP 2 x FSDP 2 (4 ranks) with a small max_shard_size, rank 0's private memory (RssAnon, sampled) rises
by at most one shard plus the gather of one tensor (+10%) while it exports a ~105 MB model (gathering it
whole, as before, costs the model and fails this). Gathering a tensor briefly takes ~2.5x its size: its
TP shard (FSDP's all-gather), the full tensor (TP's all-gather) and gloo's staging copy of it. The files are written shard by shard with the index and config.json
last, and transformers loads the result with the very weights. A failure half-way (the second shard
file) is raised on every rank, leaves no directory behind, and no rank hangs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import BIG
from tests.helpers.memory import PeakSampler, pin_mmap_threshold, rss_anon
from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_model
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.io import writer as safetensors_io
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.data import PackedDataset
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed

MB = 2**20
SHARD = 20 * 10**6  # "20MB": 9 shard files for the ~150 MB model


GATHER = 2.5  # a tensor's gather, in tensors (above)


def _big_model() -> torch.nn.Module:  # many ~10 MB tensors, none much larger: the MLP's 11.5 MB
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", **{**BIG, "vocab_size": 2048})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _record_writes(log: list[str]) -> None:
    """Note, in order, every file the writer finishes."""
    save_file, write_file = safetensors_io.save_file, safetensors_io._write_file

    def saved(tensors, path, **kw):
        save_file(tensors, path, **kw)
        log.append(Path(path).name)

    def wrote(path, content):
        write_file(path, content)
        log.append(Path(path).name)

    safetensors_io.save_file, safetensors_io._write_file = saved, wrote


def _export_worker(tmp: str) -> None:
    pin_mmap_threshold()  # freed tensors go back to the OS
    model = _big_model().parallelize(DistributedConfig(tp_size=2))
    data = PackedDataset(torch.zeros(64, dtype=torch.long), 16)
    args = TrainingArguments(output_dir=f"{tmp}/run", max_steps=1, seq_len=16, per_device_train_batch_size=1,
                             parallelism_config=ParallelismConfig(2, dp_shard_size=2))
    trainer = Trainer(model=model, args=args, train_dataset=data)  # FSDP2-wraps the TP model: both shard it
    log: list[str] = []
    _record_writes(log)
    model.save_pretrained(f"{tmp}/warm", max_shard_size=SHARD)  # one-time costs (imports, buffers)
    log.clear()
    before = rss_anon()
    with PeakSampler() as sampler:
        trainer.inner.save_pretrained(f"{tmp}/hf", max_shard_size=SHARD)
    if torch.distributed.get_rank() == 0:
        Path(tmp, "rank0.json").write_text(json.dumps({"rise": sampler.peak - before, "log": log}))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_streamed_export_memory_order_and_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    run_distributed(_export_worker, 4, str(tmp_path), timeout=400)
    result = json.loads((tmp_path / "rank0.json").read_text())
    ref = _big_model()
    sizes = [p.numel() * p.element_size() for p in ref.parameters()]
    bound = 1.1 * (SHARD + GATHER * max(sizes))
    print(f"rank 0: model {sum(sizes) / MB:.0f} MiB, peak private rise while exporting {result['rise'] / MB:.1f} MiB "
          f"(bound: one {SHARD / MB:.0f} MiB shard + {GATHER} x the largest tensor {max(sizes) / MB:.1f} MiB + 10% = "
          f"{bound / MB:.1f} MiB)")
    assert result["rise"] < bound
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) >= 5 and result["log"] == [*shards, "model.safetensors.index.json", "config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary directory was renamed

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = dict(ref.named_parameters())
    for name, t in theirs.state_dict().items():
        torch.testing.assert_close(t, ours[name].detach(), rtol=0, atol=0, msg=name)


def _failure_worker(tmp: str) -> None:
    model = tiny_model().parallelize(DistributedConfig(tp_size=2))
    if torch.distributed.get_rank() == 0:
        save_file, calls = safetensors_io.save_file, []

        def full_disk(tensors, path, **kw):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            save_file(tensors, path, **kw)

        safetensors_io.save_file = full_disk
    with pytest.raises(OSError, match=r"saving to .*hf failed: OSError: \[Errno 28\] the device holding .* has no "
                                      r"space left for this process though .* are free \(out of inodes, or over a "
                                      r"quota\) while writing checkpoint .*hf, which needs .* in all: the partial copy "
                                      r"is removed .*No space left on device\) \(on rank 0 of 2\)"):
        model.save_pretrained(f"{tmp}/hf", max_shard_size="20KB")
    assert not (Path(tmp) / "hf").exists()
    assert not list(Path(tmp).iterdir())  # no temporary directory left either
    model.save_pretrained(f"{tmp}/hf2", max_shard_size="20KB")  # every rank is still in step


def test_failed_streamed_export_raises_everywhere(tmp_path):
    run_distributed(_failure_worker, 2, str(tmp_path), timeout=200)
