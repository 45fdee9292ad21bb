"""A tiny random Llama for engine tests, with Hugging Face parameter names."""

from __future__ import annotations

import torch

from flare.package.model_config import ModelConfig
from flare.package.directory import expected_weight_shapes


def tiny_config(*, tie_word_embeddings: bool = True) -> ModelConfig:
    # Grouped-query (4 query heads share 2 KV heads) like the real model, small enough to be instant.
    return ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights large enough that attention is far from uniform (so mistakes show)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            state[name] = 0.2 * torch.randn(shape, generator=generator)
    return state
