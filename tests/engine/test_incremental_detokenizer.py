"""Streaming detokenization: token by token, the text equals decoding the whole, never broken."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from flare.engine.tokenizer import IncrementalDetokenizer, Tokenizer

SAMPLES = [
    "Hello, world! The capital of France is Paris.",
    "naïve café, Ångström, façade, jalapeño, Zürich",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "emoji 👋🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🤖🔥✨",
    "digits 3.14159 2718281828 0x1F600 1,000,000",
    "  leading spaces,   runs   of spaces, trailing  ",
    "tabs\tand\nnewlines\n\n  indented\r\nwindows",
    "mixed: a😀b日c\u0301d ñ 🧑🏾‍🚀!",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def byte_level_bpe() -> Tokenizer:
    """A GPT-2 style byte-level BPE (like SmolLM2's), small enough that characters split over tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(SAMPLES * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    return Tokenizer(backend, CHAT_TEMPLATE, eos_token_ids=[2])


def byte_fallback_bpe() -> Tokenizer:
    """A Llama/SentencePiece style BPE: ▁ for spaces, unknown characters as <0xNN> byte tokens,
    and a decoder that strips the first leading space (so a token's text depends on context)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHTW,.!:", "é", "日", "▁t", "he", "▁the"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(backend, CHAT_TEMPLATE, eos_token_ids=[2], bos_token_id=1)


TOKENIZERS = {"byte_level": byte_level_bpe(), "byte_fallback": byte_fallback_bpe()}


def stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = []
    position = 0
    for size in chunk_sizes:
        pieces.append(detokenizer.push(ids[position : position + size]))
        position += size
    assert position == len(ids)
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_token_by_token_equals_decoding_the_whole(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    prompt_ids = tokenizer.encode("the prompt:")
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    whole = tokenizer.decode(prompt_ids + ids)
    prompt_text = tokenizer.decode(prompt_ids)
    assert whole.startswith(prompt_text)

    pieces = stream(tokenizer, prompt_ids, ids, [1] * len(ids))

    assert "".join(pieces) == whole[len(prompt_text) :]
    assert not any("\ufffd" in piece for piece in pieces), pieces


@pytest.mark.parametrize("name", TOKENIZERS)
def test_streaming_in_uneven_chunks_equals_decoding_the_whole(name: str) -> None:
    # Speculative rounds emit several tokens at once.
    tokenizer = TOKENIZERS[name]
    rng = random.Random(0)
    text = " ".join(SAMPLES)
    ids = tokenizer.encode(text, add_special_tokens=False)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(1, 9), len(ids) - sum(sizes)))

    pieces = stream(tokenizer, [], ids, sizes)

    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_multi_byte_character_is_held_until_complete() -> None:
    tokenizer = TOKENIZERS["byte_fallback"]
    ids = tokenizer.encode("a🤖", add_special_tokens=False)
    robot = ids[-4:]  # the emoji has no token of its own: four <0xNN> byte tokens
    assert tokenizer.decode(robot) == "🤖"
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.push(ids[:-4]) == "a"
    assert [detokenizer.push([i]) for i in robot] == ["", "", "", "🤖"]


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement() -> None:
    tokenizer = TOKENIZERS["byte_fallback"]
    ids = tokenizer.encode("b🤖", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.push(ids) == "b"
    tail = detokenizer.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert "b" + tail == tokenizer.decode(ids)
    assert detokenizer.flush() == ""


def test_special_tokens_are_skipped_in_the_stream() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert tokenizer.backend.token_to_id("<|im_end|>") in ids
    assert "".join(stream(tokenizer, [], ids, [1] * len(ids))) == "hi"
