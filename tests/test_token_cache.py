"""The token cache: tokenized once, mapped everywhere; the same blocks and rows as the in-memory path."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from tests.helpers.chat import CHATML_GENERATION, CHATS, chat_checkpoint
from tests.helpers.ranks import run_distributed
from tptrain.losses import IGNORE_INDEX
from tptrain.training import token_cache, token_stream
from tptrain.text import ByteTokenizer, load_chat_template, load_tokenizer
from tptrain.training.data import DataOrder, build_dataset, read_documents
from tptrain.training.sft_data import SampleEncoder, SFTDataset, build_training_data

TINY_QWEN3 = Path(str(files("tptrain") / "data" / "tiny-qwen3"))
CORPUS = Path(str(files("tptrain") / "data" / "corpus.txt"))
TEXT = "naïve one\n\npara 🙂\n\n\n\ntwo \t\n \n\n three\n\n\n" * 7 + "last"


def _stores(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def _batches(dataset, dp_size: int, steps: int = 6) -> list[torch.Tensor]:
    """Every dp rank's micro-batches of `steps` steps, as the Trainer draws them."""
    out = []
    for rank in range(dp_size):
        order = DataOrder(len(dataset), seed=3, dp_rank=rank, dp_size=dp_size, global_batch=4)
        out += [torch.stack([dataset[i] for i in order.next_batch()]) for _ in range(steps)]
    return out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
@pytest.mark.parametrize("tokenizer", ["bytes", "bundled"])
def test_cached_blocks_equal_the_in_memory_blocks(tmp_path, suffix, tokenizer):
    tok = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(TINY_QWEN3)
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text(CORPUS.read_text()[:20000] + TEXT)
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT.split("\n\n\n") + ["", "x"]))
    reference = build_dataset(path, tok, seq_len=16)
    cached = build_training_data(path, tok, 16, cache_dir=tmp_path / "cache")
    assert cached.data_key is not None and not isinstance(cached.blocks, torch.Tensor)  # a view of the map
    assert torch.equal(torch.as_tensor(cached.blocks.astype("int64")), reference.blocks)
    assert cached.num_tokens == reference.num_tokens
    for dp in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(_batches(cached, dp), _batches(reference, dp)))


def test_text_is_read_in_pieces_split_at_document_breaks(tmp_path, monkeypatch):
    path = tmp_path / "d.txt"
    path.write_text(TEXT)
    for size in (1, 2, 3, 5, 7, 64):  # pieces that cut breaks and multi-byte characters anywhere
        monkeypatch.setattr(token_stream, "_READ_BYTES", size)
        assert list(token_stream.text_documents(path, lambda n: None)) == read_documents(path)[1]
    path.write_bytes(b"ok\n\n\nfine \xff bad")
    monkeypatch.setattr(token_stream, "_READ_BYTES", 4)
    with pytest.raises(ValueError, match="byte offset 10 "):
        list(token_stream.text_documents(path, lambda n: None))


def _todays_rows(samples, seq_len: int, packing: bool, pad: int) -> list[dict[str, list[int]]]:
    """sft_data's packing before the cache (the oracle): whole samples into rows, positions restarting."""
    groups, current, used = [], [], 0
    for s in samples:
        if packing and current and used + len(s.input_ids) > seq_len or not packing and current:
            groups.append(current)
            current, used = [], 0
        current.append(s)
        used += len(s.input_ids)
    groups.append(current)
    rows = []
    for group in groups:
        n = sum(len(s.input_ids) for s in group)
        extra = seq_len - n if packing else 0
        rows.append({"input_ids": [t for s in group for t in s.input_ids] + [pad] * extra,
                     "labels": [t for s in group for t in s.labels] + [IGNORE_INDEX] * extra,
                     "position_ids": [p for s in group for p in range(len(s.input_ids))] + list(range(extra))})
    return rows


