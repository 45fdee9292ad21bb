"""`flare export --quantize TYPE`: a Hugging Face directory's float weights quantized to ggml blocks.

- `q8_0`, `q4_0`: every matrix (linear weights, the embedding, an untied LM head) in that type,
  as `llama-quantize --pure` does; gguf-py's quantizers (`gguf.quants.quantize`) make the blocks.
  A matrix whose width is not a whole number of 32-value blocks stays float32.
- `q4_k_m`: llama.cpp's Q4_K_M recipe (`llama_tensor_get_type_impl` in llama-quant.cpp, for a
  Llama without experts): Q4_K everywhere but the LM head (a tied embedding is one) in Q6_K, and
  v_proj and down_proj in Q6_K in the layers `use_more_bits` picks (the first and last eighth,
  and every third between). A matrix whose width is not whole 256-value super-blocks falls back
  as llama.cpp's does: Q4_K to Q5_0, Q6_K to Q8_0 (the LM head straight to Q8_0), and to
  float32 where even 32 does not divide it. Q4_K and Q6_K blocks come from kquants.py.
Norms stay float32, and so do a mixture-of-experts layer's router and shared-expert gate (as
llama.cpp keeps `ffn_gate_inp`: a route must not flip on rounding). Stacked experts [E, out, in]
are quantized as their E * out rows, the down projections by the rule of `mlp.down_proj`. The q/k rows need no permutation here: the directory's rows are already in
Hugging Face order, and quantization works row by row, so quantizing them in that order gives the
same blocks as permuting llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import gguf
import numpy as np
import torch

from flare.package.blocks import BlockTensor, GGMLType, block_problems, row_bytes
from flare.preparation.kquants import quantize_q4_k, quantize_q6_k
from flare.package.manifest import QUANTIZE_TYPES
from flare.package.model_config import ModelConfig
from flare.package.problems import listed
from flare.preparation.source import SourceError, SourceWeights


def tensor_types(scheme: str, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, GGMLType]:
    """The ggml type each matrix of `shapes` is quantized to under `scheme` (vectors: none)."""
    if scheme not in QUANTIZE_TYPES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZE_TYPES)}")
    types = {}
    for name, shape in shapes.items():
        # Biases stay float, 2-D ones too (gpt-oss's expert biases [E, width]).
        if len(shape) not in (2, 3) or name.endswith(_FLOAT_MATRICES) or not name.endswith(".weight"):
            continue
        wanted = GGMLType[scheme.upper()] if scheme != "q4_k_m" else _q4_k_m_type(name, shape, config)
        if wanted is not None and row_bytes(wanted, shape[-1]) is None:
            wanted = _FALLBACKS.get(wanted)
        if wanted is not None and row_bytes(wanted, shape[-1]) is not None:
            types[name] = wanted
    return types


_FLOAT_MATRICES = (".mlp.router.weight", ".mlp.shared_expert_gate.weight")
# llama.cpp's fallbacks for a width that is not whole 256-value super-blocks (llama-quant.cpp,
# `tensor_type_fallback`).
_FALLBACKS = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q6_K: GGMLType.Q8_0}


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _q4_k_m_type(name: str, shape: tuple[int, ...], config: ModelConfig) -> GGMLType:
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if name == head:
        # The output tensor's own rule: Q8_0 outright where Q4_K's super-blocks do not fit.
        return GGMLType.Q6_K if shape[1] % 256 == 0 else GGMLType.Q8_0
    if name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight", "mlp.experts.down_proj.weight")):
        layer = int(name.split(".")[2])
        return GGMLType.Q6_K if _use_more_bits(layer, config.num_layers) else GGMLType.Q4_K
    return GGMLType.Q4_K


def quantize_weights(
    floats: Mapping[str, torch.Tensor],
    scheme: str,
    config: ModelConfig,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> SourceWeights:
    """`floats` (float32, Hugging Face names) with the matrices `tensor_types` picks as blocks.

    Raises SourceError naming a tensor that holds a NaN or infinite value, or whose blocks come
    out unservable (a weight beyond float16's range gives an infinite scale)."""
    types = tensor_types(scheme, config, {name: tuple(t.shape) for name, t in floats.items()})
    kept: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockTensor] = {}
    problems: list[str] = []
    for done, (name, tensor) in enumerate(floats.items(), start=1):
        ggml_type = types.get(name)
        if ggml_type is None:
            kept[name] = tensor
        else:
            values = np.ascontiguousarray(tensor.detach().float().reshape(-1, tensor.shape[-1]).numpy())
            # Refused before quantizing: llama.cpp's K-quant search (kquant_quantizers.c) would
            # round a NaN or infinity to some finite level without a word.
            found = _nonfinite_values(name, values)
            if not found:
                data = quantize_matrix(values, ggml_type)
                found = block_problems(name, ggml_type, data, (values.shape[0], values.shape[1]))
                if not found:
                    blocks[name] = BlockTensor(ggml_type, torch.from_numpy(data), tuple(int(n) for n in tensor.shape))
            problems += found
        progress(done, len(floats))
    if problems:
        raise SourceError("the quantized weights cannot be served" + listed(problems))
    return SourceWeights(kept, blocks)


def _nonfinite_values(name: str, values: np.ndarray) -> list[str]:
    """The problem of a matrix that holds NaN or infinite values, naming the first; none if finite."""
    nonfinite = ~np.isfinite(values)
    if not nonfinite.any():
        return []
    row, column = (int(i) for i in np.argwhere(nonfinite)[0])
    return [
        f"tensor {name}: {int(nonfinite.sum())} value(s) are NaN or infinite "
        f"(first: row {row}, column {column}, value {values[row, column]}), which no block can hold"
    ]


def quantize_matrix(values: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """float32 [out, in] as uint8 blocks [out, row_bytes] of `ggml_type`."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if ggml_type == GGMLType.Q4_K:
            return quantize_q4_k(values)
        if ggml_type == GGMLType.Q6_K:
            return quantize_q6_k(values)
        return np.ascontiguousarray(gguf.quants.quantize(values, ggml_type), dtype=np.uint8)
