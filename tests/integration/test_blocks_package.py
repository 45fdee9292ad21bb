"""A package that keeps a GGUF's quantized blocks, served by the real daemon: it answers as the
--dtype float32 package of the same GGUF does, and reports its tensor types and bytes in the
engine_loaded log line and `flare ctl status`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

from flare.engine import native_quantized
from flare.preparation.export import ExportOptions, export_package

from tests.package.test_blocks import every_type_gguf  # noqa: E402  (the every-type GGUF of the export tests)

CHAT = {"messages": [{"role": "user", "content": "the the the"}], "temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def packages(tiny_config: Any, make_state_dict: Any) -> Iterator[dict[str, Path]]:
    from dataclasses import replace

    from tests.preparation.test_gguf_source import tiny_vocabulary

    # AF_UNIX paths are limited to 108 bytes: a short directory rather than pytest's tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="flare-blocks-", dir="/tmp"))
    config = replace(
        tiny_config, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
        vocab_size=len(tiny_vocabulary()[0]),
    )
    every_type_gguf(workdir / "wide.gguf", config, make_state_dict)
    export_package(str(workdir / "wide.gguf"), workdir / "blocks", ExportOptions())
    export_package(str(workdir / "wide.gguf"), workdir / "float32", ExportOptions(dtype="float32"))
    yield {"blocks": workdir / "blocks", "float32": workdir / "float32", "control": workdir / "control.sock"}
    shutil.rmtree(workdir)


def greedy_answer(daemon: DaemonProcess) -> str:
    body = {**CHAT, "model": daemon.model_name()}
    response = httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_a_blocks_package_serves_the_answer_of_its_float32_package_and_reports_its_types(packages: dict[str, Path]) -> None:
    daemon = start_daemon(packages["float32"], ["--max-concurrency", "2"])
    try:
        expected = greedy_answer(daemon)
    finally:
        assert daemon.stop() == 0, daemon.log()
    daemon = start_daemon(packages["blocks"], ["--max-concurrency", "2", "--control-socket", str(packages["control"])])
    try:
        assert greedy_answer(daemon) == expected
        (loaded,) = daemon.events("engine_loaded")
        types = loaded["weight_types"]
        assert types["Q6_K"]["tensors"] == 4 and types["F32"]["tensors"] == 6  # 5 norms and a dequantized Q2_K
        assert set(types) == {"F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
        # The Q2_K tensor had no kernel: the operator is told, with the export that stores it as blocks.
        (warned,) = daemon.events("weights_dequantized")
        assert (warned["level"], warned["tensors"], warned["types"]) == ("warning", 1, "Q2_K")
        assert "flare export --quantize q8_0" in warned["message"]
        ctl = [sys.executable, "-m", "flare.cli.main", "ctl", "--socket", str(packages["control"])]
        status = json.loads(subprocess.run([*ctl, "--json", "status"], capture_output=True, text=True, check=True).stdout)
        assert status["weight_types"] == types
        table = subprocess.run([*ctl, "status"], capture_output=True, text=True, check=True).stdout
        (line,) = [line for line in table.splitlines() if line.startswith("weight types")]
        assert "Q8_0 1 tensor " in line and "MXFP4 1 tensor " in line and "Q6_K 4 tensors " in line
        # The default, auto: int8x2 activations, as K-quant blocks are among the types.
        assert loaded["activations"] == status["activations"] == "int8x2"
        assert "GEMMs, int8x2 activations" in table
        # The instructions the integer products run on, after what this CPU and its OS grant.
        assert loaded["integer_level"] == native_quantized.integer_level_name()
        # The dequantized Q2_K tensor is float: the layers run in one call only where the CPU's
        # weight format for float tensors is float16 (the engine's own kernel).
        one_call = "one call" if loaded["weight_format"] == "float16" else "steps: a linear layer is neither float16 nor ggml blocks"
        assert loaded["layer_calls"] == (one_call if loaded["native_kernels"] else "steps: the C kernels do not run")
        assert status["layer_calls"] == loaded["layer_calls"]
        (layers,) = [line for line in table.splitlines() if line.startswith("layers ")]
        assert layers.split(None, 1)[1] == loaded["layer_calls"]
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_activations_float32_serve_the_float32_packages_answer_and_say_so(packages: dict[str, Path]) -> None:
    daemon = start_daemon(packages["float32"], ["--max-concurrency", "2"])
    try:
        expected = greedy_answer(daemon)
        (loaded,) = daemon.events("engine_loaded")
        assert loaded["activations"] == "float32"  # no blocks: nothing to quantize
        assert daemon.events("weights_dequantized") == []  # dequantized because --dtype asked for floats
    finally:
        assert daemon.stop() == 0, daemon.log()
    control = packages["control"].with_name("control-float32.sock")
    daemon = start_daemon(packages["blocks"], ["--activations", "float32", "--control-socket", str(control)])
    try:
        assert greedy_answer(daemon) == expected
        (loaded,) = daemon.events("engine_loaded")
        ctl = [sys.executable, "-m", "flare.cli.main", "ctl", "--socket", str(control)]
        status = json.loads(subprocess.run([*ctl, "--json", "status"], capture_output=True, text=True, check=True).stdout)
        assert loaded["activations"] == status["activations"] == "float32"
        assert loaded["integer_level"] == "none"
    finally:
        assert daemon.stop() == 0, daemon.log()
    inspected = subprocess.run(
        [sys.executable, "-m", "flare.cli.main", "inspect", str(packages["blocks"])], capture_output=True, text=True, check=True
    ).stdout
    assert (
        "activations         int8x2; integer kernels for Q4_0 Q4_1 Q4_K Q5_0 Q5_1 Q5_K Q6_K Q8_0 "
        "(flare run --activations float32 for exact float32 activations)"
    ) in inspected


def test_flare_run_refuses_blocks_with_a_nan_scale_naming_the_tensor_without_a_traceback(packages: dict[str, Path]) -> None:
    import numpy as np

    from flare.package.blocks import BLOCKS_NAME
    from flare.package.directory import sha256_of

    package = packages["blocks"].parent / "nan-scale"
    shutil.copytree(packages["blocks"], package)
    manifest = json.loads((package / "manifest.json").read_text())
    entry = manifest["blocks"]["model.embed_tokens.weight"]  # Q8_0: d at byte 0 of 34
    raw = bytearray((package / BLOCKS_NAME).read_bytes())
    raw[entry["offset"] + 34 * 5 : entry["offset"] + 34 * 5 + 2] = np.array([np.inf], np.float16).tobytes()
    (package / BLOCKS_NAME).write_bytes(bytes(raw))
    manifest["files"][BLOCKS_NAME] = sha256_of(package / BLOCKS_NAME)
    (package / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run(
        [sys.executable, "-m", "flare.cli.main", "run", str(package), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "tensor model.embed_tokens.weight: 1 block(s) have a NaN or infinite scale" in output
    assert "Traceback" not in output
