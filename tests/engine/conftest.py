"""Fixtures of the engine tests: a tiny random Llama (see tiny_llama.py)."""

from __future__ import annotations

import pytest
import torch
from tests.engine.tiny_llama import random_state_dict, tiny_config

from flare.package.model_config import ModelConfig


@pytest.fixture
def config() -> ModelConfig:
    return tiny_config()


@pytest.fixture
def state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    return random_state_dict(config)
