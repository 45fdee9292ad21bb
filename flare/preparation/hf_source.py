"""A Hugging Face model directory as a package source.

The directory holds `config.json` (a model of a family flare serves: families/hf_config.py), one or
more `*.safetensors` files, `tokenizer.json` (or a tiktoken file with tokenizer code flare knows:
tiktoken_vocabulary.py), and the chat template in `tokenizer_config.json` (or `chat_template.jinja`).
Weights stored as FP8 with block scales (DeepSeek-V3's releases: hf_fp8.py) are dequantized to
float32 as they are read (`_tensor_reader`), the MTP layer's too; their `*_scale_inv` tensors go
with them, no tensor of the model.

A checkpoint may also ship multi-token-prediction layers in DeepSeek-V3's layout, declared by
`num_nextn_predict_layers` in its config and stored after the decoder layers, as
`model.layers.{num_hidden_layers + i}.*`. The layout read (`read_mtp_head`): `enorm`, `hnorm`
(the RMSNorms of the next token's embedding and of the target's hidden state), `eh_proj`
[hidden, 2 * hidden] over their concatenation, embedding first, a decoder layer, and optionally
`shared_head.norm` (the norm before the LM head, kept when it differs from the model's),
`shared_head.head` and `embed_tokens` (copies that must equal the model's LM head and embedding:
flare shares them). The decoder layer is the model's own kind where the model has latent
attention (DeepSeek-V2/V3: its MLA projections, and its MoE MLP where the model's last layer
has experts, converted and stacked as the model's layers are; `DraftHeadInfo.layer` "target"),
else a Llama decoder layer under Llama's names. Anything else under the layer is refused by
name. Only the first layer is read: flare applies one head step after step. The model's weights
never include these layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from flare.package import blocks as blocks_module
from flare.package.blocks import BlockTensor
from flare.preparation.families.deepseek import rope_interleaved
from flare.preparation.families.gpt_oss import gpt_oss_mxfp4_experts
from flare.preparation.families.hf_config import model_config_from_hf, served_model_type, text_config
from flare.preparation.families.hf_tensors import HF_LAYER_TENSOR, hf_tensor_name, tensor_converter
from flare.preparation.families.moe import stack_experts, stacked_expert_name
from flare.preparation.hf_fp8 import FP8_WEIGHT_DTYPE, fp8_block_dequantized, fp8_block_size, fp8_weight_scales
from flare.package.model_config import ModelConfig
from flare.package.directory import layers_held, weight_problems
from flare.package.problems import listed
from flare.preparation.recipes import hf_generation_defaults
from flare.preparation.source import ImportedDraftHead, ModelSource, SourceError, SourceWeights
from flare.preparation.tiktoken_vocabulary import TIKTOKEN_FILE, tiktoken_tokenizer_json


def open_hf_directory(path: Path, source: str | None = None) -> ModelSource:
    """Read a Hugging Face model directory's config, tokenizer and chat template (not its weights)."""
    path = Path(path)
    config_data = _read_json(path / "config.json", required=True)
    generation = _read_json(path / "generation_config.json", required=False)
    served_model_type(config_data)  # before the weights are looked at
    fp8_block = fp8_block_size(config_data)
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise SourceError(f"{path} holds no *.safetensors weights; flare reads safetensors only (not .bin or .pt)")
    stored = _stored_tensors(weight_files)
    fp8_scales = fp8_weight_scales(
        path, {n: t.shape for n, t in stored.items()}, {n: t.dtype for n, t in stored.items()}, fp8_block
    )
    read_tensor = _tensor_reader(stored, fp8_scales, fp8_block)
    # An FP8 weight's scale is read with it: the model's tensors are the rest.
    scale_names = set(fp8_scales.values())
    shapes = {name: t.shape for name, t in stored.items() if name not in scale_names}
    config = model_config_from_hf(config_data, generation, layers_held=layers_held(shapes, HF_LAYER_TENSOR))
    mtp_layers = _mtp_layer_count(config_data)
    mtp_prefixes = tuple(f"model.layers.{config.num_layers + i}." for i in range(mtp_layers))
    target_shapes = {n: s for n, s in shapes.items() if not n.startswith(mtp_prefixes)} if mtp_prefixes else shapes
    convert = tensor_converter(config, interleaved_rope=rope_interleaved(text_config(config_data)))
    # The package's names and shapes, from the same conversion run on meta tensors.
    converted = {
        name: tensor
        for source_name, shape in target_shapes.items()
        for name, tensor in convert(source_name, torch.empty(shape, device="meta")).items()
    }
    package_shapes = {name: tuple(tensor.shape) for name, tensor in stack_experts(converted, config).items()}
    tied_copy = config.tie_word_embeddings and "lm_head.weight" in package_shapes
    problems = weight_problems(
        config,
        {n: s for n, s in package_shapes.items() if not (tied_copy and n == "lm_head.weight")},
        lambda name: hf_tensor_name(name, config.architecture),
    )
    if problems:
        raise SourceError(
            f"the weights in {path} do not match its config.json" + listed(problems)
        )
    tokenizer_json = _tokenizer_json(path)

    def read(progress: Callable[[int, int], None], *, keep_blocks: bool) -> SourceWeights:
        weights = _read_weights(
            weight_files, stored, target_shapes.keys(), convert, read_tensor, fp8_scales.keys(), drop_lm_head=tied_copy,
            progress=progress, keep_blocks=keep_blocks,
        )
        floats = stack_experts(weights.floats, config)
        return SourceWeights(floats, weights.blocks, _stacked_record(weights.dequantized, floats))

    def read_weights(progress: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
        return read(progress, keep_blocks=False).floats

    # gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`) are kept as ggml MXFP4 blocks.
    mxfp4 = any(name.endswith("_blocks") for name in target_shapes)

    def read_draft_head() -> ImportedDraftHead:
        return read_mtp_head(path, config, weight_files, shapes, mtp_layers, convert, read_tensor)

    return ModelSource(
        name=path.resolve().name,
        source=source if source is not None else str(path),
        source_format="huggingface",
        source_sha256=None,
        config=config,
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(path),
        read_weights=read_weights,
        read_blocks=(lambda progress: read(progress, keep_blocks=True)) if mxfp4 else None,
        read_dequantized=(lambda progress: read(progress, keep_blocks=False)) if mxfp4 or fp8_scales else None,
        read_draft_head=read_draft_head if mtp_layers else None,
        declared_defaults=hf_generation_defaults(generation),
    )


def _mtp_layer_count(data: dict[str, Any]) -> int:
    value = data.get("num_nextn_predict_layers") or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SourceError(f"config.json: num_nextn_predict_layers must be a non-negative integer, got {value!r}")
    return value


# The tensors of a DeepSeek-V3-style MTP layer around its decoder layer, as flare names them.
_MTP_OWN = {"enorm.weight": "mtp.embed_norm.weight", "hnorm.weight": "mtp.hidden_norm.weight", "eh_proj.weight": "mtp.fc.weight"}
# Its decoder layer where that is a Llama layer.
_MTP_LLAMA_LAYER = {
    f"{part}.weight": f"mtp.layer.{part}.weight"
    for part in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )
}
# Copies of the model's own tensors an MTP layer may carry: (name in the layer, the model's name).
_MTP_SHARED = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}
_MTP_OWN_NORM = "shared_head.norm.weight"


