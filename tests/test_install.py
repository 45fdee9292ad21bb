"""What a fresh machine installs is what was tested, and the suite shadows nothing it installs.

The lock (lock/*.txt, `make lock`) fixes every distribution's version; `make test` installs it.
The suite is one package, `tests`, reached from the repository root only: a test folder put on
`sys.path` under its bare name once answered for the Hub's `kernels` library that transformers
probes for, and broke every test that built a transformers model.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPOSITORY

ROOT = Path(REPOSITORY)
TESTS = ROOT / "tests"

# Top-level modules of the Hub and ML libraries that look each other up by name to switch on
# optional paths: a folder or module of ours under one of these names would answer for it.
KNOWN_PROBED_NAMES = frozenset({
    "kernels", "engine", "datasets", "evaluate", "tokenizers", "accelerate", "peft", "bitsandbytes",
    "deepspeed", "flash_attn", "xformers", "vllm", "sglang", "triton", "optimum", "timm", "torchvision",
    "torchaudio", "sentencepiece", "safetensors", "diffusers", "transformers", "huggingface_hub",
    "hf_xet", "apex", "liger_kernel", "mamba_ssm", "causal_conv1d", "gguf", "llama_cpp", "onnxruntime",
    "tensorflow", "jax", "flax", "keras", "scipy", "sklearn", "pandas", "numpy", "torch", "models",
    "utils", "quantization", "integrations",
})


def site_packages() -> list[str]:
    return [path for path in (*site.getsitepackages(), site.getusersitepackages()) if Path(path).is_dir()]


def in_checkout(path: str) -> bool:
    """Whether `path` lies in this checkout's own files (its virtual environment is not one)."""
    resolved = Path(path).resolve()
    return resolved.is_relative_to(ROOT) and not resolved.is_relative_to(ROOT / ".venv")


def checkout_paths(path: list[str]) -> list[Path]:
    """The entries of `path` that are folders of this checkout."""
    return [Path(entry or ".").resolve() for entry in path if Path(entry or ".").is_dir() and in_checkout(entry or ".")]


def top_level_names(entry: Path) -> set[str]:
    """Every top-level name `entry` makes importable: packages, namespace folders and modules."""
    names = set()
    for child in entry.iterdir():
        name = child.stem if child.suffix == ".py" else child.name
        if (child.is_dir() or child.suffix == ".py") and name.isidentifier():
            names.add(name)
    return names


def shadowing(path: list[str]) -> dict[str, str]:
    """The names a checkout entry of `path` makes importable that are a distribution's, the standard
    library's or a known probed name, each with why; and any test folder on `path` at all."""
    found = {}
    installed = site_packages()
    for entry in checkout_paths(path):
        if entry.is_relative_to(TESTS):
            found[str(entry)] = "a test folder is on sys.path"
        for name in top_level_names(entry) - {"flare"}:
            if name in sys.stdlib_module_names:
                found[name] = f"the standard library's, from {entry}"
            elif name in KNOWN_PROBED_NAMES:
                found[name] = f"a known probed name, from {entry}"
            elif importlib.machinery.PathFinder.find_spec(name, installed) is not None:
                found[name] = f"an installed distribution's, from {entry}"
    return found


def test_no_test_folder_or_module_is_importable_under_a_name_a_distribution_could_answer_to() -> None:
    assert shadowing(sys.path) == {}
    # Every test folder is reached as a part of `tests`, and `tests` is the checkout's own.
    assert importlib.util.find_spec("tests").origin == str(TESTS / "__init__.py")
    for folder in (path for path in TESTS.rglob("*") if path.is_dir() and (path / "__init__.py").is_file()):
        spec = importlib.util.find_spec(folder.name)
        locations = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
        assert not any(Path(location).resolve().is_relative_to(TESTS) for location in locations if location), (
            f"tests/{folder.relative_to(TESTS)} is importable as {folder.name!r}"
        )


def test_the_hub_kernels_probe_of_transformers_finds_the_installed_library_not_a_test_folder() -> None:
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not in_checkout(spec.origin or "/")
    pytest.importorskip("transformers")
    # transformers imports `kernels` whenever find_spec finds one (transformers 5.25).
    importlib.import_module("transformers.integrations.hub_kernels")


def test_a_subprocess_that_imports_the_suite_as_the_forced_dispatch_tests_do_shadows_nothing() -> None:
    script = (
        f"import sys, json; sys.path.insert(0, {REPOSITORY!r})\n"
        "from tests.test_install import shadowing\n"
        "import tests.engine.tiny_llama\n"
        "print(json.dumps(shadowing(sys.path)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/")
    assert json.loads(result.stdout) == {}


def test_a_test_folder_planted_on_the_path_is_found() -> None:
    """The check above can fail: a test folder on the path, and a module named like a distribution."""
    assert str(TESTS / "engine") in shadowing([str(TESTS / "engine")])
    assert "engine" in shadowing([str(TESTS)])


def locked_versions(lock: Path) -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", lock.read_text(), re.M)
    return {name.lower().replace("_", "-"): version for name, version in pins}


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(), reason="the suite runs outside `make test`'s venv")
def test_the_installed_versions_are_the_locks() -> None:
    wanted = {**locked_versions(ROOT / "lock" / "test.txt"), **locked_versions(ROOT / "lock" / "model.txt")}
    installed = {
        dist.metadata["Name"].lower().replace("_", "-"): dist.version for dist in importlib.metadata.distributions()
    }
    assert {name: installed.get(name) for name in wanted if installed.get(name) != wanted[name]} == {}


def test_the_runtime_lock_is_the_test_locks_runtime() -> None:
    """`make run` and `make test` install the same runtime: every runtime pin is the test lock's."""
    run, test = locked_versions(ROOT / "lock" / "run.txt"), locked_versions(ROOT / "lock" / "test.txt")
    assert {name: (version, test.get(name)) for name, version in run.items() if test.get(name) != version} == {}
    assert run["torch"].endswith("+cpu")
