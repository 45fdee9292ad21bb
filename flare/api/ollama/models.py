"""What Ollama's model endpoints answer about the one served package: `/api/tags` (each served
name), `/api/show` (its details, parameters and capabilities) and `/api/ps` (the loaded model).

Ollama's fields that describe its own model store are given their nearest truth: `digest` names
the package (its path's sha256), not its content; `size` is the package's files; `modified_at`
is its directory's time; `expires_at` is far off, as the model stays loaded while the daemon
runs. `/api/show` has no `modelfile` and no `template` (the package's chat template is Jinja,
not Ollama's Go template); its `parameters` are the package policy's defaults under Ollama's
option names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flare.api.ollama.parse import SAMPLING_OPTIONS

# The model never unloads while the daemon runs; Ollama's clients read a time, so a far one.
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
# What the served model does, in Ollama's words: text completion and tool calls.
CAPABILITIES = ("completion", "tools")


@dataclass(frozen=True)
class ModelFacts:
    architecture: str  # the package's decoder family (manifest model.architecture)
    dtype: str  # the weights' stored dtype
    context_length: int  # the served context in tokens
    size: int  # bytes of the package's files
    modified: float  # seconds since the epoch
    digest: str


def tagged(name: str) -> str:
    """The name as Ollama lists it: with a tag, `:latest` when it has none."""
    return name if ":" in name else f"{name}:latest"


def _details(facts: ModelFacts) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "flare",
        "family": facts.architecture,
        "families": [facts.architecture],
        "parameter_size": "",
        "quantization_level": facts.dtype,
    }


def _modified_at(facts: ModelFacts) -> str:
    return datetime.fromtimestamp(facts.modified, UTC).isoformat().replace("+00:00", "Z")


def model_entry(name: str, facts: ModelFacts) -> dict[str, Any]:
    """One model of /api/tags."""
    return {
        "name": tagged(name),
        "model": tagged(name),
        "modified_at": _modified_at(facts),
        "size": facts.size,
        "digest": facts.digest,
        "details": _details(facts),
    }


def running_entry(name: str, facts: ModelFacts) -> dict[str, Any]:
    """The loaded model of /api/ps."""
    return {
        "name": tagged(name),
        "model": tagged(name),
        "size": facts.size,
        "digest": facts.digest,
        "details": _details(facts),
        "expires_at": NEVER_EXPIRES,
        "size_vram": facts.size,
        "context_length": facts.context_length,
    }


def show_body(facts: ModelFacts, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """/api/show: `parameters` as Ollama writes them, one `name value` a line."""
    option_of = {field: option for option, field in SAMPLING_OPTIONS.items()}
    parameters = "\n".join(f"{option_of[field]} {value}" for field, value in defaults.items() if field in option_of)
    return {
        "template": "",
        "parameters": parameters,
        "details": _details(facts),
        "model_info": {
            "general.architecture": facts.architecture,
            f"{facts.architecture}.context_length": facts.context_length,
        },
        "capabilities": list(CAPABILITIES),
        "modified_at": _modified_at(facts),
    }
