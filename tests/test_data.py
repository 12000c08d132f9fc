"""Data: tokenizers, packing from every source, its errors, DataOrder, Reporter, greedy generation under TP."""
from __future__ import annotations

import copy
import json
import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.text import ByteTokenizer, load_tokenizer
from tptrain.training.data import DataOrder, build_dataset, read_documents
from tptrain.generation import complete
from tptrain.training.reporting import Reporter, read_metrics

TINY_QWEN3 = Path(str(files("tptrain") / "data" / "tiny-qwen3"))
BYTES = ByteTokenizer()


def test_bundled_tokenizer_round_trips_and_knows_eos():
    tok = load_tokenizer(TINY_QWEN3)
    assert tok.eos_token_id == 0 and tok.vocab_size == 4096
    text = "To be, or not to be: that is the question. naïve 🙂"
    assert tok.decode(tok.encode(text)) == text


def test_eos_comes_from_the_configs_and_must_exist(tmp_path):
    shutil.copy(TINY_QWEN3 / "tokenizer.json", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096, "eos_token_id": [0, 7]}))
    assert load_tokenizer(tmp_path).eos_token_id == 0  # no tokenizer_config.json: config.json's first eos id
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<nope>"}}))
    with pytest.raises(ValueError, match="names eos_token '<nope>', which is not in"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    with pytest.raises(ValueError, match="no eos token for"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000, "eos_token_id": 0}))
    with pytest.raises(ValueError, match=r"ids up to 4095, but the model .* vocab_size=1000"):
        load_tokenizer(tmp_path)


