"""The tiny checkpoints of every family (tests/family_checkpoints.py), written as GGUFs (tests/gguf_writer.py)
and exported in float32: the package holds the Hugging Face export's config (what GGUF cannot
carry aside) and weights, and its logits are transformers' own (eager attention) within 1e-4 on
prompts longer than every sliding window. Written in Q8_0 and kept as blocks, it scores as the
float32 export of the same file.

What these checkpoints ask for beyond what the converter writes is given with the keys
llama.cpp reads for it (`EXTRA_KEYS`): Mistral's and Qwen2's sliding windows (the converter writes
none for llama and qwen2), the 3-layer Gemma 3's own local/global pattern (the converter writes
none: llama.cpp assumes 5 local : 1 global) and Gemma's query_pre_attn_scalar when it is not
head_dim (`attention.scale`; llama.cpp infers head_dim from the layer count).

The mixture-of-experts families' experts are written as the converter writes them (3-D
`ffn_{gate,up,down}_exps`, the router and the shared expert's gate float32); their Q8_0 files keep
the stacked experts as blocks. Qwen's dense `mlp_only_layers` (which llama.cpp's converter
refuses) are written as dense layers, which flare reads as such.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from tests import family_checkpoints as families
from tests.gguf_writer import gguf_vocabulary, write_family_gguf
from tests.running_scheduler import running

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import load_model
from flare.engine.tokenizer import Tokenizer
from flare.preparation.default_model import default_gguf_path
from flare.preparation.export import ExportOptions, export_package
from flare.package.directory import open_package
from flare.preparation.source import ModelSource
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta

LOGIT_TOLERANCE = 1e-4
BLOCK_SIZE = 4
PROMPT = (
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest to hide from the "
    "hunters, who follow its tracks through the snow until the night falls."
)
U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32


def extra_keys(family: str, config: Any) -> dict[str, tuple[Any, gguf.GGUFValueType]]:
    """The keys (module docstring) that carry what the converter leaves out of these checkpoints."""
    arch = {"mistral": "llama", "mixtral": "llama", "gemma3": "gemma3", "gemma2": "gemma2", "qwen2": "qwen2"}.get(family)
    keys: dict[str, tuple[Any, gguf.GGUFValueType]] = {}
    layer_types = getattr(config, "layer_types", None)
    if family in ("mistral", "mixtral", "qwen2"):
        keys[f"{arch}.attention.sliding_window"] = (config.sliding_window, U32)
    if family in ("qwen2", "gemma3") and layer_types:
        keys[f"{arch}.attention.sliding_window_pattern"] = (
            [t == "sliding_attention" for t in layer_types], gguf.GGUFValueType.ARRAY
        )
    if family in ("gemma2", "gemma3") and config.query_pre_attn_scalar != config.head_dim:
        keys[f"{arch}.attention.scale"] = (float(config.query_pre_attn_scalar) ** -0.5, F32)
    return keys


@pytest.fixture(scope="module", params=families.FAMILIES + families.MOE_FAMILIES)
def packages(request: pytest.FixtureRequest, smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """The family's checkpoint, its Hugging Face package and its GGUF package (float32 both)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    # llama.cpp's gpt-oss graph holds the SwiGLU limit as a constant, 7, which no GGUF key carries:
    # a gpt-oss checkpoint to compare with its GGUF has that limit.
    changes = {"swiglu_limit": 7.0} if family == "gpt_oss" else None
    checkpoint = families.write_checkpoint(
        family, root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=changes
    )
    config = checkpoint.model.config
    write_family_gguf(
        root / f"{family}.gguf", config, checkpoint.model.state_dict(), vocabulary=gguf_vocabulary(default_gguf_path()),
        chat_template=smollm2_source.chat_template, metadata=extra_keys(family, config),
    )
    context = families.PHI3_ORIGINAL_CONTEXT if family == "phi3" else None
    options = ExportOptions(dtype="float32", max_context=context)
    export_package(str(checkpoint.path), root / "hf-package", options, stderr=io.StringIO())
    export_package(str(root / f"{family}.gguf"), root / "gguf-package", options, stderr=io.StringIO())
    return checkpoint, root / "hf-package", root / "gguf-package"


