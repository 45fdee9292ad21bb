"""The mixture-of-experts families as Hugging Face checkpoints and GGUF files write them: the
`ModelConfig` fields of their experts and routing (DeepSeek's from deepseek.py, gpt-oss's here),
and their expert tensors in the package's stacked layout (`package.moe_weight_shapes`).

Hugging Face (`hf_moe_fields`, `moe_tensor_name`, `stack_experts`): the router (`mlp.gate`,
Mixtral's `block_sparse_moe.gate`) becomes `mlp.router`; the experts, saved one by one
(`experts.N.{gate,up,down}_proj`, Mixtral's `experts.N.w1/w3/w2`) or fused as transformers 5
keeps them in memory (`experts.gate_up_proj` [E, 2 I, hidden], `experts.down_proj` [E, hidden,
I]), become the stacked `mlp.experts.gate_up_proj.weight` and `mlp.experts.down_proj.weight`
(`stack_experts`, after the per-tensor conversion).

GGUF (`gguf_moe_fields`, `fused_expert_names`): `qwen2moe`, `qwen3moe`, and `llama` with
`expert_count` (Mixtral); a layer with a router is a MoE layer (gguf_tensors.py names its
tensors), and gate and up are fused per expert into `mlp.experts.gate_up_proj`. llama.cpp
renormalizes the top-k weights for qwen3moe and llama, not for qwen2moe (`expert_weights_norm`
where a file gives it), and runs every layer of these files as MoE (the converter refuses Qwen's
dense `mlp_only_layers`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flare.package.model_config import ModelConfig
from flare.preparation.families.deepseek import gguf_deepseek_moe_fields, hf_deepseek_moe_fields
from flare.preparation.families.gguf_keys import GGUFKeys
from flare.preparation.source import SourceError

# llama.cpp's norm_w of `build_moe_ffn` per architecture (src/models/*.cpp): whether the top-k
# weights are divided by their sum; `{arch}.expert_weights_norm` overrides it where given.
GGUF_MOE_NORMALIZED = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def hf_moe_fields(data: dict[str, Any], architecture: str, layers: int, unsupported: list[str]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` (none for a dense family): which layers
    are MoE (Qwen: not in `mlp_only_layers` and every `decoder_sparse_step`-th; Mixtral: all),
    the experts and their width (Mixtral's `intermediate_size` is each expert's), the shared
    expert and its sigmoid gate (Qwen2-MoE), softmax routing with `norm_topk_prob` (Mixtral:
    always)."""
    if architecture == "deepseek2":
        return hf_deepseek_moe_fields(data, layers)
    if architecture not in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"):
        return {}
    if architecture == "gpt_oss":
        # Every layer: a router with a bias, top-k of its logits then softmax over those k, and
        # experts of width `intermediate_size` with biases (transformers' GptOssMLP).
        experts = int(data.get("num_local_experts") or 0)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(data["intermediate_size"]),
            "moe_layers": tuple(range(layers)) if experts else (),
            "routing": "topk_softmax",
            "router_bias": True,
            "expert_bias": True,
        }
    if architecture == "mixtral":
        experts = int(data.get("num_local_experts") or 0)
        moe_layers = tuple(range(layers))
        width = int(data["intermediate_size"])
        normalize = True
    else:
        # Qwen's own key; transformers 5 saves it under its alias, Mixtral's name.
        experts = int(data.get("num_experts") or data.get("num_local_experts") or 0)
        step = int(data.get("decoder_sparse_step") or 1)
        dense = set(data.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        width = int(data["moe_intermediate_size"])
        normalize = bool(data.get("norm_topk_prob", architecture == "qwen3_moe"))
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": width,
        "moe_layers": moe_layers if experts else (),
        "routing": "softmax",
        "norm_topk_prob": normalize,
    }
    if architecture == "qwen2_moe":
        shared = int(data.get("shared_expert_intermediate_size") or 0)
        fields["shared_expert_intermediate_size"] = shared
        fields["shared_expert_gate"] = shared > 0
    return fields


