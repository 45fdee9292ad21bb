"""A package's learned draft head: what the manifest says about it and the tensors its file holds.

The head (multi-token prediction in the style of DeepSeek-V3's MTP modules and EAGLE) drafts
for the target from the target's own last hidden state: slot p of its sequence reads
RMSNorm(h_{p-1}) (the target's residual stream after its last layer at position p - 1; zeros at
p = 0) and RMSNorm(embed(x_p)), concatenated and projected back to the hidden size (`fc`), runs
one decoder layer, and predicts x_{p+1} through the target's own final
norm and LM head. Further draft steps feed its own output hidden state back in place of h. A head
imported from a checkpoint's MTP layer reads h after the target's final norm instead
(`DraftHeadInfo.target_hidden`).

The decoder layer (`DraftHeadInfo.layer`, `head_block_config`) is a Llama layer of the target's
width whatever its family (`llama`: the heads flare distills), or one of the target's own layers
(`target`: its attention, latent for DeepSeek, and its MLP, a mixture of experts where the
target's last layer is one), as a DeepSeek-V3 checkpoint's MTP layer is.

Its LM head is the target's, restricted to `draft_vocab` (the ids most frequent in the target's
own output at distillation): q is zero outside it, which keeps rejection sampling exact and costs
each draft step a fraction of the full vocabulary's GEMM (`docs/speculative.md`).

The file `draft_head.safetensors` holds the head's own weights, named as below, and
`mtp.draft_vocab` (int64 token ids); the embedding and LM head are the target's, and so is the
final norm unless the file holds `mtp.final_norm.weight` (a head imported from a checkpoint
whose MTP layer has a norm of its own, `hf_source.read_mtp_head`).
"""

from __future__ import annotations

from dataclasses import replace

from flare.package.layer_shapes import decoder_layer_shapes
from flare.package.manifest import DraftHeadInfo, HeldOutAcceptance
from flare.package.model_config import ModelConfig

DRAFT_HEAD_NAME = "draft_head.safetensors"
VOCAB_TENSOR = "mtp.draft_vocab"
FINAL_NORM_TENSOR = "mtp.final_norm.weight"

LAYER_PREFIX = "mtp.layer"  # the head's decoder layer: its tensors as layer 0 of the model names them

__all__ = [
    "DRAFT_HEAD_NAME", "FINAL_NORM_TENSOR", "LAYER_PREFIX", "VOCAB_TENSOR", "DraftHeadInfo", "HeldOutAcceptance",
    "draft_head_shapes", "head_block_config", "head_parameter_count",
]


def head_block_config(config: ModelConfig, layer: str, vocab_size: int) -> ModelConfig:
    """The config of the head's block as a one-layer model of the target `config`: its decoder
    layer (`layer`, `HEAD_LAYERS`) and, as its tied embedding, the target's LM head restricted to
    the draft vocabulary (`vocab_size` rows): its forward gives the head's residual stream and its
    logits the draft logits. The target's RoPE either way."""
    block = dict(vocab_size=vocab_size, num_layers=1, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,))
    if layer == "target":
        # Layer 0 is the target's layer at index num_layers, a mixture of experts where the
        # target's last layer is one (DeepSeek's MoE layers run from first_k_dense_replace to the end).
        return replace(config, **block, moe_layers=(0,) if config.is_moe_layer(config.num_layers - 1) else ())
    return replace(
        config,
        **block,
        attention_bias=False, qk_norm=False, sliding_window=None, sliding_layers=(), local_rope_theta=None,
        attention_scale=None, attention_softcap=None, final_logit_softcap=None, sandwich_norms=False,
        embedding_scale=1.0, hidden_activation="silu", swiglu_limit=None, attention_output_bias=False, attention_sinks=False,
        num_experts=0, moe_layers=(), shared_expert_intermediate_size=0, shared_expert_gate=False,  # a dense MLP
        expert_bias=False,
    )


def draft_head_shapes(
    config: ModelConfig, draft_vocab_size: int, *, own_final_norm: bool = False, layer: str = "llama"
) -> dict[str, tuple[int, ...]]:
    """Every tensor of `draft_head.safetensors` and its shape ([out, in] for linear weights);
    `own_final_norm`: the head's own final norm instead of the target's; `layer`: its decoder
    layer's kind (`head_block_config`)."""
    h = config.hidden_size
    own = {FINAL_NORM_TENSOR: (h,)} if own_final_norm else {}
    head = {
        **own,
        "mtp.hidden_norm.weight": (h,),
        "mtp.embed_norm.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
    }
    if layer == "target":
        block = head_block_config(config, layer, draft_vocab_size)
        return {**head, **decoder_layer_shapes(block, 0, LAYER_PREFIX), VOCAB_TENSOR: (draft_vocab_size,)}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    prefix = LAYER_PREFIX
    return {
        **head,
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.self_attn.q_proj.weight": (q, h),
        f"{prefix}.self_attn.k_proj.weight": (kv, h),
        f"{prefix}.self_attn.v_proj.weight": (kv, h),
        f"{prefix}.self_attn.o_proj.weight": (h, q),
        f"{prefix}.post_attention_layernorm.weight": (h,),
        f"{prefix}.mlp.gate_proj.weight": (config.intermediate_size, h),
        f"{prefix}.mlp.up_proj.weight": (config.intermediate_size, h),
        f"{prefix}.mlp.down_proj.weight": (h, config.intermediate_size),
        VOCAB_TENSOR: (draft_vocab_size,),
    }


def head_parameter_count(
    config: ModelConfig, draft_vocab_size: int, *, own_final_norm: bool = False, layer: str = "llama"
) -> int:
    """The head's own parameters (the draft vocabulary's ids are not parameters)."""
    total = 0
    for name, shape in draft_head_shapes(config, draft_vocab_size, own_final_norm=own_final_norm, layer=layer).items():
        if name != VOCAB_TENSOR:
            count = 1
            for n in shape:
                count *= n
            total += count
    return total
