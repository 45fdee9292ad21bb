"""Each rank's part of the weights: the parts recombine to the whole model's arithmetic."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from tests.engine.tiny_llama import random_state_dict, tiny_config

from flare.engine.quantized import QuantizedWeight, dequantize
from flare.parallel.tensor_split import (
    TensorParallelError,
    check_tensor_parallel,
    rank_state_dict,
    vocabulary_rows,
)

LAYER = "model.layers.0"


def _attention(x: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal grouped-query attention without RoPE: [T, heads * head_dim]."""
    tokens = x.shape[0]
    q = (x @ q_w.T).view(tokens, -1, head_dim).transpose(0, 1)
    k = (x @ k_w.T).view(tokens, -1, head_dim).transpose(0, 1)
    v = (x @ v_w.T).view(tokens, -1, head_dim).transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(tokens, -1)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_rank_parts_of_attention_mlp_and_lm_head_recombine_to_the_whole(tensor_parallel: int) -> None:
    config = tiny_config()
    state = random_state_dict(config)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    s = {name: state[f"{LAYER}.{name}.weight"] for name in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    attention = _attention(x, s["self_attn.q_proj"], s["self_attn.k_proj"], s["self_attn.v_proj"], config.head_dim) @ s["self_attn.o_proj"].T
    mlp = (torch.nn.functional.silu(x @ s["mlp.gate_proj"].T) * (x @ s["mlp.up_proj"].T)) @ s["mlp.down_proj"].T
    logits = x @ state["model.embed_tokens.weight"].T
    attention_sum, mlp_sum, logit_parts = torch.zeros_like(attention), torch.zeros_like(mlp), []
    for rank in range(tensor_parallel):
        part = rank_state_dict(config, state, rank, tensor_parallel)
        p = {name: part[f"{LAYER}.{name}.weight"] for name in s}
        # The all-reduce after o and after down: a sum of the ranks' partial outputs.
        attention_sum += _attention(x, p["self_attn.q_proj"], p["self_attn.k_proj"], p["self_attn.v_proj"], config.head_dim) @ p["self_attn.o_proj"].T
        mlp_sum += (torch.nn.functional.silu(x @ p["mlp.gate_proj"].T) * (x @ p["mlp.up_proj"].T)) @ p["mlp.down_proj"].T
        start, end = vocabulary_rows(config, rank, tensor_parallel)
        logit_parts.append(x @ part["model.embed_tokens.weight"][start:end].T)
        assert torch.equal(part["model.embed_tokens.weight"], state["model.embed_tokens.weight"]), "replicated"
        assert part[f"{LAYER}.self_attn.k_proj.weight"].shape[0] == config.num_kv_heads * config.head_dim // tensor_parallel
    torch.testing.assert_close(attention_sum, attention, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_sum, mlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(logit_parts, 1), logits, rtol=0, atol=0)


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_both_counts() -> None:
    config = dataclasses.replace(tiny_config(), num_heads=9, num_kv_heads=3)
    with pytest.raises(TensorParallelError, match="must divide both the model's 9 attention heads and its 3 KV heads"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(dataclasses.replace(config, intermediate_size=162), 3)


def _q8_0(values: np.ndarray) -> QuantizedWeight:
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    return QuantizedWeight.from_blocks(
        gguf.GGMLQuantizationType.Q8_0, torch.from_numpy(blocks), values.shape[0], values.shape[1]
    )


def test_quantized_weights_split_at_block_boundaries_and_refuse_a_split_inside_a_block() -> None:
    config = tiny_config()
    rng = np.random.default_rng(0)
    down = _q8_0(rng.standard_normal((config.hidden_size, 128)).astype(np.float32))
    gate = _q8_0(rng.standard_normal((128, config.hidden_size)).astype(np.float32))
    splittable = dataclasses.replace(config, intermediate_size=128)
    state = random_state_dict(splittable)
    state[f"{LAYER}.mlp.down_proj.weight"], state[f"{LAYER}.mlp.gate_proj.weight"] = down, gate
    whole_down, whole_gate = dequantize(down), dequantize(gate)
    for rank in range(2):
        part = rank_state_dict(splittable, state, rank, 2)
        assert torch.equal(dequantize(part[f"{LAYER}.mlp.down_proj.weight"]), whole_down[:, rank * 64 : (rank + 1) * 64])
        assert torch.equal(dequantize(part[f"{LAYER}.mlp.gate_proj.weight"]), whole_gate[rank * 64 : (rank + 1) * 64])
    odd = dataclasses.replace(config, intermediate_size=96)
    state = random_state_dict(odd)
    state[f"{LAYER}.mlp.down_proj.weight"] = _q8_0(rng.standard_normal((config.hidden_size, 96)).astype(np.float32))
    with pytest.raises(TensorParallelError, match=r"model.layers.0.mlp.down_proj.weight: a Q8_0 weight is stored in blocks of 32"):
        rank_state_dict(odd, state, 0, 2)
