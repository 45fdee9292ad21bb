"""`flare export --quantize TYPE`: a Hugging Face directory's float weights quantized to ggml blocks.

- `q8_0`, `q4_0`: every matrix (linear weights, the embedding, an untied LM head) in that type,
  as `llama-quantize --pure` does; gguf-py's quantizers (`gguf.quants.quantize`) make the blocks.
  A matrix whose width is not a whole number of 32-value blocks stays float32.
Norms stay float32. The q/k rows need no permutation here: the directory's rows are already in
Hugging Face order, and quantization works row by row, so quantizing them in that order gives the
same blocks as permuting llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import gguf
import numpy as np
import torch

from flare.preparation.blocks import BlockTensor, GGMLType, block_problems, row_bytes
from flare.preparation.manifest import QUANTIZE_TYPES, ModelConfig
from flare.preparation.source import SourceError, SourceWeights


def tensor_types(scheme: str, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, GGMLType]:
    """The ggml type each matrix of `shapes` is quantized to under `scheme` (vectors: none)."""
    if scheme not in QUANTIZE_TYPES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZE_TYPES)}")
    wanted = GGMLType[scheme.upper()]
    return {
        name: wanted
        for name, shape in shapes.items()
        if len(shape) == 2 and row_bytes(wanted, shape[1]) is not None
    }


def quantize_weights(
    floats: Mapping[str, torch.Tensor],
    scheme: str,
    config: ModelConfig,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> SourceWeights:
    """`floats` (float32, Hugging Face names) with the matrices `tensor_types` picks as blocks.

    Raises SourceError naming a tensor whose blocks come out unservable (a weight beyond
    float16's range gives an infinite scale)."""
    types = tensor_types(scheme, config, {name: tuple(t.shape) for name, t in floats.items()})
    kept: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockTensor] = {}
    problems: list[str] = []
    for done, (name, tensor) in enumerate(floats.items(), start=1):
        ggml_type = types.get(name)
        if ggml_type is None:
            kept[name] = tensor
        else:
            values = np.ascontiguousarray(tensor.detach().float().numpy())
            data = quantize_matrix(values, ggml_type)
            shape = (int(tensor.shape[0]), int(tensor.shape[1]))
            found = block_problems(name, ggml_type, data, shape)
            problems += found
            if not found:
                blocks[name] = BlockTensor(ggml_type, torch.from_numpy(data), shape)
        progress(done, len(floats))
    if problems:
        raise SourceError("the quantized weights cannot be served:\n" + "\n".join(f"  - {p}" for p in problems))
    return SourceWeights(kept, blocks)


def quantize_matrix(values: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """float32 [out, in] as uint8 blocks [out, row_bytes] of `ggml_type`."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(gguf.quants.quantize(values, ggml_type), dtype=np.uint8)
