"""What a source claims against what it holds (issue 40, items 3 and 4): a layer count its tensors
do not back, missing tensors by the dozen, a context no model has. `flare export` refuses each
at once, in one line (or a list capped at 20), whatever the claim; nothing scales with it. The
command runs in this process (tests/preparation/test_gguf_malformed.py runs it once as a subprocess)."""

from __future__ import annotations

import json
import subprocess
import time
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import save_file
from tests.gguf_writer import tiny_vocabulary, write_family_gguf
from tests.package_commands import export_printed

from flare.package.manifest import MAX_CONTEXT
from flare.package.problems import MAX_LISTED
from flare.preparation.gguf_source import open_gguf
from flare.preparation.hf_source import open_hf_directory
from flare.preparation.source import SourceError

U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def tiny_llama(layers: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny random Llama checkpoint of `layers` layers and the tiny vocabulary."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tiny_vocabulary()[0]), max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).state_dict()


def hf_directory(path: Path, config: Any, state: dict[str, torch.Tensor]) -> Path:
    """The checkpoint as a Hugging Face directory: config.json and its weights (no tokenizer:
    the refusals come first)."""
    path.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


def refusal_lines(result: subprocess.CompletedProcess[str], out: Path) -> list[str]:
    """stderr of a refused export, which wrote nothing."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return result.stderr.strip().splitlines()


@pytest.mark.parametrize("claimed", [10**6, 4 * 10**6])
def test_a_gguf_claiming_millions_of_layers_is_refused_at_once_in_one_line(
    claimed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "layers.gguf"
    write_family_gguf(source, *tiny_llama(2), metadata={"llama.block_count": (claimed, U32)})
    message = f"the file claims {claimed} layers (llama.block_count) but holds tensors for 2"
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(SourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
            open_gguf(source)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 5 and peak < 64 * 2**20, (elapsed, peak)
    (line,) = refusal_lines(export_printed(capsys, source, tmp_path / "package"), tmp_path / "package")
    assert line == f"flare export: error: {source}: {message}"


def test_a_hugging_face_directory_claiming_more_layers_than_it_holds_is_refused(tmp_path: Path) -> None:
    config, state = tiny_llama(2)
    config.num_hidden_layers = 10**9
    directory = hf_directory(tmp_path / "model", config, state)
    with pytest.raises(SourceError, match=r"config.json claims 1000000000 layers \(num_hidden_layers\) but the weights hold tensors for 2"):
        open_hf_directory(directory)


def test_a_source_missing_dozens_of_tensors_lists_twenty_and_how_many_more(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "missing.gguf"
    # Each of the 4 layers keeps its attn_norm (so it is held) and loses the 8 other tensors.
    write_family_gguf(
        source, *tiny_llama(4), tensors={f"blk.{i}.{name}.weight": None for i in range(4) for name in LAYER_TENSORS}
    )
    lines = refusal_lines(export_printed(capsys, source, tmp_path / "package"), tmp_path / "package")
    assert lines[0] == f"flare export: error: the tensors of {source} do not match its metadata:"
    assert len(lines) == 1 + MAX_LISTED + 1, lines
    assert lines[1] == "  - weight model.layers.0.self_attn.q_proj.weight (blk.0.attn_q.weight) is missing"
    assert all(line.startswith("  - weight model.layers.") and line.endswith(" is missing") for line in lines[1:-1])
    assert lines[-1] == f"  - and {4 * len(LAYER_TENSORS) - MAX_LISTED} more"


@pytest.mark.parametrize("context", [1 << 40, 1 << 28, MAX_CONTEXT + 1])
def test_an_implausible_context_is_refused_at_export_in_one_line_naming_the_key_and_the_bound(
    context: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "context.gguf"
    write_family_gguf(source, *tiny_llama(2), metadata={"llama.context_length": (context, U64)})
    (line,) = refusal_lines(export_printed(capsys, source, tmp_path / "package"), tmp_path / "package")
    assert f"the GGUF metadata key llama.context_length is {context}" in line, line
    assert f"beyond the longest context flare serves, {MAX_CONTEXT} tokens (2^24:" in line, line


def test_the_longest_context_a_real_model_declares_is_served(tmp_path: Path) -> None:
    """Llama 4 Scout declares 10,485,760 tokens: within the bound."""
    source = tmp_path / "context.gguf"
    write_family_gguf(source, *tiny_llama(2), metadata={"llama.context_length": (10_485_760, U32)})
    assert open_gguf(source).config.max_position_embeddings == 10_485_760


def test_a_hugging_face_config_with_an_implausible_context_is_refused_naming_the_key(tmp_path: Path) -> None:
    config, state = tiny_llama(2)
    config.max_position_embeddings = 1 << 40
    directory = hf_directory(tmp_path / "model", config, state)
    with pytest.raises(SourceError, match=f"config.json: max_position_embeddings {1 << 40} is beyond the longest context flare serves, {MAX_CONTEXT} tokens"):
        open_hf_directory(directory)
