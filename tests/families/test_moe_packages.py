"""Mixture-of-experts packages (Qwen3-MoE, Qwen2-MoE, Mixtral): what export reads of their configs,
both layouts of their experts, stacked experts kept as blocks that score as their own float32
values, and Q8_0 experts served at tensor parallel 2 answering as at 1.
test_transformers_parity.py holds their float packages to transformers."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.family_checkpoints import Checkpoint, write_checkpoint
from tests.families.test_transformers_parity import LOGIT_TOLERANCE, PROMPTS, forward_in_pieces, reference_logits
from tests.gguf_writer import LLAMA_CPP_CONVERTER, convert_with_llama_cpp, gguf_vocabulary, write_family_gguf
from tests.running_scheduler import greedy_tokens, running

from flare.engine import native, native_quantized
from flare.engine.model import DecoderModel, load_model
from flare.engine.tokenizer import Tokenizer
from flare.package.blocks import kernelless_tensors
from flare.package.directory import open_package
from flare.preparation.default_model import default_gguf_path
from flare.preparation.export import ExportError, ExportOptions, export_package
from flare.preparation.inspect import inspect_package, render_text
from flare.preparation.families.hf_config import model_config_from_hf
from flare.preparation.source import ModelSource, SourceError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2_moe(smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    root = tmp_path_factory.mktemp("qwen2_moe")
    return write_checkpoint("qwen2_moe", root / "qwen2_moe", smollm2_source.tokenizer_json, smollm2_source.chat_template)


@pytest.fixture(scope="module")
def quantized_package(smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """quantized_package(family, scheme, changes): `flare export --quantize SCHEME` of the family's
    tiny checkpoint with config `changes`, exported once a module for each (the tests only read it)."""
    made: dict[tuple[str, str, str], Path] = {}

    def make(family: str, scheme: str, changes: dict[str, int] | None = None) -> Path:
        key = (family, scheme, repr(sorted((changes or {}).items())))
        if key not in made:
            root = tmp_path_factory.mktemp(f"{family}-{scheme}")
            checkpoint = write_checkpoint(
                family, root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=changes
            )
            export_package(str(checkpoint.path), root / "package", ExportOptions(quantize=scheme), stderr=io.StringIO())
            made[key] = root / "package"
        return made[key]

    return make


# Q4_K's super-blocks are 256 values wide: a checkpoint of hidden and expert width 256.
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64}


def hf_config(family: str, **changes: object) -> dict:
    from tests.family_checkpoints import family_config

    return {**family_config(family).to_dict(), **changes}


def test_the_moe_layers_are_those_the_config_makes_sparse() -> None:
    """Qwen: not in mlp_only_layers and every decoder_sparse_step-th layer; Mixtral: all."""
    assert model_config_from_hf(hf_config("qwen3_moe"), None).moe_layers == (0, 2)
    stepped = model_config_from_hf(hf_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2), None)
    assert stepped.moe_layers == (1,)
    assert model_config_from_hf(hf_config("mixtral"), None).moe_layers == (0, 1, 2)
    dense = model_config_from_hf(hf_config("qwen2_moe", num_experts=0, num_local_experts=0), None)
    assert dense.moe_layers == () and dense.num_experts == 0


def test_a_decoder_sparse_step_of_2_makes_every_second_layer_sparse_as_transformers_does(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """Qwen3-MoE with decoder_sparse_step 2 and no mlp_only_layers: layer 1 of 0-2 has experts,
    0 and 2 the dense MLP, and the package scores a prompt as transformers' model does."""
    changes = {"decoder_sparse_step": 2, "mlp_only_layers": []}
    checkpoint = write_checkpoint("qwen3_moe", tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=changes)
    assert [hasattr(layer.mlp, "experts") for layer in checkpoint.model.model.layers] == [False, True, False]
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    assert package.manifest.model.moe_layers == (1,)
    prompt = Tokenizer.from_package(package).encode(PROMPTS[0])
    (got,) = forward_in_pieces(load_model(package), [prompt], [[len(prompt)]])
    assert (got - reference_logits(checkpoint, prompt)).abs().max().item() <= LOGIT_TOLERANCE


