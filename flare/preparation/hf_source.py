"""A Hugging Face model directory as a package source.

The directory holds `config.json` (a Llama model), one or more `*.safetensors` files,
`tokenizer.json`, and the chat template in `tokenizer_config.json` (or `chat_template.jinja`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from flare.preparation.manifest import ManifestError, ModelConfig
from flare.preparation.package import weight_problems
from flare.preparation.source import ModelSource, SourceError


def open_hf_directory(path: Path, source: str | None = None) -> ModelSource:
    """Read a Hugging Face model directory's config, tokenizer and chat template (not its weights)."""
    path = Path(path)
    config_data = _read_json(path / "config.json", required=True)
    config = model_config_from_hf(config_data, _read_json(path / "generation_config.json", required=False))
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise SourceError(f"{path} holds no *.safetensors weights; flare reads safetensors only (not .bin or .pt)")
    shapes = _tensor_shapes(weight_files)
    tied_copy = config.tie_word_embeddings and "lm_head.weight" in shapes
    problems = weight_problems(config, {n: s for n, s in shapes.items() if not (tied_copy and n == "lm_head.weight")})
    if problems:
        raise SourceError(
            f"the weights in {path} do not match its config.json:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SourceError(f"{path} has no tokenizer.json; save the tokenizer with a fast (tokenizers) backend")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")

    def read_weights(progress: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
        return _read_weights(weight_files, len(shapes), drop_lm_head=tied_copy, progress=progress)

    return ModelSource(
        name=path.resolve().name,
        source=source if source is not None else str(path),
        source_format="huggingface",
        source_sha256=None,
        config=config,
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(path),
        read_weights=read_weights,
    )


def model_config_from_hf(data: dict[str, Any], generation: dict[str, Any] | None) -> ModelConfig:
    """ModelConfig from a Hugging Face LlamaConfig's JSON; SourceError for anything flare cannot run."""
    model_type = data.get("model_type")
    if model_type != "llama":
        raise SourceError(
            f"config.json describes a {model_type!r} model; flare serves Llama-family models only (model_type 'llama')"
        )
    unsupported = []
    rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        unsupported.append(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}")
    if data.get("attention_bias") or data.get("mlp_bias"):
        unsupported.append("bias terms in attention or MLP")
    if data.get("hidden_act", "silu") != "silu":
        unsupported.append(f"activation {data['hidden_act']!r}")
    if unsupported:
        raise SourceError(f"config.json asks for {', '.join(unsupported)}, which flare's Llama does not implement")
    eos: list[int] = []
    for source in (data, generation or {}):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if token not in eos:
                eos.append(int(token))
    try:
        heads = int(data["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
            rope_theta=float(data.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(data["max_position_embeddings"]),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )
    except KeyError as error:
        raise SourceError(f"config.json lacks {error.args[0]!r}") from None
    except ManifestError as error:
        raise SourceError(f"config.json: {error}") from None


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise SourceError(
                f"{path.parent} has no {path.name}; give a GGUF file, a Hugging Face model directory, or 'default'"
            )
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SourceError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path} must hold a JSON object")
    return data


def _chat_template(path: Path) -> str:
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json", required=False).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise SourceError(
            f"{path} has no chat template (tokenizer_config.json chat_template, or chat_template.jinja); "
            "flare serves chat models only"
        )
    return template


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as error:
            raise SourceError(f"{file} is not a readable safetensors file: {error}") from None
    return shapes


def _read_weights(
    files: list[Path], total: int, *, drop_lm_head: bool, progress: Callable[[int, int], None]
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    done = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not (drop_lm_head and name == "lm_head.weight"):
                    state[name] = f.get_tensor(name).to(torch.float32)
                done += 1
                progress(done, total)
    return state