def test_byte_fallback_and_too_small_vocab(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    with pytest.raises(ValueError, match=r"byte-level fallback.*vocab_size=128"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_packing_joins_documents_with_eos_and_drops_the_remainder():
    ds = build_dataset(["ab", "", "cde"], BYTES, seq_len=2)
    stream = [97, 98, 256, 99, 100, 101, 256]  # empty documents are skipped
    assert len(ds) == 3 and ds.num_tokens == 7
    assert torch.equal(torch.stack([ds[i] for i in range(3)]).flatten(), torch.tensor(stream[:6]))
    assert ds[0].dtype == torch.long
    assert build_dataset(ds, BYTES, seq_len=2) is ds
    with pytest.raises(ValueError, match="blocks of 2 tokens but seq_len=4"):
        build_dataset(ds, BYTES, seq_len=4)


def test_txt_documents_are_split_by_two_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one\n\npara\n\n\n\ntwo\n", encoding="utf-8")
    ds = build_dataset(path, BYTES, seq_len=5)
    assert ds.blocks.flatten().tolist() == BYTES.encode("one\n\npara") + [256] + BYTES.encode("two\n") + [256]
    assert ds.num_tokens == 15 and len(ds) == 3


def test_jsonl_and_its_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "hi"}\n\n{"text": "yo", "id": 3}\n', encoding="utf-8")
    assert build_dataset(path, BYTES, seq_len=3).blocks.flatten().tolist() == [104, 105, 256, 121, 111, 256]
    path.write_text('{"text": "hi"}\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 has no \"text\" field"):
        build_dataset(path, BYTES, seq_len=2)
    path.write_text('{"text": "hi"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        build_dataset(path, BYTES, seq_len=2)
    # a raw U+2028 inside a JSON string is one line of the file (str.splitlines would cut the record in two)
    path.write_text('{"text": "a\u2028b"}\n', encoding="utf-8")
    assert read_documents(path)[1] == ["a\u2028b"]
    path.write_bytes(b'{"text": "hi"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"not valid UTF-8: byte offset 25"):
        build_dataset(path, BYTES, seq_len=2)


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing.txt does not exist"):
        build_dataset(tmp_path / "missing.txt", BYTES, seq_len=8)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        build_dataset(empty, BYTES, seq_len=8)
    with pytest.raises(ValueError, match="is empty"):
        build_dataset([], BYTES, seq_len=8)
    with pytest.raises(ValueError, match=r"too short: it has 4 tokens .* seq_len=8 needs 8"):
        build_dataset(["abc"], BYTES, seq_len=8)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf".encode() + "é au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not valid UTF-8: byte offset 3"):
        build_dataset(bad, BYTES, seq_len=2)
    with pytest.raises(TypeError, match="list item 1 is a int"):
        build_dataset(["a", 1], BYTES, seq_len=2)
    with pytest.raises(TypeError, match="cannot build a dataset from a dict"):
        build_dataset({"text": "a"}, BYTES, seq_len=2)


def test_hf_datasets_source():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["ab", "cd"]})
    assert build_dataset(ds, BYTES, seq_len=3).blocks.flatten().tolist() == [97, 98, 256, 99, 100, 256]
    with pytest.raises(ValueError, match="no 'text' column"):
        build_dataset(datasets.Dataset.from_dict({"body": ["ab"]}), BYTES, seq_len=2)


def _steps(order: DataOrder, n: int) -> list[list[int]]:
    return [order.next_batch() for _ in range(n)]


def test_data_order_is_deterministic_disjoint_and_resumable():
    kw = dict(seed=3, global_batch=4)
    ranks = [DataOrder(10, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    per_rank = [_steps(o, 5) for o in ranks]  # 2 steps per epoch: 5 steps span 3 epochs
    assert per_rank == [_steps(DataOrder(10, dp_rank=r, dp_size=2, **kw), 5) for r in range(2)]
    single = _steps(DataOrder(10, dp_rank=0, dp_size=1, **kw), 5)
    for step in range(5):
        a, b = per_rank[0][step], per_rank[1][step]
        assert len(a) == len(b) == 2 and not set(a) & set(b)
        assert a + b == single[step]  # the global batch does not depend on the dp layout
    assert len(set(single[0] + single[1])) == 8  # no block twice within an epoch
    assert single[0] + single[1] != single[2] + single[3]  # reshuffled each epoch
    assert single != _steps(DataOrder(10, dp_rank=0, dp_size=1, seed=4, global_batch=4), 5)

    order = DataOrder(10, dp_rank=1, dp_size=2, **kw)
    _steps(order, 3)
    state = order.state_dict()
    resumed = DataOrder(10, dp_rank=1, dp_size=2, **kw)
    resumed.load_state_dict(state)
    assert _steps(resumed, 2) == per_rank[1][3:5]
    with pytest.raises(ValueError, match="num_samples=10 but this run has num_samples=12"):
        DataOrder(12, dp_rank=0, dp_size=1, **kw).load_state_dict(state)


def test_data_order_errors():
    with pytest.raises(ValueError, match="global batch 5 cannot be split evenly over 2"):
        DataOrder(10, seed=0, dp_rank=0, dp_size=2, global_batch=5)
    with pytest.raises(ValueError, match="only 3 block.*global batch of 4"):
        DataOrder(3, seed=0, dp_rank=0, dp_size=1, global_batch=4)


def test_reporter_writes_metrics_and_plot_and_resumes(tmp_path):
    quiet = Reporter(tmp_path / "quiet", total_steps=3, enabled=False)
    quiet.log(1, {"loss": 1.0})
    quiet.close()
    assert not (tmp_path / "quiet").exists()

    rep = Reporter(tmp_path, total_steps=3, enabled=True)
    for step in (1, 2, 3):
        rep.log(step, {"loss": torch.tensor(4.0 - step), "learning_rate": 1e-3, "num_tokens": 64})
    rep.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["loss"] == 1.0
    assert "tokens_per_second" in records[2]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    rep = Reporter(tmp_path, total_steps=3, enabled=True)  # resumed from step 1: steps 2, 3 are redone
    rep.log(2, {"loss": 0.5})
    rep.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 3.0), (2, 0.5)]


def _generate_worker(tp: int) -> None:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_QWEN3)
    config.num_hidden_layers = 1
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    tok = load_tokenizer(TINY_QWEN3)
    with torch.no_grad():  # sharper logits than the 0.02-std init gives, so argmax ties cannot happen
        ref.lm_head.weight.mul_(50)
    expected = complete(ref, tok, ["To be, or not"], max_new_tokens=6)[0]
    model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=tp))
    assert model.training
    got = complete(model, tok, ["To be, or not"], max_new_tokens=6)[0]
    assert got == expected and len(tok.encode(got)) >= 1, (got, expected)
    assert model.training  # restored


@pytest.mark.distributed
def test_greedy_generation_tp2_matches_single_device():
    run_distributed(_generate_worker, 2, 2)
