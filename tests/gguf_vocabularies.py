"""GGUF tokenizer metadata for the tokenizer tests and benchmarks/tokenizer_parity.py.

A vocabulary is a dict of GGUF metadata keys (`tokenizer.ggml.*`, `general.name`): read from a
GGUF file, or made from a SentencePiece model trained here as llama.cpp's converter writes one
(conversion/base.py, _create_vocab_sentencepiece), and written to a vocabulary-only GGUF that
llama.cpp's `llama-tokenize` loads.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

from flare.preparation.source import SourceError

# llama.cpp's token types (gguf-py TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LLAMA_TOKENIZE = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-tokenize")


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


def read_vocabulary(path: Path) -> dict[str, Any]:
    """The tokenizer keys (and the model's name) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.ggml.") or key == "general.name"
    }


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
    texts: Sequence[str], vocab_size: int, *, user_defined: Sequence[str] = (), control: Sequence[str] = ()
) -> bytes:
    """A byte-fallback BPE SentencePiece model (the kind Llama 2, Mistral, Phi-3 and Gemma ship)
    trained on `texts`, with no normalization beyond SentencePiece's space handling."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
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
