"""What every source of a package (GGUF file, Hugging Face directory) provides to `export`.

Reading a source is split in two: everything cheap (architecture, tokenizer, chat template) is
read when the source is opened, so every export option can be checked against it; the weights,
the heavy part, are read only by `read_weights`, after all checks have passed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flare.package.blocks import BlockTensor
from flare.package.model_config import ModelConfig
from flare.preparation.recipes import DeclaredDefaults


class SourceError(Exception):
    """A source that cannot be turned into a package; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # the model's own name: a GGUF file's stem, a Hugging Face directory's name
    source: str  # as the operator gave it
    source_format: str  # "gguf" or "huggingface"
    source_sha256: str | None  # of a single-file source
    config: ModelConfig
    tokenizer_json: str
    chat_template: str
    # Reads and converts the weights to Hugging Face Llama names and layout, float32.
    # `progress(done, total)` is called as tensors are read.
    read_weights: Callable[[Callable[[int, int], None]], dict[str, torch.Tensor]]
    # Reads the weights keeping each quantized tensor of a type the engine multiplies from blocks
    # as its blocks (the rest float32): a GGUF source's. None where the source has no blocks.
    read_blocks: Callable[[Callable[[int, int], None]], SourceWeights] | None = None
    # `read_weights` saying which tensors were dequantized from which type: a GGUF source's.
    read_dequantized: Callable[[Callable[[int, int], None]], SourceWeights] | None = None
    # A checkpoint's own multi-token-prediction layer, as a draft head (`hf_source.read_mtp_head`):
    # None where the source declares none.
    read_draft_head: Callable[[], ImportedDraftHead] | None = None
    # The sampling defaults the source declares for its model (generation_config.json, GGUF
    # general.sampling.*): a model without a recipe of its own serves under them (recipes.py).
    declared_defaults: DeclaredDefaults | None = None


@dataclass(frozen=True)
class SourceWeights:
    """A source's weights, Hugging Face names and layout: float32 tensors, and tensors kept as
    ggml blocks (`blocks.BlockTensor`)."""

    floats: dict[str, torch.Tensor]
    blocks: dict[str, BlockTensor]
    dequantized: dict[str, str] = field(default_factory=dict)  # float tensors the source stored quantized: their type


@dataclass(frozen=True)
class ImportedDraftHead:
    """A draft head read from a checkpoint: tensors named as `draft_head.py` names them (float32,
    without `mtp.draft_vocab`: it scores the whole vocabulary), and where they came from."""

    tensors: dict[str, torch.Tensor]
    origin: str  # e.g. "model.layers.30 of DIR (DeepSeek-V3-style MTP layer, the first of 1)"
    layer: str = "llama"  # its decoder layer's kind (`DraftHeadInfo.layer`)
