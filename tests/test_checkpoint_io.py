"""Checkpoint I/O: HF layout round trips, slice reads, corrupt-file errors, atomic saves, hub resolution."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tptrain.io import (
    CheckpointReader,
    check_tensor_shape,
    parse_size,
    resolve_checkpoint,
    save_checkpoint,
)
from tptrain.io import writer as safetensors_io

REPO_ROOT = Path(__file__).resolve().parents[1]


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),  # 512 bytes
        "layer.0.weight": torch.randn(8, 12, generator=g),  # 384 bytes
        "layer.0.bias": torch.randn(12, generator=g).to(torch.bfloat16),
        "layer.1.weight": torch.randn(12, 8, generator=g).t(),  # non-contiguous on purpose
        "steps": torch.arange(5),
    }


def _assert_same(reader: CheckpointReader, state_dict: dict[str, torch.Tensor]) -> None:
    assert sorted(reader.keys()) == sorted(state_dict)
    for name, tensor in state_dict.items():
        assert reader.shape(name) == tuple(tensor.shape)
        assert reader.dtype(name) == tensor.dtype
        torch.testing.assert_close(reader.read(name), tensor, rtol=0, atol=0)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(" 2GiB ") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size(123) == 123
    for bad in ("5 parsecs", "GB", "", 0, "-1MB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_single_file_round_trip(tmp_path):
    sd = _state_dict()
    save_checkpoint(sd, tmp_path / "ckpt", metadata={"note": "x"},
                    extra_files={"config.json": '{"a": 1}', "tokenizer.model": b"\x00\x01"})
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert (ckpt / "tokenizer.model").read_bytes() == b"\x00\x01"
    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
    with CheckpointReader(ckpt) as reader:
        _assert_same(reader, sd)
        assert "steps" in reader and "nope" not in reader


def test_sharded_round_trip(tmp_path):
    sd = _state_dict()
    save_checkpoint(sd, tmp_path, max_shard_size=600)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert set(index["weight_map"]) == set(sd)
    for name, file in index["weight_map"].items():  # the index agrees with the files' contents
        assert name in load_file(tmp_path / file)
    _assert_same(CheckpointReader(tmp_path), sd)


def test_tied_weights_do_not_crash(tmp_path):
    w = torch.randn(4, 4)
    save_checkpoint({"embed.weight": w, "lm_head.weight": w, "view": w[1:3]}, tmp_path)
    reader = CheckpointReader(tmp_path)
    torch.testing.assert_close(reader.read("lm_head.weight"), w)
    torch.testing.assert_close(reader.read("view"), w[1:3])


def test_transformers_interop(tmp_path):
    """A sharded transformers checkpoint reads back exactly; ours loads back into transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    sd = model.state_dict()
    reader = CheckpointReader(tmp_path / "hf")
    _assert_same(reader, sd)
    q = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(reader.read(q, dim=0, index=1, count=2), sd[q].chunk(2, dim=0)[1])

    save_checkpoint(sd, tmp_path / "ours", max_shard_size="30KB",
                    extra_files={"config.json": config.to_json_string()})
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, sd[name], rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64])
def test_slice_equals_chunk_of_full_tensor(tmp_path, dim, dtype):
    full = torch.randn(8, 12)
    save_checkpoint({"w": full}, tmp_path)
    reader = CheckpointReader(tmp_path)
    for index in range(4):
        part = reader.read("w", dim=dim, index=index, count=4, dtype=dtype)
        expected = full.chunk(4, dim=dim)[index].to(dtype or full.dtype)
        assert part.is_contiguous() and part.dtype == expected.dtype
        torch.testing.assert_close(part, expected, rtol=0, atol=0)
    torch.testing.assert_close(reader.read("w", dtype=dtype, device="cpu"), full.to(dtype or full.dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slice_read_to_cuda(tmp_path):
    full = torch.randn(8, 12)
    save_checkpoint({"w": full}, tmp_path)
    part = CheckpointReader(tmp_path).read("w", dim=1, index=2, count=3, dtype=torch.bfloat16, device="cuda")
    assert part.device.type == "cuda"
    torch.testing.assert_close(part.cpu(), full.chunk(3, dim=1)[2].to(torch.bfloat16), rtol=0, atol=0)


def test_read_errors(tmp_path):
    save_checkpoint({"w": torch.zeros(6, 4)}, tmp_path)
    reader = CheckpointReader(tmp_path)
    with pytest.raises(ValueError, match=r"'w' of shape \(6, 4\) .* 4 equal chunks along dim 0"):
        reader.read("w", dim=0, count=4)
    with pytest.raises(ValueError, match="it has 2 dims"):
        reader.read("w", dim=2, count=2)
    with pytest.raises(ValueError, match="chunk index 2"):
        reader.read("w", dim=0, index=2, count=2)
    with pytest.raises(ValueError, match="need a dim"):
        reader.read("w", count=2)
    with pytest.raises(KeyError, match=r"'missing'.*searched model\.safetensors"):
        reader.read("missing")


def test_read_result_does_not_alias_the_file(tmp_path):
    save_checkpoint({"w": torch.zeros(4, 4)}, tmp_path)
    reader = CheckpointReader(tmp_path)
    reader.read("w", dim=1, index=0, count=2).fill_(1.0)
    reader.close()
    assert CheckpointReader(tmp_path).read("w").abs().sum() == 0


def test_missing_shard_file_is_named(tmp_path):
    save_checkpoint(_state_dict(), tmp_path, max_shard_size=600)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        CheckpointReader(tmp_path)


def test_missing_weights_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "tiny"])
def test_corrupt_file_is_named(tmp_path, damage):
    save_checkpoint(_state_dict(), tmp_path, max_shard_size=600)
    shard = tmp_path / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[:-10])
    elif damage == "garbage_header":
        shard.write_bytes(data[:8] + b"\xff" * (len(data) - 8))
    else:
        shard.write_bytes(data[:5])
    with pytest.raises(ValueError, match="model-00003-of-00003.safetensors"):
        CheckpointReader(tmp_path)


