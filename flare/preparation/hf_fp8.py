"""A Hugging Face checkpoint's block-scaled FP8 weights, as DeepSeek-V3, DeepSeek-R1 and Kimi K2
are released.

config.json declares them: `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}`. Each such weight `X` [out, in] is stored as float8
(safetensors F8_E4M3) beside `X_scale_inv` [ceil(out / b0), ceil(in / b1)] (float32), whose entry
[i, j] multiplies the weight's block of rows i*b0.. and columns j*b1.. (the blocks at the right
and bottom edges partial): the weight is `weight.float() * scale_inv` block by block. The rest of
the checkpoint (embeddings, norms, the MoE router, the LM head) is stored in bfloat16.

flare has no FP8 kernel: `hf_source.py` dequantizes each FP8 weight to float32 as it is read,
before the family's own conversion, and the package stores floats as from any float checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flare.package.problems import listed
from flare.preparation.source import SourceError

# The name of weight X's scale tensor is X + this (`model.layers.0.mlp.down_proj.weight_scale_inv`).
FP8_SCALE_SUFFIX = "_scale_inv"
# The float8 dtype DeepSeek's weights are stored in, as safetensors names it (`fmt` e4m3).
FP8_WEIGHT_DTYPE = "F8_E4M3"


def fp8_block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The weight block size config.json declares for block-scaled FP8 weights; None where it
    declares no quantization, or gpt-oss's MXFP4 (families/gpt_oss.py reads its experts).
    SourceError for a quantization flare does not read."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise SourceError(f"config.json: quantization_config must be a JSON object, got {quantization!r}")
    method = quantization.get("quant_method")
    if method == "mxfp4":
        return None
    if method != "fp8":
        raise SourceError(
            f"config.json: quantization_config's quant_method {method!r} is not one flare reads; it reads 'fp8' "
            "(FP8 weights with block scales, as DeepSeek-V3 ships them) and gpt-oss's 'mxfp4': "
            "export the model's float (bf16 or float32) weights instead"
        )
    # transformers' FineGrainedFP8Config writes no fmt: e4m3 is the format it reads.
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise SourceError(f"config.json: quantization_config's fmt {fmt!r} is not one flare reads; it reads fp8 weights in e4m3")
    block = quantization.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
    ):
        raise SourceError(
            f"config.json: quantization_config's weight_block_size must be two positive integers (DeepSeek-V3's "
            f"[128, 128]), got {block!r}; flare reads fp8 weights with block scales only"
        )
    return block[0], block[1]


def fp8_weight_scales(
    path: Path, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], block: tuple[int, int] | None
) -> dict[str, str]:
    """Each float8 tensor's scale tensor, by the tensor's name, from the safetensors headers of
    the checkpoint at `path` (`dtypes`: safetensors' names, "F8_E4M3"); SourceError naming every
    float8 tensor that cannot be dequantized: no block size declared, another float8 format, not
    a matrix, no scale beside it, or a scale not of one entry per block."""
    scales: dict[str, str] = {}
    problems: list[str] = []
    for name, dtype in dtypes.items():
        if not dtype.startswith("F8_") or name.endswith(FP8_SCALE_SUFFIX):
            continue
        scale = name + FP8_SCALE_SUFFIX
        shape = shapes[name]
        if block is None:
            problems.append(f"{name} is stored as {dtype}, but config.json declares no fp8 quantization_config")
        elif dtype != FP8_WEIGHT_DTYPE:
            problems.append(f"{name} is stored as {dtype}; flare reads fp8 weights in e4m3 ({FP8_WEIGHT_DTYPE})")
        elif len(shape) != 2:
            problems.append(f"{name} is stored as {dtype} with shape {list(shape)}; flare reads fp8 weights [out, in]")
        elif scale not in shapes:
            problems.append(f"{name} is stored as {dtype} but has no {scale} beside it")
        elif tuple(shapes[scale]) != (want := _block_scale_shape(shape, block)):
            problems.append(
                f"{scale} has shape {list(shapes[scale])}, expected {list(want)}: one scale per {block[0]}x{block[1]} "
                f"block (weight_block_size) of {name} {list(shape)}"
            )
        else:
            scales[name] = scale
    if problems:
        raise SourceError(f"the fp8 weights in {path} cannot be dequantized" + listed(sorted(problems)))
    return scales


def _block_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """One scale per block of a weight [out, in], the edge blocks partial."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def fp8_block_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values of an FP8 `weight` [out, in]: each block of `block` rows and columns
    times its entry of `scale_inv` (its shape checked by `fp8_weight_scales`)."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales
