"""A checkpoint's SentencePiece `tokenizer.model`, for checkpoints that ship no tokenizer.json (older Llama-style
repositories, a slow tokenizer saved by transformers): run by the sentencepiece library itself, as transformers'
SentencePiece tokenizers run it. The added tokens tokenizer_config.json declares (`added_tokens_decoder`: bos/eos,
chat markers) are split out of the text first and kept whole; the text between them is encoded piece by piece.

Needs `sentencepiece` and `protobuf` (the pieces' character offsets, for chat templates' label masks).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from tptrain.io import read_json

SPM_FILE = "tokenizer.model"


class SentencePieceTokenizer:
    """encode / encode_batch / decode / encoding / token_to_id over `path` (a tokenizer.model). `eos_token_id` is
    set by `load_tokenizer`, from the checkpoint's configs as for a tokenizer.json."""

    def __init__(self, path: Path) -> None:
        spm = _sentencepiece(path)
        self.path = path
        self.description = f"{path} (SentencePiece {SPM_FILE})"
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{path} is not a SentencePiece model ({exc}); replace it with the model's own "
                             f"{SPM_FILE}, or add its tokenizer.json") from None
        self._added = _added_tokens(path.parent / "tokenizer_config.json", self._sp)
        pattern = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None
        self.vocab_size = max([self._sp.get_piece_size(), *(i + 1 for i in self._added.values())])
        self.eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return self.encoding(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        names = {i: t for t, i in self._added.items()}
        out, run = [], []
        for i in ids:
            if i in names:
                out += [self._sp.decode(run), names[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def encoding(self, text: str) -> "_Encoding":
        """`.ids` and `.char_to_token(i)` of `text` (chat label masks need both)."""
        ids, spans, at = [], [], 0  # spans[k]: the characters [first, end) token k covers
        for chunk in (self._split.split(text) if self._split else [text]):
            if chunk in self._added:
                ids.append(self._added[chunk])
                spans.append((at, at + len(chunk)))
            elif chunk:
                chars = _char_of_byte(chunk)
                for piece in self._sp.encode(chunk, out_type="proto").pieces:  # begin/end: bytes of `chunk`
                    ids.append(piece.id)
                    spans.append((at + chars[piece.begin], at + chars[piece.end]))
            at += len(chunk)
        return _Encoding(ids, spans, len(text))

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None


class _Encoding:
    def __init__(self, ids: list[int], spans: list[tuple[int, int]], length: int) -> None:
        self.ids = ids
        # A character belongs to the first token whose span starts at or covers it: of a run of byte-fallback
        # pieces for one character (the first ones have empty spans), the first.
        self._token: list[int | None] = [None] * length
        for k, (begin, end) in reversed(list(enumerate(spans))):
            for c in range(begin, max(end, begin + 1)):
                if c < length:
                    self._token[c] = k

    def char_to_token(self, index: int) -> int | None:
        return self._token[index] if 0 <= index < len(self._token) else None


def _char_of_byte(text: str) -> list[int]:
    """For each UTF-8 byte offset of `text` (and its end), the index of the character it falls in."""
    out = []
    for c, ch in enumerate(text):
        out += [c] * len(ch.encode("utf-8"))
    return out + [len(text)]


def _added_tokens(config_path: Path, sp: Any) -> dict[str, int]:
    """{content: id} of the tokens transformers splits out of the text before SentencePiece sees it: the
    added_tokens_decoder of tokenizer_config.json and the special tokens it names (bos_token, eos_token, unk_token,
    pad_token, additional_special_tokens) that are pieces of the model."""
    if not config_path.is_file():
        return {}
    config = read_json(config_path)
    named = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    named += config.get("additional_special_tokens") or []
    added = {}
    for token in named:
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and sp.id_to_piece(sp.piece_to_id(token)) == token:
            added[token] = sp.piece_to_id(token)
    for i, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str):
            added[entry["content"]] = int(i)
    return added


def _sentencepiece(path: Path) -> Any:
    try:
        import google.protobuf  # noqa: F401 - sentencepiece's offsets (out_type="proto") need it
        import sentencepiece
    except ImportError as exc:
        raise ImportError(f"{path} is a SentencePiece tokenizer (the checkpoint has no tokenizer.json); reading it "
                          f"needs the sentencepiece and protobuf packages ({exc.name} is missing): pip install "
                          f"sentencepiece protobuf, or add the model's tokenizer.json") from None
    return sentencepiece