def read_mtp_head(
    path: Path,
    config: ModelConfig,
    files: list[Path],
    shapes: dict[str, tuple[int, ...]],
    declared: int,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    read_tensor: Callable[[safe_open, str], torch.Tensor],
) -> ImportedDraftHead:
    """The first MTP layer of the checkpoint as a draft head (module docstring: the layout), its
    tensors read by `read_tensor` (`_tensor_reader`: FP8 weights dequantized) and its decoder
    layer converted by `convert` (the model's own conversion); SourceError naming every tensor
    that does not fit it. `shapes`: the checkpoint's tensors but FP8 weights' scales."""
    from flare.package.draft_head import FINAL_NORM_TENSOR, LAYER_PREFIX, draft_head_shapes

    prefix = f"model.layers.{config.num_layers}."
    layer = {n[len(prefix) :]: shape for n, shape in shapes.items() if n.startswith(prefix)}
    kind = "target" if config.latent_attention is not None else "llama"
    expected = draft_head_shapes(config, 1, layer=kind)
    h = config.hidden_size
    own = dict(_MTP_OWN)
    if kind == "llama":
        own.update(_MTP_LLAMA_LAYER)
        decoder: dict[str, tuple[int, ...]] = {}
    else:
        # The decoder layer's tensors under the package's names, as the model's layers become them.
        decoder = _converted_shapes(
            {prefix + n: s for n, s in layer.items() if n not in _MTP_OWN and n not in _MTP_SHARED and n != _MTP_OWN_NORM},
            convert,
            config,
        )
    problems = [f"{prefix}{name} is missing" for name in own if name not in layer]
    described = (
        "a DeepSeek-V3-style MTP layer on a Llama decoder layer"
        if kind == "llama"
        else f"a DeepSeek-V3-style MTP layer of this {config.architecture} model"
    )
    for name, shape in layer.items():
        if name in own:
            want = expected[own[name]]
        elif name in _MTP_SHARED:
            want = (config.vocab_size, h)
        elif name == _MTP_OWN_NORM:
            want = (h,)
        elif kind == "target":
            continue  # the decoder layer's, checked below under the package's names
        else:
            problems.append(f"{prefix}{name} is not part of {described}")
            continue
        if tuple(shape) != want:
            problems.append(f"{prefix}{name} has shape {list(shape)}, expected {list(want)}")
    if kind == "target":
        layer_expected = {n[len(LAYER_PREFIX) + 1 :]: s for n, s in expected.items() if n.startswith(LAYER_PREFIX + ".")}
        problems += [f"{prefix}{name} is not part of {described}" for name in decoder.keys() - layer_expected.keys()]
        problems += [f"{prefix}{name} is missing" for name in layer_expected if name not in decoder]
        problems += [
            f"{prefix}{name} has shape {list(decoder[name])}, expected {list(want)}"
            for name, want in layer_expected.items()
            if name in decoder and tuple(decoder[name]) != want
        ]
    if problems:
        reads = (
            "DeepSeek-V3's layout on a Llama decoder layer"
            if kind == "llama"
            else "DeepSeek-V3's layout on a decoder layer of the model's own kind"
        )
        raise SourceError(
            f"config.json in {path} declares {declared} multi-token-prediction layer(s), but {prefix}* is not one "
            f"flare can read (it reads {reads}; export with --drafter ngram to leave the layer out)"
            + listed(sorted(problems))
        )
    wanted = {prefix + n for n in layer} | {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"}
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    found[name] = read_tensor(f, name)
    lm_head = found["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    for name, model_name in _MTP_SHARED.items():
        model_tensor = lm_head if name.startswith("shared_head") else found[model_name]
        if prefix + name in found and not _same(found[prefix + name], model_tensor):
            raise SourceError(
                f"{prefix}{name} differs from the model's {'LM head' if name.startswith('shared_head') else 'embedding'}; "
                "flare's draft head shares the target's, so it cannot serve this MTP layer "
                "(export with --drafter ngram to leave it out)"
            )
    tensors = {flare: found[prefix + name].to(torch.float32) for name, flare in own.items()}
    if kind == "target":
        converted: dict[str, torch.Tensor] = {}
        for name in layer:
            if name not in own and name not in _MTP_SHARED and name != _MTP_OWN_NORM:
                converted.update(convert(prefix + name, found[prefix + name].to(torch.float32)))
        for name, tensor in stack_experts(converted, config).items():
            tensors[f"{LAYER_PREFIX}.{name[len(prefix):]}"] = tensor.contiguous()
    # eh_proj reads [enorm(embedding); hnorm(hidden)], flare's fc [hidden; embedding].
    eh = tensors["mtp.fc.weight"]
    tensors["mtp.fc.weight"] = torch.cat((eh[:, h:], eh[:, :h]), dim=1).contiguous()
    norm = found.get(prefix + _MTP_OWN_NORM)
    if norm is not None and not _same(norm, found["model.norm.weight"]):
        tensors[FINAL_NORM_TENSOR] = norm.to(torch.float32)
    return ImportedDraftHead(
        tensors=tensors,
        origin=f"{prefix.rstrip('.')} of {path} (DeepSeek-V3-style MTP layer, the first of {declared})",
        layer=kind,
    )


def _converted_shapes(
    shapes: dict[str, tuple[int, ...]], convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]], config: ModelConfig
) -> dict[str, tuple[int, ...]]:
    """The package's names and shapes of source tensors `shapes` under one layer's prefix,
    relative to it (the conversion run on meta tensors, experts stacked)."""
    converted = {
        name: tensor
        for source_name, shape in shapes.items()
        for name, tensor in convert(source_name, torch.empty(shape, device="meta")).items()
    }
    return {name.split(".", 3)[3]: tuple(t.shape) for name, t in stack_experts(converted, config).items()}


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise SourceError(
                f"{path.parent} has no {path.name}; give a GGUF file, a Hugging Face model directory, or 'default'"
            )
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SourceError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path} must hold a JSON object")
    return data


