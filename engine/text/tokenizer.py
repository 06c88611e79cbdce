"""Byte-level BPE tokenizer rebuilt from GGUF `tokenizer.*` metadata; token ids match llama.cpp's exactly.

llama.cpp tokenizes in three steps, mirrored here:
1. special-token partition: the texts of CONTROL / USER_DEFINED / UNKNOWN tokens are cut out of the input
   literally, longest first (`_partition`);
2. every remaining fragment is split by the regexes of its `tokenizer.ggml.pre`, applied in sequence (each regex
   splits the pieces of the previous one), and byte-mapped with GPT-2's bytes_to_unicode;
3. rank-ordered BPE merges within each piece (engine/text/bpe.py, llama.cpp's merge loop).
Step 2 runs in HF `tokenizers`' pre-tokenizers (Split* -> ByteLevel, no normalizer: llama.cpp applies no NFC); where
its regex engine and llama.cpp's differ, `_onig` says how that is bridged. Step 3 needs only two str -> int tables
(the vocabulary and the merge ranks), which load from the prepare cache packed (engine/text/packed.py), in a few ms.
Decoding is done here from the token texts, as llama.cpp's token_to_piece / detokenize do.
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import json
import logging
import marshal
import re
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Regex, pre_tokenizers

from engine.errors import TokenizerError
from engine.text.bpe import BytePairEncoder
from engine.text.packed import PackedStrings, PackedTable, ints
from engine.text.vocab_rules import EOG_TEXTS, FIM_EOG, FIM_TEXTS, LOOKED_UP, PRE, onig

log = logging.getLogger(__name__)

# llama_token_attr bits. GGUF token_type 0..6 = undefined, normal, unknown, control, user-defined, unused, byte.
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
_ATTR_OF_TYPE = (UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)
_MATCHED = CONTROL | USER_DEFINED | UNKNOWN  # cut out of the input text before BPE
_HIDDEN = CONTROL | UNKNOWN  # rendered as nothing unless special rendering is asked for

_CACHE_MAGIC = b"engine.tokenizer/4\n"
# what a Tokenizer is built from besides tokens / attrs / merges (and its cache stores)
_META_KEYS = ("pre", "regexes", "clean_spaces", "ignore_merges", "chat_template", "bos_id", "eos_id", "eog_ids")
_META_KEYS += ("add_bos", "add_eos")


def _byte_decoder() -> dict[str, int]:
    """GPT-2 bytes_to_unicode, inverted: printable bytes stand for themselves, the other 68 for U+0100 + n."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(0x100 + n): b for n, b in enumerate(rest)}}


_BYTE_OF = _byte_decoder()


