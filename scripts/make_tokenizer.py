"""Retrain the bundled byte-level BPE tokenizer on tptrain/data/corpus.txt (deterministic).

    .venv/bin/python scripts/make_tokenizer.py

Writes tptrain/data/tiny-qwen3/{tokenizer.json,tokenizer_config.json}. Byte-level pre-tokenizer and decoder
with no normalizer, so any UTF-8 string round-trips exactly. The split regex is Qwen2/Qwen3's. The one special
token, <|endoftext|>, is id 0 and serves as bos, eos and pad; config.json must agree (tests check it).
"""

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).resolve().parent.parent / "tptrain" / "data"
OUT = DATA / "tiny-qwen3"
VOCAB_SIZE = 4096  # a multiple of 64, so the embedding splits evenly for TP up to 64
EOS = "<|endoftext|>"
MAX_LENGTH = 1024  # config.json max_position_embeddings
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train([str(DATA / "corpus.txt")], trainer)
    return tok


def main() -> None:
    tok = build()
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id(EOS) != 0:
        raise ValueError(f"trained vocab {tok.get_vocab_size()} / eos id {tok.token_to_id(EOS)}; expected {VOCAB_SIZE} / 0")
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {OUT}/tokenizer.json ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
