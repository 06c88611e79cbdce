"""The GGUF tokenizer against llama.cpp's token ids, plus decoding, streaming, errors and the cache form."""

from __future__ import annotations

import gc
import glob
import json
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import gguf
from engine.errors import TokenizerError
from engine.text.tokenizer import Tokenizer
from engine.text.vocab_rules import _DEEPSEEK_LLM

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOK_FIXTURES = os.path.join(FIXTURES, "tokenizer")
TINY_GGUF = os.path.join(FIXTURES, "qwen3-tiny-f32.gguf")


def _cases(name: str) -> list[dict]:
    with open(os.path.join(TOK_FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)["cases"]


QWEN3_CASES = _cases("qwen3-tokenizer-cases.json")
TINY_CASES = _cases("tiny-tokenizer-cases.json")


def _reference_prompts() -> list:
    params = []
    for path in sorted(glob.glob(os.path.join(TOK_FIXTURES, "*.reference.json"))):
        with open(path, encoding="utf-8") as f:
            prompts = json.load(f)["prompts"]
        name = os.path.basename(path).split(".")[0]
        params += [pytest.param(p, id=f"{name}-prompt{i}") for i, p in enumerate(prompts)]
    return params


REFERENCE_PROMPTS = _reference_prompts()


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.read(os.path.join(TOK_FIXTURES, "qwen3-vocab.gguf")))


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    if not os.path.exists(TINY_GGUF):
        pytest.skip("tests/fixtures/qwen3-tiny-f32.gguf is not there")
    return Tokenizer.from_gguf(gguf.read(TINY_GGUF))


# ---- a toy byte-level vocabulary, for the corners the real ones do not reach ----------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the character standing for each byte value."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = iter(range(0x100, 0x200))
    return [chr(b) if b in keep else chr(next(rest)) for b in range(256)]


