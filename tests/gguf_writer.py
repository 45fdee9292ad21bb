"""Test helper: a tiny Hugging Face checkpoint written as a GGUF, as llama.cpp's converter writes it.

The facts are convert_hf_to_gguf.py's (its `conversion/` modules llama.py, qwen.py, gemma.py,
phi.py and base.py's TextModel.set_gguf_parameters); the tensor names come from gguf-py's own
map (`gguf.get_tensor_name_map`), which is what the converter uses:

- every family: block_count, context_length, embedding_length, feed_forward_length, head_count,
  head_count_kv, layer_norm_rms_epsilon, rope.freq_base (of the full-attention layers),
  rope.freq_base_swa (of the sliding ones, where given), key_length / value_length where the
  config names a head_dim, rope.scaling.* for linear and yarn.
- llama (and Mistral, written as llama): vocab_size, rope.dimension_count (the head dimension),
  q/k rows (and biases) permuted for llama.cpp's adjacent-pair RoPE; Llama 3.1's llama3
  scaling as the tensor rope_freqs (each frequency's divisor).
- qwen2 / qwen3: nothing more.
- mixture-of-experts (qwen2_moe, qwen3_moe; mixtral written as llama): expert_count,
  expert_used_count, expert_feed_forward_length (Qwen), expert_shared_feed_forward_length
  (Qwen2-MoE); transformers 5's fused `experts.gate_up_proj` split into the 3-D
  ffn_gate_exps / ffn_up_exps, `experts.down_proj` as ffn_down_exps (Qwen2MoeModel.modify_tensors);
  the router (ffn_gate_inp) and the shared expert's gate kept float32 under --outtype q8_0, as
  the converter keeps them.
- gemma2: no rope.freq_base (llama.cpp's 10000), attn_logit_softcapping,
  final_logit_softcapping, attention.sliding_window; every `*norm.weight` + 1; no lm_head.
- gemma3: rope.freq_base of the global layers, final_logit_softcapping when set,
  attention.sliding_window; every `*norm.weight` + 1.
- phi3: rope.dimension_count = int(partial_rotary_factor * hidden) // heads,
  rope.scaling.original_context_length, attention.sliding_window (0 for none); with longrope, the
  tensors rope_factors_long / rope_factors_short and rope.scaling.attn_factor; the fused
  qkv_proj (attn_qkv) and gate_up_proj (ffn_up) kept fused.
- deepseek2 (DeepSeek-V2/V3, conversion/deepseek.py): head_count_kv 1 (MLA as MQA), key_length
  kv_lora_rank + rope and value_length kv_lora_rank, key_length_mla / value_length_mla the
  per-head sizes, q_lora_rank (where set), kv_lora_rank, rope.dimension_count the rope part,
  leading_dense_block_count, the expert keys (expert_group_count / _used_count from n_group /
  topk_group; expert_gating_func sigmoid for V3, whose real config.json names scoring_func
  sigmoid), rope.scaling.yarn_log_multiplier 0.1 mscale_all_dim; the correction bias as exp_probs_b;
  kv_b_proj split per head into attn_k_b [heads, kv_lora_rank, nope] (transposed) and attn_v_b
  [heads, v, kv_lora_rank]; the rope rows left interleaved (llama.cpp rotates adjacent pairs).

Also the canonical state dict flare's contract gives the same checkpoint (`canonical_state`):
Gemma's norms + 1 and renamed, Phi-3's fused tensors split, a tied LM head dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tests.gguf_vocabularies import read_vocabulary

from flare.package.byte_level import BYTE_LEVEL_ALPHABET

GGML = gguf.GGMLQuantizationType
TINY_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "gpt_oss": gguf.MODEL_ARCH.GPT_OSS,
}
# Tensors the converter never quantizes (base.py's list of those kept float32).
_FLOAT_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of 262 tokens: three control tokens, the byte alphabet, three merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(BYTE_LEVEL_ALPHABET.values())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + alphabet + merged
    types = [3] * len(specials) + [1] * (len(alphabet) + len(merged))
    return tokens, types, ["Ġ t", "h e", "Ġt he"]


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE vocabulary as GGUF metadata holds it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str = "smollm"


def tiny_bpe_vocabulary() -> Vocabulary:
    return Vocabulary(*tiny_vocabulary())


def gguf_vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of a GGUF file (the default model's: SmolLM2's 49152 tokens)."""
    fields = read_vocabulary(path)
    return Vocabulary(
        tokens=fields["tokenizer.ggml.tokens"],
        types=fields["tokenizer.ggml.token_type"],
        merges=fields["tokenizer.ggml.merges"],
        pre=fields["tokenizer.ggml.pre"],
    )


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The divisors the converter writes as rope_freqs for llama3 scaling (LlamaModel.generate_extra_tensors)."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    return rope.get("full_attention", rope)


