"""The tensors of one decoder layer and their shapes ([out, in] for linear weights): what
`directory.expected_weight_shapes` lists for every layer of the model and `draft_head_shapes`
for a draft head built as one of the target's layers."""

from __future__ import annotations

from flare.package.model_config import ModelConfig


def decoder_layer_shapes(config: ModelConfig, index: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `index` of `config` under `prefix` (`model.layers.{index}` in the model): its norms,
    attention (latent where the config has it) and MLP (a mixture of experts where
    `config.is_moe_layer(index)`), named as `expected_weight_shapes` documents."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    latent = config.latent_attention
    o_in = q if latent is None else config.num_heads * latent.v_head_dim
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.input_layernorm.weight": (h,)}
    if latent is not None:
        shapes.update(latent_attention_shapes(config, f"{prefix}.self_attn"))
    else:
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv, h)
    if config.attention_bias:
        shapes[f"{prefix}.self_attn.q_proj.bias"] = (q,)
        shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv,)
        shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv,)
    if config.qk_norm:
        shapes[f"{prefix}.self_attn.q_norm.weight"] = (config.head_dim,)
        shapes[f"{prefix}.self_attn.k_norm.weight"] = (config.head_dim,)
    shapes[f"{prefix}.self_attn.o_proj.weight"] = (h, o_in)
    if config.attention_output_bias:
        shapes[f"{prefix}.self_attn.o_proj.bias"] = (h,)
    if config.attention_sinks:
        shapes[f"{prefix}.self_attn.sinks"] = (config.num_heads,)
    if config.sandwich_norms:
        shapes[f"{prefix}.attention_output_norm.weight"] = (h,)
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    if config.is_moe_layer(index):
        shapes.update(moe_weight_shapes(config, f"{prefix}.mlp"))
    else:
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (h, config.intermediate_size)
    if config.sandwich_norms:
        shapes[f"{prefix}.mlp_output_norm.weight"] = (h,)
    return shapes


def latent_attention_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's projections (transformers' DeepSeek names, `LatentAttention`),
    o_proj aside: q_proj, or q_a_proj / q_a_layernorm / q_b_proj through q_lora_rank;
    kv_a_proj_with_mqa (the latent and the shared rope key), kv_a_layernorm, kv_b_proj (every
    head's nope key and value from the latent)."""
    latent = config.latent_attention
    assert latent is not None
    h, heads = config.hidden_size, config.num_heads
    q_out = heads * latent.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if latent.q_lora_rank is None:
        shapes[f"{prefix}.q_proj.weight"] = (q_out, h)
    else:
        shapes[f"{prefix}.q_a_proj.weight"] = (latent.q_lora_rank, h)
        shapes[f"{prefix}.q_a_layernorm.weight"] = (latent.q_lora_rank,)
        shapes[f"{prefix}.q_b_proj.weight"] = (q_out, latent.q_lora_rank)
    shapes[f"{prefix}.kv_a_proj_with_mqa.weight"] = (latent.kv_lora_rank + latent.qk_rope_head_dim, h)
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (latent.kv_lora_rank,)
    shapes[f"{prefix}.kv_b_proj.weight"] = (heads * (latent.qk_nope_head_dim + latent.v_head_dim), latent.kv_lora_rank)
    return shapes


def moe_weight_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one mixture-of-experts MLP under `prefix` (`expected_weight_shapes`)."""
    h, experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.router.weight": (experts, h)}
    if config.router_bias:
        shapes[f"{prefix}.router.bias"] = (experts,)
    if config.routing == "sigmoid_group":
        shapes[f"{prefix}.router.score_correction_bias"] = (experts,)
    shapes[f"{prefix}.experts.gate_up_proj.weight"] = (experts, 2 * width, h)
    shapes[f"{prefix}.experts.down_proj.weight"] = (experts, h, width)
    if config.expert_bias:
        shapes[f"{prefix}.experts.gate_up_proj.bias"] = (experts, 2 * width)
        shapes[f"{prefix}.experts.down_proj.bias"] = (experts, h)
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes[f"{prefix}.shared_expert.gate_proj.weight"] = (shared, h)
        shapes[f"{prefix}.shared_expert.up_proj.weight"] = (shared, h)
        shapes[f"{prefix}.shared_expert.down_proj.weight"] = (h, shared)
    if config.shared_expert_gate:
        shapes[f"{prefix}.shared_expert_gate.weight"] = (1, h)
    return shapes
