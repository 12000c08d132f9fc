"""The bundled default run: corpus, tokenizer and tiny Qwen3 config agree with each other and load in HF."""

import json
from importlib.resources import files

import pytest
from tokenizers import Tokenizer

DATA = files("tptrain") / "data"
MODEL = DATA / "tiny-qwen3"
ODD_TEXTS = ["To be, or not to be: that is the question.", "naïve café — 日本語 🙂\r\n\ttabs  and  spaces ", " ", ""]


@pytest.fixture(scope="module")
def config():
    return json.loads((MODEL / "config.json").read_text())


def test_corpus_is_clean_utf8_prose():
    text = (DATA / "corpus.txt").read_bytes().decode("utf-8")
    assert 1_000_000 < len(text) < 2_100_000
    assert "gutenberg" not in text.lower()


def test_tokenizer_matches_config_and_round_trips(config):
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] and config["vocab_size"] % 64 == 0
    eos = tok.token_to_id("<|endoftext|>")
    assert eos == config["eos_token_id"] == config["bos_token_id"]
    for text in ODD_TEXTS:
        assert tok.decode(tok.encode(text).ids) == text


def test_hf_auto_classes_load_the_directory(config):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.from_pretrained(str(MODEL))
    assert hf_config.model_type == "qwen3" and hf_config.vocab_size == config["vocab_size"]
    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    assert tok.eos_token_id == tok.pad_token_id == config["eos_token_id"]
    for text in ODD_TEXTS:
        assert tok.decode(tok(text)["input_ids"]) == text
