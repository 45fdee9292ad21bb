"""flare's Q4_K / Q6_K quantizers and the q4_k_m recipe, held to gguf-py's dequantizer and to
llama-quantize's output on the same tensors.

The fixtures were made by llama-quantize (llama.cpp vendored in the llama-cpp-python 0.3.36 sdist,
`-DGGML_NATIVE=ON`), from GGUFs that tests/preparation/test_gguf_source.py's `write_tiny_gguf`
wrote with random float32 weights (`random_llama_state_dict(config, seed=3)`):
- llama_quantize_blocks.npz: rows 0-15 of blk.0.ffn_gate.weight (8 layers, hidden 256) as
  float32 `values`, and as the blocks `llama-quantize --pure F32.gguf OUT.gguf Q4_K` (and Q6_K) wrote;
- llama_quantize_q4_k_m_types.json: the type `llama-quantize F32.gguf OUT.gguf Q4_K_M` gave each
  tensor of three 8-layer shapes (hidden 256 tied and untied, hidden 192 tied: the fallbacks).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from tests.preparation.test_gguf_source import gguf_name, tiny_vocabulary

from flare.preparation.kquants import quantize_q4_k, quantize_q6_k
from flare.package.model_config import ModelConfig
from flare.package.directory import expected_weight_shapes
from flare.preparation.quantize import tensor_types

FIXTURES = Path(__file__).parent / "fixtures"
T = gguf.GGMLQuantizationType
QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


@pytest.mark.parametrize("kind", QUANTIZERS, ids=lambda t: t.name)
def test_kquant_blocks_dequantize_close_to_the_values_and_requantize_to_themselves(kind: T) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((64, 512)) * 0.05).astype(np.float32)
    values[3] = 0.0  # an all-zero row
    values[5, :256] *= 40.0  # a super-block of large values beside small ones
    blocks = QUANTIZERS[kind](values)
    assert blocks.shape == (64, 512 // 256 * gguf.GGML_QUANT_SIZES[kind][1]) and blocks.dtype == np.uint8
    restored = gguf.quants.dequantize(blocks, kind)
    assert not restored[3].any()
    error = np.sqrt(((restored - values) ** 2).mean()) / np.sqrt((values**2).mean())
    assert error < {T.Q4_K: 0.08, T.Q6_K: 0.02}[kind]
    # gguf-py's values are a fixed point of quantizing again: the same grid is found.
    assert np.abs(gguf.quants.dequantize(QUANTIZERS[kind](restored), kind) - restored).max() <= 1e-6 * np.abs(values).max()


@pytest.mark.parametrize("kind", QUANTIZERS, ids=lambda t: t.name)
def test_kquant_blocks_match_llama_quantize_on_the_same_tensor(kind: T) -> None:
    fixture = np.load(FIXTURES / "llama_quantize_blocks.npz")
    ours, theirs = QUANTIZERS[kind](fixture["values"]), fixture[kind.name]
    # Sums in another order decide a rare near-tie of two scales the other way; measured on
    # these rows, 99.8-99.9% of the bytes are identical and the error is the same to 4 digits.
    assert (ours == theirs).mean() > 0.99
    values = fixture["values"]
    ours_error = np.sqrt(((gguf.quants.dequantize(ours, kind) - values) ** 2).mean())
    theirs_error = np.sqrt(((gguf.quants.dequantize(theirs, kind) - values) ** 2).mean())
    assert abs(ours_error - theirs_error) <= 0.002 * theirs_error


@pytest.mark.parametrize(
    "shape", ["hidden256-tied", "hidden256-untied", "hidden192-tied"]
)
def test_q4_k_m_picks_the_types_llama_quantize_picks(smollm2_source, shape: str) -> None:
    expected = json.loads((FIXTURES / "llama_quantize_q4_k_m_types.json").read_text())[shape]
    hidden = int(shape.removeprefix("hidden").split("-")[0])
    config: ModelConfig = replace(
        smollm2_source.config, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=512, vocab_size=len(tiny_vocabulary()[0]),
        tie_word_embeddings=shape.endswith("-tied"),
    )
    ours = {gguf_name(name): kind.name for name, kind in tensor_types("q4_k_m", config, expected_weight_shapes(config)).items()}
    assert {name: ours.get(name, "F32") for name in expected} == expected