@pytest.mark.parametrize("packing", [True, False])
def test_cached_sft_rows_equal_todays_rows(tmp_path, packing):
    model_dir = chat_checkpoint(tmp_path / "ckpt", CHATML_GENERATION)
    tok, template = load_tokenizer(model_dir), load_chat_template(model_dir)
    records = [{"messages": c} for c in CHATS] * 3 + [{"text": "Ham. To be"}, {"prompt": "a", "completion": "b"},
                                                      {"prompt": "long " * 30, "completion": "cut"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n\n" for r in records))
    encode = SampleEncoder(tok, chat_template=template)
    seq_len = 40
    samples = [encode(r, i) for i, r in enumerate(records)]
    samples = [type(s)(s.input_ids[:seq_len], s.labels[:seq_len]) for s in samples]
    expected = _todays_rows(samples, seq_len, packing, tok.eos_token_id)
    for cache in (tmp_path / "cache", None):  # mapped, then the in-memory path (no file cache: a list)
        source = path if cache else records
        data = build_training_data(source, tok, seq_len, model_dir=model_dir, packing=packing, cache_dir=cache)
        assert isinstance(data, SFTDataset) and len(data) == len(expected)
        assert [{k: v.tolist() for k, v in data[i].items()} for i in range(len(data))] == expected
        assert data.num_truncated == sum(len(encode(r, i).input_ids) > seq_len for i, r in enumerate(records))
        assert data.num_tokens == sum(label != IGNORE_INDEX for row in expected for label in row["labels"])


class _Spy:
    """A tokenizer that counts its encodings."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.calls = tokenizer, 0
        self.path, self.eos_token_id, self.vocab_size = tokenizer.path, tokenizer.eos_token_id, tokenizer.vocab_size

    def encode_batch(self, texts):
        self.calls += 1
        return self.inner.encode_batch(texts)


def test_second_build_is_a_hit_and_a_changed_file_or_tokenizer_a_miss(tmp_path, capsys):
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)
    spy = _Spy(load_tokenizer(TINY_QWEN3))
    first = build_training_data(path, spy, 8, cache_dir=cache)
    assert spy.calls == 1 and "data cache: miss (tokenizing c.txt" in capsys.readouterr().out
    again = build_training_data(path, spy, 8, cache_dir=cache)
    assert spy.calls == 1 and f"data cache: hit {_stores(cache)[0]}" in capsys.readouterr().out
    assert again.data_key == first.data_key and torch.equal(again[3], first[3])
    stat = path.stat()
    path.write_text(TEXT.replace("one", "eno"))  # same size, same mtime: only the bytes differ
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = build_training_data(path, spy, 8, cache_dir=cache)
    assert spy.calls == 2 and changed.data_key != first.data_key and len(_stores(cache)) == 2
    other = tmp_path / "tok"
    shutil.copytree(TINY_QWEN3, other)
    tok_json = json.loads((other / "tokenizer.json").read_text())
    tok_json["normalizer"] = {"type": "Lowercase"}
    (other / "tokenizer.json").write_text(json.dumps(tok_json))
    lower = build_training_data(path, load_tokenizer(other), 8, cache_dir=cache)
    assert lower.data_key != changed.data_key and len(_stores(cache)) == 3
    assert build_training_data(path, ByteTokenizer(), 8, cache_dir=cache).data_key not in (lower.data_key,
                                                                                          changed.data_key)


def test_a_failed_write_leaves_nothing_complete_and_the_next_run_rebuilds(tmp_path, monkeypatch):
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)

    def full(self, ids, targets=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(token_stream.TokenWriter, "write", full)
        with pytest.raises(OSError, match=r"no space left on the device while writing .*\.tmp-.*--data-cache") as info:
            build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    assert info.value.errno == errno.ENOSPC
    assert list(cache.iterdir()) == []  # no store, no temporary directory
    build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    assert len(_stores(cache)) == 1 and not [p for p in cache.iterdir() if p.name.startswith(".")]
    directory = _stores(cache)[0]
    meta = json.loads((directory / "meta.json").read_text())
    (directory / token_stream.TOKENS).write_bytes(b"\0" * 3)  # a store damaged later: verified, rebuilt
    rebuilt = build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    assert torch.equal(rebuilt[0], build_dataset(path, ByteTokenizer(), 8)[0])
    assert (directory / token_stream.TOKENS).stat().st_size == meta["num_tokens"] * 2
    (directory / "meta.json").write_text(json.dumps({"key": meta["key"], "version": meta["version"]}))
    assert torch.equal(build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)[0], rebuilt[0])
    assert json.loads((directory / "meta.json").read_text()) == meta


def test_a_killed_build_leaves_nothing_complete_and_its_leftovers_are_removed(tmp_path):
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)
    key, _ = token_cache.cache_key(path, ByteTokenizer(), {})
    leftover = cache / f".c-{key}.tmp-{os.uname().nodename}-{2 ** 22 + 12345}"  # a dead pid's half-written store
    leftover.mkdir(parents=True)
    (leftover / token_stream.TOKENS).write_bytes(b"\1" * 10)
    assert token_cache.open_store(cache / f"c-{key}", key)[0] is None
    data = build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    assert torch.equal(data[1], build_dataset(path, ByteTokenizer(), 8)[1])
    assert not leftover.exists() and [p.name for p in cache.iterdir()] == [f"c-{key}"]


def test_vocab_check_names_the_id_the_vocab_and_the_tokenizer(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("é" * 20)  # UTF-8 bytes 195, 169
    with pytest.raises(ValueError, match=r"largest token id is 256 \(tokenizer bytes\).*vocab_size is 200"):
        build_training_data(path, ByteTokenizer(), 8, cache_dir=tmp_path / "cache", vocab_size=200)
    assert build_training_data(path, ByteTokenizer(), 8, cache_dir=tmp_path / "cache", vocab_size=257)


def test_unwritable_cache_dir_is_an_error_or_for_the_default_a_fallback(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.txt"
    path.write_text(TEXT)
    blocker = tmp_path / "file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    with pytest.raises(OSError, match=rf"data cache directory {blocker}/sub cannot be written .*--data-cache DIR"):
        build_training_data(path, ByteTokenizer(), 8, cache_dir=blocker / "sub")
    monkeypatch.delenv("TPTRAIN_CACHE")
    monkeypatch.setenv("HOME", str(blocker))  # a HOME where ~/.cache cannot be made
    data = build_training_data(path, ByteTokenizer(), 8)
    assert "tokenizing in memory on every rank" in capsys.readouterr().out and data.data_key is None
    assert torch.equal(data.blocks, build_dataset(path, ByteTokenizer(), 8).blocks)


def test_a_waiting_rank_raises_local_rank_0s_failure(tmp_path, monkeypatch):
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    key, _ = token_cache.cache_key(path, ByteTokenizer(), {})
    status = token_cache._status_file(cache / f"c-{key}")
    cache.mkdir()
    status.write_text(json.dumps({"pid": os.getpid(), "state": "failed", "type": "ValueError", "error": "bad line 3"}))
    with pytest.raises(ValueError, match="^bad line 3$"):  # the same error as rank 0's: reported once for both
        build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    status.write_text(json.dumps({"pid": os.getpid(), "state": "failed", "type": "KeyError", "error": "'x'"}))
    with pytest.raises(RuntimeError, match="local rank 0 could not build the data cache .*KeyError: 'x'"):
        build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)
    status.write_text(json.dumps({"pid": 2 ** 22 + 12345, "state": "building"}))  # no such process
    with pytest.raises(RuntimeError, match=r"local rank 0 \(pid \d+\) died while building"):
        build_training_data(path, ByteTokenizer(), 8, cache_dir=cache)


def test_resume_on_other_data_is_refused():
    saved = DataOrder(8, seed=0, dp_rank=0, dp_size=1, global_batch=2, data_key="aaa").state_dict()
    DataOrder(8, seed=0, dp_rank=0, dp_size=1, global_batch=2, data_key="aaa").load_state_dict(saved)
    with pytest.raises(ValueError, match="token cache key aaa, but this run's data has key bbb"):
        DataOrder(8, seed=0, dp_rank=0, dp_size=1, global_batch=2, data_key="bbb").load_state_dict(saved)


class _Counting:
    """The bundled tokenizer, noting in `log` how many texts each local rank encoded; `fail_on` raises
    ValueError on that local rank's second batch (mid-way: its first is written)."""

    def __init__(self, log: str, fail_on: int | None = None) -> None:
        self.inner, self.log, self.fail_on, self.batches = load_tokenizer(TINY_QWEN3), Path(log), fail_on, 0
        self.path, self.eos_token_id, self.vocab_size = self.inner.path, self.inner.eos_token_id, self.inner.vocab_size

    def encode_batch(self, texts):
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.batches += 1
        if rank == self.fail_on and self.batches == 2:
            raise ValueError(f"bad text on local rank {rank}")
        with open(self.log / f"rank{rank}", "a") as f:
            f.write(f"{len(texts)}\n")
        return self.inner.encode_batch(texts)

    def encode(self, text):  # prompt/completion records
        return self.inner.encode(text)


def _two_ranks(path: str, cache: str, out: str, delays: tuple[float, float], fail_on: int | None) -> None:
    import time
    token_stream._BATCH_CHARS = 1 << 17  # several batches per share
    time.sleep(delays[int(os.environ["LOCAL_RANK"])])  # either rank may come first: the other polls
    try:
        data = build_training_data(Path(path), _Counting(out, fail_on), 16, cache_dir=cache)
    except ValueError as exc:
        Path(out, f"error{os.environ['RANK']}").write_text(str(exc))
        return
    rows = data if isinstance(data, SFTDataset) else None
    first = rows[0]["input_ids"] if rows is not None else data[0]
    torch.save({"first": first, "len": len(data), "key": data.data_key, "threads": os.environ.get("RAYON_NUM_THREADS")},
               Path(out) / f"rank{os.environ['RANK']}.pt")


def _store_files(cache: Path) -> dict[str, bytes]:
    (store,) = _stores(cache)
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


@pytest.mark.distributed
@pytest.mark.parametrize("suffix,delays", [(".txt", (0.0, 0.0)), (".txt", (1.0, 0.0)), (".jsonl", (0.0, 1.0))])
def test_two_ranks_tokenize_shares_into_the_store_one_process_builds(tmp_path, monkeypatch, suffix, delays):
    """Both local ranks tokenize a share (pieces of documents cut where the ids stay the same); the store they
    publish is byte for byte the one process's (ids, target flags, offsets, meta.json), and both map it."""
    monkeypatch.setattr(token_stream, "_BATCH_CHARS", 1 << 17)  # several batches per share
    path = tmp_path / f"c{suffix}"
    if suffix == ".txt":
        path.write_text(CORPUS.read_text())
    else:
        docs = read_documents(CORPUS)[1]
        path.write_text("".join(json.dumps({"text": d} if i % 3 else {"prompt": d[:200], "completion": d[200:400]})
                                + "\n" for i, d in enumerate(docs * 2)))
    one = tmp_path / "one"
    one.mkdir()
    build_training_data(path, _Counting(str(one)), 16, cache_dir=tmp_path / "cache1")  # LOCAL_RANK 0 of 1
    run_distributed(_two_ranks, 2, str(path), str(tmp_path / "cache2"), str(tmp_path), delays, None, timeout=300)
    assert all((tmp_path / f"rank{r}").read_text() for r in (0, 1))  # each rank encoded a share
    assert _store_files(tmp_path / "cache2") == _store_files(tmp_path / "cache1")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["key"] == ranks[1]["key"] and ranks[0]["len"] == ranks[1]["len"]
    assert torch.equal(ranks[0]["first"], ranks[1]["first"])
    cores = len(os.sched_getaffinity(0))
    expected = os.environ.get("RAYON_NUM_THREADS", str(max(1, cores // 2)))  # one the user set is kept
    assert [r["threads"] for r in ranks] == [expected] * 2  # the node's cores shared out
    assert [p.name for p in (tmp_path / "cache2").iterdir() if p.name.startswith(".")] == []  # no status, no tmp


@pytest.mark.distributed
@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_rank_failing_mid_way_fails_every_rank_and_leaves_no_store(tmp_path, monkeypatch, fail_on):
    path = tmp_path / "c.txt"
    path.write_text(CORPUS.read_text())
    run_distributed(_two_ranks, 2, str(path), str(tmp_path / "cache"), str(tmp_path), (0.0, 0.0), fail_on, timeout=300)
    errors = [(tmp_path / f"error{r}").read_text() for r in (0, 1)]
    assert errors == [f"bad text on local rank {fail_on}"] * 2  # the failing rank's error, on both ranks
    left = list((tmp_path / "cache").iterdir())  # only the failure's status file: no store, no half-written part
    assert [p.name.endswith(".status") for p in left] == [True], left


def test_a_part_that_fails_or_dies_fails_the_build(tmp_path, monkeypatch):
    """Local rank 0's view: another rank's part marked failed raises its error; a part whose process is gone
    raises naming the rank; nothing is kept either way."""
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for marker, match in [({"state": "failed", "type": "ValueError", "error": "record 7 is bad"}, "^record 7 is bad$"),
                          ({"state": "running", "pid": 2 ** 22 + 12345}, r"local rank 1 \(pid \d+\) died while "
                                                                           "tokenizing its share")]:
        class Injecting(_Counting):  # local rank 1's marker, as it would write it into the build directory
            def encode_batch(self, texts):
                (tmp,) = cache.glob(".c-*.tmp-*")
                (tmp / "part-1.json").write_text(json.dumps({"pid": os.getpid(), **marker}))
                return super().encode_batch(texts)

        with pytest.raises((ValueError, RuntimeError), match=match):
            build_training_data(path, Injecting(str(tmp_path)), 8, cache_dir=cache)
        assert _stores(cache) == [] and not list(cache.glob(".c-*.tmp-*"))
        status = json.loads(next(cache.glob("*.status")).read_text())
        assert status["state"] == "failed" and re.search(match, status["error"])


def test_shares_cover_the_file_once_in_order():
    for ranks, size in [(1, 10), (2, 11), (3, 100), (4, 3)]:
        owners = [next(r for r in range(ranks) if token_stream.Share(r, ranks, size).owns(p)) for p in range(size)]
        assert owners == sorted(owners) and all(sum(token_stream.Share(r, ranks, size).owns(p) for r in range(ranks))
                                                == 1 for p in range(size))


def test_prepare_data_fills_the_cache_that_training_then_hits(tmp_path, capsys):
    from tptrain.cli import main

    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text(TEXT)
    argv = ["prepare-data", "--model", str(TINY_QWEN3), "--data", str(path), "--data-cache", str(cache)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("data cache: miss (tokenizing c.txt, 0 MB) -> ")
    assert f"tokens (uint16) in {len(read_documents(path)[1])} documents" in out
    build_training_data(path, load_tokenizer(TINY_QWEN3), 8, cache_dir=cache)
    assert capsys.readouterr().out.startswith(f"data cache: hit {_stores(cache)[0]}")
    assert main(argv[:-4] + ["--data", str(tmp_path / "missing.txt")]) == 1
    assert "--data " in capsys.readouterr().err
