"""The package manifest (`manifest.json`): what a package holds and how it is to be served.

Layout of the JSON object (format 4):

    {"format": 4,
     "model": {"config": {ModelConfig}, "provenance": {Provenance}},   (ModelConfig: model_config.py)
     "serving": {ServingConfig},
     "sampling": {"defaults": {...}, "ranges": {...}},
     "files": {"model.safetensors": "<sha256>", "tokenizer.json": ..., "chat_template.jinja": ...},
     "draft_head": {DraftHeadInfo},   (only in a package that ships a learned draft head)
     "blocks": {"<tensor name>": {"type": "Q4_1", "offset": 0, "nbytes": 207360}, ...},
                                      (only in a package that keeps quantized tensors as ggml blocks,
                                       in `model.blocks`; package.py and blocks.py)
     "dequantized": {"<tensor name>": "Q2_K", ...}}
                                      (only where export dequantized quantized source tensors: their
                                       source type, for `flare inspect`)

Formats read: 2 (provenance.name), 3 (blocks) and 4 (the model families' config fields). A
format-2 manifest has no blocks, and a format-2/3 config is a Llama one; each reads as before.
flare writes format 4.

Reading is strict: an unknown or missing key is an error naming it, so a manifest written by a
newer flare is refused rather than half understood.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flare.package.model_config import ManifestError, ModelConfig, _check_keys, _fields_of
from flare.policy.policy import PolicyError, SamplingPolicy

FORMAT_VERSION = 4  # 2: provenance.name (the model name clients use); 3: blocks; 4: model families
READ_FORMATS = (2, 3, 4)
MANIFEST_NAME = "manifest.json"
DTYPES = ("float32", "bfloat16", "float16")
# What `flare export --dtype` takes besides DTYPES: float16, or bfloat16 for weights beyond
# float16's range (`export.resolve_dtype`); a manifest always names the stored one.
AUTO_DTYPE = "auto"
# What `flare export --quantize` takes (quantize.py): a Hugging Face directory's float weights
# as ggml blocks. Kept here, free of torch, for the command line.
QUANTIZE_TYPES = ("q8_0", "q4_0", "q4_k_m")
# What `flare run --weight-format` takes: auto (the fastest this CPU runs for the stored dtype),
# or a format named as the dtype it multiplies in (flare/engine/precision.py). Kept here, free of
# torch, so that the command line parses without loading it.
WEIGHT_FORMATS = (AUTO_DTYPE, *DTYPES)
# What `flare run --kv-cache-dtype` takes: the KV cache stores keys and values in one of the
# package dtypes (the engine computes in float32 whatever it stores; flare/engine/native.py).
KV_CACHE_DTYPES = DTYPES
# What ggml block weights multiply: the float32 activations themselves (exact), or 8-bit
# activation blocks with integer dot products, two per 32 activations (int8x2: a value and its
# residual, ~15 bits) or one (int8) (flare/engine/quantized.py, docs/benchmarks.md).
ACTIVATIONS = ("float32", "int8x2", "int8")
# What `flare run --activations` takes: one of ACTIVATIONS, or auto (the default), the fastest
# that meets the fidelity bar for the package's block types (`auto_activations`).
ACTIVATION_CHOICES = ("auto", *ACTIVATIONS)
# The K-quant block types: their integer products read 256-value Q8_K activation blocks.
K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# The block types with integer kernels (flare/engine/csrc/integer_linear.c for the 32-value ones,
# integer_kquants.c for the K types): what int8 reaches.
INTEGER_ACTIVATION_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Bytes of 32-value blocks from which `auto_activations` takes int8x2 for them: between the two
# sizes measured, the default package's 96 MB (float32 the faster at one row) and a 1B model's
# 1.3 GB of Q8_0 (the two level at one row).
INTEGER_FROM_BYTES = 512 << 20
# auto: the package's draft head, with n-gram lookup beside it for rows whose text repeats
# (scheduler/speculation/draft_planner.py, `DraftPlanner`); n-gram lookup alone in a package
# without a head. What a package exported with a head serves by default.
DRAFTERS = ("ngram", "mtp", "auto")
# The longest context flare serves: RoPE's positions are float32 (as transformers computes them),
# and float32 holds every integer only up to 2^24, so past it positions would share angles. It is
# above what any released model declares; a source declaring more is refused at export.
MAX_CONTEXT = 1 << 24
MAX_CONTEXT_REASON = "2^24: RoPE's float32 positions are exact up to there; the longest real models declare about 10^7"
HEAD_DTYPES = ("float32", "bfloat16", "float16")
# What a draft head's first step reads of the target at the previous position: its residual
# stream after the last layer (the heads flare distills), or that stream after the target's final
# norm (the input of the DeepSeek-V3-style MTP layers a checkpoint may ship).
HEAD_TARGET_HIDDEN = ("residual", "final_norm")
# The decoder layer a draft head runs (`draft_head.head_layer_config`): a Llama layer whatever the
# target's family (the heads flare distills, and MTP layers in that layout), or one of the
# target's own layers, its attention (latent for DeepSeek) and its MLP (a mixture of experts where
# the target's last layer is one): a DeepSeek-V3 checkpoint's MTP layer.
HEAD_LAYERS = ("llama", "target")
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class ServingConfig:
    """How the package is to be served.

    draft_tokens is K, the number of tokens the drafter proposes per speculative round
    (0 disables speculation). vocabulary_parallel_sampling says the package was prepared for the
    vocabulary-sharded sampler, which supports unfiltered distributions only (docs/sampling.md).
    """

    max_context: int
    max_concurrency: int = 32
    dtype: str = "float32"
    vocabulary_parallel_sampling: bool = False
    draft_tokens: int = 4
    drafter: str = "ngram"

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_context", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.max_context > MAX_CONTEXT:
            problems.append(
                f"max_context {self.max_context} is beyond the longest context flare serves, {MAX_CONTEXT} tokens "
                f"({MAX_CONTEXT_REASON})"
            )
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.vocabulary_parallel_sampling, bool):
            problems.append("vocabulary_parallel_sampling must be true or false")
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            problems.append(f"draft_tokens must be an integer from 0 (no speculation) to {MAX_DRAFT_TOKENS}, got {k!r}")
        if self.drafter not in DRAFTERS:
            problems.append(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if problems:
            raise ManifestError("serving: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> ServingConfig:
        return cls(**_fields_of(cls, data, "serving"))


@dataclass(frozen=True)
class Provenance:
    """Where the weights came from and what made the package."""

    name: str  # the model name clients send (`model` in requests) unless --served-model-name says otherwise
    source: str  # what the operator passed to `flare export` (a path, or "default")
    source_format: str  # "gguf" or "huggingface"
    source_sha256: str | None  # of the GGUF file; None for a directory source
    recipe: str  # the sampling/serving recipe used
    flare_version: str
    created: str  # ISO 8601, UTC

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Provenance:
        return cls(**_fields_of(cls, data, "model.provenance"))


@dataclass(frozen=True)
class HeldOutAcceptance:
    """Measured at export on prompts the head was not trained on, greedy: `per_step[j]` is the
    share of positions where the first j + 1 draft steps all equal the target's argmax, and
    `tokens_per_round` = 1 + sum(per_step), the expected tokens a verification round emits at K."""

    per_step: tuple[float, ...]
    tokens_per_round: float
    positions: int


@dataclass(frozen=True)
class DraftHeadInfo:
    """The manifest's `draft_head` object."""

    draft_tokens: int  # K the head was trained to unroll
    draft_vocab_size: int
    parameters: int
    dtype: str
    prompt_set: str  # name and size of the shipped prompt set it was distilled on
    budget: dict[str, Any] = field(default_factory=dict)  # tokens, seconds, seed as asked
    trained: dict[str, Any] = field(default_factory=dict)  # tokens generated, positions trained, seconds
    held_out: HeldOutAcceptance | None = None
    target_hidden: str = "residual"  # HEAD_TARGET_HIDDEN
    imported_from: str | None = None  # the checkpoint MTP layer the head was read from, if not distilled
    layer: str = "llama"  # HEAD_LAYERS

    def __post_init__(self) -> None:
        problems = []
        if self.layer not in HEAD_LAYERS:
            problems.append(f"layer must be one of {', '.join(HEAD_LAYERS)}, got {self.layer!r}")
        if self.target_hidden not in HEAD_TARGET_HIDDEN:
            problems.append(f"target_hidden must be one of {', '.join(HEAD_TARGET_HIDDEN)}, got {self.target_hidden!r}")
        if self.dtype not in HEAD_DTYPES:
            problems.append(f"dtype must be one of {', '.join(HEAD_DTYPES)}, got {self.dtype!r}")
        for name in ("draft_tokens", "draft_vocab_size", "parameters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            raise ManifestError("draft_head: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.held_out is not None:
            data["held_out"]["per_step"] = list(self.held_out.per_step)
        return data

    @classmethod
    def from_json(cls, data: Any) -> DraftHeadInfo:
        if not isinstance(data, dict):
            raise ManifestError(f"draft_head must be an object, got {type(data).__name__}")
        expected = {f.name for f in dataclasses.fields(cls)}
        # Keys added after the first packages with a head may be absent: their defaults hold.
        optional = {"target_hidden", "imported_from", "layer"}
        unknown, missing = sorted(set(data) - expected), sorted(expected - set(data) - optional)
        if unknown or missing:
            raise ManifestError(f"draft_head: unknown key(s) {unknown}, missing key(s) {missing}")
        values = dict(data)
        held = values.get("held_out")
        if held is not None:
            try:
                values["held_out"] = HeldOutAcceptance(
                    per_step=tuple(float(x) for x in held["per_step"]),
                    tokens_per_round=float(held["tokens_per_round"]),
                    positions=int(held["positions"]),
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ManifestError(f"draft_head.held_out: {error}") from None
        return cls(**values)


@dataclass(frozen=True)
class BlockEntry:
    """Where one quantized tensor's ggml blocks lie in `model.blocks`, and their ggml type
    (a `gguf.GGMLQuantizationType` name; blocks.py checks it against the types the engine
    multiplies). The tensor's shape is the model config's (`package.expected_weight_shapes`)."""

    type: str
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.type, str) or not self.type:
            problems.append(f"type must be a ggml type name, got {self.type!r}")
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if problems:
            raise ManifestError("; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    serving: ServingConfig
    sampling: SamplingPolicy
    provenance: Provenance
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256 hex
    format: int = FORMAT_VERSION
    draft_head: DraftHeadInfo | None = None  # the learned draft head the package ships, if any
    # Quantized tensors kept as ggml blocks (`model.blocks`), by tensor name; empty for a package
    # whose every weight is in model.safetensors.
    blocks: dict[str, BlockEntry] = field(default_factory=dict)
    # Tensors the source stored quantized that export dequantized (a --dtype asked for floats, or
    # their type has no kernel), with their source type name.
    dequantized: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.serving.drafter == "mtp" and self.draft_head is None:
            raise ManifestError("serving.drafter is mtp but the package ships no draft head (draft_head)")
        if self.draft_head is not None and self.draft_head.draft_tokens < self.serving.draft_tokens:
            raise ManifestError(
                f"serving.draft_tokens {self.serving.draft_tokens} exceeds the {self.draft_head.draft_tokens} "
                "draft steps the draft head was trained for"
            )
        if self.serving.max_context > self.model.max_position_embeddings:
            raise ManifestError(
                f"serving.max_context {self.serving.max_context} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}"
            )
        max_tokens_range = self.sampling.ranges.get("max_tokens")
        if self.sampling.defaults["max_tokens"] > self.serving.max_context or (
            max_tokens_range is not None and max_tokens_range[1] > self.serving.max_context
        ):
            raise ManifestError(
                f"sampling max_tokens (default or range) exceeds serving.max_context {self.serving.max_context}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "model": {"config": self.model.to_json(), "provenance": self.provenance.to_json()},
            "serving": self.serving.to_json(),
            "sampling": self.sampling.to_json(),
            "files": dict(sorted(self.files.items())),
            **({"draft_head": self.draft_head.to_json()} if self.draft_head is not None else {}),
            **({"blocks": {name: entry.to_json() for name, entry in self.blocks.items()}} if self.blocks else {}),
            **({"dequantized": dict(self.dequantized)} if self.dequantized else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(data).__name__}")
        version = data.get("format")
        if version not in READ_FORMATS or isinstance(version, bool):
            raise ManifestError(
                f"manifest format {version!r} is not supported by this flare (it reads formats "
                f"{', '.join(map(str, READ_FORMATS))}); re-export the package with this flare"
            )
        # draft_head and blocks are optional: a package without them reads as before.
        optional = {"draft_head": None, "blocks": None, "dequantized": None}
        if version < 3 and ("blocks" in data or "dequantized" in data):
            raise ManifestError(f"manifest format {version} cannot have blocks (format 3 added them)")
        _check_keys({**optional, **data}, {"format", "model", "serving", "sampling", "files", *optional}, "manifest")
        dequantized = data.get("dequantized") or {}
        if not isinstance(dequantized, dict) or not all(isinstance(v, str) for v in dequantized.values()):
            raise ManifestError("manifest key 'dequantized' must map tensor names to ggml type names")
        model = data["model"]
        if not isinstance(model, dict):
            raise ManifestError("manifest key 'model' must be an object")
        _check_keys(model, {"config", "provenance"}, "model")
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ManifestError("manifest key 'files' must map file names to sha256 strings")
        try:
            sampling = SamplingPolicy.from_json(data["sampling"])
        except PolicyError as error:
            raise ManifestError(f"sampling: {error}") from None
        return cls(
            model=ModelConfig.from_json(model["config"], version),
            serving=ServingConfig.from_json(data["serving"]),
            sampling=sampling,
            provenance=Provenance.from_json(model["provenance"]),
            files=dict(files),
            format=version,
            draft_head=DraftHeadInfo.from_json(data["draft_head"]) if data.get("draft_head") is not None else None,
            blocks=_blocks_from_json(data.get("blocks")),
            dequantized=dict(dequantized),
        )

    @classmethod
    def loads(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ManifestError(f"manifest is not valid JSON: {error}") from None
        return cls.from_json(data)


def _blocks_from_json(data: Any) -> dict[str, BlockEntry]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ManifestError(f"blocks must be an object, got {type(data).__name__}")
    entries = {}
    for name, entry in data.items():
        values = _fields_of(BlockEntry, entry, f"blocks.{name}")
        try:
            entries[name] = BlockEntry(**values)
        except ManifestError as error:
            raise ManifestError(f"blocks.{name}: {error}") from None
    return entries




def auto_activations(weight_types: Mapping[str, Mapping[str, int]]) -> str:
    """What `--activations auto` multiplies a package's blocks by, from its weights' stored types
    (ggml names, each with its `bytes`: `directory.weight_types`): int8x2 where K-quant blocks are
    among them (a Q4_K_M file) or where the 32-value blocks weigh INTEGER_FROM_BYTES or more (a
    Q8_0 or Q4_0 file of a 1B model), float32 otherwise (the default package's 96 MB of Q4_1 and
    Q8_0). Both meet issue 38's fidelity bar. int8x2 is the faster on K types from one row to 64;
    on the 32-value types a one-row decode round of a small model is bound by its products, where
    int8x2's unpacking costs more than float32's, and of a large one by reading the weights, where
    the two are level, while from a few rows on int8x2 is the faster at any size
    (docs/benchmarks.md, "Integer activations")."""
    if set(K_QUANT_TYPES) & set(weight_types):
        return "int8x2"
    integer = sum(entry["bytes"] for kind, entry in weight_types.items() if kind in INTEGER_ACTIVATION_TYPES)
    return "int8x2" if integer >= INTEGER_FROM_BYTES else "float32"
