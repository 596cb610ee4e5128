"""Tokenizers: Hugging Face ``tokenizers`` from a local tokenizer.json, or the built-in
byte-level tokenizer. ``load_tokenizer`` picks one from the config."""

from __future__ import annotations

from pathlib import Path

from hicache.config import ModelConfig, TokenizerConfig
from hicache.text.base import ChatMessage, DecodeStream, Tokenizer, TokenizerError
from hicache.text.byte_level import ByteTokenizer

__all__ = ["ByteTokenizer", "ChatMessage", "DecodeStream", "Tokenizer", "TokenizerError", "load_tokenizer"]


def load_tokenizer(tokenizer: TokenizerConfig, model: ModelConfig | None = None) -> Tokenizer:
    """``tokenizer.path`` (a tokenizer.json or a directory holding one) -> HF tokenizer.

    Unset: an ``hf`` model whose directory holds a tokenizer.json uses that one; otherwise
    the byte-level tokenizer. Raises TokenizerError for a missing or malformed file.
    """
    path = tokenizer.path
    if path is None and model is not None and model.kind == "hf" and model.path:
        if (Path(model.path) / "tokenizer.json").is_file():
            path = model.path
    if path is None:
        return ByteTokenizer()
    from hicache.text.hf import HFTokenizer

    return HFTokenizer(path)
