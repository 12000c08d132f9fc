"""Where a document can be cut so that its pieces, encoded one by one, give exactly the ids of the whole document:
the cuts a tokenizer's pipeline guarantees, or none (then documents are encoded whole).

    cut = piece_cutter(tokenizer)             # None: this tokenizer's pipeline guarantees no cut
    pieces = cut(document, 1 << 16)           # "".join(pieces) == document; pieces of at least that many chars

Pieces let `encode_batch` spread one long document over every core, and bound what one encoding holds.

A cut is made after a newline with a non-whitespace character on each side ("...x\\n|Y..."). It is exact for
  * byte ids (tptrain's ByteTokenizer): every character's bytes are its own;
  * a tokenizer.json holding a byte-level BPE: the pre-tokenizer GPT-2's ByteLevel regex, or a Split on the
    GPT-4 / Llama 3 / Qwen2 regex (`SPLIT_PATTERNS`) then ByteLevel without its regex, neither adding a prefix
    space; no normalizer or NFC; no BPE dropout, truncation or padding; no added token holding a newline or
    stripping the whitespace beside it.
Why, step by step through the pipeline. Added tokens are matched first: none can span the cut (none holds "\\n")
or reach across it (none strips whitespace). NFC composes nothing with "\\n" (a starter no mark combines with), so
it normalises each side as the whole. The regexes have no look-behind, so the pre-tokens after the cut are the
whole text's from Y on. Before it, every match that can take the newline ends there, whatever follows: x is not
whitespace, so no whitespace run begins before the newline; GPT-2's `\\s+(?!\\S)` fails before Y and `\\s+` takes
the lone "\\n", while at the end of the piece `\\s+(?!\\S)` takes that same "\\n"; the GPT-4 family's `\\s*[\\r\\n]+`
or ` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*` stops at the newline, as Y is not a newline. No alternative goes on from a newline
to a non-whitespace character. BPE merges only inside a pre-token. ("\\r\\n" or a space before the newline is no
cut: GPT-2's regex takes "\\r\\n" whole at the end of a piece, but splits it before Y.) `str.isspace` covers every
character the regexes' `\\s` matches (tested), so x and Y are never `\\s`.

Any other pipeline (SentencePiece, WordPiece, Metaspace, another regex or normalizer) gets no cutter: the
guarantee would have to be argued for it first.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The pre-tokenizer regexes of the GPT-4 family, as tokenizer.json spells them: Qwen2/Qwen3 (one digit per
# pre-token) and Llama 3 / cl100k (up to three)
SPLIT_PATTERNS = frozenset(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits +
                           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+" for digits in (r"\p{N}", r"\p{N}{1,3}"))

Cutter = Callable[[str, int], list[str]]


def cut_pieces(text: str, size: int) -> list[str]:
    """`text` in consecutive pieces of at least `size` characters (the last may be shorter), each cut after the
    first safe newline from there: one with a non-whitespace character on each side."""
    pieces, start, end = [], 0, len(text)
    while end - start > size:
        i = text.find("\n", start + size)
        while i != -1 and not (0 < i < end - 1 and not text[i - 1].isspace() and not text[i + 1].isspace()):
            i = text.find("\n", i + 1)
        if i == -1:
            break
        pieces.append(text[start:i + 1])
        start = i + 1
    pieces.append(text[start:])
    return pieces


def piece_cutter(tokenizer: Any) -> Cutter | None:
    """`cut_pieces` when `tokenizer`'s ids are exactly its pieces' ids joined (see the module), else None."""
    if type(tokenizer).__name__ == "ByteTokenizer":
        return cut_pieces
    path = getattr(tokenizer, "path", None)
    if path is None or Path(path).name != "tokenizer.json" or not Path(path).is_file():
        return None
    try:
        pipeline = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cut_pieces if isinstance(pipeline, dict) and _byte_level_bpe(pipeline) else None


def _byte_level_bpe(pipeline: dict) -> bool:
    model, added = pipeline.get("model") or {}, pipeline.get("added_tokens") or []
    return (pipeline.get("normalizer") in (None, {"type": "NFC"}) and _byte_level(pipeline.get("pre_tokenizer"))
            and model.get("type") == "BPE" and model.get("dropout") is None
            and pipeline.get("truncation") is None and pipeline.get("padding") is None
            and not any("\n" in t.get("content", "") or t.get("lstrip") or t.get("rstrip") for t in added))


def _byte_level(pre: Any) -> bool:
    """GPT-2's ByteLevel with its regex, or a Split on a GPT-4 family regex then ByteLevel without one."""
    def byte_level(p: Any, regex: bool) -> bool:
        return (isinstance(p, dict) and p.get("type") == "ByteLevel" and p.get("add_prefix_space") is False
                and p.get("use_regex", True) is regex)

    if byte_level(pre, True):
        return True
    if not isinstance(pre, dict) or pre.get("type") != "Sequence" or len(pre.get("pretokenizers") or ()) != 2:
        return False
    split, last = pre["pretokenizers"]
    return (isinstance(split, dict) and split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and split.get("invert") is False and (split.get("pattern") or {}).get("Regex") in SPLIT_PATTERNS
            and byte_level(last, False))
