"""save_pretrained under pipeline parallelism (parallel/pipeline_checkpoint.py): at pp 2 x tp 2 each stage's first
TP rank writes its own shard files and global rank 0 the one index, last; transformers loads the result with the
single-process logits, tptrain reloads it at pp 1 and pp 2 x tp 2; a stage failing half-way is raised on every rank
and leaves the checkpoint that was there.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_pipeline_parallel import save_family
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM

SHARD = 40_000  # bytes: a few files per stage for the tiny models


@contextlib.contextmanager
def _record_files(log: list[tuple[str, list[str]]], *, fail_on: int | None = None):
    """Note every file this rank's writer finishes (name, tensor names); with `fail_on`, fail that safetensors file."""
    from tptrain.io import writer

    save_file, write_file = writer.save_file, writer._write_file

    def saved(tensors, path, **kw):
        if fail_on is not None and sum(name.endswith(".safetensors") for name, _ in log) + 1 == fail_on:
            raise OSError("disk full (injected)")
        save_file(tensors, path, **kw)
        log.append((Path(path).name, sorted(tensors)))

    def wrote(path, content):
        write_file(path, content)
        log.append((Path(path).name, []))

    writer.save_file, writer._write_file = saved, wrote
    try:
        yield
    finally:
        writer.save_file, writer._write_file = save_file, write_file


def _layers(names: list[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}


def _check_parts(family: str, written: list[list[tuple[str, list[str]]]], out: str) -> None:
    """Ranks 0 and 2 (tp rank 0 of stages 0 and 1) wrote their stage's tensors; rank 0 the index and config last."""
    assert written[1] == [] and written[3] == [], written
    first, second = ([(f, names) for f, names in written[r] if f.endswith(".safetensors")] for r in (0, 2))
    assert len(first) > 1 and len(second) > 1 and [f for f, _ in written[2]] == [f for f, _ in second]
    total = len(first) + len(second)
    assert [f for f, _ in first + second] == [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)]
    assert [f for f, _ in written[0][-2:]] == ["model.safetensors.index.json", "config.json"]  # last
    stage0 = [n for _, names in first for n in names]
    stage1 = [n for _, names in second for n in names]
    assert _layers(stage0) == {0, 1} and _layers(stage1) == {2, 3}
    assert "model.embed_tokens.weight" in stage0 and "model.norm.weight" in stage1
    assert ("lm_head.weight" in stage1) == (family == "llama")  # a tied head is the embedding, saved once
    index = json.loads(Path(out, "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: f for f, names in first + second for n in names}


def _compare_with_transformers(path: str, out: str) -> None:
    import transformers

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # transformers computes RoPE in fp32 (~1e-7 apart); the weights themselves are compared exactly below
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-6, atol=1e-6)
    if ref.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    reloaded = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).named_parameters())  # pp 1
    for name, p in ref.named_parameters():
        torch.testing.assert_close(reloaded[name], p, rtol=0, atol=0)


def _save_cases(root: str) -> None:
    import torch.distributed as dist

    from tptrain.distributed import comm

    for family, schedule in (("qwen3_tied", "1F1B"), ("llama", "Interleaved1F1B")):
        path, out = os.path.join(root, family), os.path.join(root, f"{family}-saved")
        config = DistributedConfig(pp_size=2, tp_size=2, pp_schedule=schedule)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, distributed_config=config)
        log: list = []
        with _record_files(log):
            model.save_pretrained(out, max_shard_size=SHARD)
        if schedule == "1F1B":  # one stage per rank: the parts are the stages
            _check_parts(family, comm.all_gather_object(log), out)
        if dist.get_rank() == 0:
            _compare_with_transformers(path, out)
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, distributed_config=config)  # pp 2
        mine = dict(again.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(mine[name], p, rtol=0, atol=0)
        # A stage failing on its second file: raised on every rank, the checkpoint saved above left whole.
        with _record_files([], fail_on=2 if dist.get_rank() == 2 else None), \
                pytest.raises(OSError, match=r"disk full \(injected\).*\(on rank 2 of 4\)"):
            model.save_pretrained(out, max_shard_size=SHARD)
        dist.barrier()
        assert sorted(os.listdir(root)) == sorted(["qwen3_tied", "llama", "qwen3_tied-saved"]
                                                  + (["llama-saved"] if family == "llama" else []))
        if dist.get_rank() == 0:
            _compare_with_transformers(path, out)


@pytest.mark.distributed
def test_pp2_tp2_save_pretrained_writes_per_stage(tmp_path):
    for family in ("qwen3_tied", "llama"):
        save_family(family, tmp_path)
    run_distributed(_save_cases, 4, str(tmp_path), timeout=300)