TOY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "' s", "Ġ '", "w x"]
TOY_SPECIAL = [("<|endoftext|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("xyz!", 3), ("[PAD0]", 5)]


def toy_metadata(pre: str = "qwen2", **overrides) -> dict:
    tokens = _byte_chars() + [m.replace(" ", "") for m in TOY_MERGES] + [t for t, _ in TOY_SPECIAL]
    types = [1] * (len(tokens) - len(TOY_SPECIAL)) + [ty for _, ty in TOY_SPECIAL]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": list(TOY_MERGES),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.chat_template": "{{ messages }}",
    }
    for key, value in overrides.items():
        key = "tokenizer.ggml." + key
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


def toy(pre: str = "qwen2", **overrides) -> Tokenizer:
    return Tokenizer.from_metadata(toy_metadata(pre, **overrides))


def byte_level(text: str) -> str:
    return "".join(_byte_chars()[b] for b in text.encode())


def tid(tok: Tokenizer, text: str) -> int:
    return next(i for i in range(tok.vocab_size) if tok.token_text(i) == text)


# ---- llama.cpp's ids ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", QWEN3_CASES, ids=lambda c: f"case{c['index']}")
def test_qwen3_cases_match_llama_cpp(qwen3, case):
    # includes case 55 (e + U+0301): llama.cpp does not NFC-normalise, HF's tokenizer.json would
    assert qwen3.encode(case["text"]) == case["ids"]


def test_qwen3_case_55_is_the_unnormalised_one(qwen3):
    case = QWEN3_CASES[55]
    assert not case["matches_hf_tokenizers"]
    assert qwen3.encode(case["text"]) == case["ids"] != case["hf_tokenizers_ids"]


@pytest.mark.parametrize("case", TINY_CASES, ids=lambda c: f"case{c['index']}")
def test_tiny_cases_match_llama_cpp(tiny, case):
    assert tiny.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("prompt", REFERENCE_PROMPTS)
def test_reference_prompt_ids(tiny, prompt):
    assert tiny.add_bos is prompt["bos_added"]
    assert tiny.encode(prompt["text"]) == prompt["token_ids"]


def test_qwen3_attributes(qwen3):
    assert qwen3.vocab_size == 151936
    assert (qwen3.bos_id, qwen3.eos_id, qwen3.add_bos, qwen3.pre) == (151643, 151645, False, "qwen2")
    # </s> (an ordinary token in Qwen3, but llama.cpp ends generation on that text and makes it CONTROL),
    # <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert qwen3.eog_ids == {128247, 151643, 151645, 151662, 151663, 151664}
    assert qwen3.encode("a</s>") == [64, 128247]
    assert "<|im_start|>" in qwen3.chat_template
    assert qwen3.token_text(151644) == "<|im_start|>"


def test_special_tokens_are_single_ids_and_fakes_are_bpe(qwen3):
    for text, expected in [("<|im_start|>", 151644), ("<|im_end|>", 151645), ("<think>", 151667)]:
        assert qwen3.encode(text) == [expected]
        assert qwen3.encode(f"a{text}b") == [64, expected, 65]
    fake = qwen3.encode("<|fake_token|>")
    assert len(fake) > 1 and not set(fake) & {151644, 151645}
    assert qwen3.decode(fake) == "<|fake_token|>"


def test_parse_special_off_keeps_user_defined(qwen3):
    # llama.cpp: without parse_special CONTROL tokens are plain text; USER_DEFINED ones still match
    assert len(qwen3.encode("<|im_start|>", parse_special=False)) > 1
    assert qwen3.encode("<think>", parse_special=False) == [151667]


def test_special_tokens_longest_first_like_llama_cpp():
    # "wx" is a merge and "xyz!" a CONTROL token: llama.cpp cuts out the longest special text first, so "wxyz!"
    # is "w" + "xyz!" (leftmost-longest matching would have let BPE take "wx" first)
    tok = toy()
    assert tok.encode("wxyz!") == [tid(tok, "w"), tid(tok, "xyz!")]
    assert tok.encode("wxyz") == [tid(tok, "wx"), tid(tok, "y"), tid(tok, "z")]


def test_unused_tokens_are_not_matched_and_never_rendered():
    tok = toy()
    pad = tid(tok, "[PAD0]")
    assert pad not in tok.encode("[PAD0]")
    assert tok.decode([pad]) == tok.decode([pad], skip_special=False) == ""


def test_bos_follows_the_file_and_is_never_doubled():
    tok = toy(add_bos_token=True)
    bos, the = tok.bos_id, tid(tok, "Ġthe")
    assert tok.encode(" the") == [bos, the]
    assert tok.encode("<|endoftext|> the") == [bos, the]
    assert tok.encode(" the", add_bos=False) == [the]
    assert toy(add_bos_token=False).encode(" the") == [the]
    assert toy().encode(" the", add_bos=True) == [bos, the]
    assert toy(add_eos_token=True).encode("") == [tok.eos_id]


def test_bos_default_when_the_key_is_absent():
    # llama.cpp's BPE vocabularies add BOS by default only for the llama3 family
    assert toy("qwen2").add_bos is False
    assert toy("gpt-2").add_bos is False
    assert toy("llama-bpe").add_bos is True
    assert toy("llama-bpe", add_bos_token=False).add_bos is False


def test_eog_ids_by_text_and_keys():
    tok = toy()
    assert tok.eog_ids == {tid(tok, "<|endoftext|>"), tid(tok, "<|im_end|>")}
    # an end-of-generation text is one even when the GGUF types it as normal (llama.cpp forces CONTROL)
    types = toy_metadata()["tokenizer.ggml.token_type"].copy()
    types[tid(tok, "<|im_end|>")] = 1
    tok2 = toy(token_type=types, eos_token_id=None)
    assert tid(tok, "<|im_end|>") in tok2.eog_ids
    assert tok2.decode([tid(tok, "<|im_end|>")]) == ""
    assert toy(eot_token_id=5).eog_ids >= {5}


# ---- decoding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", QWEN3_CASES, ids=lambda c: f"case{c['index']}")
def test_decode_round_trips(qwen3, case):
    ids = case["ids"]
    assert qwen3.decode(ids, skip_special=False) == case["text"]
    hidden = [i for i in ids if not qwen3.piece(i) and qwen3.piece(i, skip_special=False)]  # CONTROL tokens
    if not hidden:
        assert qwen3.decode(ids) == case["text"]


def test_decode_hides_control_but_renders_user_defined(qwen3):
    ids = qwen3.encode("<|im_start|>user\n<think>hi</think><|im_end|>")
    assert qwen3.decode(ids) == "user\n<think>hi</think>"
    assert qwen3.decode(ids, skip_special=False) == "<|im_start|>user\n<think>hi</think><|im_end|>"


STREAM_TEXT = "Emoji 👨‍👩‍👧‍👦 🇯🇵 👍🏽, 日本語のテキスト, 한국어, é vs é, 𝕏 done."


def test_stream_decoder_yields_each_character_once(qwen3):
    ids = qwen3.encode(STREAM_TEXT)
    pieces = [qwen3.piece(i) for i in ids]
    assert any(_incomplete_utf8(p) for p in pieces)  # the test needs characters split across tokens
    dec = qwen3.stream_decoder()
    chunks = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(chunks) == qwen3.decode(ids) == STREAM_TEXT
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # held back at least once


def _incomplete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_clean_spaces_for_gpt2_vocabularies():
    # llama.cpp's detokenize drops a space before ?!., and in " 's" for vocabularies with clean_spaces (gpt-2)
    tok = toy("gpt-2")
    ids = tok.encode("a . b 's c ' d ?")
    assert tok.decode(ids) == "a. b's c'd?"
    assert toy("qwen2").decode(toy("qwen2").encode("a . b")) == "a . b"


TOY_GPT2, TOY_QWEN2 = toy("gpt-2"), toy("qwen2")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOY_GPT2.vocab_size - 1), max_size=40), st.booleans(), st.booleans())
def test_stream_equals_decode(ids, clean, skip_special):
    tok = TOY_GPT2 if clean else TOY_QWEN2
    dec = tok.stream_decoder(skip_special)
    streamed = "".join(dec.push(i) for i in ids) + dec.flush()
    assert streamed == tok.decode(ids, skip_special)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*" '.,?!smrevabc\n", "é", "日", "🇯"]), max_size=30).map("".join))
