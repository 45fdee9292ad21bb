"""Which of the decoder's optional tensors each family's layers hold, whatever the source format:
the q/k/v biases, the per-head q/k norms and the sandwich norms (`ModelConfig.attention_bias`,
`qk_norm`, `sandwich_norms`). A family's definition decides them, never the tensors a file
happens to hold: a Qwen3 file without its q/k norms is then refused naming the missing tensor
(as llama.cpp refuses it), not served as a different computation, and a file holding a tensor
its family has not is refused naming that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTensors:
    """The optional tensors of one family's layers (True: every layer has them)."""

    # None: the source says. llama.cpp's Llama takes q/k/v biases where a file has them (its
    # TENSOR_NOT_REQUIRED biases); Hugging Face's Llama config says so by `attention_bias`.
    attention_bias: bool | None
    qk_norm: bool
    sandwich_norms: bool


# Per ModelConfig.architecture: transformers' modeling files and llama.cpp's tensor loading agree.
FAMILY_TENSORS = {
    "llama": FamilyTensors(attention_bias=None, qk_norm=False, sandwich_norms=False),
    "mistral": FamilyTensors(attention_bias=False, qk_norm=False, sandwich_norms=False),
    "qwen2": FamilyTensors(attention_bias=True, qk_norm=False, sandwich_norms=False),
    "qwen3": FamilyTensors(attention_bias=False, qk_norm=True, sandwich_norms=False),
    "gemma2": FamilyTensors(attention_bias=False, qk_norm=False, sandwich_norms=True),
    "gemma3": FamilyTensors(attention_bias=False, qk_norm=True, sandwich_norms=True),
    "phi3": FamilyTensors(attention_bias=False, qk_norm=False, sandwich_norms=False),
    # Latent attention's own norms (q_a, kv_a) are part of its projections (`LatentAttention`).
    "deepseek2": FamilyTensors(attention_bias=False, qk_norm=False, sandwich_norms=False),
    # Mixture-of-experts families: their attention is their dense sibling's (Qwen2-MoE's q/k/v
    # biases are its config's `qkv_bias`, on by default, read as Llama's `attention_bias`).
    "qwen2_moe": FamilyTensors(attention_bias=None, qk_norm=False, sandwich_norms=False),
    "qwen3_moe": FamilyTensors(attention_bias=False, qk_norm=True, sandwich_norms=False),
    "mixtral": FamilyTensors(attention_bias=False, qk_norm=False, sandwich_norms=False),
    # gpt-oss: q/k/v (and o) biases where its config's attention_bias says (default on).
    "gpt_oss": FamilyTensors(attention_bias=None, qk_norm=False, sandwich_norms=False),
}
