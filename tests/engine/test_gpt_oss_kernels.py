"""gpt-oss's layer arithmetic: attention sinks in the paged attention kernel and in the torch
attention path (layers/attention.py), and the clamped SwiGLU in C and torch (layers/mlp.py), each
held to transformers' gpt_oss modeling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, eager_attention_forward

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.layers.attention import PagedAttention
from flare.engine.layers.mlp import clamped_swiglu
from flare.engine.native import clamped_swiglu_rows, paged_attention

from tests.engine.test_native import linear_layouts
from tests.engine.tiny_llama import tiny_config


def transformers_attention(q, k, v, sinks, window: int | None, starts: list[int], query_len: int) -> torch.Tensor:
    """transformers' eager gpt-oss attention of each row: q [rows * Q, heads, D], k and v per row
    [kv_heads, L_r, D] (the row's cached keys), the causal (and sliding) mask additive."""
    heads, kv_heads = q.shape[1], k[0].shape[0]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False)
    outputs = []
    for r, start in enumerate(starts):
        keys = k[r].shape[1]
        positions = torch.arange(start, start + query_len).view(-1, 1)
        visible = torch.arange(keys).view(1, -1) <= positions
        if window is not None:
            visible &= torch.arange(keys).view(1, -1) > positions - window
        mask = torch.zeros(query_len, keys).masked_fill(~visible, float("-inf")).view(1, 1, query_len, keys)
        query = q[r * query_len : (r + 1) * query_len].transpose(0, 1).unsqueeze(0)
        out, _ = eager_attention_forward(module, query, k[r].unsqueeze(0), v[r].unsqueeze(0), mask, scaling=q.shape[-1] ** -0.5)
        outputs.append(out[0])
    return torch.cat(outputs)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(
    ("rows", "query_len", "window", "max_blocks"),
    # The last two: rows of up to 2,400 keys, cut every 1,024 and merged (paged_attention.c).
    [(1, 1, None, 6), (3, 1, 5, 6), (2, 6, None, 6), (2, 7, 4, 6), (2, 5, None, 600), (2, 5, 300, 600)],
)
def test_paged_attention_with_sinks_attends_as_transformers_gpt_oss_does(rows, query_len, window, max_blocks, portable) -> None:
    kv_heads, group, head_dim, block_size = 2, 3, 64, 4
    blocks = rows * max_blocks + 6
    generator = torch.Generator().manual_seed(rows * 10 + query_len)
    keys = torch.randn(kv_heads, blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, blocks, block_size, head_dim, generator=generator)
    block_table = torch.randperm(blocks, generator=generator)[: rows * max_blocks].view(rows, max_blocks)
    starts = torch.randint(0, max_blocks * block_size - query_len + 1, (rows,), generator=generator)
    starts[0] = max_blocks * block_size - query_len  # the longest row the table holds
    q = 2 * torch.randn(rows * query_len, kv_heads * group, head_dim, generator=generator)
    # Sinks spread from far below the scores to far above: a head that hardly sinks, and one
    # whose sink takes nearly all its weight.
    sinks = torch.linspace(-6, 12, kv_heads * group)

    got = paged_attention(q, keys, values, block_table, starts, query_len, window=window, sinks=sinks, portable=portable)

    k = [keys[:, block_table[r]].reshape(kv_heads, -1, head_dim)[:, : int(starts[r]) + query_len] for r in range(rows)]
    v = [values[:, block_table[r]].reshape(kv_heads, -1, head_dim)[:, : int(starts[r]) + query_len] for r in range(rows)]
    expected = transformers_attention(q, k, v, sinks, window, starts.tolist(), query_len)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
    # The sinks matter: without them the answer is another one.
    assert not torch.allclose(paged_attention(q, keys, values, block_table, starts, query_len, window=window), expected, atol=1e-3)


@pytest.mark.parametrize("kernels", [False, True])
def test_the_models_attention_with_sinks_is_transformers_eager_attention_on_both_paths(kernels: bool) -> None:
    # A prefill row of 20 tokens (past the kernel's short rows: the torch path) and a decode row
    # (the kernel where the model runs it): the sinks reach each query head, folded or not.
    config = tiny_config()
    heads, kv_heads, head_dim, block_size = config.num_heads, config.num_kv_heads, config.head_dim, 16
    generator = torch.Generator().manual_seed(11)
    cache = KVCache.for_budget(config, 4 * 1024**2, block_size)
    keys, values = cache.keys[0], cache.values[0]
    keys.copy_(torch.randn(keys.shape, generator=generator))
    values.copy_(torch.randn(values.shape, generator=generator))
    sinks = torch.tensor([-3.0, 0.5, 2.0, 6.0])
    attention = PagedAttention(config, kernels=kernels, window=None, device=torch.device("cpu"), dtype=torch.float32)
    for row in (ForwardRow(list(range(20)), 0, [3, 5], num_logits=1), ForwardRow([7], 30, [3, 5], num_logits=1)):
        batch = ForwardBatch.build([row], block_size)
        q = 2 * torch.randn(len(row.token_ids), heads, head_dim, generator=generator)
        got = attention.attend(q, keys, values, attention.plan(batch, cache), None, sinks)
        length = row.start_position + len(row.token_ids)
        k = keys[:, [3, 5]].reshape(kv_heads, -1, head_dim)[:, :length]
        v = values[:, [3, 5]].reshape(kv_heads, -1, head_dim)[:, :length]
        expected = transformers_attention(q, [k], [v], sinks, None, [row.start_position], len(row.token_ids))
        torch.testing.assert_close(got.view_as(expected), expected, atol=2e-6, rtol=2e-5)


def test_sinks_of_the_wrong_shape_are_refused_naming_them() -> None:
    keys = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous CPU float32 \[2\]"):
        paged_attention(torch.zeros(1, 2, 8), keys, keys, torch.tensor([[0]]), torch.tensor([0]), 1, sinks=torch.zeros(3))


def transformers_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GptOssExperts._apply_gate on its checkpoints' layout: gate and up interleaved, gate first."""
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)
    return GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), interleaved)


def test_the_clamped_swiglu_is_transformers_gpt_oss_activation_in_torch_and_in_c() -> None:
    generator = torch.Generator().manual_seed(5)
    for intermediate, tokens in ((96, 1), (640, 33), (50, 70)):
        gate_up = 6 * torch.randn(2 * intermediate, tokens, generator=generator)
        gate_up[0, 0], gate_up[1, 0] = 90.0, -90.0  # past the clamp, far into the sigmoid's tail
        gate_up[intermediate, 0], gate_up[intermediate + 1, 0] = 30.0, -30.0  # up past both clamps
        gate, up = gate_up.chunk(2)
        expected = transformers_swiglu(gate.t(), up.t())
        torch.testing.assert_close(clamped_swiglu(gate_up, kernels=False), expected, atol=0, rtol=0)
        for layout, columns in linear_layouts(gate_up).items():
            out = clamped_swiglu(columns, kernels=True)
            assert out.is_contiguous() and out.shape == (tokens, intermediate)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6, msg=layout)


def test_the_clamped_swiglu_keeps_nan_and_refuses_a_limit_that_is_not_positive() -> None:
    gate_up = torch.randn(2 * 32, 3)
    gate_up[5, 1] = float("nan")
    gate_up[32 + 7, 2] = float("nan")
    out = clamped_swiglu_rows(gate_up, 1.702, 7.0)
    assert out[1, 5].isnan() and out[2, 7].isnan() and out.isnan().sum() == 2
    with pytest.raises(ValueError, match="limit must be a positive finite number"):
        clamped_swiglu_rows(gate_up, 1.702, 0.0)
