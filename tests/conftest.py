"""Shared test set-up.

TRITON_INTERPRET must be set before any module decorates a Triton kernel: the interpreter
mode is fixed at decoration time.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# Test processes and the daemons they start share two cores with each other: OpenMP threads
# sleep at once rather than spin (flare/engine/openmp.py), so no process starves another.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Stored Responses go to the daemon's state directory: the suite's own, never the user's
# (~/.local/state/flare) or a service's (systemd's STATE_DIRECTORY). Daemons started as
# subprocesses inherit it.
os.environ.pop("STATE_DIRECTORY", None)
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="flare-tests-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], ignore_errors=True)

import json  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from flare.preparation.default_model import default_gguf_path  # noqa: E402
from flare.preparation.default_package import default_package_path  # noqa: E402
from flare.preparation.gguf_source import open_gguf  # noqa: E402
from flare.package.manifest import Provenance, ServingConfig  # noqa: E402
from flare.package.model_config import ModelConfig  # noqa: E402
from flare.package.directory import expected_weight_shapes, write_package  # noqa: E402
from flare.preparation.source import ModelSource  # noqa: E402
from flare.policy.policy import SamplingPolicy  # noqa: E402

TINY_MAX_CONTEXT = 512


@pytest.fixture(autouse=True)
def no_logging_to_closed_streams() -> None:
    """A test that configured logging (`configure_logging`, or a daemon run in-process) leaves its
    handler on the root logger, writing to a stream pytest has closed since: later tests' log lines
    would print logging's own error and traceback to stderr, which tests that check a process's
    stderr read as the process's. Such handlers are dropped before each test."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        stream = getattr(handler, "stream", None)
        if stream is not None and getattr(stream, "closed", False):
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    """The default model's GGUF, opened (metadata, tokenizer and chat template; weights on demand)."""
    return open_gguf(default_gguf_path())


@pytest.fixture(scope="session")
def tiny_config(smollm2_source: ModelSource) -> ModelConfig:
    """A tiny Llama of the default model's shape family (GQA, tied embeddings) and its vocabulary."""
    return replace(
        smollm2_source.config,
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=TINY_MAX_CONTEXT,
    )


def random_llama_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights of a Llama with `config`, Hugging Face names and layout."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            state[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return state


@pytest.fixture(scope="session")
def make_state_dict() -> Callable[..., dict[str, torch.Tensor]]:
    """make_state_dict(config, seed=0): deterministic random Llama weights (Hugging Face names)."""
    return random_llama_state_dict


TEST_POLICY_DEFAULTS: dict[str, Any] = {
    "temperature": 0.2, "top_k": -1, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 64,
}


@pytest.fixture(scope="session")
def package_parts(tiny_config: ModelConfig, smollm2_source: ModelSource) -> dict[str, Any]:
    """The keyword arguments of write_package for the tiny model (replace any to vary it).

    Random weights, with the default model's real tokenizer and chat template, so text is realistic.
    """
    return {
        "config": tiny_config,
        "state_dict": random_llama_state_dict(tiny_config),
        "tokenizer_json": smollm2_source.tokenizer_json,
        "chat_template": smollm2_source.chat_template,
        "policy": SamplingPolicy(
            TEST_POLICY_DEFAULTS,
            {"temperature": (0.0, 2.0), "top_k": (-1, 200), "top_p": (0.05, 1.0), "max_tokens": (1, TINY_MAX_CONTEXT)},
        ),
        "serving": ServingConfig(max_context=TINY_MAX_CONTEXT),
        "provenance": Provenance(
            name="tiny-llama", source="tests", source_format="huggingface", source_sha256=None, recipe="tests",
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


@pytest.fixture(scope="session")
def vocabulary_parallel_package(make_package: Callable[..., Path], package_parts: dict[str, Any]) -> Path:
    """The tiny model as `flare export --vocabulary-parallel-sampling` writes it: unfiltered() policy."""
    policy = package_parts["policy"]
    unfiltered = SamplingPolicy({**policy.defaults, "top_p": 1.0}, policy.ranges).unfiltered()
    return make_package(serving={"vocabulary_parallel_sampling": True}, policy=unfiltered)


@pytest.fixture(scope="session")
def contradicting_package(make_package: Callable[..., Path], package_parts: dict[str, Any]) -> Path:
    """An older export: vocabulary-parallel sampling with filter ranges (top_k, top_p) in its policy.

    Its defaults enable no filter, so `flare run --sampling-policy unfiltered` can serve it.
    """
    policy = package_parts["policy"]
    filtered_ranges = SamplingPolicy({**policy.defaults, "top_p": 1.0}, policy.ranges)
    return make_package(serving={"vocabulary_parallel_sampling": True}, policy=filtered_ranges)


def _hf_config_json(config: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0], "hidden_act": "silu", "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }


def _write_hf_directory(
    path: Path, parts: dict[str, Any], *, config_changes: dict[str, Any] | None = None, shards: int = 1
) -> Path:
    """A directory as transformers' save_pretrained writes it (bf16 weights, optionally sharded)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**_hf_config_json(parts["config"]), **(config_changes or {})}))
    names = sorted(parts["state_dict"])
    for shard in range(shards):
        tensors = {n: parts["state_dict"][n].to(torch.bfloat16) for n in names[shard::shards]}
        save_file(tensors, str(path / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"))
    (path / "tokenizer.json").write_text(parts["tokenizer_json"])
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": parts["chat_template"]}))
    return path


@pytest.fixture(scope="session")
def make_hf_directory() -> Callable[..., Path]:
    """make_hf_directory(path, parts, *, config_changes=None, shards=1): a tiny Hugging Face model directory.

    `parts` is `package_parts` (or a variant); config_changes edits config.json.
    """
    return _write_hf_directory


@pytest.fixture(scope="session")
def tiny_hf_directory(make_hf_directory: Callable[..., Path], package_parts: dict[str, Any],
                      tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a Hugging Face directory (a source for `flare export`)."""
    return make_hf_directory(tmp_path_factory.mktemp("hf") / "tiny-llama", package_parts)


@pytest.fixture(scope="session")
def default_package() -> Path:
    """The real default model's package as `flare run` serves it (dtype auto: the GGUF's Q4_1 and
    Q8_0 blocks kept), exported once into the cache ($FLARE_CACHE_DIR or ~/.cache/flare).

    For tests marked real_model.
    """
    return default_package_path()


@pytest.fixture(scope="session")
def default_float32_package() -> Path:
    """The real default model's package in float32, for parity with float32 references."""
    return default_package_path(dtype="float32")
