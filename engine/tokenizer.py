"""The public tokenizer API, `engine.tokenizer.Tokenizer.from_gguf(gguf_file)`; it lives in engine/text/tokenizer.py."""

from engine.text.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
