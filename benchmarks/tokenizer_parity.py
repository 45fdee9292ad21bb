"""flare's rebuilt GGUF tokenizers against llama.cpp's own, on a corpus: which texts differ.

For each vocabulary, every text of benchmarks/tokenizer_parity_corpus.json (multi-byte scripts,
emoji, digits, whitespace runs, code) and texts around the vocabulary's own special tokens is
tokenized by flare's tokenizer (rebuilt from the GGUF's metadata by
flare/preparation/gguf_tokenizer.py, BOS as the file says) and by llama.cpp's `llama-tokenize`
(special-token text parsed, BOS as the file says); the script prints, per vocabulary, how many
texts give different ids, and the first few differences. The vocabularies:

- each GGUF file given (default: the default model's, SmolLM2-135M-Instruct);
- `--pre NAME ...` (or `--pre all`): the default model's vocabulary and merges, plus a token
  merged last for every two tokens that meet in the corpus when nothing splits them (so that
  each split rule gives its own ids), under each of llama.cpp's pre-tokenizer names that flare
  knows;
- `--sentencepiece`: SentencePiece vocabularies trained here, written as llama.cpp's converter
  writes them (tests/gguf_vocabularies.py SENTENCEPIECE_FLAVOURS: Llama 2, Phi-3, Gemma).

`--llama-cpp-tests DIR` (llama.cpp's models/ folder) also checks flare on llama.cpp's own
tokenizer tests: the real models' vocabularies there (ggml-vocab-NAME.gguf: Llama 2 and Phi-3
SentencePiece, Llama 3, Qwen2, DeepSeek, GPT-2, ...), their texts (.inp) and the ids llama.cpp
must give them (.out, no BOS, special-token text read as text); a vocabulary flare does not
rebuild is listed as refused. Give the same files as GGUF arguments to run the corpus on them.

    .venv/bin/python benchmarks/tokenizer_parity.py --pre all --sentencepiece \\
        --llama-tokenize /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-tokenize

`--record FILE` writes the llama.cpp ids of the `--pre` vocabularies as the JSON fixture
tests/preparation/test_gguf_tokenizer.py checks flare against (CI has no llama.cpp), and
`--record-gguf FILE` the texts and ids of each GGUF file given (the real DeepSeek-V3 and gpt-oss
vocabularies' fixtures: their tests say how their GGUFs are made).
Exit status 1 when any text differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_vocabularies import (
    SENTENCEPIECE_FLAVOURS,
    MetadataDict,
    corpus_texts,
    llama_cpp_vocabulary_tests,
    llama_tokenize,
    llama_tokenize_path,
    read_vocabulary,
    sentencepiece_flavour,
    special_texts,
    with_boundary_merges,
    write_vocabulary_gguf,
)
from tokenizers import Tokenizer

from flare.preparation.default_model import default_gguf_path
from flare.preparation.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer_json
from flare.preparation.source import SourceError


def compare(label: str, vocabulary: dict[str, Any], gguf_path: Path, tool: Path, scratch: Path) -> dict[str, Any]:
    tokenizer = Tokenizer.from_str(build_tokenizer_json(MetadataDict(vocabulary)))
    texts = corpus_texts() + special_texts(vocabulary)
    differences = []
    llama_ids = []
    for text in texts:
        ours = tokenizer.encode(text).ids
        theirs = llama_tokenize(tool, gguf_path, text, scratch)
        llama_ids.append(theirs)
        if ours != theirs:
            differences.append(
                {"text": text, "flare": [tokenizer.id_to_token(i) for i in ours],
                 "llama.cpp": [tokenizer.id_to_token(i) for i in theirs]}
            )  # fmt: skip
    print(f"{label:<28} {len(texts):>3} texts  {len(differences):>3} differ")
    for difference in differences[:3]:
        print(f"    {difference['text']!r:.70}\n      flare     {difference['flare'][:24]}")
        print(f"      llama.cpp {difference['llama.cpp'][:24]}")
    return {"texts": texts, "llama_ids": llama_ids, "differences": differences}


def llama_cpp_tests(path: Path) -> dict[str, Any]:
    """flare against the ids llama.cpp's tests expect for one of its vocabularies."""
    vocabulary = read_vocabulary(path)
    kind = f"{vocabulary.get('tokenizer.ggml.model')}/{vocabulary.get('tokenizer.ggml.pre', '-')}"
    try:
        tokenizer = Tokenizer.from_str(build_tokenizer_json(MetadataDict(vocabulary)))
    except SourceError as error:
        print(f"{path.name:<34} refused: {str(error).split(';')[0]}")
        return {"texts": [], "differences": [], "refused": str(error)}
    tokenizer.encode_special_tokens = True  # llama.cpp's tests read special-token text as text
    cases = llama_cpp_vocabulary_tests(path)
    differences = [
        {"text": text, "flare": tokenizer.encode(text, add_special_tokens=False).ids, "llama.cpp": expected}
        for text, expected in cases
        if tokenizer.encode(text, add_special_tokens=False).ids != expected
    ]
    print(f"{path.name:<34} {kind:<20} {len(cases):>3} llama.cpp test texts  {len(differences):>3} differ")
    return {"texts": [text for text, _ in cases], "differences": differences}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: the default model's)")
    parser.add_argument("--llama-tokenize", type=Path, default=llama_tokenize_path())
    parser.add_argument("--pre", nargs="*", default=[], help="llama.cpp pre-tokenizer names, or 'all'")
    parser.add_argument("--sentencepiece", action="store_true", help="SentencePiece vocabularies trained here")
    parser.add_argument("--record", type=Path, help="write the --pre vocabularies' llama.cpp ids here")
    parser.add_argument("--record-gguf", type=Path, help="write the GGUF files' texts and llama.cpp ids here")
    parser.add_argument("--llama-cpp-tests", type=Path, help="llama.cpp's models/ folder: its tokenizer tests")
    args = parser.parse_args()
    if args.llama_tokenize is None or not args.llama_tokenize.is_file():
        parser.error("llama-tokenize not found; give --llama-tokenize PATH")
    names = sorted(PRE_TOKENIZERS) if args.pre == ["all"] else args.pre
    scratch = Path(tempfile.mkdtemp(prefix="tokenizer-parity-"))
    results: dict[str, dict[str, Any]] = {}
    for path in args.gguf or [default_gguf_path()]:
        results[path.name] = compare(path.name, read_vocabulary(path), path, args.llama_tokenize, scratch)
    base = with_boundary_merges(read_vocabulary(default_gguf_path()), corpus_texts())
    recorded: dict[str, list[list[int]]] = {}
    for name in names:
        vocabulary = {**base, "tokenizer.ggml.pre": name}
        path = scratch / f"pre-{name}.gguf"
        write_vocabulary_gguf(path, vocabulary)
        result = compare(f"pre={name}", vocabulary, path, args.llama_tokenize, scratch)
        results[f"pre={name}"] = result
        recorded[name] = result["llama_ids"]
    if args.sentencepiece:
        for flavour in SENTENCEPIECE_FLAVOURS:
            _, vocabulary = sentencepiece_flavour(flavour)
            path = scratch / f"spm-{flavour}.gguf"
            write_vocabulary_gguf(path, vocabulary)
            label = f"sentencepiece={flavour}"
            results[label] = compare(label, vocabulary, path, args.llama_tokenize, scratch)
    if args.record is not None:
        texts = corpus_texts() + special_texts(base)
        args.record.write_text(json.dumps({"texts": texts, "llama_ids": recorded}, ensure_ascii=False) + "\n")
        print(f"recorded in {args.record}")
    if args.record_gguf is not None:
        files = {path.name: {key: results[path.name][key] for key in ("texts", "llama_ids")} for path in args.gguf}
        args.record_gguf.write_text(json.dumps(files, ensure_ascii=False) + "\n")
        print(f"recorded in {args.record_gguf}")
    if args.llama_cpp_tests is not None:
        for path in sorted(args.llama_cpp_tests.glob("ggml-vocab-*.gguf")):
            if Path(f"{path}.inp").is_file():
                results[f"test={path.name}"] = llama_cpp_tests(path)
    total = sum(len(r["differences"]) for r in results.values())
    texts = sum(len(r["texts"]) for r in results.values())
    print(f"{len(results)} vocabularies, {texts} texts, {total} differ")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
