"""Which tokenizer a run trains on: the checkpoint's tokenizer.json, else its SentencePiece tokenizer.model (the ids,
character offsets and eos transformers gives for it), else, for a model without weights only, UTF-8 bytes. A
checkpoint with weights and no tokenizer is refused (load_tokenizer, the Trainer, `tptrain train` before any
worker), naming the files looked for; every run prints the tokenizer it uses on rank 0.

    .venv/bin/python -m pytest tests/test_tokenizers.py -q
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import warnings

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tptrain import AutoConfig, AutoModelForCausalLM
from tptrain.text import ByteTokenizer, load_tokenizer

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
TEXTS = ["To be, or not to be: that is the question.", "  Whether 'tis nobler\nin the mind 🙂x",
         "café — naïve ünïcödé 東京", "</s> an eos in the text <s>", "a</s>b", "",
         "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello! café<end_of_turn>"]
needs_spm = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("sentencepiece", "google.protobuf")),
                               reason="sentencepiece and protobuf read tokenizer.model")


def _weights(directory):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY)).save_pretrained(directory)
    return directory


def _spm_checkpoint(directory):
    """A tiny checkpoint whose only tokenizer is a Gemma-style SentencePiece BPE model (byte fallback, no dummy
    prefix, chat markers as user-defined pieces) and a tokenizer_config.json, as a slow tokenizer saves it."""
    import sentencepiece

    from tests.helpers.launch import ROOT
    _weights(directory)
    lines = (ROOT / "tptrain" / "data" / "corpus.txt").read_text().splitlines()[:3000]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "tokenizer"), vocab_size=500, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    (directory / "tokenizer.vocab").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False}))
    return directory


@needs_spm
def test_a_sentencepiece_checkpoint_tokenizes_as_transformers(tmp_path):
    import transformers
    directory = _spm_checkpoint(tmp_path / "ckpt")
    ours = load_tokenizer(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(str(directory))  # converted to `tokenizers` by transformers
    assert type(theirs).__name__ == "GemmaTokenizer"
    assert ours.description == f"{directory / 'tokenizer.model'} (SentencePiece tokenizer.model)"
    assert ours.eos_token_id == theirs.eos_token_id == 2 and ours.vocab_size == 500
    for text in TEXTS:
        ids = ours.encode(text)
        expected = theirs(text, add_special_tokens=False)
        assert ids == expected.input_ids, text
        assert ours.decode(ids) == text
        encoding = ours.encoding(text)
        assert encoding.ids == ids
        assert [encoding.char_to_token(i) for i in range(len(text))] == \
               [expected.char_to_token(i) for i in range(len(text))], text
    assert ours.token_to_id("<end_of_turn>") == theirs.convert_tokens_to_ids("<end_of_turn>")
    assert ours.encode_batch(TEXTS[:2]) == [ours.encode(t) for t in TEXTS[:2]]


def test_weights_without_a_tokenizer_are_refused_and_a_bare_config_gets_bytes(tmp_path, capsys):
    directory = _weights(tmp_path / "weights")
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert f"the checkpoint {directory} has weights but no tokenizer" in message, message
    assert "looked for tokenizer.json and tokenizer.model" in message and "Copy the model's tokenizer" in message
    bare = tmp_path / "bare"
    AutoConfig.for_model("qwen3", **TINY).save_pretrained(bare)
    tokenizer = load_tokenizer(bare)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.description == "byte-level fallback (the model has no weights)"

    from tptrain.cli import main
    data = tmp_path / "data.txt"
    data.write_text("some text " * 50)
    code = main(["train", "--model", str(directory), "--data", str(data), "--seq-len", "32",
                 "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tptrain train: error: ") and "has weights but no tokenizer" in err, err


def _trainer_worker(tmp: str) -> None:
    """The Trainer refuses weights without a tokenizer, and prints the tokenizer each run uses (rank 0)."""
    from pathlib import Path

    from tests.helpers.trainer import training_args
    from tptrain.training.trainer import Trainer
    tmp = Path(tmp)
    def args(name):
        return training_args(tmp / name, max_steps=1, seq_len=16, per_device_train_batch_size=2)

    texts = ["To be, or not to be: that is the question. " * 8] * 8
    with pytest.raises(FileNotFoundError, match="has weights but no tokenizer"):
        Trainer(model=AutoModelForCausalLM.from_pretrained(tmp / "weights"), args=args("refused"), train_dataset=texts)
    models = [AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY))]
    expected = ["tptrain: tokenizer byte-level fallback (the model has no weights)"]
    if (tmp / "spm").is_dir():
        models.append(AutoModelForCausalLM.from_pretrained(tmp / "spm"))
        expected.append(f"tptrain: tokenizer {tmp / 'spm' / 'tokenizer.model'} (SentencePiece tokenizer.model)")
    for i, (model, line) in enumerate(zip(models, expected)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            trainer = Trainer(model=model, args=args(f"run{i}"), train_dataset=texts)
        assert line in out.getvalue().splitlines(), out.getvalue()
        trainer.train()


@pytest.mark.distributed
def test_the_trainer_prints_its_tokenizer_and_refuses_weights_without_one(tmp_path):
    _weights(tmp_path / "weights")
    if all(importlib.util.find_spec(m) for m in ("sentencepiece", "google.protobuf")):
        _spm_checkpoint(tmp_path / "spm")
    run_distributed(_trainer_worker, 1, str(tmp_path), timeout=300)
