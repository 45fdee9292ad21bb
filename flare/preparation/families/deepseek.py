"""DeepSeek-V2/V3 as Hugging Face checkpoints (`deepseek_v2`, `deepseek_v3`) and GGUF files
(llama.cpp's `deepseek2`) write them, each rule's two readings side by side (`hf_*`, `gguf_*`):
the shapes of multi-head latent attention (MLA) and its softmax scale under yarn, the routed and
shared experts (from `first_k_dense_replace` / the first layer with a router on), the GGUF's
split key/value up-projections (`LATENT_UP_PROJECTIONS`), and the rope rows of q and kv_a, in
interleaved-pair order in both sources, reordered at export to the rotate-half order flare's RoPE
applies (`deinterleave_rope_rows`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from flare.package.model_config import LatentAttention, ManifestError, RopeScaling
from flare.preparation.families.gguf_keys import GGUFKeys
from flare.preparation.source import SourceError

# The newer converter writes kv_b_proj as two per-head tensors, for llama.cpp's absorbed MLA:
# attn_k_b [heads, kv_lora_rank, nope] (each head's key block transposed) and attn_v_b [heads,
# v_head_dim, kv_lora_rank]; export joins them back into kv_b_proj (`TensorPlan.latent_part`).
LATENT_UP_PROJECTIONS = ("attn_k_b", "attn_v_b")


def hf_latent_attention(data: dict[str, Any], layers: int, unsupported: list[str]) -> LatentAttention | None:
    """DeepSeek-V2/V3's MLA shapes."""
    try:
        q_rank = data.get("q_lora_rank")
        return LatentAttention(
            q_lora_rank=None if q_rank is None else int(q_rank),
            kv_lora_rank=int(data["kv_lora_rank"]),
            qk_nope_head_dim=int(data["qk_nope_head_dim"]),
            qk_rope_head_dim=int(data["qk_rope_head_dim"]),
            v_head_dim=int(data["v_head_dim"]),
        )
    except KeyError as error:
        raise SourceError(f"config.json lacks {error.args[0]!r}") from None
    except (ManifestError, TypeError, ValueError) as error:
        raise SourceError(f"config.json: {error}") from None


def gguf_latent_attention(keys: GGUFKeys) -> LatentAttention:
    """deepseek2's MLA shapes: the converter writes the latent as an MQA head (key_length
    kv_lora_rank + rope, value_length kv_lora_rank) and the per-head shapes as key_length_mla
    (nope + rope) and value_length_mla; files before those keys have the per-head ones in
    key_length / value_length. V2-Lite has no q_lora_rank (a plain attn_q)."""
    rope = keys.integer("rope.dimension_count")
    key_mla = keys.maybe_integer("attention.key_length_mla")
    value_mla = keys.maybe_integer("attention.value_length_mla")
    if key_mla is None or value_mla is None:
        key_mla, value_mla = keys.integer("attention.key_length"), keys.integer("attention.value_length")
    if key_mla <= rope:
        raise SourceError(f"{keys.path}: the MLA key length {key_mla} must exceed the rope dimensions {rope}")
    try:
        return LatentAttention(
            q_lora_rank=keys.maybe_integer("attention.q_lora_rank"),
            kv_lora_rank=keys.integer("attention.kv_lora_rank"),
            qk_nope_head_dim=key_mla - rope,
            qk_rope_head_dim=rope,
            v_head_dim=value_mla,
        )
    except ManifestError as error:
        raise SourceError(f"{keys.path}: {error}") from None


def hf_latent_softmax_scale(data: dict[str, Any], latent: LatentAttention) -> float:
    """MLA's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn
    (DeepSeek's reference and transformers' `yarn_apply_mscale`: the yarn factor on the rotary
    dims' cos/sin does not reach the nope dims, this does)."""
    scale = latent.qk_head_dim**-0.5
    parameters = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type")) or "default"
    m_all = parameters.get("mscale_all_dim")
    factor = parameters.get("factor")
    if kind != "default" and m_all and factor and float(factor) > 1:
        mscale = 0.1 * float(m_all) * math.log(float(factor)) + 1.0
        scale *= mscale * mscale
    return scale


def gguf_latent_scales(keys: GGUFKeys, latent: LatentAttention, scaling: RopeScaling | None) -> tuple[float, RopeScaling | None]:
    """MLA's softmax scale and RoPE scaling from a deepseek2 file.

    The converter writes yarn's mscale_all_dim m as `rope.scaling.yarn_log_multiplier` = 0.1 m
    (and not yarn's mscale): the softmax scale is (nope + rope)^-0.5 mscale^2 with mscale =
    1 + 0.1 m ln(factor) (transformers' `yarn_apply_mscale`), and the factor on cos/sin is
    mscale(factor, mscale) / mscale(factor, m), 1 for DeepSeek's releases (mscale = m), which is
    what llama.cpp computes too. Without the key, yarn's own default."""
    scale = latent.qk_head_dim**-0.5
    log_mul = keys.maybe_number("rope.scaling.yarn_log_multiplier", allow_zero=True)
    if scaling is None or scaling.kind != "yarn" or log_mul is None:
        return scale, scaling
    mscale = 1.0 + log_mul * math.log(scaling.factor) if scaling.factor > 1 else 1.0
    attention = keys.maybe_number("rope.scaling.yarn_attn_factor")
    return scale * mscale * mscale, dataclasses.replace(scaling, attention_factor=1.0 if attention is None else attention)


