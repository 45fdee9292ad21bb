"""Hugging Face configs of each family, in transformers 5's layout and the older one checkpoints on
the Hub still carry, read into ModelConfig; the tensors renamed, shifted and split as the package
contract says; and what flare does not serve refused before any weight is read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from flare.preparation.families.hf_config import model_config_from_hf
from flare.preparation.families.hf_tensors import tensor_converter
from flare.preparation.hf_source import open_hf_directory
from flare.package.model_config import RopeScaling
from flare.preparation.source import SourceError

SHAPE = {
    "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}


def config(model_type: str, **fields: Any):
    return model_config_from_hf({**SHAPE, "model_type": model_type, **fields}, None)


def test_older_gemma3_keys_give_the_local_base_the_global_scaling_and_the_five_to_one_pattern() -> None:
    c = config(
        "gemma3_text", num_hidden_layers=12, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert c.architecture == "gemma3" and c.qk_norm and c.sandwich_norms and c.tie_word_embeddings
    assert c.rope_theta == 1_000_000.0 and c.local_rope_theta == 10_000.0
    assert c.rope_scaling == RopeScaling("linear", factor=8.0)
    assert c.sliding_window == 512 and c.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert c.attention_scale == 256**-0.5 and c.embedding_scale == 8.0 and c.hidden_activation == "gelu_tanh"


def test_gemma2_slides_on_even_layers_with_both_soft_caps() -> None:
    c = config("gemma2", sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=224)
    assert c.sliding_layers == (0, 2) and not c.qk_norm
    assert (c.attention_softcap, c.final_logit_softcap) == (50.0, 30.0)


def test_qwen2_slides_from_max_window_layers_only_when_use_sliding_window_is_set() -> None:
    assert config("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2).sliding_layers == (2, 3)
    off = config("qwen2", use_sliding_window=False, sliding_window=32, max_window_layers=2)
    assert off.sliding_window is None and off.sliding_layers == () and off.attention_bias


def test_layer_types_win_over_the_family_rule() -> None:
    c = config("mistral", sliding_window=16, layer_types=["full_attention", "sliding_attention"] * 2)
    assert c.sliding_layers == (1, 3)
    with pytest.raises(SourceError, match="layer types 'chunked_attention'"):
        config("mistral", sliding_window=16, layer_types=["chunked_attention"] * 4)


def test_older_phi3_su_scaling_is_longrope_with_the_top_level_original_context_and_partial_rotary() -> None:
    c = config(
        "phi3", max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6},
    )
    assert c.rotary_dim == 12
    assert c.rope_scaling == RopeScaling(
        "longrope", factor=32.0, original_max_position_embeddings=4096, short_factor=(1.0,) * 6, long_factor=(2.0,) * 6
    )


def test_llama3_and_yarn_scalings_carry_their_parameters() -> None:
    llama = config("llama", rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert llama.rope_scaling == RopeScaling("llama3", 32.0, 8192, 1.0, 4.0)
    yarn = config("qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "mscale": 0.707,
                                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 32768})
    assert yarn.rope_theta == 1e6 and yarn.qk_norm
    assert yarn.rope_scaling is not None and yarn.rope_scaling.attention_factor == 1.0
    default_yarn = config("qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    assert default_yarn.rope_scaling is not None
    assert default_yarn.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_a_multimodal_gemma3_serves_its_text_model() -> None:
    text = {**SHAPE, "sliding_window": 8, "query_pre_attn_scalar": 16}
    c = model_config_from_hf({"model_type": "gemma3", "text_config": text, "eos_token_id": [2, 3]}, None)
    assert c.architecture == "gemma3" and c.eos_token_ids == (2,)


def test_gemma_norms_are_renamed_and_their_weights_shifted_by_one() -> None:
    convert = tensor_converter(config("gemma2", sliding_window=8))
    w = torch.tensor([0.5, -0.25])
    assert list(convert("model.layers.0.post_attention_layernorm.weight", w)) == ["model.layers.0.attention_output_norm.weight"]
    assert list(convert("model.layers.0.pre_feedforward_layernorm.weight", w)) == ["model.layers.0.post_attention_layernorm.weight"]
    (shifted,) = convert("model.layers.3.post_feedforward_layernorm.weight", w).values()
    assert torch.equal(shifted, torch.tensor([1.5, 0.75]))
    assert torch.equal(convert("model.norm.weight", w)["model.norm.weight"], torch.tensor([1.5, 0.75]))
    assert convert("model.layers.0.mlp.up_proj.weight", w)["model.layers.0.mlp.up_proj.weight"] is w
    vision = tensor_converter(config("gemma3_text"))
    assert vision("model.vision_tower.encoder.weight", w) == {}
    assert list(vision("model.language_model.layers.0.self_attn.q_norm.weight", w)) == ["model.layers.0.self_attn.q_norm.weight"]


def test_phi3_fused_projections_are_split_in_order() -> None:
    convert = tensor_converter(config("phi3"))
    qkv = torch.arange((64 + 2 * 32) * 2, dtype=torch.float32).view(128, 2)
    parts = convert("model.layers.1.self_attn.qkv_proj.weight", qkv)
    assert [name.rsplit(".", 2)[1] for name in parts] == ["q_proj", "k_proj", "v_proj"]
    assert torch.equal(torch.cat(list(parts.values())), qkv) and [t.shape[0] for t in parts.values()] == [64, 32, 32]
    gate_up = torch.randn(256, 64)
    split = convert("model.layers.1.mlp.gate_up_proj.weight", gate_up)
    assert torch.equal(split["model.layers.1.mlp.gate_proj.weight"], gate_up[:128])
    assert torch.equal(split["model.layers.1.mlp.up_proj.weight"], gate_up[128:])


def test_a_model_type_flare_does_not_serve_is_refused_before_its_weights_are_looked_at(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "falcon_mamba"}))
    with pytest.raises(SourceError) as refusal:
        open_hf_directory(tmp_path)  # no weights, tokenizer or template: never reached
    message = str(refusal.value)
    assert "config.json describes a 'falcon_mamba' model; flare serves model types" in message
    for served in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3"):
        assert served in message


# Kimi K2's config.json as Moonshot ships it (Kimi-K2-Instruct): DeepSeek-V3's keys under
# model_type kimi_k2, 384 experts, one dense layer, FP8 weights.
KIMI_K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                                     "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_kimi_k2s_config_reads_as_the_deepseek_v3_it_is() -> None:
    c = model_config_from_hf(KIMI_K2_CONFIG, None)
    v3 = model_config_from_hf({**KIMI_K2_CONFIG, "model_type": "deepseek_v3"}, None)
    assert c == v3 and c.architecture == "deepseek2"
    assert c.latent_attention is not None and (c.latent_attention.q_lora_rank, c.latent_attention.kv_lora_rank) == (1536, 512)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_layers) == (384, 8, tuple(range(1, 61)))
    assert c.routing == "sigmoid_group" and c.norm_topk_prob and c.routed_scaling_factor == 2.827
    assert c.shared_expert_intermediate_size == 2048 and c.eos_token_ids == (163585,)
    assert c.rope_scaling is not None and (c.rope_scaling.kind, c.rope_scaling.factor) == ("yarn", 32.0)