def test_gguf_package_config_is_the_hugging_face_packages_but_what_gguf_cannot_carry(packages: tuple[Any, Path, Path]) -> None:
    """Equal configs, except: Mistral is written as arch llama; Llama 3.1's llama3 scaling is
    its per-frequency divisors (the same frequencies: test_gguf_families checks them against
    transformers); an attention scale given in the GGUF is float32."""
    checkpoint, hf, from_gguf = packages
    ours, theirs = open_package(from_gguf).manifest.model, open_package(hf).manifest.model
    if checkpoint.family == "mistral":
        ours = replace(ours, architecture="mistral")
    if checkpoint.family == "llama":
        assert ours.rope_scaling is not None and ours.rope_scaling.kind == "factors"
        ours = replace(ours, rope_scaling=theirs.rope_scaling)
    if theirs.attention_scale is not None and ours.attention_scale is not None:
        assert ours.attention_scale == pytest.approx(theirs.attention_scale, rel=1e-7)
        ours = replace(ours, attention_scale=theirs.attention_scale)
    assert ours == theirs


def test_gguf_package_holds_the_hugging_face_packages_weights(packages: tuple[Any, Path, Path]) -> None:
    _, hf, from_gguf = packages
    ours, theirs = open_package(from_gguf).load_state_dict(), open_package(hf).load_state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_gguf_package_logits_are_transformers(packages: tuple[Any, Path, Path]) -> None:
    checkpoint, _, from_gguf = packages
    package = open_package(from_gguf)
    ids = Tokenizer.from_package(package).encode(PROMPT)
    assert len(ids) > 2 * families.WINDOW
    with torch.inference_mode():
        expected = checkpoint.model(torch.tensor([ids])).logits[0].float()
    assert (prompt_logits(from_gguf, ids) - expected).abs().max().item() < LOGIT_TOLERANCE


async def greedy_answer(package_path: Path, tokens: int) -> list[int]:
    """The package's greedy continuation of PROMPT through the scheduler (paged, in decode rounds)."""
    output: list[int] = []
    async with running(package_path, block_size=BLOCK_SIZE, draft_tokens=0) as scheduler:
        prompt = tuple(scheduler.tokenizer.encode(PROMPT))
        async for event in scheduler.submit(GenerationRequest("greedy", prompt, SamplingParams(temperature=0.0, max_tokens=tokens))):
            if isinstance(event, TextDelta):
                output += event.token_ids
            else:
                assert isinstance(event, Finished), event
    return output


async def test_gguf_package_answers_as_the_hugging_face_package(packages: tuple[Any, Path, Path]) -> None:
    # The Hugging Face package's greedy answer is transformers' own (tests/families/); the GGUF's
    # must be the same tokens, read through its own config, tokenizer and weights.
    checkpoint, hf_package, gguf_package = packages
    hf_answer = await greedy_answer(hf_package, 24)
    assert hf_answer, f"{checkpoint.family}: no tokens generated"
    assert await greedy_answer(gguf_package, 24) == hf_answer, checkpoint.family


def prompt_logits(package_path: Path, ids: list[int]) -> torch.Tensor:
    model = load_model(open_package(package_path))
    cache = KVCache.for_budget(model.config, 16 * 1024**2, BLOCK_SIZE)
    table = BlockAllocator(cache.num_blocks).allocate(-(-len(ids) // BLOCK_SIZE))
    return model.forward(ForwardBatch.build([ForwardRow(ids, 0, table, num_logits=len(ids))], BLOCK_SIZE), cache)


def test_q8_0_gguf_package_serves_its_blocks_as_its_own_dequantization(
    packages: tuple[Any, Path, Path], smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """A Q8_0 GGUF of the family (fused and permuted tensors split and unpermuted as block rows)
    kept as blocks scores the prompt as the float32 export of the same file does."""
    checkpoint, _, _ = packages
    config = checkpoint.model.config
    write_family_gguf(
        tmp_path / "q8.gguf", config, checkpoint.model.state_dict(), quantize=gguf.GGMLQuantizationType.Q8_0,
        vocabulary=gguf_vocabulary(default_gguf_path()), chat_template=smollm2_source.chat_template,
        metadata=extra_keys(checkpoint.family, config),
    )
    context = families.PHI3_ORIGINAL_CONTEXT if checkpoint.family == "phi3" else None
    export_package(str(tmp_path / "q8.gguf"), tmp_path / "blocks", ExportOptions(max_context=context), stderr=io.StringIO())
    export_package(str(tmp_path / "q8.gguf"), tmp_path / "float32", ExportOptions(dtype="float32", max_context=context), stderr=io.StringIO())
    assert open_package(tmp_path / "blocks").manifest.blocks
    ids = Tokenizer.from_package(open_package(tmp_path / "blocks")).encode(PROMPT)
    served, dequantized = prompt_logits(tmp_path / "blocks", ids), prompt_logits(tmp_path / "float32", ids)
    assert torch.allclose(served, dequantized, atol=1e-4, rtol=1e-4), (served - dequantized).abs().max()
