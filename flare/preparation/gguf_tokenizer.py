"""A GGUF file's tokenizer, stored as metadata, rebuilt as a Hugging Face `tokenizers` pipeline.

llama.cpp keeps the vocabulary (`tokenizer.ggml.tokens`), the token types, the merges and the name
of its pre-tokenizer (`tokenizer.ggml.pre`) in the file's metadata; this module reproduces
llama.cpp's tokenizer from them so that a package exported from a GGUF tokenizes as llama.cpp does.
"""

from __future__ import annotations

from typing import Any, Protocol

from flare.preparation.source import SourceError

_CONTROL_TOKEN = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED_TOKEN = 4


class TokenizerMetadata(Protocol):
    """The GGUF metadata reader: `get` gives a key's value or the default, `require` refuses a missing key."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


def build_tokenizer_json(metadata: TokenizerMetadata) -> str:
    """A Hugging Face tokenizer.json equivalent to the GGUF's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = metadata.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SourceError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "export from the Hugging Face model directory instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_NAMES:
        raise SourceError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZER_NAMES)}); "
            "export from the Hugging Face model directory instead"
        )
    tokens = list(metadata.require("tokenizer.ggml.tokens"))
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = []
    for merge in metadata.require("tokenizer.ggml.merges"):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise SourceError(f"GGUF merge {merge!r} is not a pair of tokens")
        merges.append((parts[0], parts[1]))
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole and skipped when decoding with
    # skip_special_tokens; user-defined ones are matched whole but are ordinary text.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == _CONTROL_TOKEN
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == _USER_DEFINED_TOKEN
        ]
    )
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_token = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A $B", special_tokens=[(bos_token, int(bos))]
        )
    return tokenizer.to_str()


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names (llama-vocab.cpp) that flare knows how to reproduce.
_PRE_TOKENIZER_NAMES = ("default", "gpt-2", "llama-bpe", "smollm")


def _pre_tokenizer(name: str) -> Any:
    """The Hugging Face pre-tokenizer that splits text as llama.cpp's pre-tokenizer `name` does."""
    from tokenizers import Regex, pre_tokenizers

    if name == "smollm":
        # llama.cpp splits on \p{N} first (each digit alone), then applies GPT-2's regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
