"""flare's test suite, one package: helpers are imported as `tests.<folder>.<module>`.

Nothing under tests/ is put on `sys.path` (pytest runs with `--import-mode=importlib` and the
repository root as its only path entry), so no test folder or module can shadow a distribution
that a dependency looks up by name (transformers probes for the Hub's `kernels`, say).
"""

from pathlib import Path

# What a subprocess puts on its path to import `tests.*` as the suite does.
REPOSITORY = str(Path(__file__).resolve().parents[1])
