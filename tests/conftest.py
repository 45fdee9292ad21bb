"""Shared test set-up.

TRITON_INTERPRET must be set before any module decorates a Triton kernel: the interpreter
mode is fixed at decoration time (../shared/notes/triton-on-cpu.md).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flare.preparation.manifest import ModelConfig, Provenance, ServingConfig  # noqa: E402
from flare.preparation.package import expected_weight_shapes, write_package  # noqa: E402
from flare.sampling.policy import SamplingPolicy  # noqa: E402

TINY_MAX_CONTEXT = 512


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, 100)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    """A tiny Llama of the default model's shape family (GQA, tied embeddings)."""
    return ModelConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=TINY_MAX_CONTEXT, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,),
    )


def random_llama_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            state[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return state


TEST_POLICY_DEFAULTS: dict[str, Any] = {
    "temperature": 0.2, "top_k": -1, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 64,
}


@pytest.fixture(scope="session")
def package_parts(tiny_config: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of write_package for the tiny model (replace any to vary it)."""
    return {
        "config": tiny_config,
        "state_dict": random_llama_state_dict(tiny_config),
        "tokenizer_json": _tiny_tokenizer_json(),
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "policy": SamplingPolicy(
            TEST_POLICY_DEFAULTS,
            {"temperature": (0.0, 2.0), "top_k": (-1, 200), "top_p": (0.05, 1.0), "max_tokens": (1, TINY_MAX_CONTEXT)},
        ),
        "serving": ServingConfig(max_context=TINY_MAX_CONTEXT),
        "provenance": Provenance(
            source="tests", source_format="huggingface", source_sha256=None, recipe="tests",
            flare_version="0.1.0", created="2026-11-29T00:00:00Z",
        ),
    }


@pytest.fixture(scope="session")
def make_package(package_parts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_package(serving=..., policy=..., ...) writes a tiny package and returns its path.

    Keyword arguments replace those of `package_parts`; `serving` may also be a dict of
    ServingConfig fields to change, e.g. make_package(serving={"vocabulary_parallel_sampling": True}).
    """

    def make(out_dir: Path | None = None, **changes: Any) -> Path:
        parts = dict(package_parts)
        serving = changes.pop("serving", None)
        if isinstance(serving, dict):
            changes["serving"] = replace(parts["serving"], **serving)
        elif serving is not None:
            changes["serving"] = serving
        parts.update(changes)
        out = out_dir if out_dir is not None else tmp_path_factory.mktemp("package") / "pkg"
        write_package(out, **parts)
        return out

    return make


@pytest.fixture(scope="session")
def tiny_package(make_package: Callable[..., Path]) -> Path:
    """A tiny random Llama package (read-only: copy it before changing files)."""
    return make_package()