def _tokenizer_json(path: Path) -> str:
    """The directory's tokenizer.json, or the one its tiktoken file makes (Kimi K2, Moonlight);
    SourceError for a tokenizer.json the tokenizers library (which flare run loads it with)
    cannot read."""
    from tokenizers import Tokenizer

    tokenizer_path = path / "tokenizer.json"
    if tokenizer_path.is_file():
        try:
            text = tokenizer_path.read_text(encoding="utf-8")
            Tokenizer.from_str(text)
        except Exception as error:  # tokenizers raises a bare Exception; a file not UTF-8 UnicodeDecodeError
            raise SourceError(f"{tokenizer_path} is not a tokenizer the tokenizers library reads: {error}") from None
        return text
    if (path / TIKTOKEN_FILE).is_file():
        return tiktoken_tokenizer_json(path, _read_json(path / "tokenizer_config.json", required=False))
    raise SourceError(f"{path} has no tokenizer.json; save the tokenizer with a fast (tokenizers) backend")


def _chat_template(path: Path) -> str:
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json", required=False).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise SourceError(
            f"{path} has no chat template (tokenizer_config.json chat_template, or chat_template.jinja); "
            "flare serves chat models only"
        )
    return template


@dataclass(frozen=True)
class _StoredTensor:
    """A tensor as its safetensors file's header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name of it: "BF16", "F8_E4M3", ...


def _stored_tensors(files: list[Path]) -> dict[str, _StoredTensor]:
    stored: dict[str, _StoredTensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    header = f.get_slice(name)
                    stored[name] = _StoredTensor(file, tuple(header.get_shape()), header.get_dtype())
        except (SafetensorError, OSError) as error:
            raise SourceError(f"{file} is not a readable safetensors file: {error}") from None
    return stored


def _tensor_reader(
    stored: dict[str, _StoredTensor], fp8_scales: dict[str, str], fp8_block: tuple[int, int] | None
) -> Callable[[safe_open, str], torch.Tensor]:
    """`read(f, name)`: tensor `name` of the open safetensors file `f` as stored, but an FP8
    weight (`fp8_scales`: its scale's name) in float32, dequantized with its scale
    (`hf_fp8.fp8_block_dequantized`)."""

    def read(f: safe_open, name: str) -> torch.Tensor:
        tensor = f.get_tensor(name)
        scale_name = fp8_scales.get(name)
        if scale_name is None:
            return tensor
        assert fp8_block is not None  # fp8_weight_scales names no scale without it
        if stored[scale_name].file == stored[name].file:
            # DeepSeek's shards hold each scale beside its weight: no file is opened again.
            scale = f.get_tensor(scale_name)
        else:
            with safe_open(str(stored[scale_name].file), framework="pt") as g:
                scale = g.get_tensor(scale_name)
        return fp8_block_dequantized(tensor, scale, fp8_block)

    return read


def _stacked_record(dequantized: dict[str, str], stacked: dict[str, torch.Tensor]) -> dict[str, str]:
    """The record of dequantized tensors under the names `stack_experts` gave: an expert tensor
    stacked from dequantized ones takes their kind."""
    record: dict[str, str] = {}
    for name, kind in dequantized.items():
        target = name if name in stacked else stacked_expert_name(name)
        if target in stacked:
            record[target] = kind
    return record


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, whatever the two dtypes they are stored in."""
    return torch.equal(a, b) if a.dtype == b.dtype else torch.equal(a.float(), b.float())


def _read_weights(
    files: list[Path],
    stored: dict[str, _StoredTensor],
    names: Collection[str],
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    read_tensor: Callable[[safe_open, str], torch.Tensor],
    fp8_weights: Collection[str],
    *,
    drop_lm_head: bool,
    progress: Callable[[int, int], None],
    keep_blocks: bool = False,
) -> SourceWeights:
    """The model's tensors, source `names` (not the MTP layers, not the FP8 weights' scales:
    `read_tensor` reads those with their weights), in float32 under the package's names
    (`convert`), without a tied LM head's copy. gpt-oss's MXFP4 experts (`*_blocks` with their
    `*_scales`, `gpt_oss_mxfp4_experts`) as MXFP4 blocks with `keep_blocks`, else dequantized.
    The record of what was dequantized names the FP8 weights (`fp8_weights`) too. `stored`: the
    files' headers (`_stored_tensors`), where each tensor lies."""
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockTensor] = {}
    dequantized: dict[str, str] = {}
    total = len(names)
    done = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for source_name in f.keys():
                if source_name not in names:
                    continue
                done += 1
                if source_name.endswith("_blocks"):
                    scales_name = source_name.removesuffix("_blocks") + "_scales"
                    if scales_name not in stored:
                        raise SourceError(f"{source_name} has no {scales_name} beside it")
                    with safe_open(str(stored[scales_name].file), framework="pt") as g:
                        scales = g.get_tensor(scales_name)
                    name, kept = gpt_oss_mxfp4_experts(source_name, f.get_tensor(source_name), scales)
                    if keep_blocks:
                        blocks[name] = kept
                    else:
                        state[name] = blocks_module.dequantized(kept)
                        dequantized[name] = kept.ggml_type.name
                    progress(done, total)
                    continue
                if source_name.endswith("_scales") and source_name.removesuffix("_scales") + "_blocks" in stored:
                    progress(done, total)
                    continue
                for name, tensor in convert(source_name, read_tensor(f, source_name).to(torch.float32)).items():
                    if not (drop_lm_head and name == "lm_head.weight"):
                        state[name] = tensor.contiguous()
                        if source_name in fp8_weights:
                            dequantized[name] = FP8_WEIGHT_DTYPE
                progress(done, total)
    return SourceWeights(state, blocks, dequantized)