def _clean_spaces(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces passes (detokenize, when the vocab sets clean_spaces)."""
    text = re.sub(r" (?=[?!.,])", "", text)
    text = text.replace(" ' ", "'")
    return re.sub(r" (?='(?:[sm]|re|ve))", "", text)


def _stable_cut(text: str) -> int:
    """Longest prefix whose space cleanup cannot change with more text: a cleanup pattern starts with a space and
    spans at most 4 characters, so the prefix must not have a space among its last 3 characters."""
    cut = len(text)
    while (j := text.rfind(" ", max(0, cut - 3), cut)) >= 0:
        cut = j
    return cut


@contextlib.contextmanager
def _gc_paused():
    """Building ~450k strings and tuples otherwise sets off repeated GC passes over them (~25 ms of ~300)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _key(md: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return md.get("tokenizer.ggml." + name, default)


def _attrs_from(types: Any, n: int) -> bytearray:
    """GGUF token_type (absent: all normal) -> (n,) llama_token_attr bits, one byte per token."""
    if types is None:
        return bytearray([NORMAL]) * n
    types = types.tolist() if hasattr(types, "tolist") else list(types)
    if len(types) < n or any(isinstance(t, list) for t in types[:1]):
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    last = len(_ATTR_OF_TYPE)
    return bytearray(_ATTR_OF_TYPE[t] if 0 <= t < last else UNDEFINED for t in types[:n])


def _indices(attrs: bytearray, mask: int, equal: int | None = None) -> list[int]:
    """Ids whose attrs has any bit of `mask` (or, with `equal`, whose attrs differ from it), found at C speed: the
    bytes are mapped to zero / non-zero by a translation table and the non-zero ones searched for."""
    if equal is None:
        table = bytes(1 if b & mask else 0 for b in range(256))
    else:
        table = bytes(0 if b == equal else 1 for b in range(256))
    return [m.start() for m in re.finditer(b"\x01", attrs.translate(table))]


def _resolve_control_tokens(token_id: Any, vocab: Mapping[str, int], attrs: bytearray) -> set[int]:
    """llama.cpp's by-text special-token detection: returns the end-of-generation ids and makes control-looking
    tokens CONTROL in `attrs`. `token_id(key)` reads an id key of the GGUF (None when absent)."""
    by_text = {t: vocab[t] for t in LOOKED_UP if t in vocab}
    eog = {token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")}
    for slot, texts in FIM_TEXTS.items():
        found = [token_id(slot + "_token_id")]
        if found[0] is None:
            found = [by_text[t] for t in texts.split() if t in by_text]
            for i in found:
                attrs[i] |= CONTROL
        if slot in FIM_EOG:
            eog.update(found)
    for t in EOG_TEXTS & by_text.keys():
        eog.add(by_text[t])
        attrs[by_text[t]] |= CONTROL
    eog.discard(None)
    # (llama.cpp's later exceptions for gpt-oss' <|end|> and Gemma-4's </s> concern vocabularies not supported here)
    return eog


class Tokenizer:
    """Encode text to llama.cpp token ids and decode ids back to text (llama.cpp semantics throughout).

    Build with `from_gguf` / `from_metadata`, or `from_cache_bytes` on the output of `to_cache_bytes`.
    """

    def __init__(self, vocab: Mapping[str, int], ranks: Mapping[str, int], attrs: bytearray, meta: dict[str, Any],
                 special: list[tuple[str, int, bool]], tokens: Sequence[str] | None = None):  # fmt: skip
        # vocab: token text -> id; ranks: "left right" -> merge rank (dicts, or packed tables from the cache); attrs:
        # (vocab_size,) llama_token_attr bits, a byte per token; meta: the _META_KEYS; special: (text, id, hidden) of
        # the tokens cut out before BPE, longest first; tokens: id -> text when the caller has it (else built from
        # vocab on first use).
        self._vocab, self._ranks, self._attrs, self._meta = vocab, ranks, attrs, meta
        self._token_list = tokens
        self.vocab_size = len(vocab)
        self.bos_id: int | None = meta["bos_id"]
        self.eos_id: int | None = meta["eos_id"]
        self.eog_ids: frozenset[int] = frozenset(meta["eog_ids"])
        self.add_bos: bool = meta["add_bos"]
        self.add_eos: bool = meta["add_eos"]
        self.chat_template: str | None = meta["chat_template"]
        self.pre: str = meta["pre"]
        self._clean: bool = meta["clean_spaces"]
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._special = special
        splits = [pre_tokenizers.Split(Regex(onig(r)), behavior="isolated") for r in meta["regexes"]]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        self._pre = pre_tokenizers.Sequence([*splits, byte_level])
        self._bpe = BytePairEncoder(vocab, ranks, meta["ignore_merges"])

    @property
    def _tokens(self) -> Sequence[str]:
        if self._token_list is None:
            tokens = [""] * self.vocab_size
            for text, i in self._vocab.items():
                tokens[i] = text
            self._token_list = tokens
        return self._token_list

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> Tokenizer:
        """From a parsed GGUF file (anything with a `.metadata` mapping)."""
        return cls.from_metadata(gguf_file.metadata)

    @classmethod
    @_gc_paused()
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata: str -> str / list[str] / 1-D numeric array or list / scalar."""
        model = _key(md, "model")
        if model is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); only 'gpt2' is")
        pre = _key(md, "pre") or "default"  # llama.cpp falls back to 'default' (with a warning)
        if pre not in PRE:
            raise TokenizerError(f"unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
        regexes, clean_spaces, ignore_merges, add_bos_default = PRE[pre]
        for name in ("tokens", "merges"):
            if _key(md, name) is None:
                raise TokenizerError(f"GGUF metadata has no tokenizer.ggml.{name}")
        # llama.cpp renames empty tokens and refuses duplicates, so that every text maps to one id.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(_key(md, "tokens"))]
        n = len(tokens)
        vocab = dict(zip(tokens, range(n), strict=True))
        if len(vocab) != n:
            dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
            raise TokenizerError(f"duplicate token in tokenizer.ggml.tokens: {dup!r}")
        attrs = _attrs_from(_key(md, "token_type"), n)

        def token_id(name: str) -> int | None:
            v = _key(md, name)
            if v is not None and not 0 <= int(v) < n:
                log.warning("tokenizer.ggml.%s = %s is outside the vocabulary; ignored", name, v)
                v = None
            return None if v is None else int(v)

        eog = _resolve_control_tokens(token_id, vocab, attrs)
        meta = {
            "pre": pre,
            "regexes": regexes,
            "clean_spaces": clean_spaces,
            "ignore_merges": ignore_merges,
            "bos_id": token_id("bos_token_id"),
            "eos_id": token_id("eos_token_id"),
            "eog_ids": sorted(eog),
            "add_bos": bool(_key(md, "add_bos_token", add_bos_default)),
            "add_eos": bool(_key(md, "add_eos_token", False)),
            "chat_template": md.get("tokenizer.chat_template"),
        }
        for flag, tok in (("add_bos", "bos_id"), ("add_eos", "eos_id")):
            if meta[flag] and meta[tok] is None:
                raise TokenizerError(
                    f"tokenizer.ggml.{flag}_token is true but tokenizer.ggml.{tok[:3]}_token_id is missing"
                )
        # llama.cpp keeps the first rank of a merge listed twice
        ranks = {f"{a} {b}": r for r, (a, b) in reversed(list(enumerate(_merge_pairs(_key(md, "merges")))))}
        # llama.cpp sorts by byte length, longest first; ties by id keep the order deterministic.
        ids = sorted(_indices(attrs, _MATCHED), key=lambda i: (-len(tokens[i].encode()), i))
        special = [(tokens[i], i, bool(attrs[i] & _HIDDEN)) for i in ids]
        return cls(vocab, ranks, attrs, meta, special, tokens)

    def to_cache_bytes(self) -> bytes:
        """One self-contained blob from which `from_cache_bytes` rebuilds this tokenizer: a magic line, a JSON line
        (meta, sparse attrs, special tokens) and, in `marshal` form (the fastest builtin to load; unlike pickle it
        cannot run code), the packed tables of engine/text/packed.py: the token texts in id order with the ids in
        text order, and the merge keys in text order with their ranks."""
        odd = _indices(self._attrs, 0, equal=NORMAL)  # attrs are NORMAL almost everywhere: store the exceptions
        header = {**self._meta, "attrs": [odd, [self._attrs[i] for i in odd]], "special": self._special}
        tokens = PackedStrings.pack(self._tokens[i] for i in range(self.vocab_size))
        order = sorted(range(self.vocab_size), key=self._tokens.__getitem__)
        ranks = PackedTable.pack(self._ranks.items())
        rank_keys, rank_values = ranks.packed_keys, ranks.packed_values
        table = (tokens.blob, tokens.ends.tobytes(), array("q", order).tobytes(), rank_keys.blob,
                 rank_keys.ends.tobytes(), rank_values.tobytes())  # fmt: skip
        return _CACHE_MAGIC + json.dumps(header).encode() + b"\n" + marshal.dumps(table)

    @classmethod
    @_gc_paused()
    def from_cache_bytes(cls, data: bytes) -> Tokenizer:
        """Rebuild from `to_cache_bytes` output, without the GGUF metadata."""
        if not data.startswith(_CACHE_MAGIC):
            raise TokenizerError(f"not a tokenizer cache (expected it to start with {_CACHE_MAGIC!r})")
        try:
            nl = data.index(b"\n", len(_CACHE_MAGIC))  # the JSON line; the tables follow (read in place)
            state = json.loads(data[len(_CACHE_MAGIC) : nl])
            tok_blob, tok_ends, order, rank_blob, rank_ends, rank_values = marshal.loads(memoryview(data)[nl + 1 :])
            tokens = PackedStrings(tok_blob, ints(tok_ends))
            vocab = PackedTable(tokens, ints(order))
            ranks = PackedTable(PackedStrings(rank_blob, ints(rank_ends)), None, ints(rank_values))
            attrs = bytearray([NORMAL]) * len(vocab)
            for i, a in zip(*state["attrs"], strict=True):
                attrs[i] = a
            meta = {k: state[k] for k in _META_KEYS}
            special = [(str(t), int(i), bool(h)) for t, i, h in state["special"]]
        except (KeyError, IndexError, TypeError, ValueError, EOFError) as e:
            raise TokenizerError(f"tokenizer cache is damaged: {e!r}") from e
        return cls(vocab, ranks, attrs, meta, special, tokens)

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`. add_bos / add_eos None: as the GGUF says. parse_special False: CONTROL tokens
        are not recognised in the text (USER_DEFINED ones still are, as in llama.cpp)."""
        ids: list[int] = []
        for p in self._partition(text, parse_special):
            if isinstance(p, str):
                ids += self._bpe.encode([w for w, _ in self._pre.pre_tokenize_str(p)])
            else:
                ids.append(p)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: for each special token, longest first, split every remaining text
        fragment at all its occurrences. Longest-first per token (not leftmost-longest) is what llama.cpp does."""
        parts: list[str | int] = [text] if text else []
        for tok_text, tok_id, hidden in self._special:
            if (hidden and not parse_special) or tok_text not in text:
                continue
            out: list[str | int] = []
            for p in parts:
                if not isinstance(p, str) or tok_text not in p:
                    out.append(p)
                    continue
                for k, piece in enumerate(p.split(tok_text)):
                    if k:
                        out.append(tok_id)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (byte-level form, e.g. 'Ġworld')."""
        return self._tokens[token_id]

    def piece(self, token_id: int, skip_special: bool = True) -> bytes:
        """llama.cpp token_to_piece: the bytes a token stands for. CONTROL/UNKNOWN tokens are empty unless
        skip_special is False; USER_DEFINED tokens are their literal text; UNUSED/UNDEFINED are always empty."""
        key = (token_id, skip_special)
        if (b := self._pieces.get(key)) is None:
            if not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            attr, text = int(self._attrs[token_id]), self._tokens[token_id]
            if attr & _HIDDEN:
                b = b"" if skip_special else text.encode()
            elif attr & USER_DEFINED:
                b = text.encode()
            elif attr & NORMAL:
                # a character outside the byte map cannot come from a byte-level vocab; keep its UTF-8
                b = b"".join(bytes([_BYTE_OF[c]]) if c in _BYTE_OF else c.encode() for c in text)
            elif attr & BYTE:
                b = bytes([int(text[3:5], 16)])  # "<0xAB>"
            else:
                b = b""
            self._pieces[key] = b
        return b

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """llama.cpp detokenize; invalid UTF-8 becomes U+FFFD."""
        text = b"".join(self.piece(int(i), skip_special) for i in ids).decode("utf-8", errors="replace")
        return _clean_spaces(text) if self._clean else text

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Incremental decode: `push` returns only newly completed text; a UTF-8 character split across tokens is held
    back until whole. The concatenation of all pushes and `flush` equals `Tokenizer.decode` of the same ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text whose space cleanup still depends on what follows

    def push(self, token_id: int) -> str:
        return self._emit(self._utf8.decode(self._tok.piece(int(token_id), self._skip)), final=False)

    def flush(self) -> str:
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, new: str, final: bool) -> str:
        if not self._tok._clean:
            return new
        text = self._held + new
        cut = len(text) if final else _stable_cut(text)
        self._held = text[cut:]
        # cleanup of consecutive stable prefixes concatenates: no pattern crosses a cut (see _stable_cut)
        return _clean_spaces(text[:cut])


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    """'left right' -> (left, right). llama.cpp splits at the first space after position 0; plain split differs only
    for a merge that starts with a space or has none (llama.cpp's ("", "") then, which never applies: dropped)."""
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 or not p[0] for p in pairs):
        pairs = [(m[:i], m[i + 1 :]) for m in merges if (i := m.find(" ", 1)) > 0 and i + 1 < len(m)]
    return pairs  # type: ignore[return-value]