def write_family_gguf(
    path: Path,
    config: Any,
    state: dict[str, torch.Tensor],
    *,
    quantize: GGML | None = None,
    chat_template: str = TINY_CHAT_TEMPLATE,
    architecture: str | None = None,
    metadata: dict[str, tuple[Any, gguf.GGUFValueType] | None] | None = None,
    tensors: dict[str, np.ndarray | None] | None = None,
    vocabulary: Vocabulary | None = None,
    types: dict[str, GGML] | None = None,
) -> None:
    """Write the Hugging Face checkpoint (`config`: its transformers config, `state`: its state
    dict with Hugging Face names) as convert_hf_to_gguf.py would (module docstring). With
    `quantize` (Q8_0 say), every matrix whose rows are whole blocks is stored in that type, as
    the converter's --outtype does (Q4_K and Q6_K by flare's port of llama.cpp's reference
quantizers, which gguf-py lacks); vectors stay float32. `types`: another type for the tensors
of a kind (`ffn_up_exps`: Q6_K, say), as llama-quantize mixes them. `vocabulary`: the tiny one by default.

    To make a malformed file: `architecture` replaces general.architecture (the keys keep the
    family's prefix), `metadata` sets keys ((value, type)) or removes them (None), `tensors`
    adds or replaces GGUF tensors (float32 arrays [out, in]) or removes them (None)."""
    hparams = config.to_dict()
    model_type = hparams["model_type"]
    arch = _ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    layers = hparams["num_hidden_layers"]
    hidden, heads = hparams["hidden_size"], hparams["num_attention_heads"]
    kv_heads = hparams.get("num_key_value_heads") or heads
    rope = _rope_parameters(hparams)
    deepseek = arch == gguf.MODEL_ARCH.DEEPSEEK2
    writer.add_block_count(layers)
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1 if deepseek else kv_heads)
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if model_type != "phi3" and hparams.get("head_dim") is not None and not deepseek:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    if model_type != "gemma2":
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    sliding_rope = (hparams.get("rope_parameters") or {}).get("sliding_attention")
    if sliding_rope is not None:
        writer.add_rope_freq_base_swa(sliding_rope["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    head_dim = hparams.get("head_dim") or hidden // heads
    experts = hparams.get("num_local_experts") or hparams.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hparams["num_experts_per_tok"])
        if hparams.get("moe_intermediate_size") is not None:
            writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
        if hparams.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(hparams["shared_expert_intermediate_size"])
    extra: dict[str, np.ndarray] = {}
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
        if rope_type == "llama3":
            extra["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim)
    elif deepseek:
        rank, rope_dims = hparams["kv_lora_rank"], hparams["qk_rope_head_dim"]
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_leading_dense_block_count(hparams["first_k_dense_replace"])
        if hparams.get("q_lora_rank") is not None:
            writer.add_q_lora_rank(hparams["q_lora_rank"])
        writer.add_kv_lora_rank(rank)
        writer.add_key_length(rank + rope_dims)
        writer.add_value_length(rank)
        writer.add_key_length_mla(hparams["qk_nope_head_dim"] + rope_dims)
        writer.add_value_length_mla(hparams["v_head_dim"])
        writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
        writer.add_expert_count(hparams["n_routed_experts"])
        writer.add_expert_used_count(hparams["num_experts_per_tok"])
        if hparams.get("n_group") is not None:
            writer.add_expert_group_count(hparams["n_group"])
            writer.add_expert_group_used_count(hparams["topk_group"])
        if model_type == "deepseek_v3":
            # DeepSeek-V3's config.json says scoring_func "sigmoid" (transformers' class drops the key).
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_shared_count(hparams["n_shared_experts"])
        writer.add_expert_weights_scale(hparams["routed_scaling_factor"])
        if hparams.get("norm_topk_prob"):
            writer.add_expert_weights_norm(True)
        writer.add_rope_dimension_count(rope_dims)
        if rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    elif model_type == "gemma2":
        writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
        writer.add_sliding_window(hparams["sliding_window"])
    elif model_type == "gemma3_text":
        if hparams.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
        writer.add_sliding_window(hparams["sliding_window"])
    elif model_type == "gpt_oss":
        writer.add_sliding_window(hparams["sliding_window"])
        writer.add_expert_feed_forward_length(hparams["intermediate_size"])
    elif model_type == "phi3":
        rotary = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        original = rope.get("original_max_position_embeddings") or hparams["original_max_position_embeddings"]
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(hparams.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = hparams["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    vocabulary = vocabulary or tiny_bpe_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    if hparams.get("bos_token_id") is not None:
        writer.add_bos_token_id(hparams["bos_token_id"])
    eos = hparams.get("eos_token_id")
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_chat_template(chat_template)
    if architecture is not None:
        writer.add_string("general.architecture", architecture)
    for key, value in (metadata or {}).items():
        if value is None:
            del writer.kv_data[0][key]
        else:
            writer.add_key_value(key, value[0], value[1], sub_type=gguf.GGUFValueType.get_type(value[0][0]) if isinstance(value[0], list) else None)
    names = gguf.get_tensor_name_map(arch, layers)
    replaced = tensors or {}
    gemma = model_type in ("gemma2", "gemma3_text")
    split = _gpt_oss_experts(state) if model_type == "gpt_oss" else _split_expert_gate_up(state)
    for hf, tensor in split.items():
        if hf == "lm_head.weight" and (model_type == "gemma2" or hparams.get("tie_word_embeddings")):
            continue  # save_pretrained leaves a tied head out; the Gemma 2 converter skips it always
        array = tensor.detach().to(torch.float32).numpy()
        if gemma and hf.endswith("norm.weight"):
            array = array + 1  # the converter bakes Gemma's (1 + w) in
        if arch == gguf.MODEL_ARCH.LLAMA and hf.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute_rope_rows(array, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and hf.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute_rope_rows(array, kv_heads)
        if hf.endswith("e_score_correction_bias"):  # base.py renames it for the map
            hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        if deepseek and hf.endswith("kv_b_proj.weight"):
            nope, value = hparams["qk_nope_head_dim"], hparams["v_head_dim"]
            per_head = array.reshape(heads, nope + value, -1)
            for part, block in (("k_b_proj", per_head[:, :nope].transpose(0, 2, 1)), ("v_b_proj", per_head[:, nope:])):
                part_name = names.get_name(hf.replace("kv_b_proj", part), try_suffixes=(".weight",))
                assert part_name is not None
                _add_tensor(writer, part_name, np.ascontiguousarray(block), quantize)
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias")) or _dense_mlp_name(hf)
        assert name is not None, f"gguf-py maps no name for {hf} in {arch.name}"
        if name not in replaced:
            kind = name.split(".")[-2]
            # Biases stay float32 (gpt-oss's 2-D expert biases are rows of whole blocks, not weights).
            chosen = None if name.endswith(".bias") else (types or {}).get(kind, quantize)
            _add_tensor(writer, name, np.ascontiguousarray(array), chosen)
    for name, array in {**extra, **replaced}.items():
        if array is not None:
            _add_tensor(writer, name, np.ascontiguousarray(array, dtype=np.float32), quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dense_mlp_name(hf: str) -> str | None:
    """A dense MLP tensor of a MoE family's layer (Qwen's `mlp_only_layers`), which gguf-py maps
    no name for in those architectures: under the dense families' `ffn_{gate,up,down}`."""
    parts = hf.split(".")
    if len(parts) == 6 and parts[3] == "mlp" and parts[4] in ("gate_proj", "up_proj", "down_proj"):
        return f"blk.{parts[2]}.ffn_{parts[4].removesuffix('_proj')}.{parts[5]}"
    return None


def _split_expert_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts under the names the converter maps: `experts.gate_up_proj`
    [E, 2 I, H] split into `experts.gate_proj.weight` and `experts.up_proj.weight` [E, I, H],
    `experts.down_proj` as `experts.down_proj.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.removesuffix("gate_up_proj") + "gate_proj.weight"] = gate
            out[name.removesuffix("gate_up_proj") + "up_proj.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    return out


def _gpt_oss_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's float experts as GptOssModel.modify_tensors writes them: `gate_up_proj` [E, H, 2 I]
    transposed and its interleaved columns split (gate even, up odd) into `gate_proj.weight` and
    `up_proj.weight` [E, I, H], its bias likewise into `gate_proj.bias` / `up_proj.bias`,
    `down_proj` transposed to [E, H, I], `down_proj_bias` as `down_proj.bias`; the sinks as a weight."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
        if name.endswith(".mlp.experts.gate_up_proj"):
            transposed = tensor.transpose(-1, -2)
            out[f"{prefix}.gate_proj.weight"] = transposed[:, ::2, :]
            out[f"{prefix}.up_proj.weight"] = transposed[:, 1::2, :]
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            out[f"{prefix}.gate_proj.bias"] = tensor[..., ::2]
            out[f"{prefix}.up_proj.bias"] = tensor[..., 1::2]
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name}.weight"] = tensor.transpose(-1, -2)
        elif name.endswith(".mlp.experts.down_proj_bias"):
            out[f"{prefix}.down_proj.bias"] = tensor
        elif name.endswith(".self_attn.sinks"):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    return out


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, quantize: GGML | None) -> None:
    block = None if quantize is None else gguf.GGML_QUANT_SIZES[quantize][0]
    if name.endswith(_FLOAT_TENSORS):
        quantize = None
    if quantize is not None and array.ndim in (2, 3) and array.shape[-1] % block == 0:  # type: ignore[operator]
        writer.add_tensor(name, _quantized(array, quantize), raw_dtype=quantize)
    else:
        writer.add_tensor(name, array.astype(np.float32))


def _quantized(array: np.ndarray, quantize: GGML) -> np.ndarray:
    """The blocks of `array` [..., in] in `quantize`, [..., row_bytes]."""
    from flare.preparation.quantize import quantize_matrix

    rows = quantize_matrix(np.ascontiguousarray(array.reshape(-1, array.shape[-1]), dtype=np.float32), quantize)
    return rows.reshape(*array.shape[:-1], rows.shape[-1])


def quantized_values(array: np.ndarray, quantize: GGML | None) -> np.ndarray:
    """What `write_family_gguf` stores of `array` ([out, in] or a vector), read back as float32."""
    block = None if quantize is None else gguf.GGML_QUANT_SIZES[quantize][0]
    if quantize is None or array.ndim != 2 or array.shape[1] % block:  # type: ignore[operator]
        return array.astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, quantize), quantize)


_GEMMA_NORMS = {
    "post_attention_layernorm": "attention_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}


def canonical_state(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as flare's package contract names and shapes it (float32): Gemma's norms are
    the factor (1 + w) and renamed (families-common: post_attention_layernorm ->
    attention_output_norm, pre_feedforward_layernorm -> post_attention_layernorm,
    post_feedforward_layernorm -> mlp_output_norm), Phi-3's qkv_proj and gate_up_proj split into
    q/k/v and gate/up, a tied LM head left out."""
    hparams = config.to_dict()
    model_type = hparams["model_type"]
    gemma = model_type in ("gemma2", "gemma3_text")
    heads = hparams["num_attention_heads"]
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // heads
    q = heads * head_dim
    kv = (hparams.get("num_key_value_heads") or heads) * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to(torch.float32)
        if name == "lm_head.weight" and hparams.get("tie_word_embeddings"):
            continue
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1
            for hf, ours in _GEMMA_NORMS.items():
                if name.endswith(f".{hf}.weight"):
                    name = name.replace(f".{hf}.", f".{ours}.")
                    break
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            out[f"{prefix}q_proj.weight"], out[f"{prefix}k_proj.weight"], out[f"{prefix}v_proj.weight"] = (
                t.contiguous() for t in tensor.split([q, kv, kv])
            )
            continue
        if name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = gate.contiguous(), up.contiguous()
            continue
        out[name] = tensor.contiguous()
    return out


LLAMA_CPP_CONVERTER = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py")
# Runs llama.cpp's converter with its own gguf-py. Two answers about the vocabulary only, which
# changes no weight and no model key: the BPE pre-tokenizer check says "smollm" (the converter
# recognises a tokenizer only by the hash of a known model's output, and the tiny test vocabulary
# is none) unless the check is to run ("detect"), and Gemma 2 takes the byte-level BPE vocabulary
# (its converter reads only a SentencePiece tokenizer.model). One interpreter converts every
# checkpoint it is given, one after the other: torch and transformers are imported once, not once
# a checkpoint.
_CONVERTER_DRIVER = """
import runpy, sys
converter = sys.argv.pop(1)
pre = sys.argv.pop(1)
sys.path.insert(0, converter.rsplit("/", 1)[0])
sys.path.insert(1, converter.rsplit("/", 1)[0] + "/gguf-py")
import conversion.base, conversion.gemma
if pre != "detect":
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
conversion.gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
options = sys.argv[1:3]
for directory, outfile in zip(sys.argv[3::2], sys.argv[4::2]):
    sys.argv = [converter, directory, *options, "--outfile", outfile]
    runpy.run_path(converter, run_name="__main__")
"""


def save_tiny_checkpoint(directory: Path, config: Any, state: dict[str, torch.Tensor]) -> None:
    """The checkpoint as a Hugging Face directory (`save_pretrained`), with the tiny vocabulary's
    byte-level BPE tokenizer (declared a GPT2Tokenizer, which Phi-3's converter asks for)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokens, types, merges = tiny_vocabulary()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, types) if k == 3])
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state)
    model.save_pretrained(directory)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "GPT2Tokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def convert_with_llama_cpp(
    conversions: Sequence[tuple[Path, Path]], outtype: str = "f32", converter: Path = LLAMA_CPP_CONVERTER, *, detect_pre: bool = False
) -> None:
    """llama.cpp's own convert_hf_to_gguf.py (`converter`) on each (Hugging Face directory, GGUF to
    write) of `conversions` (in a subprocess: it imports its own gguf-py); `detect_pre`: the
    pre-tokenizer named by the converter's own hash check (a real model's tokenizer), not "smollm"."""
    import subprocess
    import sys

    paths = [str(path) for conversion in conversions for path in conversion]
    result = subprocess.run(
        [sys.executable, "-c", _CONVERTER_DRIVER, str(converter), "detect" if detect_pre else "smollm", "--outtype", outtype, *paths],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
