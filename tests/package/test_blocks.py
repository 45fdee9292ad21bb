"""Packages that keep quantized tensors as ggml blocks: export from a GGUF and from a Hugging Face
directory (--quantize), served end to end as their own float32 dequantization, and bad blocks
refused naming the tensor with nothing written."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests import REPOSITORY
from flare.engine import native, native_layers, native_quantized
from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.quantized import QuantizedWeight
from flare.package.blocks import BLOCKS_NAME, E8M0_SCALE_OFFSETS, KEPT_TYPES, SCALE_OFFSETS, kernelless_tensors, map_blocks, row_bytes
from flare.preparation.export import ExportError, ExportOptions, export_package
from flare.preparation.inspect import inspect_package, render_text
from flare.package.model_config import ModelConfig
from flare.package.manifest import BlockEntry
from flare.package.directory import PackageError, open_package, sha256_of
from flare.preparation.quantize import tensor_types
from tests.package_commands import export_printed, flare_printed
from tests.preparation.test_gguf_source import tiny_vocabulary, write_tiny_gguf

T = gguf.GGMLQuantizationType
BLOCK_SIZE = 16
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42]

# Every type served from blocks, on the tensors of a two-layer model whose widths are whole
# 256-value super-blocks. Layer 1's q/k/v share Q6_K (one fused matrix over the file's bytes);
# layer 0's are three types side by side (a stacked weight), as llama.cpp's Q4_K_M mixes them.
EVERY_TYPE = {
    "model.embed_tokens.weight": T.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": T.Q4_0,
    "model.layers.0.self_attn.k_proj.weight": T.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": T.Q5_0,
    "model.layers.0.self_attn.o_proj.weight": T.Q5_1,
    "model.layers.0.mlp.gate_proj.weight": T.Q4_K,
    "model.layers.0.mlp.up_proj.weight": T.Q5_K,
    "model.layers.0.mlp.down_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.q_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.k_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.v_proj.weight": T.Q6_K,
    "model.layers.1.self_attn.o_proj.weight": T.MXFP4,
    "model.layers.1.mlp.gate_proj.weight": T.Q4_K,
    "model.layers.1.mlp.up_proj.weight": T.Q4_K,
    "model.layers.1.mlp.down_proj.weight": T.Q2_K,  # no kernel: dequantized at export
}


@pytest.fixture(scope="module")
def wide_config(tiny_config: ModelConfig) -> ModelConfig:
    return replace(
        tiny_config, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
        vocab_size=len(tiny_vocabulary()[0]),
    )


def random_blocks(kind: T, shape: tuple[int, int], seed: int, scale: float | None = None) -> np.ndarray:
    """Random blocks of `kind` for a weight [out, in] whose values spread about 1/sqrt(in): random
    quants, and float16 scales set so (values are linear in the scales) the spread comes out right
    (an E8M0 scale, MXFP4's, to the nearest power of two). `scale` forces every float16 scale to
    that value instead (NaN, inf)."""
    rng = np.random.default_rng(seed)
    width = row_bytes(kind, shape[1])
    assert width is not None
    data = rng.integers(0, 256, size=(shape[0], width), dtype=np.uint8)
    type_size = gguf.GGML_QUANT_SIZES[kind][1]
    offsets = SCALE_OFFSETS.get(kind, {T.Q2_K: (80, 82)}.get(kind, ()))
    if kind in E8M0_SCALE_OFFSETS:
        blocks = data.reshape(-1, type_size)
        blocks[:, 0] = 128  # 2^0 in gguf-py's half form
        spread = float(gguf.quants.dequantize(data, kind).std())
        blocks[:, 0] = 128 + round(np.log2(shape[1] ** -0.5 / spread))
        return data

    def set_scales(value: float) -> None:
        blocks = data.reshape(-1, type_size)
        for offset in offsets:
            blocks[:, offset : offset + 2] = np.full((blocks.shape[0], 1), value, np.float16).view(np.uint8)

    set_scales(1.0)
    spread = float(gguf.quants.dequantize(data, kind).std())
    set_scales(scale if scale is not None else shape[1] ** -0.5 / spread)
    return data


def every_type_gguf(path: Path, config: ModelConfig, make_state_dict: Any, **overrides: Any) -> dict[str, Any]:
    state = make_state_dict(config, seed=5)
    blocks = {
        name: (kind, random_blocks(kind, tuple(state[name].shape), seed=i))
        for i, (name, kind) in enumerate(EVERY_TYPE.items())
    }
    blocks.update(overrides)
    write_tiny_gguf(path, config, state, tensor_types={}, blocks=blocks)
    return blocks


def prompt_logits(model: DecoderModel, prompt: list[int] = PROMPT) -> torch.Tensor:
    cache = KVCache.for_budget(model.config, 8 * 1024**2, BLOCK_SIZE)
    rows = [ForwardRow(prompt, 0, list(range(-(-len(prompt) // BLOCK_SIZE))), num_logits=len(prompt))]
    return model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)


def greedy(model: DecoderModel, prompt: list[int] = PROMPT, new_tokens: int = 12) -> list[int]:
    cache = KVCache.for_budget(model.config, 8 * 1024**2, BLOCK_SIZE)
    table = list(range(-(-(len(prompt) + new_tokens) // BLOCK_SIZE)))
    logits = model.forward(ForwardBatch.build([ForwardRow(prompt, 0, table, num_logits=1)], BLOCK_SIZE), cache)
    out = [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        row = ForwardRow([out[-1]], len(prompt) + len(out) - 1, table, num_logits=1)
        out.append(int(model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache).argmax()))
    return out


@pytest.fixture(scope="module")
def every_type_packages(tmp_path_factory: pytest.TempPathFactory, wide_config: ModelConfig, make_state_dict: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("every-type")
    blocks = every_type_gguf(root / "wide.gguf", wide_config, make_state_dict)
    export_package(str(root / "wide.gguf"), root / "blocks", ExportOptions())
    export_package(str(root / "wide.gguf"), root / "float32", ExportOptions(dtype="float32"))
    return {"root": root, "blocks": blocks}


def test_a_gguf_exports_each_tensor_in_its_own_type_byte_for_byte(every_type_packages: dict[str, Any]) -> None:
    package = open_package(every_type_packages["root"] / "blocks")
    manifest = package.manifest
    assert manifest.serving.dtype == "float32"  # norms and the dequantized Q2_K tensor
    kept = {name: kind for name, kind in EVERY_TYPE.items() if kind in KEPT_TYPES}
    assert {name: T[entry.type] for name, entry in manifest.blocks.items()} == kept
    assert manifest.dequantized == {"model.layers.1.mlp.down_proj.weight": "Q2_K"}
    _, mapped = package.load_weights()
    for name, (kind, data) in every_type_packages["blocks"].items():
        if kind not in KEPT_TYPES:
            continue
        expected = data
        if "q_proj" in name or "k_proj" in name:  # llama.cpp's row order undone on whole block rows
            heads = 4 if "q_proj" in name else 2
            rows, width = data.shape
            expected = data.reshape(heads, rows // heads // 2, 2, width).swapaxes(1, 2).reshape(rows, width)
        assert np.array_equal(mapped[name].data.numpy(), expected), name


def test_a_blocks_package_scores_text_as_its_float32_dequantization_does(every_type_packages: dict[str, Any]) -> None:
    root = every_type_packages["root"]
    blocks_model = load_model(open_package(root / "blocks"))
    float_model = load_model(open_package(root / "float32"))
    assert isinstance(blocks_model.lm_head, QuantizedWeight) and blocks_model.lm_head is blocks_model.embed
    assert isinstance(blocks_model.layers[1].qkv, QuantizedWeight)  # Q6_K q, k, v: one matrix
    assert isinstance(blocks_model.layers[0].qkv, tuple)  # three types side by side
    # The same values, summed in another order: float32 rounding apart.
    ours, theirs = prompt_logits(blocks_model), prompt_logits(float_model)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert greedy(blocks_model) == greedy(float_model)


@pytest.fixture(scope="module")
def every_kept_type_package(tmp_path_factory: pytest.TempPathFactory, wide_config: ModelConfig, make_state_dict: Any) -> Path:
    """EVERY_TYPE with layer 1's down projection Q5_K (kept) in place of Q2_K: every linear layer
    blocks, so every layer can run as one kernel call."""
    root = tmp_path_factory.mktemp("every-kept-type")
    name = "model.layers.1.mlp.down_proj.weight"
    shape = (wide_config.hidden_size, wide_config.intermediate_size)
    every_type_gguf(root / "kept.gguf", wide_config, make_state_dict, **{name: (T.Q5_K, random_blocks(T.Q5_K, shape, seed=99))})
    export_package(str(root / "kept.gguf"), root / "blocks", ExportOptions())
    return root / "blocks"


@pytest.mark.parametrize("activations", ["float32", "int8x2", "int8"])
def test_a_blocks_package_runs_each_layer_in_one_kernel_call_with_the_bits_of_the_steps(
    every_kept_type_package: Path, monkeypatch: pytest.MonkeyPatch, activations: str
) -> None:
    # native_layers.decoder_layer multiplies each part of a layer's linear layers (three types side by
    # side in layer 0's q/k/v, one Q6_K matrix in layer 1's) with the kernels the step by step path
    # calls, in the same order: logits, greedy tokens and the KV cache are the same bits, a row's
    # bits do not depend on its batch-mates, and a row too long for the attention kernel runs the
    # steps. Under int8x2 and int8 every part takes integer products (the K types Q8_K activation
    # blocks, quantized once per layer input in both paths).
    fused = load_model(open_package(every_kept_type_package), activations=activations)
    if not native.available():
        pytest.skip("the engine's C kernels were not built")
    assert fused.kernel_layers is not None
    assert [len(layer.qkv) for layer in fused.kernel_layers] == [3, 1]
    halves = {"float32": 0, "int8x2": 2, "int8": 1}[activations]
    assert {part.halves for layer in fused.kernel_layers for part in (*layer.qkv, *layer.gate_up)} == {halves}
    steps = copy.copy(fused)
    steps.kernel_layers = None
    layer_calls = []
    run = native_layers.LayerStack.run
    monkeypatch.setattr(native_layers.LayerStack, "run", lambda stack, *args: layer_calls.extend(stack.layers) or run(stack, *args))
    assert torch.equal(prompt_logits(fused), prompt_logits(steps))
    assert greedy(fused) == greedy(steps)
    layers = fused.config.num_layers
    assert len(layer_calls) == 13 * layers  # the fused model's rounds: one of prompt logits, 12 of greedy decoding

    caches = [KVCache.for_budget(fused.config, 8 * 1024**2, BLOCK_SIZE) for _ in range(3)]
    rounds = [
        [ForwardRow(PROMPT, 0, [0], num_logits=1), ForwardRow(PROMPT[:5], 0, [1], num_logits=1)],
        [ForwardRow([7], len(PROMPT), [0], num_logits=1), ForwardRow([8, 9, 10], 5, [1], num_logits=3)],
        [ForwardRow([11], len(PROMPT) + 1, [0], num_logits=1), ForwardRow(list(range(30, 60)), 0, [2, 3], num_logits=2)],
    ]
    for rows in rounds:
        batch = ForwardBatch.build(rows, BLOCK_SIZE)
        batched = fused.forward(batch, caches[0])
        assert torch.equal(batched, steps.forward(batch, caches[1]))
        # The first row alone, in a cache of its own: the same bits as beside its batch-mates.
        assert torch.equal(fused.forward(ForwardBatch.build(rows[:1], BLOCK_SIZE), caches[2]), batched[:1])
    for fused_pool, steps_pool in zip((*caches[0].keys, *caches[0].values), (*caches[1].keys, *caches[1].values)):
        assert torch.equal(fused_pool, steps_pool)


FORCED_LAYERS_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.package.test_blocks import greedy, prompt_logits
from flare.engine import native, native_quantized
from flare.engine.model import load_model
from flare.package.directory import open_package
model = load_model(open_package({package!r}))
assert model.kernel_layers is not None
torch.save({{'isa': native_quantized.QUANTIZED_ISA, 'logits': prompt_logits(model), 'greedy': greedy(model)}}, {path!r})
"""


@pytest.mark.parametrize(("capability", "isa"), [("avx2", native.ISA_AVX2), ("default", native.ISA_PORTABLE)])
def test_the_whole_layer_path_gives_the_same_bits_under_forced_avx2_and_portable_dispatch(
    every_kept_type_package: Path, tmp_path: Path, capability: str, isa: int
) -> None:
    if not native.available():
        pytest.skip("the engine's C kernels were not built")
    path = tmp_path / "outputs.pt"
    script = FORCED_LAYERS_SCRIPT.format(
        root=REPOSITORY, package=str(every_kept_type_package), path=str(path)
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, check=True, timeout=300)
    forced = torch.load(path)
    model = load_model(open_package(every_kept_type_package))
    assert forced["isa"] == isa
    assert torch.equal(forced["logits"], prompt_logits(model)) and forced["greedy"] == greedy(model)


def test_without_the_c_kernels_a_blocks_package_is_expanded_once_and_runs_step_by_step_with_its_own_values(
    every_kept_type_package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    model = load_model(open_package(every_kept_type_package))
    assert model.kernel_layers is None and not model.native_kernels
    # Expanded once at load, not at every call.
    assert not isinstance(model.embed, QuantizedWeight) and not isinstance(model.layers[0].qkv, QuantizedWeight)
    monkeypatch.undo()
    fused = load_model(open_package(every_kept_type_package))
    # torch's float32 matmul over gguf-py's values against the kernels' order: rounding apart.
    assert torch.allclose(prompt_logits(model), prompt_logits(fused), atol=1e-4, rtol=1e-4)


def test_fused_blocks_are_views_of_one_storage_not_copies_per_layer(every_type_packages: dict[str, Any]) -> None:
    model = load_model(open_package(every_type_packages["root"] / "blocks"))
    qkv = model.layers[1].qkv
    assert isinstance(qkv, QuantizedWeight) and isinstance(model.embed, QuantizedWeight)
    # One storage (the huge-page memory the matrices moved into at load) under every tensor kept as blocks.
    assert qkv.data.untyped_storage().data_ptr() == model.embed.data.untyped_storage().data_ptr()


def test_inspect_reports_tensor_types_and_bytes_and_what_was_dequantized(every_type_packages: dict[str, Any]) -> None:
    path = every_type_packages["root"] / "blocks"
    info = inspect_package(path)
    assert info["integrity"]["ok"]
    types = info["weight_types"]
    assert types["Q6_K"] == {"tensors": 4, "bytes": sum(e["nbytes"] for e in info["blocks"].values() if e["type"] == "Q6_K")}
    assert set(types) == {"F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
    text = render_text(info, path)
    assert "Q6_K                4" in text and "(ggml blocks, mapped by flare run)" in text
    assert "dequantized         1 Q2_K tensor at export (no kernel for the type; flare export --quantize q8_0" in text


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_k_m"])
def test_quantize_from_a_hugging_face_directory_serves_its_own_dequantization(
    tmp_path: Path, tiny_hf_directory: Path, package_parts: dict[str, Any], scheme: str
) -> None:
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions(quantize=scheme))
    config = package_parts["config"]
    matrices = {n for n, t in package_parts["state_dict"].items() if t.dim() == 2}
    types = tensor_types(scheme, config, {n: tuple(t.shape) for n, t in package_parts["state_dict"].items()})
    assert set(types) == matrices
    if scheme == "q4_k_m":  # the tiny model's widths (64, 128) take llama.cpp's fallbacks
        assert set(types.values()) == {T.Q5_0, T.Q8_0} and types["model.embed_tokens.weight"] == T.Q8_0
    else:
        assert set(types.values()) == {T[scheme.upper()]}
    assert {n: e.type for n, e in manifest.blocks.items()} == {n: kind.name for n, kind in types.items()}
    package = open_package(tmp_path / "pkg")
    _, mapped = package.load_weights()
    for name in matrices:  # gguf-py's quantizer on the directory's (bfloat16) values
        source = package_parts["state_dict"][name].to(torch.bfloat16).float().numpy()
        assert np.array_equal(mapped[name].data.numpy(), gguf.quants.quantize(source, types[name])), name
    served = load_model(package)
    dequantized = DecoderModel(package.manifest.model, package.load_state_dict())
    assert torch.allclose(prompt_logits(served), prompt_logits(dequantized), atol=1e-4, rtol=1e-4)
    assert greedy(served) == greedy(dequantized)


def test_quantize_is_refused_beside_a_dtype(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="cannot be combined with --dtype float16") as error:
        export_package("unused", tmp_path / "pkg", ExportOptions(quantize="q8_0", dtype="float16"))
    assert error.value.option == "--quantize"
    assert not (tmp_path / "pkg").exists()


def test_quantize_on_a_gguf_keeps_its_blocks_and_stores_a_type_without_a_kernel_as_blocks(
    tmp_path: Path, every_type_packages: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # The Q2_K down projection has no kernel: dequantized it would be float32 (the GGUF's Q3_K_M
    # and IQ* files grow four- to fivefold so); --quantize q8_0 stores it as Q8_0 blocks of its
    # values, and every block flare multiplies stays as the file has it.
    root, name = every_type_packages["root"], "model.layers.1.mlp.down_proj.weight"
    plain = export_printed(capsys, root / "wide.gguf", tmp_path / "plain")
    assert plain.returncode == 0
    assert "note: 1 Q2_K tensor of a type flare has no kernel for, stored as float32: the package is" in plain.stderr
    assert "--quantize q8_0 stores them as 8-bit blocks" in plain.stderr
    done = flare_printed(capsys, "export", str(root / "wide.gguf"), "-o", str(tmp_path / "pkg"), "--quantize", "q8_0")
    assert done.returncode == 0 and "note:" not in done.stderr
    package = open_package(tmp_path / "pkg")
    manifest = package.manifest
    assert manifest.dequantized == {name: "Q2_K"}  # its source type, still on record
    assert {n: T[e.type] for n, e in manifest.blocks.items()} == {**{n: k for n, k in EVERY_TYPE.items() if k in KEPT_TYPES}, name: T.Q8_0}
    _, mapped = package.load_weights()
    _, kept = open_package(root / "blocks").load_weights()
    for other, tensor in kept.items():
        assert np.array_equal(mapped[other].data.numpy(), tensor.data.numpy()), other
    values = gguf.quants.dequantize(every_type_packages["blocks"][name][1], T.Q2_K)
    assert np.array_equal(mapped[name].data.numpy(), gguf.quants.quantize(values, T.Q8_0))
    assert "quantized again     1 Q2_K tensor as Q8_0 at export (--quantize)" in render_text(
        inspect_package(tmp_path / "pkg"), tmp_path / "pkg"
    )
    served = load_model(package)
    dequantized = DecoderModel(manifest.model, package.load_state_dict())
    assert torch.allclose(prompt_logits(served), prompt_logits(dequantized), atol=1e-4, rtol=1e-4)
    assert greedy(served) == greedy(dequantized)


def test_only_tensors_without_a_kernel_stored_as_floats_beside_blocks_count_as_kernelless() -> None:
    # What export's note, run's warning and inspect's line name: not a kept type joined into one
    # float tensor (DeepSeek's latent k_b and v_b, experts' gate and up of two types), not a tensor
    # --quantize stored as blocks, and nothing in a package a named --dtype dequantized whole.
    dequantized = {"a.weight": "Q3_K", "b.weight": "IQ4_XS", "kv_b.weight": "Q8_0", "gate_up.weight": "Q4_K", "c.weight": "Q2_K"}
    blocks = {"c.weight": object(), "q.weight": object()}
    assert kernelless_tensors(dequantized, blocks) == {"a.weight": "Q3_K", "b.weight": "IQ4_XS"}
    assert kernelless_tensors(dequantized, {}) == {}


@pytest.mark.parametrize("scale", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_gguf_with_a_bad_scale_is_refused_naming_the_tensor_and_nothing_is_written(
    tmp_path: Path, wide_config: ModelConfig, make_state_dict: Any, scale: float
) -> None:
    name = "model.layers.1.mlp.gate_proj.weight"
    every_type_gguf(tmp_path / "bad.gguf", wide_config, make_state_dict, **{name: (T.Q4_K, random_blocks(T.Q4_K, (512, 256), 0, scale))})
    for dtype in ("auto", "float32"):
        with pytest.raises(ExportError, match=f"tensor {name}: .*(NaN or infinite)"):
            export_package(str(tmp_path / "bad.gguf"), tmp_path / "pkg", ExportOptions(dtype=dtype))
        assert not (tmp_path / "pkg").exists()
        assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_a_gguf_with_an_unknown_type_id_is_refused(tmp_path: Path, wide_config: ModelConfig, make_state_dict: Any) -> None:
    every_type_gguf(tmp_path / "odd.gguf", wide_config, make_state_dict)
    raw = bytearray((tmp_path / "odd.gguf").read_bytes())
    # The first tensor's info: name (u64 length + bytes), n_dims u32, dims u64 each, type u32.
    name = b"token_embd.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == int(T.Q8_0)
    raw[type_at : type_at + 4] = (250).to_bytes(4, "little")
    (tmp_path / "odd.gguf").write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="tensor token_embd.weight: unknown ggml type 250"):
        export_package(str(tmp_path / "odd.gguf"), tmp_path / "pkg", ExportOptions())
    assert not (tmp_path / "pkg").exists()


def test_a_truncated_gguf_is_refused_and_nothing_is_written(tmp_path: Path, every_type_packages: dict[str, Any]) -> None:
    whole = (every_type_packages["root"] / "wide.gguf").read_bytes()
    (tmp_path / "short.gguf").write_bytes(whole[:-1000])
    with pytest.raises(ExportError, match="tensor output_norm.weight: its data .* lies outside the file"):
        export_package(str(tmp_path / "short.gguf"), tmp_path / "pkg", ExportOptions())
    assert [p.name for p in tmp_path.iterdir()] == ["short.gguf"]


def _rewrite(package: Path, change: Any) -> None:
    """Apply `change` to the package's manifest JSON (and blocks file), keeping its checksums true."""
    manifest = json.loads((package / "manifest.json").read_text())
    change(manifest)
    manifest["files"][BLOCKS_NAME] = sha256_of(package / BLOCKS_NAME)
    (package / "manifest.json").write_text(json.dumps(manifest))


def test_blocks_of_the_wrong_length_or_an_unknown_type_are_refused_at_load(
    tmp_path: Path, every_type_packages: dict[str, Any]
) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "length": (lambda m: m["blocks"][name].update(nbytes=m["blocks"][name]["nbytes"] - 176), "Q5_K blocks of a \\[512, 256\\] weight take 90112 bytes, the manifest says 89936"),
        "type": (lambda m: m["blocks"][name].update(type="Q9_X"), "unknown ggml type 'Q9_X'"),
        "no kernel": (lambda m: m["blocks"][name].update(type="Q3_K"), "Q3_K is not served from blocks"),
    }
    for case, (change, message) in cases.items():
        package = tmp_path / case
        shutil.copytree(every_type_packages["root"] / "blocks", package)
        _rewrite(package, change)
        with pytest.raises(PackageError, match=f"tensor {name}: .*{message}"):
            open_package(package)


def test_a_nan_scale_in_the_blocks_file_is_refused_at_load_naming_the_tensor(
    tmp_path: Path, every_type_packages: dict[str, Any]
) -> None:
    package = tmp_path / "nan"
    shutil.copytree(every_type_packages["root"] / "blocks", package)
    entry = json.loads((package / "manifest.json").read_text())["blocks"]["model.layers.0.mlp.gate_proj.weight"]
    raw = bytearray((package / BLOCKS_NAME).read_bytes())
    raw[entry["offset"] + 144 * 3 : entry["offset"] + 144 * 3 + 2] = np.array([np.nan], np.float16).tobytes()
    (package / BLOCKS_NAME).write_bytes(bytes(raw))
    _rewrite(package, lambda m: None)
    with pytest.raises(PackageError, match="tensor model.layers.0.mlp.gate_proj.weight: 1 block.*NaN or infinite scale.*block 3"):
        load_model(open_package(package))


RSS_PROBE = """
import sys, torch
from pathlib import Path
from flare.package.blocks import map_blocks
from flare.package.manifest import BlockEntry

def rss(kind):
    for line in open("/proc/self/status"):
        if line.startswith(kind):
            return int(line.split()[1]) * 1024

path, rows, width = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
before = rss("RssAnon")
tensors = map_blocks(path, {"w": BlockEntry("Q8_0", 0, rows * width)}, {"w": (rows, width // 34 * 32)})
total = int(tensors["w"].data.sum(dtype=torch.int64))  # reads every page of the mapping
print(rss("RssAnon") - before, rss("RssFile"), total)
"""


def test_mapped_blocks_stay_page_cache_and_never_become_anonymous_memory(tmp_path: Path) -> None:
    rows, width = 8192, 34 * 128  # 34 MB of Q8_0 blocks (4096 values a row)
    data = random_blocks(T.Q8_0, (rows, 4096), 0)
    (tmp_path / BLOCKS_NAME).write_bytes(data.tobytes())
    result = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path / BLOCKS_NAME), str(rows), str(width)],
        capture_output=True, text=True, check=True,
    )
    anonymous_growth, file_resident, total = map(int, result.stdout.split())
    assert total == int(data.astype(np.int64).sum())
    assert file_resident >= rows * width  # the blocks are resident as the file's pages...
    assert anonymous_growth < rows * width // 8  # ...and not copied into anonymous memory