def test_stream_equals_decode_on_spacing_text(text):
    tok = TOY_GPT2
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)


TEXT = st.text(st.characters(codec="utf-8"), max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT)
def test_qwen3_decode_of_encode_is_identity(qwen3, text):
    assert qwen3.decode(qwen3.encode(text), skip_special=False) == text


def _reference_bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """llama.cpp's merge loop: repeatedly merge the adjacent pair of lowest rank, leftmost first."""
    symbols = list(word)
    while len(symbols) > 1:
        best = min(range(len(symbols) - 1), key=lambda k: (ranks.get((symbols[k], symbols[k + 1]), 1 << 62), k))
        if (symbols[best], symbols[best + 1]) not in ranks:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    return symbols


@pytest.fixture(scope="module")
def qwen3_bpe() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    md = gguf.read(os.path.join(TOK_FIXTURES, "qwen3-vocab.gguf")).metadata
    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    return vocab, {tuple(m.split(" ", 1)): r for r, m in enumerate(md["tokenizer.ggml.merges"])}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT)
def test_hf_bpe_equals_llama_cpp_merge_order(qwen3, qwen3_bpe, text):
    vocab, ranks = qwen3_bpe
    words = [w for w, _ in qwen3._pre.pre_tokenize_str(text)]
    expected = [vocab[s] for w in words for s in _reference_bpe(w, ranks)]
    assert qwen3.encode(text, parse_special=False) == expected


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"pre": "bogus-pre"}, "bogus-pre"),
        ({"model": "llama"}, "llama"),
        ({"model": "bert"}, "bert"),
        ({"model": None}, "tokenizer.ggml.model"),
        ({"tokens": None}, "tokenizer.ggml.tokens"),
        ({"merges": None}, "tokenizer.ggml.merges"),
        ({"add_bos_token": True, "bos_token_id": None}, "tokenizer.ggml.bos_token_id"),
        ({"token_type": np.ones(3, dtype=np.int32)}, "tokenizer.ggml.token_type"),
    ],
)
def test_errors_name_the_culprit(overrides, needle):
    with pytest.raises(TokenizerError, match=needle.replace(".", r"\.")):
        toy(**overrides)


def test_duplicate_tokens_are_refused():
    md = toy_metadata()
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"][:-1], "a"]
    with pytest.raises(TokenizerError, match="duplicate"):
        Tokenizer.from_metadata(md)


def test_symbols_that_are_no_tokens_merge_like_llama_cpp():
    # llama.cpp merges "q z" although "qz" is no token (it is then spelled by its ASCII bytes), and that merge,
    # ranked first, keeps "z y" from happening; HF alone would refuse the merge
    md = toy_metadata(merges=[*TOY_MERGES, "q z", "z y"])
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], "zy"]
    md["tokenizer.ggml.token_type"] = np.append(md["tokenizer.ggml.token_type"], 1).astype(np.int32)
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("qzy") == [tid(tok, "q"), tid(tok, "z"), tid(tok, "y")]
    assert tok.encode("zy") == [tid(tok, "zy")]
    # a byte with no token still separates its neighbours (here "w" and "x", which merge when adjacent)
    md = toy_metadata()
    missing = byte_level("\x1d")
    md["tokenizer.ggml.tokens"] = [t if t != missing else "[unused]" for t in md["tokenizer.ggml.tokens"]]
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("wx") == [tid(tok, "wx")]
    assert tok.encode("w\x1dx") == [tid(tok, "w"), tid(tok, "x")]


