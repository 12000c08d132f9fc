"""Streaming text (training/streaming.py): the same blocks as PackedDataset, dp shares that add up to the global
batch, exact resume from a saved position, the Trainer stopped and resumed, and the errors a user can provoke."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import SEQ, tiny_model, training_args
from tptrain.training.args import ParallelismConfig
from tptrain.text import ByteTokenizer
from tptrain.training.data import DataOrder, build_dataset
from tptrain.training.sft_data import build_training_data
from tptrain.training.streaming import StreamingText, check_streaming
from tptrain.training.trainer import Trainer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _documents(n: int, seed: int = 0) -> list[str]:
    """Documents of 0 to ~60 bytes (some empty, some longer than a block), deterministic."""
    g = torch.Generator().manual_seed(seed)
    words = ["tensor", "parallel", "shard", "rank", "gloo", "block", "eos", "stream", "résumé"]
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(k),), generator=g))
            for k in torch.randint(0, 10, (n,), generator=g)]


def _write(directory: Path, docs: list[str], fmt: str, shards: int = 3, column: str = "text") -> Path:
    """`docs` split over `shards` files of format `fmt` in `directory`, named so that sorting keeps their order."""
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(docs) // shards)
    for s in range(shards):
        part = docs[s * size:(s + 1) * size]
        path = directory / f"part-{s:05d}.{fmt.split('_')[0]}"
        table = pa.table({column: pa.array(part, pa.string()), "id": pa.array(range(len(part)))})
        if fmt == "parquet":
            pq.write_table(table, path, row_group_size=4)  # several row groups: resume skips whole ones
        elif fmt == "arrow":  # the IPC stream format, as datasets' save_to_disk writes it, in batches of 5 rows
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                for batch in table.to_batches(max_chunksize=5):
                    writer.write_batch(batch)
        elif fmt == "arrow_file":  # the IPC file format (random access), which pyarrow's writers also make
            with pa.ipc.new_file(str(path), table.schema) as writer:
                writer.write_table(table, max_chunksize=5)
        else:
            path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" * (1 + i % 2) for i, d in enumerate(part)))
    return directory


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "arrow_file", "jsonl"])
def test_blocks_equal_packed_dataset(tmp_path, fmt):
    docs = _documents(40)
    stream = StreamingText(_write(tmp_path, docs, fmt)).bind(ByteTokenizer(), 16)
    blocks = [block for block, _ in stream.blocks()]
    packed = build_dataset(docs, ByteTokenizer(), 16)
    assert len(blocks) == len(packed) > 10
    torch.testing.assert_close(torch.stack(blocks), packed.blocks, rtol=0, atol=0)


def _steps(order, n: int) -> list[torch.Tensor]:
    return [torch.stack(order.next_batch()) for _ in range(n)]


def test_dp_shares_make_the_global_batch_across_epochs(tmp_path):
    stream = StreamingText(_write(tmp_path, _documents(40), "parquet")).bind(ByteTokenizer(), 16)
    num_blocks = sum(1 for _ in stream.blocks())
    steps = 2 * (num_blocks // 4) + 1  # into the third epoch
    single = _steps(stream.order(dp_rank=0, dp_size=1, global_batch=4), steps)
    shares = [_steps(stream.order(dp_rank=r, dp_size=2, global_batch=4), steps) for r in range(2)]
    for step in range(steps):
        torch.testing.assert_close(torch.cat([shares[0][step], shares[1][step]]), single[step], rtol=0, atol=0)
    packed = build_dataset(_documents(40), ByteTokenizer(), 16).blocks
    epoch = torch.cat(single[:num_blocks // 4])  # the partial batch at the end of an epoch is dropped
    torch.testing.assert_close(epoch, packed[:len(epoch)], rtol=0, atol=0)
    torch.testing.assert_close(single[num_blocks // 4], packed[:4], rtol=0, atol=0)  # epoch 2 starts over


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "arrow_file", "jsonl"])  # each reader skips to a row
def test_resume_at_every_step_mid_file_and_mid_block(tmp_path, fmt):
    stream = StreamingText(_write(tmp_path, _documents(30, seed=3), fmt)).bind(ByteTokenizer(), 16)
    full = _steps(stream.order(dp_rank=0, dp_size=1, global_batch=2), 40)
    states = []
    for stop in range(1, 36):
        order = stream.order(dp_rank=0, dp_size=1, global_batch=2)
        _steps(order, stop)
        state = json.loads(json.dumps(order.state_dict()))  # as the checkpoint's trainer_state.json holds it
        states.append(state)
        resumed = stream.order(dp_rank=1, dp_size=2, global_batch=2)  # at another dp size: its share
        resumed.load_state_dict(state)
        for step in range(stop, stop + 4):
            torch.testing.assert_close(resumed.next_batch()[0], full[step][1], rtol=0, atol=0)
    assert any(s["file"] > 0 and s["row"] > 0 and s["offset"] > 0 for s in states)  # mid-file, mid-document
    assert any(s["epoch"] == 1 for s in states)


def test_resume_refuses_other_data(tmp_path):
    data = _write(tmp_path / "a", _documents(40), "parquet")
    order = StreamingText(data).bind(ByteTokenizer(), 16).order(dp_rank=0, dp_size=1, global_batch=2)
    order.next_batch()
    state = order.state_dict()
    other = StreamingText(_write(tmp_path / "b", _documents(41), "parquet")).bind(ByteTokenizer(), 16)
    with pytest.raises(ValueError, match="cannot resume the data stream: the checkpoint was saved with stream="):
        other.order(dp_rank=0, dp_size=1, global_batch=2).load_state_dict(state)
    in_memory = DataOrder(10, seed=0, dp_rank=0, dp_size=1, global_batch=2).state_dict()
    with pytest.raises(ValueError, match="the checkpoint's data order is not a stream's"):
        other.order(dp_rank=0, dp_size=1, global_batch=2).load_state_dict(in_memory)
    longer = StreamingText(data).bind(ByteTokenizer(), 32).order(dp_rank=0, dp_size=1, global_batch=2)
    with pytest.raises(ValueError, match="saved with seq_len=16 but this run has seq_len=32"):
        longer.load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint was saved by a streaming run .* --streaming"):
        DataOrder(10, seed=0, dp_rank=0, dp_size=1, global_batch=2).load_state_dict(state)


def _offline_hub(monkeypatch, cache: Path) -> None:
    """huggingface_hub offline, its cache at `cache` (its constants are read when it is imported: patch them)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_dataset_id_streams_its_cached_shards(tmp_path, monkeypatch):
    """org/name resolves through the HF cache (the layout huggingface_hub writes), parquet/arrow/jsonl only."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--org--corpus"
    docs = _documents(30)
    _write(repo / "snapshots" / rev / "data", docs, "parquet")
    (repo / "snapshots" / rev / "README.md").write_text("not a shard")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    _offline_hub(monkeypatch, tmp_path / "hub")
    spec = StreamingText("org/corpus")
    assert [p.name for p in spec.files()] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    local = StreamingText(repo / "snapshots" / rev / "data")
    got, expected = (s.bind(ByteTokenizer(), 16).order(dp_rank=0, dp_size=1, global_batch=2) for s in (spec, local))
    for _ in range(3):
        torch.testing.assert_close(got.next_batch()[0], expected.next_batch()[0], rtol=0, atol=0)


def test_bad_inputs(tmp_path, monkeypatch):
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"directory .*none has no .parquet/.arrow/.jsonl file \(found: .txt\)"):
        StreamingText(tmp_path / "none").check()
    with pytest.raises(FileNotFoundError, match="the pattern .*missing-\\*.parquet matches no file"):
        StreamingText(str(tmp_path / "missing-*.parquet")).check()
    _offline_hub(monkeypatch, tmp_path / "empty-hub")
    with pytest.raises(FileNotFoundError, match=r"'org/corpus' is neither a local path nor a hub dataset found in "
                                                r"the HF cache .*HF_HUB_OFFLINE=1.*hf download --repo-type dataset"):
        StreamingText("org/corpus").check()
    for fmt in ("parquet", "jsonl"):
        data = _write(tmp_path / fmt, _documents(6), fmt, column="content")
        with pytest.raises(ValueError, match=r"part-00000.* has no column 'text' \(its columns: .*content.*id"):
            StreamingText(data).check()
    empty = _write(tmp_path / "empty", ["", ""], "parquet", shards=2)
    with pytest.raises(ValueError, match=r"is empty: its 2 file\(s\) hold no text in column 'text'"):
        StreamingText(empty).check()
    short = StreamingText(_write(tmp_path / "short", ["abc"] * 4, "parquet")).bind(ByteTokenizer(), 8)
    with pytest.raises(ValueError, match=r"gives only 2 block\(s\) of seq_len=8 tokens, but one step needs a "
                                         r"global batch of 4"):
        short.order(dp_rank=0, dp_size=1, global_batch=4).next_batch()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r"needs pyarrow: `pip install datasets`"):
        StreamingText(tmp_path / "parquet").check()
    StreamingText(tmp_path / "jsonl", text_column="content").check()  # jsonl needs no pyarrow


def test_trainer_arguments_a_stream_cannot_serve(tmp_path):
    data = StreamingText(tmp_path)
    with pytest.raises(ValueError, match="num_train_epochs .* cannot be turned into steps; set max_steps"):
        check_streaming(training_args(tmp_path, num_train_epochs=1.0), data, None)
    with pytest.raises(ValueError, match="eval_split .* cannot hold out rows of a StreamingText"):
        check_streaming(training_args(tmp_path, eval_split=0.1), data, None)
    with pytest.raises(ValueError, match="eval_dataset cannot be a StreamingText"):
        check_streaming(training_args(tmp_path), "corpus.txt", data)
    stream = StreamingText(_write(tmp_path / "d", _documents(6), "jsonl")).bind(ByteTokenizer(), 16)
    assert build_training_data(stream, ByteTokenizer(), 16) is stream  # the CLI builds it before the Trainer
    with pytest.raises(ValueError, match="the TextStream given cuts blocks of 16 tokens but seq_len=32"):
        build_training_data(stream, ByteTokenizer(), 32)


class _SmallTokenizer:
    """Bytes folded into the tiny model's 128 ids (no encode_batch: the stream's per-document fallback)."""

    eos_token_id, vocab_size = 127, 128

    def encode(self, text: str) -> list[int]:
        return [b % 127 for b in text.encode("utf-8")]


def _train(output_dir: str, data: Path, *, tp: int, shard: int, batch: int, **kw):
    model = tiny_model()
    if tp > 1:
        from tptrain import DistributedConfig

        model = model.parallelize(DistributedConfig(tp_size=tp))
    args = training_args(output_dir, max_steps=8, save_steps=3, per_device_train_batch_size=batch,
                         parallelism_config=ParallelismConfig(tp, dp_shard_size=shard), **kw)
    return Trainer(model=model, args=args, train_dataset=StreamingText(data), tokenizer=_SmallTokenizer()).train()


def _trainer_worker(tmp: str) -> None:
    data = Path(tmp) / "data"
    full = _train(f"{tmp}/a", data, tp=1, shard=2, batch=2)  # dp 2: global batch 4, checkpoints at 3 and 6
    state = json.loads((Path(f"{tmp}/a/checkpoint-3") / "trainer_state.json").read_text())["data_order"]
    assert state["file"] > 0 and state["epoch"] == 0, state
    same = _train(f"{tmp}/b", data, tp=1, shard=2, batch=2, resume_from_checkpoint=f"{tmp}/a/checkpoint-3")
    assert same.losses == full.losses[3:], (same.losses, full.losses)  # bit-identical, into the next epoch
    other = _train(f"{tmp}/c", data, tp=2, shard=1, batch=4, resume_from_checkpoint=f"{tmp}/a/checkpoint-6")
    torch.testing.assert_close(torch.tensor(other.losses), torch.tensor(full.losses[6:]), rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_trainer_stopped_and_resumed_gives_the_same_losses(tmp_path):
    # 5 global batches of 4 x 16 tokens per epoch and one block dropped: 8 steps run into the second epoch
    _write(tmp_path / "data", _documents(14, seed=5), "parquet")
    assert len(build_dataset(_documents(14, seed=5), _SmallTokenizer(), SEQ)) == 21
    run_distributed(_trainer_worker, 2, str(tmp_path), timeout=600)


@pytest.mark.distributed
def test_cli_streaming_run_resumes_with_the_same_losses(tmp_path, capsys):
    from tests.helpers.launch import tptrain_train
    from tptrain.cli import main
    from tptrain.training.reporting import read_metrics

    data = _write(tmp_path / "data", _documents(200, seed=7), "parquet")
    a, b = tmp_path / "a", tmp_path / "b"
    flags = ("--data", str(data), "--streaming", "--max-steps", "6")  # --smoke-test: tp 2, checkpoints every 2 steps
    run = tptrain_train(*flags, "--output-dir", str(a))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"streaming 3 file(s) of {data} in blocks of 32" in run.stdout, run.stdout
    resumed = tptrain_train(*flags, "--output-dir", str(b), "--resume", str(a / "checkpoint-4"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses = {r["step"]: r["loss"] for r in read_metrics(a / "metrics.jsonl")}
    again = {r["step"]: r["loss"] for r in read_metrics(b / "metrics.jsonl")}
    assert again == {5: losses[5], 6: losses[6]}, (losses, again)

    (tmp_path / "none").mkdir()
    for extra, message in [(("--data", str(tmp_path / "none")), "has no .parquet/.arrow/.jsonl file"),
                           (("--data", str(data), "--text-column", "body"), r"has no column 'body' \(its columns: "),
                           (("--data", str(data), "--num-epochs", "1"), "--num-epochs cannot be used")]:
        capsys.readouterr()
        code = main(["train", "--smoke-test", "--streaming", *extra, "--output-dir", str(tmp_path / "err")])
        stderr = capsys.readouterr().err
        assert code == 2 and re.search(message, stderr), (extra, code, stderr)
