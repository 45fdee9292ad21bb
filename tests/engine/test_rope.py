"""RoPE tables of every scaling against transformers' own frequencies, the choices flare makes
where transformers decides per forward (longrope's factors), and their size: the context served."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.engine.tiny_llama import random_state_dict, tiny_config

from flare.engine.model import DecoderModel
from flare.engine.layers.rope import (
    apply_rope,
    inverse_frequencies,
    rope_tables,
    scaled_frequencies,
)
from flare.package.model_config import RopeScaling

LLAMA3 = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0)


def test_factors_from_a_gguf_give_the_table_of_the_llama3_scaling_they_store() -> None:
    config = replace(tiny_config(), rope_scaling=LLAMA3)
    scaled, _ = scaled_frequencies(LLAMA3, config.rope_theta, config.head_dim, config.max_position_embeddings)
    # llama.cpp's converter stores 1 / (scaled / unscaled) per frequency as rope_freqs.weight.
    divisors = (inverse_frequencies(config.rope_theta, config.head_dim) / scaled).tolist()
    as_factors = replace(config, rope_scaling=RopeScaling("factors", short_factor=tuple(divisors)))
    # The divisors are rounded to float32 once more: angles of hundreds of radians differ in their
    # last bits (float32's ulp at 512 is 6e-5).
    for ours, theirs in zip(rope_tables(config, torch.float32, "cpu"), rope_tables(as_factors, torch.float32, "cpu")):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=3e-5)


def test_longrope_uses_the_long_factors_only_where_the_context_served_exceeds_the_original() -> None:
    scaling = RopeScaling("longrope", factor=2.0, original_max_position_embeddings=256,
                          short_factor=(1.0,) * 8, long_factor=(4.0,) * 8)
    config = replace(tiny_config(), rope_scaling=scaling)
    plain = inverse_frequencies(config.rope_theta, 16)
    short, attention = scaled_frequencies(scaling, config.rope_theta, 16, context=256)
    long, _ = scaled_frequencies(scaling, config.rope_theta, 16, context=512)
    torch.testing.assert_close(short, plain)
    torch.testing.assert_close(long, plain / 4)
    assert attention == pytest.approx((1 + torch.log(torch.tensor(2.0)).item() / torch.log(torch.tensor(256.0)).item()) ** 0.5)
    cos, _ = rope_tables(config, torch.float32, "cpu", context=256)
    assert cos[0, 0].item() == pytest.approx(attention)  # cos and sin carry the attention factor


@pytest.mark.parametrize("local", [False, True])
def test_the_tables_hold_the_context_served_not_the_context_the_model_declares(local: bool) -> None:
    """A model declaring 2^40 positions (4.4 TB of tables) served at 256 builds 256 rows, the same
    rows its declared context would begin with."""
    config = replace(tiny_config(), local_rope_theta=10_000.0, sliding_window=8, sliding_layers=(0,))
    huge = replace(config, max_position_embeddings=1 << 40)
    served = rope_tables(huge, torch.float32, "cpu", local=local, context=256)
    declared = rope_tables(config, torch.float32, "cpu", local=local)
    for table, reference in zip(served, declared):
        assert table.shape == (256, config.rotary_dims // 2)
        torch.testing.assert_close(table, reference[:256], rtol=0, atol=0)


def test_a_model_serving_a_short_context_of_a_huge_declared_one_loads_small_tables() -> None:
    config = replace(tiny_config(), max_position_embeddings=1 << 40, local_rope_theta=10_000.0, sliding_window=8, sliding_layers=(0,))
    model = DecoderModel(config, random_state_dict(config), context=256)
    assert model.rope_cos.shape[0] == model.rope_sin.shape[0] == 256
    assert model.local_rope is not None and model.local_rope[0].shape[0] == 256


@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    ],
)
def test_scaled_frequencies_are_transformers_bit_for_bit(parameters: dict) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flare.preparation.families.hf_config import model_config_from_hf

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
                                  rope_parameters={"rope_theta": 10000.0, **parameters})
    expected, expected_attention = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf, "cpu")
    config = model_config_from_hf({**hf.to_dict(), "model_type": "llama"}, None)
    assert config.rope_scaling is not None
    got, attention = scaled_frequencies(config.rope_scaling, config.rope_theta, 16, config.max_position_embeddings)
    assert torch.equal(got, expected.float())
    assert attention == pytest.approx(expected_attention)


def test_partial_rotary_rotates_the_leading_dimensions_and_passes_the_rest() -> None:
    config = replace(tiny_config(), rotary_dim=8)
    cos, sin = rope_tables(config, torch.float32, "cpu")
    assert cos.shape == (config.max_position_embeddings, 4)
    x = torch.randn(3, 2, 16)
    positions = torch.tensor([0, 5, 9])
    rotated = apply_rope(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert torch.equal(rotated[..., 8:], x[..., 8:])
    assert torch.equal(rotated[0], x[0])  # position 0 turns nothing
    assert not torch.allclose(rotated[1, :, :8], x[1, :, :8])
