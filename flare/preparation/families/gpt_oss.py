"""gpt-oss as the two sources write it: the GGUF names of its norm before the MLP and of its
attention sinks, the SwiGLU limit llama.cpp holds as a constant, and the Hugging Face
checkpoint's expert tensors (transposed, gate and up interleaved, MXFP4 blocks) in the package's
layout. Its routing fields are moe.py's."""

from __future__ import annotations

import re

import numpy as np
import torch

from flare.package.blocks import BlockTensor, GGMLType, mxfp4_from_openai
from flare.preparation.source import SourceError

# gpt-oss's own: its norm before the MLP is written as `post_attention_norm` (Gemma's sandwich
# norm's name elsewhere), and its sinks, one per head, as a weight.
GPT_OSS_GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm.weight", "attn_sinks": "self_attn.sinks"}
# gpt-oss's SwiGLU limit: llama.cpp's constant (LLM_FFN_SWIGLU_OAI_MOE), which no key carries.
GPT_OSS_SWIGLU_LIMIT = 7.0

_GPT_OSS_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def gpt_oss_tensor(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A gpt-oss expert tensor in the package's layout, or None for any other tensor. transformers
    keeps them transposed, [E, in, out], with gate and up interleaved (gate at even columns,
    `GptOssExperts._apply_gate`): the package's are [E, out, in], gate rows then up rows."""
    match = _GPT_OSS_EXPERTS.match(name)
    if match is None:
        return None
    prefix, projection, kind = match.groups()
    if kind == "_scales":
        return {}  # read with its blocks (`gpt_oss_mxfp4_experts`)
    if kind == "_blocks":
        # The shape of what `gpt_oss_mxfp4_experts` makes of it (this runs on meta tensors only).
        experts, rows, groups, _ = tensor.shape
        return {f"{prefix}.{projection}.weight": torch.empty((experts, rows, groups * 32), device="meta")}
    if kind == "_bias":
        bias = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1) if projection == "gate_up_proj" else tensor
        return {f"{prefix}.{projection}.bias": bias}
    if tensor.dim() != 3:
        return {f"{prefix}.{projection}.weight": tensor}  # for the shape check to name
    if projection == "gate_up_proj":
        tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
    return {f"{prefix}.{projection}.weight": tensor.transpose(1, 2)}


def gpt_oss_mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[str, BlockTensor]:
    """gpt-oss's MXFP4 experts, `*_blocks` uint8 [E, rows, groups, 16] and `*_scales` [E, rows,
    groups] ([out, in] per expert, gate_up's rows interleaved gate/up), as the package's stacked
    projection in ggml MXFP4 rows (`blocks.mxfp4_from_openai`), gate rows then up rows: whole
    rows move, so the values are exactly the checkpoint's."""
    match = _GPT_OSS_EXPERTS.match(name)
    assert match is not None and match.group(3) == "_blocks", name
    prefix, projection, _ = match.groups()
    b, s = blocks.numpy(), scales.numpy()
    if b.ndim != 4 or s.shape != b.shape[:3]:
        raise SourceError(f"{name}: MXFP4 blocks [E, rows, groups, 16] with scales [E, rows, groups], got {list(b.shape)} and {list(s.shape)}")
    if projection == "gate_up_proj":
        b = np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)
        s = np.concatenate([s[:, 0::2], s[:, 1::2]], axis=1)
    rows = mxfp4_from_openai(np.ascontiguousarray(b), np.ascontiguousarray(s))
    experts, out = rows.shape[:2]
    data = torch.from_numpy(np.ascontiguousarray(rows.reshape(experts * out, -1)))
    return f"{prefix}.{projection}.weight", BlockTensor(GGMLType.MXFP4, data, (experts, out, b.shape[2] * 32))