def gguf_moe_fields(path: Path, keys: GGUFKeys, gguf_arch: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` (none without `expert_count`): the layers
    holding a router (`ffn_gate_inp`), llama.cpp's routing of the architecture (softmax, top
    `expert_used_count`, `GGUF_MOE_NORMALIZED`), the experts' width (`expert_feed_forward_length`, or
    `feed_forward_length` as Mixtral's files give it) and the shared expert's."""
    experts = keys.metadata.get(keys._key("expert_count"))
    if not experts:  # absent or 0: a dense model
        return {}
    experts = keys.integer("expert_count")
    if gguf_arch == "gpt-oss":
        # llama.cpp's openai-moe graph: every layer MoE, softmax over the top-k logits
        # (SOFTMAX_WEIGHT), the router's and the experts' biases.
        return {
            "num_experts": experts,
            "num_experts_per_tok": keys.integer("expert_used_count"),
            "moe_intermediate_size": keys.maybe_integer("expert_feed_forward_length") or keys.integer("feed_forward_length"),
            "moe_layers": tuple(range(keys.integer("block_count"))),
            "routing": "topk_softmax",
            "router_bias": "blk.0.ffn_gate_inp.bias" in shapes,
            "expert_bias": "blk.0.ffn_down_exps.bias" in shapes,
        }
    if gguf_arch == "deepseek2":
        return gguf_deepseek_moe_fields(keys, experts, shapes)
    if gguf_arch not in GGUF_MOE_NORMALIZED:
        raise SourceError(f"{path}: {gguf_arch}.expert_count is {experts}, but flare serves experts only in {', '.join(GGUF_MOE_NORMALIZED)} files")
    gating = keys.metadata.get(keys._key("expert_gating_func"))
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise keys._bad(keys._key("expert_gating_func"), gating, "1 (softmax), the gating these families use")
    normalize = keys.metadata.get(keys._key("expert_weights_norm"))
    layers = sorted(int(m.group(1)) for name in shapes if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", name)))
    if not layers:
        raise SourceError(f"{path}: {gguf_arch}.expert_count is {experts} but no layer holds a router (ffn_gate_inp)")
    shared = keys.maybe_integer("expert_shared_feed_forward_length") if "blk.0.ffn_down_shexp.weight" in shapes else None
    return {
        "num_experts": experts,
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "moe_intermediate_size": keys.maybe_integer("expert_feed_forward_length") or keys.integer("feed_forward_length"),
        "moe_layers": tuple(layers),
        "routing": "softmax",
        "norm_topk_prob": GGUF_MOE_NORMALIZED[gguf_arch] if normalize is None else bool(normalize),
        "shared_expert_intermediate_size": shared or 0,
        "shared_expert_gate": bool(shared) and "blk.0.ffn_gate_inp_shexp.weight" in shapes,
    }


# Mixtral's saved names of a layer's MoE tensors -> Qwen's (and transformers 5's), which
# `moe_tensor_name` then maps to the package's.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_tensor_name(name: str) -> str:
    """A source's MoE tensor under the package's name (the router) or Qwen's per-expert name
    (`stack_experts` stacks those); any other name unchanged."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) == 8 and parts[4] == "experts" and parts[6] in _MIXTRAL_EXPERT:
        parts[6] = _MIXTRAL_EXPERT[parts[6]]
        name = ".".join(parts)
    if name.endswith(".mlp.gate.weight"):
        return name.removesuffix("gate.weight") + "router.weight"
    # DeepSeek's: the router's correction bias, and its shared experts as one gated MLP.
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name.removesuffix("gate.e_score_correction_bias") + "router.score_correction_bias"
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def _stacked(prefix: str, projection: str) -> str:
    """The stacked tensor of a layer's experts (`prefix`: `...mlp.experts`) that a per-expert
    `projection` (gate_proj, up_proj, down_proj) goes into."""
    return f"{prefix}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}.weight"


def stacked_expert_name(name: str) -> str | None:
    """The package's stacked tensor a per-expert tensor `name` goes into (`stack_experts`), or None."""
    match = _EXPERT_TENSOR.match(name)
    return None if match is None else _stacked(match.group(1), match.group(3))


def stack_experts(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`tensors` with each MoE layer's per-expert gate/up/down (`mlp.experts.N.*_proj.weight`)
    stacked into the package's `mlp.experts.gate_up_proj.weight` [E, 2 I, hidden] and
    `mlp.experts.down_proj.weight` [E, hidden, I]. A layer whose experts are not all there, or
    not all of one shape, is left as it is, for the shape check to name what is wrong. Works on
    meta tensors too."""
    if not config.num_experts:
        return tensors
    found: dict[str, dict[tuple[int, str], str]] = {}
    for name in tensors:
        match = _EXPERT_TENSOR.match(name)
        if match:
            found.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = name
    stacked = dict(tensors)
    for prefix, parts in found.items():
        names = [[parts.get((e, p)) for p in ("gate_proj", "up_proj", "down_proj")] for e in range(config.num_experts)]
        if len(parts) != 3 * config.num_experts or any(n is None for each in names for n in each):
            continue
        gate, up, down = ([tensors[each[i]] for each in names] for i in range(3))  # type: ignore[index]
        if len({t.shape for t in gate + up}) != 1 or len({t.shape for t in down}) != 1:
            continue
        for each in names:
            for n in each:
                del stacked[n]  # type: ignore[arg-type]
        stacked[_stacked(prefix, "gate_proj")] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        stacked[_stacked(prefix, "down_proj")] = torch.stack(down)
    return stacked


# The package's per-expert gate and up (3-D, as the GGUF holds them), fused per expert into
# `mlp.experts.gate_up_proj.weight` by `fused_expert_names`.
EXPERT_GATE, EXPERT_UP, EXPERT_GATE_UP = "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.gate_up_proj.weight"


def fused_expert_names(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The package tensor `mlp.experts.gate_up_proj.weight` of each layer among `names` that has
    both `mlp.experts.gate_proj.weight` and `up_proj.weight`: (gate, up), to be joined per expert;
    the same of their biases (`.bias`, gpt-oss's [E, I] each)."""
    present = set(names)
    fused = {}
    for suffix in ("weight", "bias"):
        gate_name, up_name = EXPERT_GATE.replace("weight", suffix), EXPERT_UP.replace("weight", suffix)
        for name in names:
            if name.endswith(f".{gate_name}"):
                prefix = name.removesuffix(gate_name)
                if prefix + up_name in present:
                    fused[prefix + EXPERT_GATE_UP.replace("weight", suffix)] = (name, prefix + up_name)
    return fused
