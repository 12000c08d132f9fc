"""Documents cut into pieces (training/token_pieces.py): the pieces' ids joined are the whole document's ids, for
the bundled tokenizer, byte-level BPEs built here with `tokenizers` (GPT-2's ByteLevel; the GPT-4 family's Split
with Qwen2's and Llama 3's digits, NFC), and byte ids, on the bundled corpus and on adversarial text; any pipeline
the guarantee does not cover gets no cutter."""
from __future__ import annotations

import json
import random
import sys
from importlib.resources import files
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tptrain.text import ByteTokenizer, load_tokenizer
from tptrain.training.token_pieces import SPLIT_PATTERNS, cut_pieces, piece_cutter

TINY_QWEN3 = Path(str(files("tptrain") / "data" / "tiny-qwen3"))
CORPUS = Path(str(files("tptrain") / "data" / "corpus.txt")).read_text(encoding="utf-8")
QWEN2, LLAMA3 = (next(p for p in SPLIT_PATTERNS if ("{1,3}" in p) == three) for three in (False, True))
PIECES = ["\n", "\n", "\n\n", " ", "  ", "\t", "\r", "\r\n", " \n", "a", "Zo", "é", "e\u0301", "\u0301", "1", "23",
          "4567", ".", "'s", "'", "!!", "-", "🙂", "本", "\u00a0", "\u3000", "\u2028", "\u0085", "\x1c", "\ufeff",
          "<|endoftext|>", "x\ny", "word"]


def _adversarial() -> list[str]:
    rng = random.Random(0)
    texts = ["a" * 20000 + "\n" + "b" * 9000 + "\n" + "c" * 100,  # long lines without spaces
             "é\n" * 500, "\n".join("本" * 50 for _ in range(60)), "1\n2\n3\n" * 80, ".\n.\n'\ns\n" * 60,
             "\u0301\n\u0301\n" * 40, " \n \n\n\t\n\r\n\n  \n" * 50, "x\n\n\ny \t\n\nz" * 30,  # repeated whitespace
             "<|endoftext|>\n<|endoftext|>x\ny<|endoftext|>" * 20]
    return texts + ["".join(rng.choice(PIECES) for _ in range(rng.randint(20, 300))) for _ in range(400)]


def _bpe(kind: str, directory: Path) -> Path:
    """A byte-level BPE of `kind` trained on the corpus (and whitespace runs, so their merges exist), saved as
    directory/tokenizer.json."""
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2 if kind == "qwen2" else LLAMA3), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS[:300000], " \n \n\n\t\n\r\n\n  \n 123 4567" * 40], trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bpe")
    built = {kind: load_tokenizer(_bpe(kind, root / kind)) for kind in ("gpt2", "qwen2", "llama3")}
    return {"bundled": load_tokenizer(TINY_QWEN3), "bytes": ByteTokenizer(), **built}


@pytest.mark.parametrize("name", ["bundled", "gpt2", "qwen2", "llama3", "bytes"])
def test_pieces_encode_to_the_whole_documents_ids(tokenizers, name):
    tok = tokenizers[name]
    cut = piece_cutter(tok)
    assert cut is cut_pieces
    cases = [(text, 1) for text in _adversarial()] + [(CORPUS[:300000], 1), (CORPUS, 4096)]  # 1: every cut there is
    for text, size in cases:
        pieces = cut(text, size)
        assert "".join(pieces) == text and all(len(p) >= size for p in pieces[:-1])
        joined = [i for ids in tok.encode_batch(pieces) for i in ids]
        assert joined == tok.encode(text), (name, text[:80], len(pieces))
    assert len(cut(CORPUS[:300000], 1)) > 5000  # the corpus was really cut, line by line


def test_a_cut_the_rule_refuses_changes_the_ids(tokenizers):
    """The rule is what makes it exact: cut after every newline instead, and ids change (merges across "\\n\\n",
    " \\n", "\\r\\n" pre-tokens), so the test above can fail."""
    def every_newline(text):
        return [line for line in text.splitlines(keepends=True)]

    for name in ("bundled", "gpt2", "qwen2", "llama3"):
        tok = tokenizers[name]
        wrong = sum([i for ids in tok.encode_batch(every_newline(t)) for i in ids] != tok.encode(t)
                    for t in _adversarial())
        assert wrong > 10, (name, wrong)


def test_regex_whitespace_is_python_whitespace():
    """x and Y of a cut are not `str.isspace`, so never the regexes' `\\s` (Oniguruma's, as tokenizers runs it)."""
    chars = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000)
    kept = "".join(s for s, _ in pre_tokenizers.Split(Regex(r"\s"), "removed").pre_tokenize_str(chars))
    removed = set(chars) - set(kept)
    assert len(removed) == 25 and all(c.isspace() for c in removed)


def _variant(tmp_path: Path, name: str, change) -> object:
    directory = tmp_path / name
    directory.mkdir()
    pipeline = json.loads((TINY_QWEN3 / "tokenizer.json").read_text())
    change(pipeline)
    (directory / "tokenizer.json").write_text(json.dumps(pipeline))
    (directory / "tokenizer_config.json").write_text((TINY_QWEN3 / "tokenizer_config.json").read_text())
    return load_tokenizer(directory)


def test_pipelines_without_the_guarantee_get_no_cutter(tmp_path):
    def split(p):
        return p["pre_tokenizer"]["pretokenizers"][0]

    changes = {"nfkc": lambda p: p.update(normalizer={"type": "NFKC"}),
               "dropout": lambda p: p["model"].update(dropout=0.1),
               "lstrip": lambda p: p["added_tokens"][0].update(lstrip=True),
               "newline-token": lambda p: p["added_tokens"].append(dict(p["added_tokens"][0], id=4095, content="a\nb")),
               "regex": lambda p: split(p)["pattern"].update(Regex=r"\s+|\S+"),
               "prefix-space": lambda p: p["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
               "metaspace": lambda p: p.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                              "prepend_scheme": "first", "split": True}),
               "truncation": lambda p: p.update(truncation={"max_length": 8, "strategy": "LongestFirst",
                                                            "stride": 0, "direction": "Right"})}
    for name, change in changes.items():
        assert piece_cutter(_variant(tmp_path, name, change)) is None, name
    assert piece_cutter(_variant(tmp_path, "nfc", lambda p: p.update(normalizer={"type": "NFC"}))) is cut_pieces
    assert piece_cutter(object()) is None  # no tokenizer file to read the pipeline from