def test_unicode_16_characters_count_as_unassigned():
    # llama.cpp's tables predate Unicode 16: U+1FAE9 (an emoji since 16.0) is no symbol to it, so in DeepSeek-V3's
    # "[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+" it can lead a word, unlike U+1F600
    def pieces(text):
        return [w for w, _ in toy("deepseek-v3")._pre.pre_tokenize_str(text)]

    assert pieces("\U0001fae9abc") == [byte_level("\U0001fae9abc")]
    assert pieces("\U0001f600abc") == [byte_level("\U0001f600"), "abc"]


def test_construction_leaves_the_garbage_collector_on():
    assert gc.isenabled()
    toy()
    Tokenizer.from_cache_bytes(toy().to_cache_bytes())
    assert gc.isenabled()


def test_every_listed_pre_tokenizer_builds():
    for pre in ["qwen2", "deepseek-r1-qwen", "qwen35", "smollm", "gpt2", "gpt-2", "default"]:
        assert toy(pre).encode("Hello 123 world!") != []
    for pre in ["llama-bpe", "llama3", "deepseek-llm", "deepseek-v3"]:
        assert toy(pre).encode("Hello 123 world! 日本 ~é") != []


def test_pre_tokenizer_splits():
    # digit grouping differs per pre-tokenizer: qwen2 and smollm one digit, llama3 and deepseek-v3 up to three
    def pieces(pre, text):
        return [w for w, _ in toy(pre)._pre.pre_tokenize_str(text)]

    assert pieces("qwen2", "x 1234") == ["x", "Ġ", "1", "2", "3", "4"]
    assert pieces("smollm", "x 1234") == ["x", "Ġ", "1", "2", "3", "4"]
    assert pieces("llama-bpe", "x 1234") == ["x", "Ġ", "123", "4"]
    assert pieces("deepseek-v3", "x 1234") == ["x", "Ġ", "123", "4"]
    assert pieces("gpt-2", "x 1234") == ["x", "Ġ1234"]
    # llama.cpp matches category-free regexes on text whose non-ASCII spaces became U+000B, so DeepSeek's CJK range
    # U+0800-U+4E00 does not swallow U+2028
    assert pieces("deepseek-llm", "日\u2028本") == [byte_level("日"), byte_level("\u2028"), byte_level("本")]
    assert pieces("deepseek-v3", "x ~ y") == ["x", "Ġ~", "Ġy"]
    # DeepSeek-LLM's letter class holds canonical singletons (KELVIN SIGN, OHM SIGN, PROSGEGRAMMENI, oxia forms)
    # that differ from their NFC lookalikes; U+2127 is no letter
    letters = _DEEPSEEK_LLM[1]
    assert re.fullmatch(letters, " \u212a\u2126\u1fbe\u1f7d\u1fd3K\u03a9")
    assert not re.fullmatch(letters, "\u2127")


# ---- cache ------------------------------------------------------------------------------------------------------


def test_cache_round_trip(qwen3):
    again = Tokenizer.from_cache_bytes(qwen3.to_cache_bytes())
    for case in QWEN3_CASES:
        assert again.encode(case["text"]) == case["ids"]
        assert again.decode(case["ids"]) == qwen3.decode(case["ids"])
    for attr in ("vocab_size", "bos_id", "eos_id", "eog_ids", "add_bos", "add_eos", "chat_template", "pre"):
        assert getattr(again, attr) == getattr(qwen3, attr)


def test_cache_round_trip_keeps_toy_attributes():
    tok = toy("gpt-2", add_bos_token=True)
    again = Tokenizer.from_cache_bytes(tok.to_cache_bytes())
    text = "<think> the 'sell xyz![PAD0]<|im_end|> é"
    assert again.encode(text) == tok.encode(text)
    ids = list(range(tok.vocab_size))
    assert again.decode(ids) == tok.decode(ids)
    assert again.decode(ids, skip_special=False) == tok.decode(ids, skip_special=False)


@pytest.mark.parametrize(
    "blob",
    [b"", b"not a cache", b"engine.tokenizer/2\n", b"engine.tokenizer/2\n{}\n", b"engine.tokenizer/2\n[1]\nabc"],
)
def test_bad_cache_is_a_tokenizer_error(blob):
    with pytest.raises(TokenizerError):
        Tokenizer.from_cache_bytes(blob)


def test_truncated_cache_is_a_tokenizer_error():
    blob = toy().to_cache_bytes()
    with pytest.raises(TokenizerError):
        Tokenizer.from_cache_bytes(blob[: len(blob) - 3])
