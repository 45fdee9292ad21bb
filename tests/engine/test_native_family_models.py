"""Every family's model on the C kernels: each tiny transformers-built checkpoint (tests/family_checkpoints.py),
exported in float32, runs the kernels (`kernels_fit`), and with float16 weights runs each layer of
a round of short rows in one `decoder_layer` call that gives the step-by-step kernels' bits and
the torch path's logits, over prompts longer than every sliding window."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests.family_checkpoints import FAMILIES, PHI3_ORIGINAL_CONTEXT, write_checkpoint

from flare.engine import native, native_layers
from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, kernels_fit, load_model
from flare.engine.precision import WeightFormat
from flare.preparation.export import ExportOptions, export_package
from flare.package.model_config import ModelConfig
from flare.package.directory import open_package
from flare.preparation.source import ModelSource

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not native.available(), reason="the engine's C kernels were not built")

BLOCK_SIZE = 4


# DeepSeek's latent attention runs its layers step by step (layers/latent_attention.py, around
# the paged kernel), the others each layer in one call.
LATENT_FAMILIES = tuple(family for family in FAMILIES if family.startswith("deepseek"))
KERNEL_FAMILIES = tuple(family for family in FAMILIES if family not in LATENT_FAMILIES)


@pytest.fixture(scope="module", params=KERNEL_FAMILIES)
def family_package(request: pytest.FixtureRequest, smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_checkpoint(request.param, root / request.param, smollm2_source.tokenizer_json, smollm2_source.chat_template)
    context = PHI3_ORIGINAL_CONTEXT if request.param == "phi3" else None
    export_package(str(checkpoint.path), root / "package", ExportOptions(dtype="float32", max_context=context), stderr=io.StringIO())
    return root / "package"


def rounds_of_short_rows(model: DecoderModel, pieces: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    """The logits of two sequences fed through one paged cache in rounds of (tokens of the first,
    tokens of the second), every token scored: rows of at most 17 tokens, the kernels' short rows."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [sum(p[i] for p in pieces) for i in range(2)]
    sequences = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    cache = KVCache.for_budget(model.config, 16 * 1024**2, BLOCK_SIZE)
    allocator = BlockAllocator(cache.num_blocks)
    tables = [allocator.allocate(-(-n // BLOCK_SIZE)) for n in lengths]
    done, logits = [0, 0], []
    for sizes in pieces:
        rows = [ForwardRow(sequences[i][done[i] : done[i] + sizes[i]], done[i], tables[i], num_logits=sizes[i]) for i in range(2)]
        logits.append(model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache))
        done = [d + n for d, n in zip(done, sizes)]
    return logits


# Prompt chunks, decode rounds and verify rows: 41 and 40 tokens, past the windows of 8 five times.
PIECES = [(13, 9), (1, 1), (3, 3), (11, 17), (1, 1), (4, 4), (1, 1), (7, 4)]


def test_every_family_runs_on_the_c_kernels(family_package: Path) -> None:
    package = open_package(family_package)
    assert kernels_fit(package.manifest.model)
    assert load_model(package).native_kernels


@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_a_latent_attention_family_runs_the_kernels_step_by_step_with_its_decode_read_from_the_pool(
    family: str, smollm2_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek on the kernels: its layers step by step (engine_loaded says why), every short
    round's absorbed attention one `paged_attention` call per group reading the latent pool where
    it lies (each value the latent prefix of its row), the logits the torch path's within 1e-5."""
    from flare.engine.layers import latent_attention as latent_module

    checkpoint = write_checkpoint(family, tmp_path / family, smollm2_source.tokenizer_json, smollm2_source.chat_template)
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    config = package.manifest.model
    assert config.latent_attention is not None and kernels_fit(config)
    state = dict(package.load_weights()[0])
    model = DecoderModel(config, state)
    assert model.native_kernels and model.layer_calls == "steps: latent attention is not in the one-call layer"
    calls: list[int | None] = []
    paged = native.paged_attention
    monkeypatch.setattr(latent_module.native, "paged_attention", lambda *a, **o: calls.append(o.get("value_dim")) or paged(*a, **o))
    got = rounds_of_short_rows(model, PIECES)
    # one call per attention group (rows of one length) per layer and round
    assert calls == [config.latent_attention.kv_lora_rank] * (sum(len(set(sizes)) for sizes in PIECES) * config.num_layers)
    for kernels, torch_path in zip(got, rounds_of_short_rows(DecoderModel(config, state, native_kernels=False), PIECES)):
        assert (kernels - torch_path).abs().max().item() <= 1e-5


def test_a_family_layer_runs_in_one_kernel_call_with_the_steps_bits_and_the_torch_paths_logits(
    family_package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = open_package(family_package)
    config = package.manifest.model
    # float16-exact weights: float16 linear layers (the decoder_layer path) multiply them exactly.
    state = {name: tensor.half().float() for name, tensor in package.load_weights()[0].items()}
    fused = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    steps = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    steps.kernel_layers = None
    reference = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16, native_kernels=False)
    assert fused.kernel_layers is not None
    calls = []
    run = native_layers.LayerStack.run
    monkeypatch.setattr(native_layers.LayerStack, "run", lambda stack, *args: calls.append(len(stack.layers)) or run(stack, *args))

    fused_logits = rounds_of_short_rows(fused, PIECES)
    assert calls == [config.num_layers] * len(PIECES)  # every round, every layer, one call each
    for got, by_steps, by_torch in zip(fused_logits, rounds_of_short_rows(steps, PIECES), rounds_of_short_rows(reference, PIECES)):
        assert torch.equal(got, by_steps)
        difference = (got - by_torch).abs().max().item()
        assert difference <= 1e-4, f"{config.architecture}: max |logit difference| from the torch path {difference:.2e}"


def test_only_heads_wider_than_the_features_path_takes_keep_a_featured_family_off_the_kernels() -> None:
    wide = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=native.FEATURES_MAX_HEAD_DIM * 2, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    assert kernels_fit(wide)  # Llama's loops take any head
    assert not kernels_fit(replace(wide, architecture="qwen3", qk_norm=True))
    assert kernels_fit(replace(wide, head_dim=native.FEATURES_MAX_HEAD_DIM, architecture="qwen3", qk_norm=True))
    head_dim = wide.head_dim
    keys = torch.zeros(1, 1, 4, head_dim)
    with pytest.raises(ValueError, match="head_dim is over 1024 for a bias, q/k norms or partial rotary"):
        native.rope_and_cache(
            torch.randn(3 * head_dim, 1), torch.tensor([0]), torch.tensor([0]), torch.ones(4, head_dim // 2), torch.zeros(4, head_dim // 2),
            keys, keys.clone(), 1, q_norm=torch.ones(head_dim), k_norm=torch.ones(head_dim),
        )
    assert not keys.any()
