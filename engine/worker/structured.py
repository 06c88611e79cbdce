"""Structured output: `response_format` (json_object, json_schema) and a `grammar` (Lark or GBNF) compiled by
llguidance, the constrained-decoding library llama.cpp uses, into a token mask per step.

The mask is computed on the host (llguidance works on the CPU, in Rust, without the GIL) and applied to the host
logits row before the engine's sampler draws (engine/worker/logprobs.py): one bitmask of n_vocab bits per token, the
only extra traffic on CUDA being the logits row itself. When the grammar is complete only the end-of-generation
tokens stay allowed, so generation ends there. A schema or grammar that does not compile is an `invalid_input`
error naming the field; the compile itself is bounded by llguidance's parser limits.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from engine.errors import InvalidInput

_lock = threading.Lock()
_tokenizers: dict[int, Any] = {}  # id(engine tokenizer) -> llguidance.LLTokenizer (built once: ~0.1-0.3 s)


def ll_tokenizer(tokenizer):
    """The llguidance view of the engine's tokenizer: every token's bytes, control tokens marked with 0xFF (the
    convention of llguidance's own llama.cpp bridge), end-of-generation tokens as its EOS set."""
    import llguidance

    with _lock:
        cached = _tokenizers.get(id(tokenizer))
        if cached is not None and cached[0] is tokenizer:
            return cached[1]

        class Vocab:  # the attributes llguidance.TokenizerWrapper reads
            eos_token_id = tokenizer.eos_id
            bos_token_id = tokenizer.bos_id

            def __init__(self):
                self.tokens: list[bytes] = []
                self.special_token_ids: list[int] = []

            def __call__(self, text: bytes | str) -> list[int]:
                s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                return tokenizer.encode(s, add_bos=False, add_eos=False, parse_special=False)

        vocab = Vocab()
        for i in range(tokenizer.vocab_size):
            shown = tokenizer.piece(i, skip_special=False)
            hidden = shown and not tokenizer.piece(i, skip_special=True)  # control: rendered only on request
            vocab.tokens.append(b"\xff" + shown if hidden else shown)
            if hidden:
                vocab.special_token_ids.append(i)
        eos = sorted(tokenizer.eog_ids) or [tokenizer.eos_id]
        lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=tokenizer.vocab_size, eos_token=eos)
        _tokenizers[id(tokenizer)] = (tokenizer, lltok)
        return lltok


def grammar_for(response_format, grammar: str | None) -> str | None:
    """The llguidance grammar of a request, or None for free text."""
    import llguidance

    if grammar is not None:
        if response_format is not None and response_format.type != "text":
            raise InvalidInput("invalid job input: grammar and a JSON response_format exclude each other")
        try:
            return llguidance.grammar_from("grammar", grammar)
        except ValueError as e:
            raise InvalidInput(f"invalid job input: grammar: {e}") from None
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema: Any = {"type": "object"}
    else:
        schema = response_format.json_schema.schema_
        if not isinstance(schema, dict):
            raise InvalidInput("invalid job input: response_format.json_schema.schema: a JSON schema object is needed")
    try:
        # Compact JSON (", " and ": " separators, no free whitespace): a weak model cannot loop on blanks, and the
        # schema's own "x-guidance" options still apply over these defaults.
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact)
    except ValueError as e:
        raise InvalidInput(f"invalid job input: response_format.json_schema.schema: {e}") from None


class Constraint:
    """One request's grammar state."""

    def __init__(self, tokenizer, grammar: str, where: str = "response_format"):
        import llguidance

        lltok = ll_tokenizer(tokenizer)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise InvalidInput(f"invalid job input: {where}: {messages[0] if messages else 'does not compile'}")
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidInput(f"invalid job input: {where}: {self.matcher.get_error()}")
        self.n_vocab = tokenizer.vocab_size

    def masked(self, logits, fill: float):
        """A copy of logits (n_vocab,) with every token the grammar forbids set to `fill`."""
        import numpy as np

        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # u32 words, token i = bit i % 32
        bits = np.unpackbits(bits, bitorder="little")[: min(logits.shape[0], self.n_vocab)]
        allowed = np.zeros(logits.shape[0], dtype=bool)  # rows past the tokenizer's vocabulary stay forbidden
        allowed[: bits.size] = bits
        if not allowed.any():
            raise InvalidInput(f"the grammar allows no token here: {self.matcher.get_error() or 'dead end'}")
        return np.where(allowed, logits, np.float32(fill)).astype(logits.dtype, copy=False)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token) and not self.matcher.is_stopped():
            raise InvalidInput(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