def test_the_routing_and_shared_expert_fields_are_read() -> None:
    qwen2 = model_config_from_hf(hf_config("qwen2_moe"), None)
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.moe_intermediate_size) == (8, 2, 32)
    assert qwen2.routing == "softmax" and not qwen2.norm_topk_prob and qwen2.attention_bias
    assert qwen2.shared_expert_intermediate_size == 48 and qwen2.shared_expert_gate
    mixtral = model_config_from_hf(hf_config("mixtral"), None)
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 128 and mixtral.shared_expert_intermediate_size == 0


def test_a_checkpoint_in_the_fused_expert_layout_exports_the_same_package(qwen2_moe: Checkpoint, tmp_path: Path) -> None:
    """transformers 5 keeps experts as `experts.gate_up_proj` [E, 2 I, hidden] and
    `experts.down_proj` [E, hidden, I]; a checkpoint saved that way is read as the per-expert one."""
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for item in qwen2_moe.path.iterdir():
        if item.suffix != ".safetensors":
            (fused_dir / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(qwen2_moe.path / "model.safetensors"))
    fused = {name: tensor for name, tensor in tensors.items() if ".experts." not in name}
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat((tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"])) for e in range(8)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    for source, out in ((qwen2_moe.path, tmp_path / "per-expert"), (fused_dir, tmp_path / "fused-package")):
        export_package(str(source), out, ExportOptions(dtype="float32"), stderr=io.StringIO())
    a = load_file(str(tmp_path / "per-expert" / "model.safetensors"))
    b = load_file(str(tmp_path / "fused-package" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert a["model.layers.0.mlp.experts.gate_up_proj.weight"].shape == (8, 64, 64)


def test_a_checkpoint_missing_an_expert_is_refused_naming_what_is_wrong(qwen2_moe: Checkpoint, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in qwen2_moe.path.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(qwen2_moe.path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError) as error:
        export_package(str(broken), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    message = str(error.value)
    assert "model.layers.1.mlp.experts.gate_up_proj.weight is missing" in message
    assert "model.layers.1.mlp.experts.5.gate_proj.weight is not part of a qwen2_moe model" in message


def test_a_deepseek_config_without_its_latent_attention_keys_is_refused_naming_one() -> None:
    with pytest.raises(SourceError, match="lacks 'kv_lora_rank'"):
        model_config_from_hf({"model_type": "deepseek_v3", "num_attention_heads": 4, "hidden_size": 64,
                              "num_hidden_layers": 2, "max_position_embeddings": 64}, None)


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
@pytest.mark.parametrize("scheme", ["q8_0", "q4_k_m"])
def test_quantized_experts_are_kept_as_blocks_and_score_as_their_own_float32_values(
    scheme: str, quantized_package: Callable[..., Path]
) -> None:
    """`--quantize` keeps each stacked expert projection as one block tensor ([E * out] rows; the
    router stays float32), served from the mapped file; its logits are those of the same
    package's weights dequantized to float32, within 1e-4."""
    path = quantized_package("qwen3_moe", scheme, WIDE) if scheme == "q4_k_m" else quantized_package("qwen2_moe", scheme)
    package = open_package(path)
    blocks = package.manifest.blocks
    gate_up = blocks["model.layers.0.mlp.experts.gate_up_proj.weight"]
    assert gate_up.type == ("Q8_0" if scheme == "q8_0" else "Q4_K")
    assert "model.layers.0.mlp.router.weight" not in blocks
    served = load_model(package)
    reference = DecoderModel(package.manifest.model, package.load_state_dict(), native_kernels=False)
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS]
    pieces = [[len(p) for p in prompts]]
    for got, want in zip(forward_in_pieces(served, prompts, pieces), forward_in_pieces(reference, prompts, pieces)):
        difference = (got - want).abs().max().item()
        assert difference <= 1e-4, f"{scheme}: max |logit difference| {difference:.2e}"
    # The served experts are views of the mapped blocks, not copies.
    layer = served.layers[0].moe
    assert layer is not None
    mapped = package.load_weights()[1]["model.layers.0.mlp.experts.gate_up_proj.weight"]
    assert layer.gate_up[1].data.untyped_storage().nbytes() == mapped.data.untyped_storage().nbytes()  # type: ignore[union-attr]


@pytest.mark.skipif(not LLAMA_CPP_CONVERTER.is_file(), reason="llama.cpp's convert_hf_to_gguf.py is not on this machine")
def test_llama_cpp_converter_output_is_the_hugging_face_package(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """The real converter's GGUF of each MoE checkpoint exports to the Hugging Face export's
    config and weights. Every layer is MoE and Mixtral has no window here: the converter refuses
    Qwen's dense layers and writes no window for arch llama."""
    changes = {"qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {"mlp_only_layers": []}, "mixtral": {"sliding_window": None}}
    conversions = []
    for family, change in changes.items():
        write_checkpoint(family, tmp_path / family, smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=change)
        conversions.append((tmp_path / family, tmp_path / f"{family}.gguf"))
    convert_with_llama_cpp(conversions)
    for family, (directory, gguf_file) in zip(changes, conversions):
        options = ExportOptions(dtype="float32")
        export_package(str(directory), tmp_path / f"{family}-hf", options, stderr=io.StringIO())
        export_package(str(gguf_file), tmp_path / f"{family}-gguf", options, stderr=io.StringIO())
        hf, converted = open_package(tmp_path / f"{family}-hf"), open_package(tmp_path / f"{family}-gguf")
        assert converted.manifest.model == hf.manifest.model, family
        ours, theirs = converted.load_state_dict(), hf.load_state_dict()
        assert ours.keys() == theirs.keys(), family
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), f"{family}: {name}"


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
def test_a_q4_k_gguf_keeps_its_experts_as_blocks_and_scores_as_its_float32_export(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """Q4_K expert blocks (llama.cpp's reference quantizer, flare/preparation/kquants.py) of a
    GGUF: gate and up joined per expert as whole block rows, served from the mapped file, scoring
    as the float32 export of the same file within 1e-4. A file whose gate is Q4_K and up Q6_K
    keeps them float32 (joined rows of two types are no one type's blocks), scoring the same."""
    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64}
    checkpoint = write_checkpoint("qwen3_moe", tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=wide)
    state = checkpoint.model.state_dict()
    vocabulary = gguf_vocabulary(default_gguf_path())
    for variant, up_type in (("q4_k", gguf.GGMLQuantizationType.Q4_K), ("mixed", gguf.GGMLQuantizationType.Q6_K)):
        path = tmp_path / f"{variant}.gguf"
        # Only the experts quantized: the 49152-row embedding would take the numpy quantizer minutes.
        experts = {"ffn_gate_exps": gguf.GGMLQuantizationType.Q4_K, "ffn_up_exps": up_type, "ffn_down_exps": gguf.GGMLQuantizationType.Q4_K}
        write_family_gguf(
            path, checkpoint.model.config, state, vocabulary=vocabulary, chat_template=smollm2_source.chat_template, types=experts
        )
        export_package(str(path), tmp_path / f"{variant}-blocks", ExportOptions(), stderr=io.StringIO())
        export_package(str(path), tmp_path / f"{variant}-float32", ExportOptions(dtype="float32"), stderr=io.StringIO())
        blocks = open_package(tmp_path / f"{variant}-blocks")
        fused = blocks.manifest.blocks.get("model.layers.0.mlp.experts.gate_up_proj.weight")
        assert (fused is not None and fused.type == "Q4_K") == (variant == "q4_k")
        if variant == "mixed":  # joined from two kept types: no kernel is missing, nothing to warn of
            assert kernelless_tensors(blocks.manifest.dequantized, blocks.manifest.blocks) == {}
            assert "dequantized         2 Q4_K tensors at export (joined with another tensor into one float32 tensor)" in render_text(
                inspect_package(blocks.path), blocks.path
            )
        assert blocks.manifest.blocks["model.layers.0.mlp.experts.down_proj.weight"].type == "Q4_K"
        prompts = [Tokenizer.from_package(blocks).encode(PROMPTS[0])]
        pieces = [[len(prompts[0])]]
        (served,) = forward_in_pieces(load_model(blocks), prompts, pieces)
        (reference,) = forward_in_pieces(load_model(open_package(tmp_path / f"{variant}-float32")), prompts, pieces)
        difference = (served - reference).abs().max().item()
        assert difference <= 1e-4, f"{variant}: max |logit difference| {difference:.2e}"
    # --quantize stores what the mixed file's package would keep as float32 (its joined gate and
    # up) as blocks of those values, every block of the file as it is: experts stacked [E, out, in].
    export_package(str(tmp_path / "mixed.gguf"), tmp_path / "mixed-q8_0", ExportOptions(quantize="q8_0"), stderr=io.StringIO())
    requantized = open_package(tmp_path / "mixed-q8_0")
    assert requantized.manifest.blocks["model.layers.0.mlp.experts.gate_up_proj.weight"].type == "Q8_0"
    assert requantized.manifest.blocks["model.layers.0.mlp.experts.down_proj.weight"].type == "Q4_K"
    (served,) = forward_in_pieces(load_model(requantized), prompts, pieces)
    (own,) = forward_in_pieces(DecoderModel(requantized.manifest.model, requantized.load_state_dict()), prompts, pieces)
    difference = (served - own).abs().max().item()
    print(f"requantized: max |logit difference| {difference:.2e} from its own dequantization, {(served - reference).abs().max().item():.2e} from the file's")
    assert difference <= 1e-4


@pytest.mark.skipif(not native.available(), reason="integer products are C kernels")
def test_a_q4_k_m_moe_package_on_int8x2_activations_runs_every_block_product_on_the_integer_kernels_within_fidelity(
    quantized_package: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flare run --activations int8x2` on a Qwen3-MoE Q4_K_M package: the experts take the one
    call on 8-bit activations, the attention and the LM head the integer products (no block weight
    multiplies float32 activations), and every position's log-probabilities stay within issue 38's
    bars of the float32 activations' (mean |delta| 1e-3, max 2e-2), prompts fed as a prefill then
    decode rounds of both rows."""
    package = open_package(quantized_package("qwen3_moe", "q4_k_m", WIDE))
    tokenizer = Tokenizer.from_package(package)
    prompts = [tokenizer.encode(text) for text in PROMPTS[:2]]
    pieces = [[len(p) - 3 for p in prompts], [1, 1], [1, 1], [1, 1]]
    exact = forward_in_pieces(load_model(package), prompts, pieces)
    float_products: list[int] = []
    moe_calls: list[tuple[object, object]] = []
    quantized_linear, moe_layer = native_quantized.quantized_linear, native_quantized.moe_layer

    def float_product(*args: object, **options: object) -> torch.Tensor:
        float_products.append(int(args[2]))  # type: ignore[call-overload]
        return quantized_linear(*args, **options)  # type: ignore[arg-type]

    def one_call(*args: object, **options: object) -> torch.Tensor:
        moe_calls.append((options.get("gate_up_halves"), options.get("down_halves")))
        return moe_layer(*args, **options)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(native_quantized, "quantized_linear", float_product)
        patch.setattr(native_quantized, "moe_layer", one_call)
        integer = forward_in_pieces(load_model(package, activations="int8x2"), prompts, pieces)
    assert float_products == []
    assert moe_calls and set(moe_calls) == {(2, 2)}
    for got, want, tokens in zip(integer, exact, prompts, strict=True):
        index = torch.tensor(tokens[1:]).unsqueeze(1)
        delta = (got[:-1].log_softmax(-1).gather(1, index) - want[:-1].log_softmax(-1).gather(1, index)).abs()
        assert delta.mean().item() <= 1e-3 and delta.max().item() <= 2e-2, f"mean {delta.mean():.2e}, max {delta.max():.2e}"


@pytest.mark.skipif(not native.available(), reason="the one-call decoder layer is a C kernel")
@pytest.mark.parametrize(
    ("family", "scheme", "activations"),
    [("qwen3_moe", "q4_k_m", "int8x2"), ("qwen3_moe", "q4_k_m", "float32"), ("mixtral", "q8_0", "float32"), ("qwen2_moe", "q8_0", "float32"),
     ("qwen2_moe", "q4_k_m", "int8x2")],
)
def test_a_moe_layer_of_blocks_runs_in_the_one_call_decoder_layer_with_the_steps_bits(
    family: str, scheme: str, activations: str, quantized_package: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of short rows on a MoE package of blocks runs every layer, its route and experts
    included (Qwen2-MoE's shared expert and its gate too), in one `decoder_layers` call (no
    `moe_route` or `moe_layer` from Python), and gives the bits of the same model step by step: a
    prompt as a prefill, then decode and verify rounds."""
    from flare.engine import native_layers
    from flare.engine.layers import moe as moe_module

    wide = dict(WIDE)
    if family == "qwen2_moe":
        wide["shared_expert_intermediate_size"] = 512  # whole blocks, and wider than the round's own MLP
    package = open_package(quantized_package(family, scheme, wide))
    fused = load_model(package, activations=activations)
    assert fused.kernel_layers is not None
    moe_layers = sum(layer.moe is not None for layer in fused.kernel_layers)
    assert moe_layers == len(package.manifest.model.moe_layers) >= 1
    if family == "qwen2_moe":
        assert all(layer.moe is None or (layer.gate_up and layer.moe.shared_gate is not None) for layer in fused.kernel_layers)
    steps = load_model(package, activations=activations)
    steps.kernel_layers = None
    tokenizer = Tokenizer.from_package(package)
    prompts = [tokenizer.encode(text) for text in PROMPTS[:2]]
    # Short rows only after the prefill: decode rounds of one token, then verify rows of 2 and 4.
    pieces = [[len(p) - 8 for p in prompts], [1, 1], [2, 4], [1, 1], [4, 2]]
    calls: list[str] = []
    with monkeypatch.context() as patch:
        run = native_layers.LayerStack.run
        patch.setattr(native_layers.LayerStack, "run", lambda stack, *args: calls.append("layers") or run(stack, *args))
        route = moe_module.native.moe_route
        patch.setattr(moe_module.native, "moe_route", lambda *a, **o: calls.append("route") or route(*a, **o))
        got = forward_in_pieces(fused, prompts, pieces)
    assert calls.count("layers") == len(pieces) - 1  # every round of short rows in one call
    assert calls.count("route") == moe_layers  # the prefill's MoE layers, step by step
    for fused_logits, step_logits in zip(got, forward_in_pieces(steps, prompts, pieces), strict=True):
        assert torch.equal(fused_logits, step_logits)


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
async def test_a_q8_0_moe_package_served_at_tensor_parallel_2_answers_as_at_1(
    family: str, smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """Served through the scheduler, rank 1 a worker process: each rank keeps half of every
    expert's intermediate columns as whole Q8_0 blocks (64 wide: 32 a rank) and multiplies them
    on the C kernels. Both prompts at once at TP 2, with the package's n-gram drafting on, answer
    as TP 1 answers each alone without drafts."""
    changes = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {}
    checkpoint = write_checkpoint(family, tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=changes)
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(quantize="q8_0"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    layer = package.manifest.model.moe_layers[0]
    assert package.manifest.blocks[f"model.layers.{layer}.mlp.experts.gate_up_proj.weight"].type == "Q8_0"
    async with running(tmp_path / "package", draft_tokens=0) as single:
        expected = [await greedy_tokens(single, f"p{i}", text, 24) for i, text in enumerate(PROMPTS)]
    async with running(tmp_path / "package", tensor_parallel=2) as double:
        got = await asyncio.gather(*(greedy_tokens(double, f"t{i}", text, 24) for i, text in enumerate(PROMPTS)))
    assert all(len(tokens) == 24 for tokens in expected)
    assert got == expected
