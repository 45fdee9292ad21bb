"""Tiny random checkpoints of every family flare serves, built by transformers itself.

Each is its family's own config class and `XForCausalLM.from_config` (eager attention, float32),
3 layers of width 64, with the default model's vocabulary so that its tokenizer and chat
template serve it. Sliding windows are 8 tokens (16 for Phi-3), so that the tests' prompts pass
them; the RoPE scalings are picked so that each kind changes the frequencies the prompts reach.

transformers initializes with std 0.02, which leaves logits nearly uniform (top-two gaps below
1e-3); the weights are redrawn here at unit scale (linear layers randn / sqrt(in), norms around
their identity, biases 0.1), so that greedy choices are clear and every tensor matters.

`write_as_fp8` rewrites a checkpoint's projections as DeepSeek-V3's FP8 release stores them
(float8 blocks with their scales), beside a float32 copy of the values they stand for.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "deepseek_v3", "deepseek_v2")
# Mixture-of-experts families: 8 experts of width 32 (Mixtral: 4 of the dense width), 2 per token.
# gpt-oss: 8 experts of width 32, 2 per token.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
# DeepSeek with its experts from layer 1 on: V3's sigmoid group routing with a random correction
# bias, V2's group-limited softmax; both with a shared expert and routed_scaling_factor.
DEEPSEEK_MOE_FAMILIES = ("deepseek_v3_moe", "deepseek_v2_moe")
WINDOW = 8
VOCAB = 49152  # SmolLM2's, the default model's tokenizer
BOS, EOS = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>
# Phi-3's longrope: flare picks the long factors where the context it serves exceeds the
# original one (flare/engine/layers/rope.py); transformers uses the short ones for prompts shorter than
# it. Its package is exported with this context, the original, so both pick the short factors.
PHI3_ORIGINAL_CONTEXT = 256
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Checkpoint:
    """A tiny checkpoint saved as a Hugging Face directory, and the model that wrote it."""

    family: str
    path: Path
    model: Any  # transformers' XForCausalLM, eval mode


def family_config(family: str) -> Any:
    """The family's transformers config of the tiny checkpoint (the features each exercises)."""
    import transformers

    if family == "llama":
        # Llama 3.1's scaling with an original context the prompts reach past one wavelength band.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**_SHAPE, rope_parameters=rope, tie_word_embeddings=True)
    if family == "mistral":
        return transformers.MistralConfig(**_SHAPE, sliding_window=WINDOW)
    if family == "qwen2":
        # q/k/v biases; the window on the layers from max_window_layers on.
        return transformers.Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                        tie_word_embeddings=True)
    if family == "qwen3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        return transformers.Qwen3Config(**_SHAPE, rope_parameters=rope)
    if family == "gemma2":
        # Soft-caps low enough to bite on these weights; a query scale other than head_dim's.
        return transformers.Gemma2Config(**_SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    if family == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return transformers.Gemma3TextConfig(**_SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=32, rope_parameters=rope,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if family == "phi3":
        # Partial rotary (half of each head) with longrope's per-frequency factors.
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [2.0, 3.0, 5.0, 8.0]}
        return transformers.Phi3Config(**_SHAPE, rope_parameters=rope, original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
                                       sliding_window=2 * WINDOW)
    if family in ("deepseek_v3", "deepseek_v2"):
        return deepseek_config(family)
    if family == "deepseek_v3_moe":
        return deepseek_config("deepseek_v3", dense_layers=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    if family == "deepseek_v2_moe":
        return deepseek_config("deepseek_v2", dense_layers=1, routed_scaling_factor=1.5, topk_method="group_limited_greedy",
                               n_group=2, topk_group=1)
    if family == "qwen3_moe":
        # Layer 1 dense (`mlp_only_layers`), renormalized top-k, Qwen3's q/k norms.
        return transformers.Qwen3MoeConfig(**_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True, mlp_only_layers=[1])
    if family == "qwen2_moe":
        # A shared expert behind its sigmoid gate, top-k not renormalized, q/k/v biases; layer 2 dense.
        return transformers.Qwen2MoeConfig(**_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[2],
                                           tie_word_embeddings=True)
    if family == "mixtral":
        return transformers.MixtralConfig(**_SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
    if family == "gpt_oss":
        # Even layers slide (its default layer_types); yarn without truncation over an original
        # context the prompts pass; a SwiGLU limit low enough to clamp these activations. Its
        # sinks and router and expert biases start at zero: write_checkpoint redraws them.
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}
        shape = {**_SHAPE, "intermediate_size": 32}
        return transformers.GptOssConfig(**shape, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
                                         rope_parameters=rope, swiglu_limit=1.0)
    raise ValueError(f"no tiny checkpoint for {family!r}")


def deepseek_config(family: str, *, dense_layers: int | None = None, **overrides: Any) -> Any:
    """A tiny DeepSeek: multi-head latent attention with every width distinct (latent 32, rope 8,
    nope 16, value 12), interleaved RoPE. V3 has a q_lora_rank of 24 and yarn with an mscale_all_dim
    equal to its mscale, as every DeepSeek release has (it moves the softmax scale; a GGUF keeps only mscale_all_dim); V2 a plain q_proj (as V2-Lite).
    `dense_layers`: the first k layers are dense MLPs (first_k_dense_replace), all of them unless given."""
    import transformers

    shape = {k: v for k, v in _SHAPE.items() if k not in ("head_dim", "num_key_value_heads")}
    latent = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4,
              "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "first_k_dense_replace": _SHAPE["num_hidden_layers"] if dense_layers is None else dense_layers}
    if family == "deepseek_v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
        return transformers.DeepseekV3Config(**{**shape, **latent, "q_lora_rank": 24, "n_group": 2, "topk_group": 1,
                                                "rope_parameters": rope, **overrides})
    return transformers.DeepseekV2Config(**{**shape, **latent, "q_lora_rank": None, **overrides})


def multimodal_gemma3_config() -> Any:
    """A Gemma 3 with a (tiny) vision tower: flare serves its text model."""
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=family_config("gemma3"), vision_config=vision, mm_tokens_per_image=4,
                                     boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)


def write_checkpoint(
    family: str, path: Path, tokenizer_json: str, chat_template: str, seed: int = 0, changes: dict[str, Any] | None = None
) -> Checkpoint:
    """The family's tiny random checkpoint, saved at `path` with the tokenizer and chat template;
    family `gemma3-multimodal`: `multimodal_gemma3_config`'s. `changes`: config attributes set
    over the family's (wider layers, say)."""
    import transformers

    torch.manual_seed(seed)
    if family == "gemma3-multimodal":
        model = transformers.Gemma3ForConditionalGeneration._from_config(multimodal_gemma3_config(), attn_implementation="eager")
    else:
        config = family_config(family)
        for name, value in (changes or {}).items():
            setattr(config, name, value)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma stores w of its (1 + w) factor.
                parameter.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(parameter))
            elif name.endswith((".bias", "_bias")):
                parameter.copy_(0.1 * torch.randn_like(parameter))
            elif "embed_tokens" in name:
                parameter.copy_(0.5 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, a buffer transformers zeroes
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.eval()
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return Checkpoint(family, path, model)


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as DeepSeek's quantizer stores it: per block of `block` rows and columns
    (the edge blocks partial) a scale of the block's largest magnitude over e4m3's (448), the
    weight over its scale in float8_e4m3fn, and the scales [blocks down, blocks across] as its
    `weight_scale_inv`; with the float32 values they stand for."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    blocked = padded.unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0]))  # [down, b0, across, b1]
    # An all-zero block (the MTP layer's eh_proj has some) keeps a scale above 0: its zeros, not 0 / 0.
    amax = blocked.abs().amax(dim=(1, 3), keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocked / scale).to(torch.float8_e4m3fn)

    def unblocked(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(2).flatten(0, 1)[:rows, :cols].contiguous()

    return unblocked(quantized), scale[:, 0, :, 0].contiguous(), unblocked(quantized.float() * scale)


def write_as_fp8(path: Path, block: tuple[int, int]) -> Path:
    """Rewrite the checkpoint at `path` as DeepSeek-V3's FP8 release stores it: each projection of
    a decoder layer (an MTP layer's too; not the MoE router `mlp.gate`) in `fp8_blocks` with its
    `weight_scale_inv` beside it, and config.json's quantization_config declaring them;
    embeddings, norms and the LM head as they were. A copy of the checkpoint holding, in float32,
    the values the FP8 tensors stand for is written beside it: its path is returned."""
    dequantized = path.with_name(f"{path.name}-dequantized")
    shutil.copytree(path, dequantized)
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(shard))
        values = dict(tensors)
        for name, tensor in list(tensors.items()):
            if re.fullmatch(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight", name):
                tensors[name], tensors[f"{name}_scale_inv"], values[name] = fp8_blocks(tensor, block)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        save_file({name: t.float() for name, t in values.items()}, str(dequantized / shard.name), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic",
    }
    (path / "config.json").write_text(json.dumps(config))
    return dequantized