def hf_deepseek_moe_fields(data: dict[str, Any], layers: int) -> dict[str, Any]:
    """DeepSeek-V2/V3's experts (transformers' DeepseekV2Moe / DeepseekV3MoE): every layer from
    `first_k_dense_replace` on, `n_shared_experts` x moe_intermediate_size of shared expert (no
    gate), weights times `routed_scaling_factor`. V3 routes by sigmoid scores with the correction
    bias, groups scored by their top two (sigmoid_group, `norm_topk_prob`); V2 by softmax, greedy
    or group_limited_greedy (its weights never renormalized)."""
    experts = int(data.get("n_routed_experts") or 0)
    first_moe = int(data.get("first_k_dense_replace") or 0)
    if not experts or first_moe >= layers:
        return {}  # every layer dense: the expert keys describe none
    width = int(data["moe_intermediate_size"])
    v3 = data.get("model_type") == "deepseek_v3"
    method = data.get("topk_method") or "greedy"
    grouped = v3 or method == "group_limited_greedy"
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": width,
        "moe_layers": tuple(range(first_moe, layers)),
        "routing": "sigmoid_group" if v3 else "softmax_group_max" if grouped else "softmax",
        "norm_topk_prob": bool(data.get("norm_topk_prob")) if v3 else False,
        "routed_scaling_factor": float(data.get("routed_scaling_factor") or 1.0),
        "n_group": int(data.get("n_group") or 1) if grouped else 1,
        "topk_group": int(data.get("topk_group") or 1) if grouped else 1,
        "shared_expert_intermediate_size": int(data.get("n_shared_experts") or 0) * width,
    }


def gguf_deepseek_moe_fields(keys: GGUFKeys, experts: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """deepseek2's experts (llama.cpp's llama_model_deepseek2): the layers with a router (those
    from leading_dense_block_count on); sigmoid gating (V3) is group routing with the correction
    bias `exp_probs_b`; softmax (V2, llama.cpp's default for the arch) is group-limited where the
    file has groups of which fewer are used, greedy otherwise; `expert_weights_scale` and
    `expert_weights_norm` (off unless given); the shared experts one MLP of expert_shared_count
    experts' width."""
    layers = sorted(int(m.group(1)) for name in shapes if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", name)))
    if not layers:
        return {}  # every layer dense: the expert keys describe none
    gating = keys.metadata.get(keys._key("expert_gating_func"))
    if gating not in (None, 1, 2):  # softmax, sigmoid
        raise keys._bad(keys._key("expert_gating_func"), gating, "1 (softmax) or 2 (sigmoid), DeepSeek's gatings")
    if gating != 2 and any(re.fullmatch(r"blk\.\d+\.exp_probs_b\.bias", name) for name in shapes):
        # llama.cpp would serve such a file, softmax scores with V3's bias added to choose: a model
        # no checkpoint is. The converter writes the key only from config.json's scoring_func,
        # which DeepSeek's releases have and a config saved by transformers' DeepseekV3Config lacks.
        found = "missing" if gating is None else f"{gating} (softmax)"
        raise SourceError(
            f"{keys.path} has DeepSeek-V3's expert correction bias (exp_probs_b) but the GGUF metadata key "
            f"{keys._key('expert_gating_func')} is {found}: V3 scores its experts by sigmoid (2). llama.cpp's "
            f'converter writes the key from config.json\'s scoring_func: add "scoring_func": "sigmoid" there and convert again'
        )
    groups = keys.maybe_integer("expert_group_count") or 1
    used_groups = keys.maybe_integer("expert_group_used_count") or groups
    width = keys.integer("expert_feed_forward_length")
    sigmoid = gating == 2
    grouped = sigmoid or used_groups < groups
    scale = keys.maybe_number("expert_weights_scale")
    return {
        "num_experts": experts,
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "moe_intermediate_size": width,
        "moe_layers": tuple(layers),
        "routing": "sigmoid_group" if sigmoid else "softmax_group_max" if grouped else "softmax",
        "norm_topk_prob": bool(keys.metadata.get(keys._key("expert_weights_norm"), False)),
        "routed_scaling_factor": 1.0 if scale is None else scale,
        "n_group": groups if grouped else 1,
        "topk_group": used_groups if grouped else 1,
        "shared_expert_intermediate_size": (keys.maybe_integer("expert_shared_count") or 0) * width,
    }


def rope_interleaved(data: dict[str, Any]) -> bool:
    """Whether a checkpoint rotates interleaved pairs (x0, x1), (x2, x3), ... rather than halves:
    DeepSeek-V2 always, V3 unless `rope_interleave` is false (transformers' classes)."""
    model_type = data.get("model_type")
    return model_type == "deepseek_v2" or (model_type == "deepseek_v3" and data.get("rope_interleave", True) is not False)


def deinterleaved_row_order(rows: int, start: int, rope: int, stride: int) -> torch.Tensor:
    """The row order that takes the `rope` rows at `start` of every `stride` rows (a head's rope
    part) from interleaved pairs to halves: rows 0, 2, 4, ... then 1, 3, 5, .... Rotate-half RoPE
    on the reordered rows computes exactly what pairwise RoPE does on the original ones, and a
    query and key reordered alike have the same dot products (layers/latent_attention.py)."""
    pairs = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    order = torch.arange(rows).view(-1, stride)
    order[:, start : start + rope] = order[:, start : start + rope][:, pairs]
    return order.flatten()


def deinterleave_rope_rows(weight: torch.Tensor, start: int, rope: int, stride: int) -> torch.Tensor:
    """`weight` with its rope rows in rotate-half order (`deinterleaved_row_order`)."""
    if weight.device.type == "meta":
        return weight
    return weight[deinterleaved_row_order(weight.shape[0], start, rope, stride)]
