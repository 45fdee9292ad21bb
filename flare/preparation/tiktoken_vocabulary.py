"""A tiktoken vocabulary (a file of byte sequences and their ranks) as a `tokenizers` pipeline.

Kimi K2 and Moonlight (DeepSeek-V3 architecture) ship no tokenizer.json: their tokenizer is a
`tiktoken.model` file (a line per token, `base64(bytes) rank`, ranks 0..n-1), a split pattern in
the tokenizer code of their repository (`tokenization_kimi.py`, `tokenization_moonshot.py`, run
as remote code), and 256 special tokens after the ranks, named by tokenizer_config.json's
`added_tokens_decoder` (`<|reserved_token_{id}|>` where it names none). flare runs no remote
code: it knows the pattern of the tokenizers it reads (`KNOWN_TOKENIZERS`) and rebuilds the same
tokenizer from the file.

tiktoken's byte-pair encoding merges, within each piece the pattern splits off, the adjacent pair
whose concatenation has the lowest rank, and takes a piece that is a token whole. A BPE model does
the same with `ignore_merges` and these merges: every split of a token into two tokens, ordered by
the whole token's rank (then the left and the right part's, among splits of one token, which give
the same token either way). The bytes are written in GPT-2's byte-level alphabet, as every byte-level
tokenizer.json is.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flare.package.byte_level import BYTE_LEVEL_ALPHABET
from flare.preparation.source import SourceError

TIKTOKEN_FILE = "tiktoken.model"
RESERVED_SPECIAL_TOKENS = 256  # after the ranks, in both repositories' tokenizer code

# `pat_str` of tokenization_kimi.py (Kimi K2, K2-Thinking) and tokenization_moonshot.py
# (Moonlight), identical in both: Han runs apart from other letters (the class intersections
# `&&[^\p{Han}]`), words with an optional leading non-letter and contractions of either case,
# numbers of up to three digits, punctuation runs, newlines, and whitespace that leaves its last
# space to the next word.
KIMI_PATTERN = "|".join((
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))  # fmt: skip

# The tokenizer code a repository names (tokenizer_config.json's auto_map AutoTokenizer) -> its
# split pattern.
KNOWN_TOKENIZERS = {
    "tokenization_kimi.TikTokenTokenizer": KIMI_PATTERN,
    "tokenization_moonshot.TikTokenTokenizer": KIMI_PATTERN,
}


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The byte sequences of a tiktoken file and their ranks; SourceError naming the line that is
    not `base64 rank`, a repeated sequence, or ranks that are not 0..n-1."""
    ranks: dict[bytes, int] = {}
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise SourceError(f"{path} line {number} is not 'base64-bytes rank': {line[:80]!r}") from None
            if token in ranks:
                raise SourceError(f"{path} line {number} repeats the byte sequence of rank {ranks[token]}")
            ranks[token] = rank
    if not ranks:
        raise SourceError(f"{path} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise SourceError(f"{path}: the ranks of its {len(ranks)} tokens are not 0..{len(ranks) - 1}, each once")
    return ranks


def tokenizer_json_from_ranks(ranks: Mapping[bytes, int], pattern: str, specials: Mapping[int, str]) -> str:
    """A tokenizer.json that tokenizes as tiktoken does with these ranks (module docstring), the
    text split by `pattern`; `specials` (id -> text), the ids right after the ranks, are matched
    whole in a text and skipped when decoding for users."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if sorted(specials) != list(range(len(ranks), len(ranks) + len(specials))):
        raise SourceError(f"the special tokens' ids must follow the {len(ranks)} ranks one by one")
    text = {token: "".join(BYTE_LEVEL_ALPHABET[b] for b in token) for token in ranks}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text[left], text[right]))
    merges.sort()
    tokenizer = Tokenizer(
        models.BPE(
            vocab={text[token]: rank for token, rank in ranks.items()},
            merges=[(left, right) for *_, left, right in merges],
            fuse_unk=False,
            ignore_merges=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    return tokenizer.to_str()


def tiktoken_tokenizer_json(directory: Path, tokenizer_config: Mapping[str, Any]) -> str:
    """The tokenizer of a repository that ships `tiktoken.model` and known tokenizer code
    (`KNOWN_TOKENIZERS`) as a tokenizer.json; SourceError for code flare does not know or
    special tokens it cannot place."""
    code = _tokenizer_code(tokenizer_config)
    pattern = KNOWN_TOKENIZERS.get(code or "")
    if pattern is None:
        named = f"its tokenizer code {code!r}" if code else "no tokenizer code (tokenizer_config.json auto_map)"
        raise SourceError(
            f"{directory} has {TIKTOKEN_FILE} and {named}, whose split pattern flare does not know (it reads "
            f"{', '.join(sorted(KNOWN_TOKENIZERS))}); save the tokenizer as tokenizer.json with a fast (tokenizers) backend"
        )
    ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)
    first, end = len(ranks), len(ranks) + RESERVED_SPECIAL_TOKENS
    specials = {i: f"<|reserved_token_{i}|>" for i in range(first, end)}
    added = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise SourceError(f"{directory}/tokenizer_config.json: added_tokens_decoder must be an object of id -> token")
    for key, entry in added.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (isinstance(key, str) and key.isdigit() and first <= int(key) < end and isinstance(content, str) and content):
            raise SourceError(
                f"{directory}/tokenizer_config.json: added_tokens_decoder {key!r} must name a special token's text by an "
                f"id from {first} to {end - 1} (the {RESERVED_SPECIAL_TOKENS} after the {first} ranks of {TIKTOKEN_FILE})"
            )
        specials[int(key)] = content
    if len(set(specials.values())) != len(specials):
        raise SourceError(f"{directory}/tokenizer_config.json: added_tokens_decoder names one text for two ids")
    return tokenizer_json_from_ranks(ranks, pattern, specials)


def _tokenizer_code(tokenizer_config: Mapping[str, Any]) -> str | None:
    """The slow tokenizer class tokenizer_config.json's auto_map names (`module.Class`)."""
    auto_map = tokenizer_config.get("auto_map")
    auto = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(auto, list):  # [slow class, fast class]
        auto = next((name for name in auto if name), None)
    if not isinstance(auto, str):
        return None
    return auto.rpartition("--")[2]  # a class from another repository: "owner/name--module.Class"

