"""A GGUF file (llama.cpp's format) as a package source.

Each family's metadata and tensor names are read as `families/gguf_config.py` and
`families/gguf_tensors.py` describe: weights renamed to the package's canonical (Hugging Face
Llama) names, fused tensors split, and the rows of q_proj and k_proj put back in Hugging Face
order where the converter permuted them (`unpermute_rope_rows`).
`read_blocks` keeps each tensor of a type the engine multiplies from blocks (`blocks.KEPT_TYPES`)
as its ggml blocks (split and unpermuted by whole block rows) and dequantizes the rest to float32;
`read_weights` dequantizes everything with the `gguf` package to float32. Either refuses a tensor
whose blocks have a NaN or infinite scale, naming it.
The tokenizer, stored in GGUF as metadata (vocabulary, merges, token types), is rebuilt as a
Hugging Face `tokenizers` tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quant_shape_to_byte_shape

from flare.package.blocks import KEPT_TYPES, BlockTensor, block_problems, unpermute_block_rows
from flare.package.blocks import dequantized as dequantized_values
from flare.preparation.families.deepseek import deinterleaved_row_order
from flare.preparation.families.gguf_config import model_config, served_architecture
from flare.preparation.families.gguf_tensors import ROPE_TENSORS, TensorPlan, gguf_tensor_name, tensor_plans
from flare.preparation.families.moe import fused_expert_names
from flare.preparation.gguf_layout import GGUFLayout, GGUFTensorInfo, read_gguf_layout, read_gguf_value
from flare.preparation.gguf_tokenizer import build_tokenizer_json
from flare.package.directory import sha256_of, weight_problems
from flare.package.model_config import ModelConfig
from flare.package.problems import listed
from flare.preparation.recipes import gguf_sampling_defaults
from flare.preparation.source import ModelSource, SourceError, SourceWeights


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of the q/k projection rows (and of their biases).

    Hugging Face's Llama applies RoPE in rotate-half form: in each head, dimension j pairs with
    j + head_dim/2. llama.cpp pairs adjacent dimensions (2j, 2j+1), so its converter permutes the
    rows of each head: row order (2, head_dim/2) -> (head_dim/2, 2), i.e.
    `w.reshape(heads, 2, hd/2, in).swapaxes(1, 2)` (convert_hf_to_gguf.py, LlamaModel.permute).
    The inverse reads the rows as (heads, hd/2, 2, in) and swaps axes 1 and 2 back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def open_gguf(path: Path, source: str | None = None) -> ModelSource:
    """Read a GGUF file's architecture, tokenizer and chat template (not its weights)."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path} is not a file; give a GGUF file, a Hugging Face model directory, or 'default'")
    # Every count and length bounded by the file's size: the values and tensors are then read
    # where the walk found them.
    layout = read_gguf_layout(path)
    try:
        data = np.memmap(path, mode="r")
    except (ValueError, OSError) as error:
        raise SourceError(f"{path} is not a readable GGUF file: {error}") from None
    tensors = [_tensor(data, info) for info in layout.tensors]
    metadata = _Metadata(data, layout, path)
    # An architecture flare does not serve is refused before anything else is read.
    gguf_arch = metadata.require("general.architecture")
    served_architecture(path, gguf_arch)
    # gguf reports shapes as [in, out]; the tensors are [out, in], as Hugging Face's.
    gguf_shapes = {tensor.name: tuple(int(n) for n in reversed(tensor.shape)) for tensor in tensors}
    rope_tensors = {
        tensor.name: [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type)).reshape(-1)]
        for tensor in tensors
        if tensor.name in ROPE_TENSORS
    }
    config = model_config(path, metadata, gguf_shapes, rope_tensors)
    plans = tensor_plans(path, config, gguf_shapes, gguf_arch)
    shapes = {
        # attn_k_b / attn_v_b are 3-D per-head blocks that join into one kv_b_proj (its rows).
        part.name: (part.stop - part.start, *(gguf_shapes[gguf_name][1:] if plan.latent_part is None else _latent_in(gguf_name, gguf_shapes, plan)))
        for gguf_name, plan in plans.items()
        for part in plan.parts
    }
    for fused, (gate, up) in fused_expert_names(list(shapes)).items():
        if shapes[gate] == shapes[up]:
            experts, rows, *width = shapes.pop(gate)
            del shapes[up]
            shapes[fused] = (experts, 2 * rows, *width)
    problems = weight_problems(config, shapes, lambda name: gguf_tensor_name(name, config.architecture))
    if problems:
        raise SourceError(
            f"the tensors of {path} do not match its metadata" + listed(problems)
        )
    tokenizer_json = build_tokenizer_json(metadata)
    chat_template = metadata.get("tokenizer.chat_template")
    if not chat_template:
        raise SourceError(f"{path} has no chat template (tokenizer.chat_template); flare serves chat models only")

    def read_weights(progress: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
        return _read_weights(tensors, plans, progress, keep_blocks=False, config=config).floats

    def read_dequantized(progress: Callable[[int, int], None]) -> SourceWeights:
        return _read_weights(tensors, plans, progress, keep_blocks=False, config=config)

    def read_blocks(progress: Callable[[int, int], None]) -> SourceWeights:
        return _read_weights(tensors, plans, progress, keep_blocks=True, config=config)

    return ModelSource(
        name=path.name.split(".")[0],
        source=source if source is not None else str(path),
        source_format="gguf",
        source_sha256=sha256_of(path),
        config=config,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        read_weights=read_weights,
        read_blocks=read_blocks,
        read_dequantized=read_dequantized,
        declared_defaults=gguf_sampling_defaults(metadata.get),
    )


@dataclass(frozen=True)
class _Tensor:
    """A tensor as gguf-py's reader gives it (`ReaderTensor`): dimensions innermost first, and
    its data a view of the mapped file: typed values for float and integer types, for block types
    the bytes of each row (`quant_shape_to_byte_shape`)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


# The types gguf-py reads as typed values; every other one (bfloat16 and the block types) as bytes.
_VALUE_TYPES = {
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


def _tensor(data: np.ndarray, info: GGUFTensorInfo) -> _Tensor:
    shape = tuple(reversed(info.dims))
    raw = data[info.data_start : info.data_start + info.data_bytes]
    if info.kind in _VALUE_TYPES:
        values = raw.view(_VALUE_TYPES[info.kind]).reshape(shape)
    else:
        values = raw.reshape(quant_shape_to_byte_shape(shape, info.kind))
    return _Tensor(info.name, info.kind, info.dims, values)


class _Metadata:
    def __init__(self, data: np.ndarray, layout: GGUFLayout, path: Path) -> None:
        self._data = data
        self._fields = layout.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else read_gguf_value(self._data, field)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise SourceError(f"{self._path} lacks the GGUF metadata key {key}; it cannot be exported")
        return value


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _latent_in(gguf_name: str, shapes: dict[str, tuple[int, ...]], plan: TensorPlan) -> tuple[int, ...]:
    """The input width (kv_lora_rank) of the kv_b_proj an attn_k_b [heads, rank, nope] or
    attn_v_b [heads, v, rank] joins into; the shape as it is where it is not 3-D (for the shape
    check to name)."""
    shape = shapes[gguf_name]
    if len(shape) != 3:
        return shape[1:]
    return (shape[1],) if plan.latent_part == "attn_k_b" else (shape[2],)


def _joined_kv_b(k_b: np.ndarray, v_b: np.ndarray, name: str, config: ModelConfig) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), rank] from the converter's attn_k_b [heads, rank, nope]
    (each head's key block, transposed) and attn_v_b [heads, v, rank]: per head, its key rows
    then its value rows, as the checkpoint holds them."""
    latent = config.latent_attention
    assert latent is not None
    heads, rank = config.num_heads, latent.kv_lora_rank
    want_k, want_v = (heads, rank, latent.qk_nope_head_dim), (heads, latent.v_head_dim, rank)
    if k_b.shape != want_k or v_b.shape != want_v:
        raise SourceError(f"{name}: attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} must be {list(want_k)} and {list(want_v)}")
    keys = torch.from_numpy(np.array(k_b, np.float32)).transpose(1, 2)
    values = torch.from_numpy(np.array(v_b, np.float32))
    return torch.cat((keys, values), dim=1).reshape(-1, rank).contiguous()


def _read_weights(
    source_tensors: list[_Tensor],
    plans: dict[str, TensorPlan],
    progress: Callable[[int, int], None],
    *,
    keep_blocks: bool,
    config: ModelConfig,
) -> SourceWeights:
    floats: dict[str, torch.Tensor] = {}
    latent_parts: dict[str, dict[str, np.ndarray]] = {}
    blocks: dict[str, BlockTensor] = {}
    dequantized: dict[str, str] = {}
    problems: list[str] = []
    tensors = [tensor for tensor in source_tensors if tensor.name in plans]
    # attn_k_b and attn_v_b give one tensor between them.
    total = sum(len(plans[tensor.name].parts) for tensor in tensors if plans[tensor.name].latent_part != "attn_v_b")
    done = 0
    for tensor in tensors:
        plan = plans[tensor.name]
        kind = tensor.tensor_type
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # Problems name the package tensor, or the GGUF one where it is split into several.
        label = plan.parts[0].name if len(plan.parts) == 1 else tensor.name
        if kind in KEPT_TYPES and plan.latent_part is None:
            # Stacked experts [E, out, in] are checked as their E * out rows.
            found = block_problems(label, kind, tensor.data, (int(np.prod(shape[:-1])), shape[-1]))
            problems += found
            if keep_blocks and not found:
                # Blocks run along the input dimension: a row range of the fused tensor is whole block rows.
                data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
                if plan.rope_rows is not None:
                    data = data[deinterleaved_row_order(data.shape[0], *plan.rope_rows)]
                for part in plan.parts:
                    part_shape = (part.stop - part.start, *shape[1:])
                    rows = data[part.start : part.stop].reshape(-1, data.shape[-1]).contiguous()
                    kept = BlockTensor(kind, rows, part_shape)
                    blocks[part.name] = kept if plan.heads is None else unpermute_block_rows(kept, plan.heads)
                    done += 1
                    progress(done, total)
                continue
            if found:
                continue
        weight = dequantize(tensor.data, kind)
        if kind not in _FLOAT_TYPES and not np.isfinite(weight).all():
            problems.append(f"tensor {label}: its {kind.name} blocks dequantize to NaN or infinite values (a bad scale)")
            continue
        if plan.latent_part is not None:
            name = plan.parts[0].name
            if kind not in _FLOAT_TYPES:
                dequantized[name] = kind.name
            pair = latent_parts.setdefault(name, {})
            pair[plan.latent_part] = weight
            if len(pair) == 2:
                floats[name] = _joined_kv_b(pair["attn_k_b"], pair["attn_v_b"], name, config)
                done += 1
                progress(done, total)
            continue
        if plan.rope_rows is not None:
            weight = weight[deinterleaved_row_order(weight.shape[0], *plan.rope_rows).numpy()]
        for part in plan.parts:
            if kind not in _FLOAT_TYPES:
                dequantized[part.name] = kind.name
            rows = weight[part.start : part.stop]
            if plan.heads is not None:
                rows = unpermute_rope_rows(rows, plan.heads)
            # Unquantized tensors come back as read-only views of the memory-mapped file: copy those.
            floats[part.name] = torch.from_numpy(np.require(rows, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
            done += 1
            progress(done, total)
    if problems:
        raise SourceError("the GGUF's blocks cannot be served" + listed(problems))
    _fuse_expert_gate_up(floats, blocks, dequantized)
    return SourceWeights(floats, blocks, dequantized)


def _fuse_expert_gate_up(floats: dict[str, torch.Tensor], blocks: dict[str, BlockTensor], dequantized_types: dict[str, str]) -> None:
    """Join each MoE layer's `ffn_gate_exps` and `ffn_up_exps` per expert into the package's
    `mlp.experts.gate_up_proj.weight` [E, 2 I, hidden] (expert e's gate rows, then its up rows),
    in place: as blocks where both are blocks of one type (whole block rows move, exactly),
    otherwise as float32 (their blocks dequantized, gguf-py's values)."""
    for fused, (gate, up) in fused_expert_names([*floats, *blocks]).items():
        if gate in blocks and up in blocks and blocks[gate].ggml_type == blocks[up].ggml_type:
            g, u = blocks.pop(gate), blocks.pop(up)
            experts, rows, width = g.shape
            data = torch.cat((g.data.view(experts, rows, -1), u.data.view(experts, rows, -1)), dim=1)
            blocks[fused] = BlockTensor(g.ggml_type, data.reshape(experts * 2 * rows, -1), (experts, 2 * rows, width))
            continue
        parts, types = [], [dequantized_types.pop(gate, None), dequantized_types.pop(up, None)]
        for name in (gate, up):
            if name in blocks:
                tensor = blocks.pop(name)
                types.append(tensor.ggml_type.name)
                parts.append(dequantized_values(tensor))
            else:
                parts.append(floats.pop(name))
        if any(types):
            dequantized_types[fused] = next(t for t in types if t)
        floats[fused] = torch.cat(parts, dim=1)
