"""Linear layers from ggml blocks: the values gguf-py gives, the product of float32 rows by them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from flare.engine.quantized import QuantizedWeight, dequantize, dequantize_rows, quantized_linear, supported_types

T = gguf.GGMLQuantizationType


def quantized(ggml_type: T, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """A weight of `ggml_type` from random values (gguf-py's quantizer)."""
    values = np.random.default_rng(seed).standard_normal((out_features, in_features), dtype=np.float32)
    blocks = gguf.quants.quantize(values, ggml_type)
    return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(blocks), out_features, in_features)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_a_quantized_layer_multiplies_rows_by_gguf_pys_dequantized_values(ggml_type: T) -> None:
    weight = quantized(ggml_type, 40, 96)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    values = gguf.quants.dequantize(weight.data.numpy(), ggml_type)
    exact = (x.double() @ torch.from_numpy(values).double().T).float()
    assert torch.equal(dequantize(weight), torch.from_numpy(values))
    torch.testing.assert_close(quantized_linear(x, weight), exact, atol=1e-4, rtol=1e-5)
    assert torch.equal(dequantize_rows(weight, torch.tensor([3, 0, 3])), torch.from_numpy(values)[[3, 0, 3]])


def test_blocks_of_the_wrong_length_or_an_unknown_type_are_refused() -> None:
    good = quantized(T.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"Q8_0 blocks of a \[4, 64\] weight must be CPU uint8 \[4, 68\]"):
        QuantizedWeight.from_blocks(T.Q8_0, good.data[:, :-1], 4, 64)
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        QuantizedWeight.from_blocks(99, good.data, 4, 64)
    with pytest.raises(ValueError, match="IQ2_XXS is not served from blocks"):
        QuantizedWeight.from_blocks(T.IQ2_XXS, good.data, 4, 64)
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        QuantizedWeight.from_blocks(T.Q8_0, good.data, 4, 48)
    assert T.Q4_K in supported_types() and T.F16 not in supported_types()