HUGE_PAGES_PROBE = """
import sys
from pathlib import Path
import torch
from flare.package.blocks import map_blocks
from flare.package.manifest import BlockEntry

def rss(kind):
    for line in open("/proc/self/status"):
        if line.startswith(kind):
            return int(line.split()[1]) * 1024

path, rows, width = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
half = rows // 2 * width
entries = {"matrix": BlockEntry("Q8_0", 0, half), "experts": BlockEntry("Q8_0", half, half)}
shapes = {"matrix": (rows // 2, width // 34 * 32), "experts": (4, rows // 8, width // 34 * 32)}
before = rss("RssAnon"), rss("RssFile")
tensors = map_blocks(path, entries, shapes, huge_pages=True)
totals = [int(tensors[name].data.sum(dtype=torch.int64)) for name in ("matrix", "experts")]  # every page read
print(rss("RssAnon") - before[0], rss("RssFile") - before[1], *totals)
"""


def test_huge_pages_move_the_matrices_into_anonymous_memory_release_their_file_pages_and_leave_experts_mapped(
    tmp_path: Path,
) -> None:
    rows, width = 8192, 34 * 128  # 34 MB of Q8_0 blocks: a 17 MB matrix, then 17 MB of 4 stacked experts
    data = random_blocks(T.Q8_0, (rows, 4096), 0)
    (tmp_path / BLOCKS_NAME).write_bytes(data.tobytes())
    result = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_PROBE, str(tmp_path / BLOCKS_NAME), str(rows), str(width)],
        capture_output=True, text=True, check=True,
    )
    anonymous_growth, file_growth, matrix_total, experts_total = map(int, result.stdout.split())
    half = rows // 2
    # The same bytes either way.
    assert matrix_total == int(data[:half].astype(np.int64).sum())
    assert experts_total == int(data[half:].astype(np.int64).sum())
    # The matrix is resident once, as anonymous memory (its file pages were dropped once copied:
    # kept, they would double the file's growth); the experts stay the file's pages (the growth
    # also counts library pages the probe touches, a few MB).
    assert anonymous_growth >= half * width
    assert half * width <= file_growth < half * width * 3 // 2


def test_a_blocks_file_larger_than_the_machines_memory_maps_and_its_matrices_move_into_huge_pages(tmp_path: Path) -> None:
    # A sparse blocks file of 64 GiB (more than CI's memory, as a large MoE file can be) whose one
    # matrix is at the front: both the private mapping of the file and the anonymous memory the
    # matrices move into (as long as the file) must be granted without reserving their length.
    data = random_blocks(T.Q8_0, (64, 256), 0)
    path = tmp_path / BLOCKS_NAME
    with open(path, "wb") as file:
        file.write(data.tobytes())
        file.truncate(64 << 30)
    tensors = map_blocks(path, {"w": BlockEntry("Q8_0", 0, data.nbytes)}, {"w": (64, 256)}, huge_pages=True)
    assert np.array_equal(tensors["w"].data.numpy(), data)
