"""llama.cpp's vocabulary rules, as data: the pre-tokenizer regexes per `tokenizer.ggml.pre`, the token texts it
treats as end-of-generation or fill-in-the-middle markers, and how its regex engine's Unicode tables differ from
Oniguruma's (HF `tokenizers`), which `onig` bridges."""

from __future__ import annotations

import re

# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe lists them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_APOS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _APOS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = _APOS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# DeepSeek-LLM's cased-letter class. Greek Extended and Letterlike Symbols are escaped because several of their
# code points (U+1FBE, U+2126, U+212A, the oxia vowels) are canonical singletons that editors silently normalise.
_DS_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-"
    "\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK_LLM = [
    "[\r\n]",
    r"\s?[" + _DS_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
]
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]

# pre name -> (regexes, clean_spaces, ignore_merges, add_bos when the GGUF has no add_bos_token), per llama.cpp.
PRE: dict[str, tuple[list[str], bool, bool, bool]] = {
    "default": (_DEFAULT, True, False, False),
    "gpt-2": ([_GPT2], True, False, False),
    "llama3": ([_LLAMA3], True, True, True),
    "qwen2": ([_QWEN2], False, False, False),
    "qwen35": ([_QWEN35], False, False, False),
    "smollm": ([r"\p{N}", _GPT2], False, False, False),
    "deepseek-llm": (_DEEPSEEK_LLM, False, False, False),
    "deepseek-v3": (_DEEPSEEK3, False, False, False),
}
# "gpt2" is no llama.cpp name (it says "gpt-2") but is accepted
ALIASES = {"gpt2": "gpt-2", "llama-v3": "llama3", "llama-bpe": "llama3", "deepseek-r1-qwen": "qwen2"}
PRE |= {alias: PRE[name] for alias, name in ALIASES.items()}

# Token texts llama.cpp treats as end-of-generation (and forces to CONTROL), whatever the GGUF says. That includes
# "</s>", also where it is an ordinary token (Qwen's 128247).
EOG_TEXTS = frozenset(
    (
        *("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>"),
        *("<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>"),
        *("<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["),
    )
)
# FIM slots llama.cpp fills by token text when the id key is absent; such tokens are forced to CONTROL, and the
# pad / repo / file-separator ones also end generation.
FIM_TEXTS = {
    "fim_pre": "<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|> <|prefix|>",
    "fim_suf": "<|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> <|suffix|>",
    "fim_mid": "<|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> <|middle|>",
    "fim_pad": "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]",
    "fim_rep": "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>",
    "fim_sep": "<|file_sep|>",
}
FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
LOOKED_UP = EOG_TEXTS.union(*(v.split() for v in FIM_TEXTS.values()))

# Code points that HF's Oniguruma (Unicode 16) assigns a category but llama.cpp's tables (Unicode 15.1) leave
# unassigned: the Unicode 16.0 additions. Keeping them out of every \p{..} makes both treat them as unassigned.
_UNICODE_16 = (
    "\u0897\u1b4e-\u1b4f\u1b7f\u1c89-\u1c8a\u2427-\u2429\u31e4-\u31e5\ua7cb-\ua7cd\ua7da-\ua7dc"
    "\U000105c0-\U000105f3\U00010d40-\U00010d65\U00010d69-\U00010d85\U00010d8e-\U00010d8f\U00010ec2-\U00010ec4"
    "\U00010efc\U00011380-\U00011389\U0001138b\U0001138e\U00011390-\U000113b5\U000113b7-\U000113c0\U000113c2"
    "\U000113c5\U000113c7-\U000113ca\U000113cc-\U000113d5\U000113d7-\U000113d8\U000113e1-\U000113e2"
    "\U000116d0-\U000116e3\U00011bc0-\U00011be1\U00011bf0-\U00011bf9\U00011f5a\U00013460-\U000143fa"
    "\U00016100-\U00016139\U00016d40-\U00016d79\U00018cff\U0001cc00-\U0001ccf9\U0001cd00-\U0001ceb3"
    "\U0001e5d0-\U0001e5fa\U0001e5ff\U0001f8b2-\U0001f8bb\U0001f8c0-\U0001f8c1\U0001fa89\U0001fa8f\U0001fabe"
    "\U0001fac6\U0001fadc\U0001fadf\U0001fae9\U0001fbcb-\U0001fbef"
)
_NON_ASCII_SPACE = "\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # llama.cpp's, = White_Space


def onig(regex: str) -> str:
    """Rewrite a llama.cpp pre-tokenizer regex so that Oniguruma (HF) splits like llama.cpp does.

    llama.cpp matches a regex naming Unicode categories against its own (Unicode 15.1) tables: keep the Unicode 16
    additions out of each \\p{..}. A regex without categories runs in std::wregex on code points where every
    non-ASCII whitespace became U+000B: such characters then match no bracket class (DeepSeek's CJK ranges span
    U+2028 and U+3000), and `$` means the end of the piece."""
    if "\\p{" in regex:
        return re.sub(r"\\p\{([LNPSM])\}", lambda m: f"[\\p{{{m[1]}}}&&[^{_UNICODE_16}]]", regex)
    assert "\\]" not in regex  # every "]" closes a bracket class
    regex = regex.replace("]", "&&[^" + _NON_ASCII_SPACE + "]]")
    return regex[:-1] + r"\z" if regex.endswith("$") else regex
