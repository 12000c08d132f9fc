"""Text: a checkpoint's tokenizer (tokenizer.json, SentencePiece tokenizer.model, or bytes for a model without
weights) and its chat template. Used by training's data, generation and the CLI; imports no torch.

    tokenizer = load_tokenizer("path/to/checkpoint")
    text, spans = load_chat_template("path/to/checkpoint").render(messages)   # spans: the assistant turns
"""
from __future__ import annotations

from tptrain.text.chat_template import ROLES, ChatTemplate, load_chat_template
from tptrain.text.spm_tokenizer import SPM_FILE, SentencePieceTokenizer
from tptrain.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["ROLES", "SPM_FILE", "ByteTokenizer", "ChatTemplate", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer",
           "load_chat_template", "load_tokenizer"]
