"""A GGUF file (llama.cpp's format) as a package source.

Weights are renamed to Hugging Face Llama names and the rows of q_proj and k_proj are put back in
Hugging Face order (see `unpermute_rope_rows`). `read_blocks` keeps each tensor of a type the
engine multiplies from blocks (`blocks.KEPT_TYPES`) as its ggml blocks and dequantizes the rest to
float32; `read_weights` dequantizes everything with the `gguf` package to float32. Either refuses
a tensor whose blocks have a NaN or infinite scale, naming it.
The tokenizer, stored in GGUF as metadata (vocabulary, merges, token types), is rebuilt as a
Hugging Face `tokenizers` tokenizer.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from flare.preparation.blocks import KEPT_TYPES, BlockTensor, block_problems, unpermute_block_rows
from flare.preparation.gguf_layout import read_gguf_layout
from flare.preparation.manifest import ModelConfig
from flare.preparation.package import sha256_of, weight_problems
from flare.preparation.recipes import gguf_sampling_defaults
from flare.preparation.source import ModelSource, SourceError, SourceWeights

# GGUF tensor names -> Hugging Face Llama names; {i} is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_CONTROL_TOKEN = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED_TOKEN = 4


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when a Llama model has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of the q/k projection rows.

    Hugging Face's Llama applies RoPE in rotate-half form: in each head, dimension j pairs with
    j + head_dim/2. llama.cpp pairs adjacent dimensions (2j, 2j+1), so its converter permutes the
    rows of each head: row order (2, head_dim/2) -> (head_dim/2, 2), i.e.
    `w.reshape(heads, 2, hd/2, in).swapaxes(1, 2)` (convert_hf_to_gguf.py, LlamaModel.permute).
    The inverse reads the rows as (heads, hd/2, 2, in) and swaps axes 1 and 2 back.
    """
    rows, columns = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def open_gguf(path: Path, source: str | None = None) -> ModelSource:
    """Read a GGUF file's architecture, tokenizer and chat template (not its weights)."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path} is not a file; give a GGUF file, a Hugging Face model directory, or 'default'")
    # Every count and length bounded by the file's size first: gguf-py trusts them.
    read_gguf_layout(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, struct.error) as error:
        # The layout walk above answers for what it bounds; gguf-py may still refuse something else.
        raise SourceError(f"{path} is not a readable GGUF file: {error}") from None
    metadata = _Metadata(reader, path)
    config = _model_config(reader, metadata)
    names: dict[str, str] = {}  # GGUF name -> Hugging Face name
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise SourceError(f"{path} holds the tensor {tensor.name}, which flare's Llama does not have")
        names[tensor.name] = name
        # gguf reports shapes as [in, out]; the tensors are [out, in], as Hugging Face's.
        shapes[name] = tuple(int(n) for n in reversed(tensor.shape))
    problems = weight_problems(config, shapes)
    if problems:
        raise SourceError(
            f"the tensors of {path} do not match its metadata:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    tokenizer_json = build_tokenizer_json(metadata)
    chat_template = metadata.get("tokenizer.chat_template")
    if not chat_template:
        raise SourceError(f"{path} has no chat template (tokenizer.chat_template); flare serves chat models only")

    def read_weights(progress: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
        return _read_weights(reader, names, config, progress, keep_blocks=False).floats

    def read_dequantized(progress: Callable[[int, int], None]) -> SourceWeights:
        return _read_weights(reader, names, config, progress, keep_blocks=False)

    def read_blocks(progress: Callable[[int, int], None]) -> SourceWeights:
        return _read_weights(reader, names, config, progress, keep_blocks=True)

    return ModelSource(
        name=path.name.split(".")[0],
        source=source if source is not None else str(path),
        source_format="gguf",
        source_sha256=sha256_of(path),
        config=config,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        read_weights=read_weights,
        read_blocks=read_blocks,
        read_dequantized=read_dequantized,
        declared_defaults=gguf_sampling_defaults(metadata.get),
    )


class _Metadata:
    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise SourceError(f"{self._path} lacks the GGUF metadata key {key}; it cannot be exported")
        return value


def _model_config(reader: gguf.GGUFReader, metadata: _Metadata) -> ModelConfig:
    architecture = metadata.require("general.architecture")
    if architecture != "llama":
        raise SourceError(f"GGUF architecture {architecture!r} is not supported; flare serves Llama-family models only")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise SourceError(f"RoPE scaling {scaling!r} is not supported; flare implements plain RoPE")
    tokens = metadata.require("tokenizer.ggml.tokens")
    hidden = int(metadata.require("llama.embedding_length"))
    heads = int(metadata.require("llama.attention.head_count"))
    head_dim = int(
        metadata.get("llama.attention.key_length") or metadata.get("llama.rope.dimension_count") or hidden // heads
    )
    tensor_names = {tensor.name for tensor in reader.tensors}
    eos = [int(metadata.require("tokenizer.ggml.eos_token_id"))]
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(metadata.get("llama.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(metadata.require("llama.feed_forward_length")),
        num_layers=int(metadata.require("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(metadata.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(metadata.require("llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(metadata.require("llama.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
    )


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _read_weights(
    reader: gguf.GGUFReader,
    names: dict[str, str],
    config: ModelConfig,
    progress: Callable[[int, int], None],
    *,
    keep_blocks: bool,
) -> SourceWeights:
    floats: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockTensor] = {}
    dequantized: dict[str, str] = {}
    problems: list[str] = []
    total = len(reader.tensors)
    heads = {".attn_q.weight": config.num_heads, ".attn_k.weight": config.num_kv_heads}
    for done, tensor in enumerate(reader.tensors, start=1):
        name = names[tensor.name]
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        num_heads = next((n for suffix, n in heads.items() if tensor.name.endswith(suffix)), None)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if kind in KEPT_TYPES:
            found = block_problems(name, kind, tensor.data, shape)  # type: ignore[arg-type]
            problems += found
            if keep_blocks and not found:
                kept = BlockTensor(kind, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)), shape)  # type: ignore[arg-type]
                blocks[name] = kept if num_heads is None else unpermute_block_rows(kept, num_heads)
                progress(done, total)
                continue
            if found:
                continue
        weight = dequantize(tensor.data, kind)
        if kind not in _FLOAT_TYPES and not np.isfinite(weight).all():
            problems.append(f"tensor {name}: its {kind.name} blocks dequantize to NaN or infinite values (a bad scale)")
            continue
        if kind not in _FLOAT_TYPES:
            dequantized[name] = kind.name
        if num_heads is not None:
            weight = unpermute_rope_rows(weight, num_heads)
        # Unquantized tensors come back as read-only views of the memory-mapped file: copy those.
        floats[name] = torch.from_numpy(np.require(weight, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
        progress(done, total)
    if problems:
        raise SourceError("the GGUF's blocks cannot be served:\n" + "\n".join(f"  - {p}" for p in problems))
    return SourceWeights(floats, blocks, dequantized)


def build_tokenizer_json(metadata: _Metadata) -> str:
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
