"""Which models run the C kernels: those whose layers the kernels implement (`kernels_fit`), every
served family's; heads too wide for the kernels' feature path are tested in
tests/engine/test_native_family_models.py. Correctness of each feature's torch step is held to
transformers by tests/families/."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.engine.tiny_llama import random_state_dict, tiny_config

from flare.engine import native
from flare.engine.model import DecoderModel, kernels_fit
from flare.package.model_config import RopeScaling

LLAMA3 = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"rope_scaling": LLAMA3},  # in the cos/sin table the kernels read
        {"final_logit_softcap": 30.0, "embedding_scale": 8.0},  # outside the layers
        {"attention_scale": 16**-0.5},  # head_dim's own
        {"sliding_window": 512, "sliding_layers": (0, 1)},  # as long as the context: narrows nothing
        # Options of the kernels themselves (tests/engine/test_native_families.py holds each to torch).
        {"attention_bias": True},
        {"qk_norm": True},
        {"rotary_dim": 8},
        {"sliding_window": 8, "sliding_layers": (0,)},
        {"attention_scale": 0.1},
        {"attention_softcap": 50.0},
        {"sandwich_norms": True},
        {"hidden_activation": "gelu_tanh"},
    ],
)
def test_what_the_kernels_implement_fits_them(change: dict) -> None:
    config = replace(tiny_config(), **change)
    assert kernels_fit(config)
    assert DecoderModel(config, random_state_dict(config)).native_kernels == native.available()


def test_a_window_narrower_than_the_context_served_only_counts_there() -> None:
    config = replace(tiny_config(), sliding_window=64, sliding_layers=(1,))
    state = random_state_dict(config)
    assert DecoderModel(config, state, context=64).layers[1].window is None
    assert DecoderModel(config, state).layers[1].window == 64
    assert DecoderModel(config, state, context=64).native_kernels == native.available()