def test_check_tensor_shape():
    check_tensor_shape("w", (2, 3), (2, 3), "f.safetensors")
    with pytest.raises(ValueError, match=r"'w' in f.safetensors has shape \(3, 2\) but the config implies "
                                         r"\(2, 3\); the checkpoint does not match config.json"):
        check_tensor_shape("w", (2, 3), (3, 2), "f.safetensors")


def test_save_replaces_existing_checkpoint_whole(tmp_path):
    target = tmp_path / "ckpt"
    save_checkpoint(_state_dict(), target, max_shard_size=600)
    save_checkpoint({"only": torch.ones(3)}, target, extra_files={"config.json": "{}"})
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or backup dirs left


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, error):
    target = tmp_path / "ckpt"
    save_checkpoint(_state_dict(), target, max_shard_size=600, extra_files={"config.json": "{}"})
    before = _snapshot(target)
    real_save_file, calls = safetensors_io.save_file, []

    def fail_after_first_shard(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise error("disk full")
        real_save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors_io, "save_file", fail_after_first_shard)
    with pytest.raises(error, match="disk full"):
        save_checkpoint({"a": torch.ones(200), "b": torch.ones(200)}, target, max_shard_size=1000)
    assert len(calls) == 2 and ".ckpt.tmp-" in calls[0]  # shards really went to the temp dir
    assert _snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_swap_restores_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    save_checkpoint(_state_dict(), target)
    before = _snapshot(target)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".ckpt.tmp-"):
            raise OSError("simulated crash while renaming the new checkpoint into place")
        real_rename(src, dst)

    monkeypatch.setattr(safetensors_io.os, "rename", rename)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint({"new": torch.ones(2)}, target)
    assert _snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_refuses_to_replace_a_non_checkpoint_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="does not look like a checkpoint"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path)
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "new", extra_files={"../x": "y"})
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_resolve_local_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_checkpoint(tmp_path) == tmp_path
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no config.json"):
        resolve_checkpoint(str(tmp_path))


_HUB_PROBE = textwrap.dedent("""
    import sys
    from tptrain.io import resolve_checkpoint
    print(resolve_checkpoint("tiny-org/tiny-llama"))
    print(resolve_checkpoint("tiny-org/tiny-llama", revision="{rev}"))
    try:
        resolve_checkpoint("tiny-org/not-cached")
    except FileNotFoundError as e:
        print("ERROR", e)
""")


def test_resolve_hub_id_from_offline_cache(tmp_path):
    """A fake populated HF cache (the layout huggingface_hub writes), resolved with HF_HUB_OFFLINE=1."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    (snapshot / "config.json").write_text("{}")
    save_checkpoint({"w": torch.ones(2)}, tmp_path / "tmp_ckpt")
    os.rename(tmp_path / "tmp_ckpt" / "model.safetensors", snapshot / "model.safetensors")

    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", _HUB_PROBE.replace("{rev}", rev)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0] == out[1] == str(snapshot)
    assert out[2].startswith("ERROR checkpoint 'tiny-org/not-cached' is neither a local directory nor")
    assert "HF_HUB_OFFLINE=1" in out[2] and "HF_HOME" in out[2] and str(tmp_path / "hub") in out[2]
    assert CheckpointReader(out[0]).read("w").tolist() == [1.0, 1.0]


_MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    from tptrain.io import CheckpointReader

    def status():
        fields = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024 if value.strip().endswith("kB") else 0
        return fields

    reader = CheckpointReader(sys.argv[1])
    mode = sys.argv[2]
    before = status()
    if mode == "full":
        kept = reader.read("w")
    else:
        kept = reader.read("w", dim=int(mode), index=1, count=4)
    after = status()
    print(json.dumps({
        # Upper bound on the rise of the peak (the peak before is the current RSS or above).
        "peak": after["VmHWM"] - before["VmRSS"],
        "private": after["RssAnon"] - before["RssAnon"],  # the result tensor, no temporaries
        "file": after["RssFile"] - before["RssFile"],  # pages of the memory-mapped file touched
    }))
""")


@pytest.mark.slow  # three fresh interpreters import torch: ~20 s on 2 cores
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_slice_read_memory_is_a_fraction_of_the_tensor(tmp_path):
    """Reading 1/4 of a 64 MiB tensor costs ~1/4 of it in private memory; the whole read costs it all."""
    nbytes = 4096 * 4096 * 4
    save_checkpoint({"w": torch.randn(4096, 4096)}, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    rise = {}
    for mode in ("0", "1", "full"):
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path), mode], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        rise[mode] = {k: v / nbytes for k, v in json.loads(out).items()}
    print("memory rise as a fraction of the 64 MiB tensor:", rise)
    for mode in ("0", "1"):
        assert 0.2 < rise[mode]["private"] < 0.35, rise
    # A dim-0 chunk is one contiguous byte range: only its pages (plus kernel read-ahead) are mapped in.
    assert rise["0"]["file"] < 0.6 and rise["0"]["peak"] < 0.85, rise
    assert rise["full"]["private"] > 0.9 and rise["full"]["peak"] > 1.5, rise
