"""A package's learned draft head: what the manifest says about it and the tensors its file holds.

The head (multi-token prediction in the style of DeepSeek-V3's MTP modules and EAGLE) drafts
for the target from the target's own last hidden state: slot p of its sequence reads
RMSNorm(h_{p-1}) (the target's residual stream after its last layer at position p - 1; zeros at
p = 0) and RMSNorm(embed(x_p)), concatenated and projected back to the hidden size (`fc`), runs
one decoder block of the target's shape, and predicts x_{p+1} through the target's own final
norm and LM head. Further draft steps feed its own output hidden state back in place of h. A head
imported from a checkpoint's MTP layer reads h after the target's final norm instead
(`DraftHeadInfo.target_hidden`).

Its LM head is the target's, restricted to `draft_vocab` (the ids most frequent in the target's
own output at distillation): q is zero outside it, which keeps rejection sampling exact and costs
each draft step a fraction of the full vocabulary's GEMM (`docs/speculative.md`).

The file `draft_head.safetensors` holds the head's own weights, named as below, and
`mtp.draft_vocab` (int64 token ids); the embedding and LM head are the target's, and so is the
final norm unless the file holds `mtp.final_norm.weight` (a head imported from a checkpoint
whose MTP layer has a norm of its own, `hf_source.read_mtp_head`).
"""

from __future__ import annotations

from flare.package.manifest import DraftHeadInfo, HeldOutAcceptance, ModelConfig

DRAFT_HEAD_NAME = "draft_head.safetensors"
VOCAB_TENSOR = "mtp.draft_vocab"
FINAL_NORM_TENSOR = "mtp.final_norm.weight"

__all__ = ["DRAFT_HEAD_NAME", "FINAL_NORM_TENSOR", "VOCAB_TENSOR", "DraftHeadInfo", "HeldOutAcceptance", "draft_head_shapes", "head_parameter_count"]


def draft_head_shapes(
    config: ModelConfig, draft_vocab_size: int, *, own_final_norm: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every tensor of `draft_head.safetensors` and its shape ([out, in] for linear weights);
    `own_final_norm`: the head's own final norm instead of the target's."""
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = "mtp.layer"
    own = {FINAL_NORM_TENSOR: (h,)} if own_final_norm else {}
    return {
        **own,
        "mtp.hidden_norm.weight": (h,),
        "mtp.embed_norm.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        f"{layer}.input_layernorm.weight": (h,),
        f"{layer}.self_attn.q_proj.weight": (q, h),
        f"{layer}.self_attn.k_proj.weight": (kv, h),
        f"{layer}.self_attn.v_proj.weight": (kv, h),
        f"{layer}.self_attn.o_proj.weight": (h, q),
        f"{layer}.post_attention_layernorm.weight": (h,),
        f"{layer}.mlp.gate_proj.weight": (config.intermediate_size, h),
        f"{layer}.mlp.up_proj.weight": (config.intermediate_size, h),
        f"{layer}.mlp.down_proj.weight": (h, config.intermediate_size),
        VOCAB_TENSOR: (draft_vocab_size,),
    }


def head_parameter_count(config: ModelConfig, draft_vocab_size: int, *, own_final_norm: bool = False) -> int:
    """The head's own parameters (the draft vocabulary's ids are not parameters)."""
    total = 0
    for name, shape in draft_head_shapes(config, draft_vocab_size, own_final_norm=own_final_norm).items():
        if name != VOCAB_TENSOR:
            count = 1
            for n in shape:
                count *= n
            total += count
    return total
