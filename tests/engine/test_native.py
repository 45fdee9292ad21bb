"""The engine's CPU kernels: built, equal to their torch counterparts, and safe with bad input."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.engine import _native, native, native_layers
from flare.engine.layers.rope import apply_rope, rope_tables
from flare.engine.model import DecoderModel
from flare.engine.native import add_rms_norm, available, gated_rows, paged_attention, rope_and_cache

from tests.engine.tiny_llama import random_state_dict, tiny_config

KV_HEADS, HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE = 3, 9, 64, 40, 16


def test_the_native_kernel_is_built() -> None:
    # setup.py builds it wherever a C compiler is present, as on every machine this project
    # runs on; a build failure is not fatal to the install, so it is caught here.
    assert available(), "flare/engine/csrc did not build: is gcc installed?"


def pools(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def textbook_attention(q, keys, values, block_table, starts, query_len) -> torch.Tensor:
    """Per token: softmax(q k^T / sqrt(d)) v over the row's positions 0 .. start + t, K/V repeated per head."""
    out = torch.empty_like(q)
    heads, (kv_heads, _, _, head_dim) = q.shape[1], keys.shape
    group = heads // kv_heads
    for r, start in enumerate(starts.tolist()):
        k = keys[:, block_table[r]].reshape(kv_heads, -1, head_dim).repeat_interleave(group, 0)
        v = values[:, block_table[r]].reshape(kv_heads, -1, head_dim).repeat_interleave(group, 0)
        for t in range(query_len):
            visible = start + t + 1
            scores = torch.einsum("hd,hkd->hk", q[r * query_len + t], k[:, :visible]) / head_dim**0.5
            out[r * query_len + t] = torch.einsum("hk,hkd->hd", scores.softmax(-1), v[:, :visible])
    return out


@pytest.mark.parametrize(("rows", "query_len"), [(1, 1), (6, 1), (4, 5), (3, 17)])
def test_short_rows_attend_like_textbook_attention_over_scattered_blocks(rows: int, query_len: int) -> None:
    keys, values = pools()
    generator = torch.Generator().manual_seed(rows * 100 + query_len)
    # Each row's blocks scattered over the pool, its context ending anywhere in its last block.
    block_table = torch.stack([torch.randperm(BLOCKS, generator=generator)[:8] for _ in range(rows)])
    starts = torch.randint(0, 8 * BLOCK_SIZE - query_len + 1, (rows,), generator=generator)
    starts[0] = 0  # a row whose first token attends to itself alone
    # q as the model hands it over: a view of q, k and v heads side by side per token.
    qkv = torch.randn(rows * query_len, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=generator)
    q = qkv[:, :HEADS]

    got = paged_attention(q, keys, values, block_table, starts, query_len)

    torch.testing.assert_close(got, textbook_attention(q, keys, values, block_table, starts, query_len), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("rows", "query_len"), [(1, 1), (3, 4)])
def test_values_narrower_than_the_keys_are_each_rows_prefix(portable: bool, rows: int, query_len: int) -> None:
    """Latent attention's absorbed form: one pool as keys and values, each value the first
    value_dim numbers of its row (the latent), the heads all on its one KV head."""
    generator = torch.Generator().manual_seed(rows + query_len)
    pool = torch.randn(1, BLOCKS, BLOCK_SIZE, 96, generator=generator)
    block_table = torch.stack([torch.randperm(BLOCKS, generator=generator)[:6] for _ in range(rows)])
    starts = torch.randint(0, 6 * BLOCK_SIZE - query_len + 1, (rows,), generator=generator)
    q = torch.randn(rows * query_len, 8, 96, generator=generator)
    got = paged_attention(q, pool, pool, block_table, starts, query_len, value_dim=64, portable=portable)
    assert got.shape == (rows * query_len, 8, 64)
    full = textbook_attention(q, pool, pool, block_table, starts, query_len)
    torch.testing.assert_close(got, full[..., :64], atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="value_dim must be an integer in 1 .. 96"):
        paged_attention(q, pool, pool, block_table, starts, query_len, value_dim=97)


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([2, 6, 16, 64, 72]),
    block_size=st.sampled_from([1, 3, 16]),
    query_len=st.integers(1, 17),
    contexts=st.lists(st.integers(0, 60), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_any_shape_of_pool_and_rows_attends_like_textbook_attention(
    kv_heads, group, head_dim, block_size, query_len, contexts, seed
) -> None:
    # Odd head sizes (vector remainders), blocks of one position, rows ending anywhere in a
    # block, verify rows longer than a block: the cases a fixed test would miss.
    generator = torch.Generator().manual_seed(seed)
    rows = len(contexts)
    max_blocks = -(-(max(contexts) + query_len) // block_size)
    num_blocks = rows * max_blocks + 2
    keys = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    block_table = torch.randperm(num_blocks, generator=generator)[: rows * max_blocks].view(rows, max_blocks)
    q = 3 * torch.randn(rows * query_len, kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor(contexts)

    got = paged_attention(q, keys, values, block_table, starts, query_len)

    expected = textbook_attention(q, keys, values, block_table, starts, query_len)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


SIXTEEN_BIT = pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])


@SIXTEEN_BIT
@pytest.mark.parametrize(("rows", "query_len"), [(1, 1), (5, 1), (3, 6)])
def test_a_16_bit_pool_attends_exactly_as_its_float32_widening(kv_dtype, rows: int, query_len: int) -> None:
    # The kernel widens each block and runs the float32 code on it: the same sums in the same
    # order, so the outputs are equal to the last bit, not merely close.
    keys, values = (pool.to(kv_dtype) for pool in pools(seed=7))
    generator = torch.Generator().manual_seed(rows)
    block_table = torch.stack([torch.randperm(BLOCKS, generator=generator)[:6] for _ in range(rows)])
    starts = torch.randint(0, 6 * BLOCK_SIZE - query_len + 1, (rows,), generator=generator)
    q = torch.randn(rows * query_len, HEADS, HEAD_DIM, generator=generator)

    got = paged_attention(q, keys, values, block_table, starts, query_len)

    assert torch.equal(got, paged_attention(q, keys.float(), values.float(), block_table, starts, query_len))


@SIXTEEN_BIT
def test_rope_and_cache_rounds_k_and_v_into_a_16_bit_pool_as_torch_casts_them(kv_dtype) -> None:
    config = tiny_config()
    cos, sin = rope_tables(config, torch.float32, "cpu")
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    tokens = 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, generator=torch.Generator().manual_seed(8))
    # Values a cast treats specially: half's subnormals and underflow, ties to even, the largest
    # half and past it (infinity from 65520 on), infinity, signed zeros.
    v = qkv[:, heads + kv_heads :]
    v[0, 0, :12] = torch.tensor(
        [3e-7, -5.9e-8, 1e-10, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, -1e6, float("inf"), 0.0, -0.0]
    )
    positions, slots = torch.tensor([0, 1, 2, 3, 60]), torch.tensor([4, 0, 31, 9, 17])
    rotated = apply_rope(qkv[:, : heads + kv_heads], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))

    for layout, columns in linear_layouts(qkv.flatten(1).t()).items():
        keys, values = torch.zeros(kv_heads, 4, 8, d, dtype=kv_dtype), torch.zeros(kv_heads, 4, 8, d, dtype=kv_dtype)
        q = rope_and_cache(columns, positions, slots, cos, sin, keys, values, heads)

        torch.testing.assert_close(q, rotated[:, :heads], atol=1e-6, rtol=1e-6, msg=layout)  # q stays float32
        flat_keys, flat_values = keys.view(kv_heads, -1, d), values.view(kv_heads, -1, d)
        assert torch.equal(flat_values[:, slots], v.transpose(0, 1).to(kv_dtype)), layout
        # k is rotated in float32 (products may fuse into one rounding) and then rounded once.
        expected_keys = rotated[:, heads:].transpose(0, 1).to(kv_dtype)
        error = (flat_keys[:, slots].float() - expected_keys.float()).abs().max()
        assert error <= expected_keys.float().abs().max() * 2**-7, layout


def test_a_nan_written_into_a_float16_pool_stays_nan_and_stays_in_its_row() -> None:
    config = tiny_config()
    cos, sin = rope_tables(config, torch.float32, "cpu")
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = torch.randn(2, heads + 2 * kv_heads, d)
    qkv[1, heads + kv_heads, 3] = float("nan")  # token 1's value, first KV head
    keys, values = torch.zeros(kv_heads, 4, 8, d, dtype=torch.float16), torch.zeros(kv_heads, 4, 8, d, dtype=torch.float16)
    rope_and_cache(qkv.flatten(1).t().contiguous(), torch.tensor([0, 1]), torch.tensor([0, 8]), cos, sin, keys, values, heads)
    assert values[0, 1, 0, 3].isnan() and values.isnan().sum() == 1

    q = torch.randn(2, heads, d)
    out = paged_attention(q, keys, values, torch.tensor([[0], [1]]), torch.tensor([0, 0]), 1)
    assert out[0].isfinite().all()  # the row without the NaN
    assert out[1, : heads // kv_heads].isnan().any() and out[1, heads // kv_heads :].isfinite().all()


def test_pools_of_other_or_mixed_dtypes_are_refused() -> None:
    keys, values = pools()
    table, starts, q = torch.tensor([[0, 1]]), torch.tensor([3]), torch.randn(1, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="CPU pools of one dtype of float32, float16, bfloat16"):
        paged_attention(q, keys.double(), values.double(), table, starts, 1)
    with pytest.raises(ValueError, match="got cpu torch.float16 and torch.float32"):
        paged_attention(q, keys.half(), values, table, starts, 1)


def test_nan_in_a_query_reaches_that_rows_output_only() -> None:
    keys, values = pools()
    q = torch.randn(2, HEADS, HEAD_DIM)
    q[1, 4, 7] = float("nan")
    out = paged_attention(q, keys, values, torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 5]), 1)
    assert out[0].isfinite().all()
    assert out[1, 4].isnan().all()  # the head that read the NaN
    assert out[1, :3].isfinite().all()  # other KV groups' heads are untouched


@pytest.mark.parametrize(
    ("block_table", "starts", "message"),
    [
        ([[0, BLOCKS]], [20], "a block id lies outside the KV pool"),
        ([[0, -1]], [20], "a block id lies outside the KV pool"),
        ([[0, 1]], [2 * BLOCK_SIZE], "a row reaches past its block table"),
        ([[0, 1]], [-1], "a row starts at a negative position"),
    ],
)
def test_block_tables_outside_the_pool_are_refused_before_any_read(block_table, starts, message) -> None:
    keys, values = pools()
    with pytest.raises(ValueError, match=message):
        paged_attention(torch.randn(1, HEADS, HEAD_DIM), keys, values, torch.tensor(block_table), torch.tensor(starts), 1)


def test_tensors_of_the_wrong_dtype_or_layout_are_refused_with_their_name() -> None:
    keys, values = pools()
    table, starts = torch.tensor([[0, 1]]), torch.tensor([3])
    q = torch.randn(1, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="q must be a CPU torch.float32 tensor"):
        paged_attention(q.double(), keys, values, table, starts, 1)
    with pytest.raises(ValueError, match="block_table must be a CPU torch.int64 tensor"):
        paged_attention(q, keys, values, table.int(), starts, 1)
    with pytest.raises(ValueError, match="contiguous pools"):
        paged_attention(q, keys.transpose(1, 2).contiguous().transpose(1, 2), values, table, starts, 1)
    with pytest.raises(ValueError, match="heads and dims must be contiguous"):
        paged_attention(torch.randn(1, HEAD_DIM, HEADS).transpose(1, 2), keys, values, table, starts, 1)
    with pytest.raises(ValueError, match="2 query tokens, 1 block-table rows of 1 tokens"):
        paged_attention(torch.randn(2, HEADS, HEAD_DIM), keys, values, table, starts, 1)


def test_a_model_uses_the_kernels_where_they_apply_and_the_torch_path_elsewhere() -> None:
    config = tiny_config()
    state = random_state_dict(config)
    assert DecoderModel(config, state).native_kernels
    assert not DecoderModel(config, state, dtype=torch.bfloat16).native_kernels
    assert not DecoderModel(config, state, native_kernels=False).native_kernels


def test_asking_for_the_kernels_where_they_cannot_run_names_why(monkeypatch) -> None:
    config = tiny_config()
    state = random_state_dict(config)
    with pytest.raises(ValueError, match="need a float32 model on the CPU"):
        DecoderModel(config, state, dtype=torch.bfloat16, native_kernels=True)
    monkeypatch.setattr(native, "available", lambda: False)  # as where no compiler built them
    assert not DecoderModel(config, state).native_kernels
    with pytest.raises(ValueError, match="extension built: False"):
        DecoderModel(config, state, native_kernels=True)


def linear_layouts(columns: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear layer's output [channels, tokens] in every layout the model hands the kernels:
    MKL's contiguous columns, the transposed view of a packed format's rows, and MKL's one-token
    product (a column of a two-column result, channels two floats apart)."""
    layouts = {"columns": columns.contiguous(), "rows": columns.t().contiguous().t()}
    if columns.shape[1] == 1:
        layouts["one-token column"] = torch.cat((columns, columns), 1)[:, :1]
    return layouts


@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_and_cache_rotates_q_and_k_and_writes_k_and_v_into_their_slots(tokens: int) -> None:
    config = tiny_config()
    cos, sin = rope_tables(config, torch.float32, "cpu")
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, generator=generator)
    positions = torch.tensor([0, 1, 2, 40, 41, 300, 5])[:tokens]
    slots = torch.tensor([9, 3, 30, 0, 17, 22, 31])[:tokens]
    rotated = apply_rope(qkv[:, : heads + kv_heads], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))

    for layout, columns in linear_layouts(qkv.flatten(1).t()).items():
        keys, values = torch.zeros(kv_heads, 4, 8, d), torch.zeros(kv_heads, 4, 8, d)
        q = rope_and_cache(columns, positions, slots, cos, sin, keys, values, heads)
        torch.testing.assert_close(q, rotated[:, :heads], atol=1e-6, rtol=1e-6, msg=layout)
        flat_keys, flat_values = keys.view(kv_heads, -1, d), values.view(kv_heads, -1, d)
        torch.testing.assert_close(flat_keys[:, slots], rotated[:, heads:].transpose(0, 1), atol=1e-6, rtol=1e-6)
        assert torch.equal(flat_values[:, slots], qkv[:, heads + kv_heads :].transpose(0, 1)), layout
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[slots] = False
        assert not flat_keys[:, untouched].any() and not flat_values[:, untouched].any()


@pytest.mark.parametrize(
    ("position", "slot", "message"),
    [(512, 0, "a position lies outside the RoPE tables"), (0, 32, "a slot lies outside the KV pool"), (0, -1, "a slot")],
)
def test_rope_and_cache_refuses_positions_and_slots_outside_their_tables(position, slot, message) -> None:
    config = tiny_config()
    cos, sin = rope_tables(config, torch.float32, "cpu")
    keys, values = torch.zeros(2, 4, 8, 16), torch.zeros(2, 4, 8, 16)
    qkv_columns = torch.randn(8 * 16, 2)
    with pytest.raises(ValueError, match=message):
        rope_and_cache(qkv_columns, torch.tensor([1, position]), torch.tensor([3, slot]), cos, sin, keys, values, 4)
    assert not keys.any() and not values.any()  # checked before anything was written


def test_gated_rows_equals_silu_of_gate_times_up_transposed() -> None:
    generator = torch.Generator().manual_seed(4)
    for intermediate, tokens in ((160, 1), (1536, 32), (100, 70)):
        gate_up = 4 * torch.randn(2 * intermediate, tokens, generator=generator)
        gate_up[0, 0], gate_up[1, 0] = 90.0, -90.0  # far into both tails
        gate, up = gate_up.chunk(2)
        expected = (torch.nn.functional.silu(gate) * up).t()
        for layout, columns in linear_layouts(gate_up).items():
            out = gated_rows(columns)
            assert out.is_contiguous() and out.shape == (tokens, intermediate)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6, msg=layout)


def test_gated_rows_keeps_nan_where_it_was() -> None:
    gate_up = torch.randn(2 * 64, 3)
    gate_up[5, 1] = float("nan")
    out = gated_rows(gate_up)
    assert out[1, 5].isnan() and out.isnan().sum() == 1


@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_add_rms_norm_adds_the_sublayer_output_in_place_then_normalises_like_torch(tokens: int) -> None:
    generator = torch.Generator().manual_seed(5)
    hidden = 576
    h = torch.randn(tokens, hidden, generator=generator)
    weight = 1 + 0.1 * torch.randn(hidden, generator=generator)
    delta = torch.randn(hidden, tokens, generator=generator).t()  # any layout; here MKL's columns
    for given in (None, *linear_layouts(delta.t()).values()):
        stream = h.clone()
        out = add_rms_norm(stream, None if given is None else given.t(), weight, 1e-5)
        expected_stream = h if given is None else h + delta
        assert torch.equal(stream, expected_stream)  # one float32 add, as `h += delta`
        expected = torch.nn.functional.rms_norm(expected_stream, (hidden,), weight, 1e-5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_keeps_nan_in_its_row_and_refuses_misshapen_input() -> None:
    h, weight = torch.randn(3, 64), torch.ones(64)
    delta = torch.zeros(3, 64)
    delta[1, 7] = float("nan")
    out = add_rms_norm(h, delta, weight, 1e-5)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    with pytest.raises(ValueError, match=r"delta must be shaped like h \(3, 64\)"):
        add_rms_norm(h, torch.zeros(3, 32), weight, 1e-5)
    with pytest.raises(ValueError, match="weight \\[64\\] contiguous"):
        add_rms_norm(h, None, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="h must be a CPU torch.float32 tensor"):
        add_rms_norm(h.double(), None, weight, 1e-5)


FLOAT16_SHAPES = [(960, 576), (50, 33), (17, 8), (1, 5), (3072, 64)]  # out, in: whole and partial blocks


def float16_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight float16 holds exactly, so products can be compared with float64 ones."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).half().float()


@pytest.mark.parametrize(("out_features", "in_features"), FLOAT16_SHAPES)
def test_float16_linear_equals_the_float64_product_of_the_float16_weights(out_features: int, in_features: int) -> None:
    weight = float16_weight(out_features, in_features)
    packed = native.Float16Weight.pack(weight)
    assert packed.out_features == out_features and packed.in_features == in_features
    generator = torch.Generator().manual_seed(1)
    for tokens in (1, 2, 3, 4, 5, 6, 7, 8, 13, 40):
        x = torch.randn(tokens, in_features, generator=generator)
        exact = (x.double() @ weight.double().T).float()
        got = native.float16_linear(x, packed)
        assert got.shape == (tokens, out_features) and got.dtype == torch.float32
        # float32 accumulation over `in_features` terms of about 0.05 * 1.
        torch.testing.assert_close(got, exact, atol=2e-6 * in_features**0.5, rtol=1e-5)


def test_a_rows_float16_product_does_not_depend_on_its_batch_mates() -> None:
    # Seeded sampling must not depend on batch-mates, so each row's sums are the same bits alone
    # or beside any number of other rows (each output sums over the inputs in order).
    weight = float16_weight(200, 96)
    packed = native.Float16Weight.pack(weight)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(2))
    together = native.float16_linear(x, packed)
    for first, count in ((0, 1), (5, 1), (3, 2), (4, 7), (10, 13)):
        assert torch.equal(native.float16_linear(x[first : first + count], packed), together[first : first + count])


def test_the_portable_avx2_and_avx512_float16_loops_give_the_same_bits() -> None:
    # Each level is forced here (a level this CPU lacks runs the widest it has); every loop fuses
    # each multiply-add in the same order. Rows 1 to 20 take every tile shape of both vector loops.
    for out_features, in_features in FLOAT16_SHAPES[1:]:
        packed = native.Float16Weight.pack(float16_weight(out_features, in_features))
        for tokens in (*range(1, 21), 33):
            x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(tokens))
            portable = native.float16_linear(x, packed, isa=native.ISA_PORTABLE)
            for isa in (native.ISA_AVX2, native.ISA_AVX512):
                assert torch.equal(native.float16_linear(x, packed, isa=isa), portable), (out_features, in_features, tokens, isa)


def test_float16_linear_reads_rows_of_a_wider_tensor_and_rounds_the_weights_to_nearest() -> None:
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))  # not float16 values
    wide = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    x = wide[:, 4:28]  # rows 32 floats apart
    exact = (x.double() @ weight.half().double().T).float()
    torch.testing.assert_close(native.float16_linear(x, native.Float16Weight.pack(weight)), exact, atol=1e-5, rtol=1e-5)


def test_a_nan_in_one_rows_input_reaches_that_rows_outputs_only() -> None:
    packed = native.Float16Weight.pack(float16_weight(48, 16))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    x[3, 7] = float("nan")
    y = native.float16_linear(x, packed)
    assert y[3].isnan().all()
    assert not y[torch.arange(8) != 3].isnan().any()


def test_float16_linear_refuses_inputs_it_cannot_read_with_their_shape() -> None:
    packed = native.Float16Weight.pack(float16_weight(16, 8))
    for bad in (torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 9), torch.randn(8, 2).t()):
        with pytest.raises(ValueError, match="float16_linear: x must be a CPU float32 \\[tokens, 8\\]"):
            native.float16_linear(bad, packed)


@pytest.mark.parametrize(("rows", "query_len", "context"), [(1, 1, 100), (5, 1, 37), (2, 4, 60), (3, 17, 20)])
def test_the_portable_attention_loops_agree_with_the_vector_tiles(rows: int, query_len: int, context: int) -> None:
    # The register tiles (AVX2) and the portable loops sum in different orders: equal to float32
    # rounding. Query counts of 3, 12 and 51 per task cover every tile size (3, 2 and 1 queries).
    keys, values = pools(seed=9)
    generator = torch.Generator().manual_seed(rows * 7 + query_len)
    block_table = torch.stack([torch.randperm(BLOCKS, generator=generator)[:8] for _ in range(rows)])
    starts = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows * query_len, HEADS, HEAD_DIM, generator=generator)
    tiles = paged_attention(q, keys, values, block_table, starts, query_len)
    loops = paged_attention(q, keys, values, block_table, starts, query_len, portable=True)
    torch.testing.assert_close(tiles, loops, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(tiles, textbook_attention(q, keys, values, block_table, starts, query_len), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("portable", [False, True])
def test_a_verify_rows_attention_is_the_same_bits_alone_as_among_many_rows(portable: bool) -> None:
    # Alone, a row's 3 (row, KV head) tasks split their 15 queries into chunks so that two threads
    # share the work evenly; among 12 rows the tasks are whole. Each query's result is its own.
    keys, values = pools(seed=11)
    generator = torch.Generator().manual_seed(5)
    rows, query_len = 12, 5
    block_table = torch.stack([torch.randperm(BLOCKS, generator=generator)[:8] for _ in range(rows)])
    starts = torch.randint(0, 8 * BLOCK_SIZE - query_len + 1, (rows,), generator=generator)
    q = torch.randn(rows * query_len, HEADS, HEAD_DIM, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = paged_attention(q, keys, values, block_table, starts, query_len, portable=portable)
        torch.testing.assert_close(together, textbook_attention(q, keys, values, block_table, starts, query_len), atol=2e-6, rtol=2e-5)
        for r in range(rows):
            tokens = slice(r * query_len, (r + 1) * query_len)
            alone = paged_attention(q[tokens], keys, values, block_table[r : r + 1], starts[r : r + 1], query_len, portable=portable)
            assert torch.equal(alone, together[tokens]), f"row {r}"
    finally:
        torch.set_num_threads(threads)


# Keys are cut into ranges of R positions (paged_attention.c): a query whose keys reach past one
# is computed range by range and merged.
R = _native.ATTENTION_KEY_RANGE
LONG_BLOCKS = 3 * R // BLOCK_SIZE  # three ranges


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("starts", "query_len"), [([2 * R + 50], 1), ([R - 6, 2 * R + 100, 5], 1), ([R - 3, 2 * R - 3], 6), ([40, 2 * R + 70], 17)]
)
def test_rows_whose_keys_reach_over_several_ranges_attend_like_textbook_attention(
    portable: bool, kv_dtype: torch.dtype, starts: list[int], query_len: int
) -> None:
    generator = torch.Generator().manual_seed(sum(starts) + query_len)
    shape = (KV_HEADS, len(starts) * LONG_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    keys, values = (torch.randn(shape, generator=generator).to(kv_dtype) for _ in range(2))
    block_table = torch.randperm(len(starts) * LONG_BLOCKS, generator=generator).view(len(starts), LONG_BLOCKS)
    q = 3 * torch.randn(len(starts) * query_len, HEADS, HEAD_DIM, generator=generator)
    rows = torch.tensor(starts)

    got = paged_attention(q, keys, values, block_table, rows, query_len, portable=portable)

    expected = textbook_attention(q, keys.float(), values.float(), block_table, rows, query_len)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("portable", [False, True])
def test_narrower_values_past_a_key_range_are_each_rows_prefix(portable: bool) -> None:
    # Latent attention's absorbed form (one pool, values the first 64 of 96) over rows cut at R and 2 R.
    generator = torch.Generator().manual_seed(17)
    pool = torch.randn(1, 2 * LONG_BLOCKS, BLOCK_SIZE, 96, generator=generator)
    block_table = torch.randperm(2 * LONG_BLOCKS, generator=generator).view(2, LONG_BLOCKS)
    starts, query_len = torch.tensor([R - 2, 2 * R + 300]), 4
    q = torch.randn(2 * query_len, 8, 96, generator=generator)
    got = paged_attention(q, pool, pool, block_table, starts, query_len, value_dim=64, portable=portable)
    full = textbook_attention(q, pool, pool, block_table, starts, query_len)
    torch.testing.assert_close(got, full[..., :64], atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("portable", [False, True])
def test_a_query_past_a_key_range_is_the_same_bits_in_a_verify_row_as_in_a_decode_row(portable: bool) -> None:
    # A verify row whose queries stand on both sides of the cuts at R and 2 R against the decode
    # row at each of its positions, alone and among rows of other lengths: where a query's keys
    # are cut depends on its own position alone.
    keys, values = (torch.randn(KV_HEADS, LONG_BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    generator = torch.Generator().manual_seed(3)
    table = torch.randperm(LONG_BLOCKS, generator=generator)
    for start, query_len in ((R - 3, 6), (2 * R - 3, 5), (R - 8, 17)):
        q = torch.randn(query_len, HEADS, HEAD_DIM, generator=generator)
        verify = paged_attention(q, keys, values, table[None], torch.tensor([start]), query_len, portable=portable)
        for t in range(query_len):
            decode = paged_attention(q[t : t + 1], keys, values, table[None], torch.tensor([start + t]), 1, portable=portable)
            assert torch.equal(decode, verify[t : t + 1]), (start, t)
        among = paged_attention(
            torch.cat([q, torch.randn(2 * query_len, HEADS, HEAD_DIM, generator=generator)]), keys, values,
            table[None].repeat(3, 1), torch.tensor([start, 30, 2 * R + 500]), query_len, portable=portable,
        )
        assert torch.equal(among[:query_len], verify), start


@settings(max_examples=60, deadline=None)
@given(
    out_features=st.integers(1, 80),
    in_features=st.integers(1, 70),
    tokens=st.integers(1, 20),
    row_gap=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_any_shape_of_float16_layer_and_rows_equals_the_float64_product(out_features, in_features, tokens, row_gap, seed) -> None:
    weight = float16_weight(out_features, in_features, seed)
    packed = native.Float16Weight.pack(weight)
    wide = torch.randn(tokens, in_features + row_gap, generator=torch.Generator().manual_seed(seed + 1))
    x = wide[:, :in_features]
    exact = (x.double() @ weight.double().T).float()
    got = native.float16_linear(x, packed)
    torch.testing.assert_close(got, exact, atol=2e-6 * in_features**0.5, rtol=1e-5)
    for isa in (native.ISA_PORTABLE, native.ISA_AVX2):
        assert torch.equal(native.float16_linear(x, packed, isa=isa), got)


def _float16_layer(hidden: int = 32, heads: int = 2, kv_heads: int = 1, head_dim: int = 16, intermediate: int = 48):
    generator = torch.Generator().manual_seed(11)

    def packed(out_features: int, in_features: int) -> tuple[native_layers.LinearPart]:
        return (native_layers.LinearPart.float16(native.Float16Weight.pack(torch.randn(out_features, in_features, generator=generator) * 0.1)),)

    return native_layers.KernelLayer(
        input_norm=torch.ones(hidden),
        post_norm=torch.ones(hidden),
        qkv=packed((heads + 2 * kv_heads) * head_dim, hidden),
        o=packed(hidden, heads * head_dim),
        gate_up=packed(2 * intermediate, hidden),
        down=packed(hidden, intermediate),
    )


def test_a_float16_layer_whose_linear_layers_do_not_chain_is_refused_naming_them() -> None:
    layer = _float16_layer()
    with pytest.raises(ValueError, match="decoder_layer: .*chain hidden -> qkv.*gate_up 32->96, down 40->32"):
        native_layers.KernelLayer(layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, _float16_layer(intermediate=40).down)
    with pytest.raises(ValueError, match="norms must be contiguous float32 \\[32\\]"):
        native_layers.KernelLayer(torch.ones(32, dtype=torch.float64), layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down)


def test_a_moe_mlp_that_does_not_fit_its_layer_is_refused_naming_what_is_wrong() -> None:
    layer = _float16_layer()  # hidden 32
    router = torch.randn(4, 32)
    q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
    # Q8_0: 34 bytes a block of 32; 4 experts of gate_up [2 x 32, 32] and down [32, 32].
    gate_up, down = torch.zeros(4 * 64, 34, dtype=torch.uint8), torch.zeros(4 * 32, 34, dtype=torch.uint8)
    moe = native_layers.KernelMoE(router, gate_up, q8_0, down, q8_0, "softmax", 2)
    fused = native_layers.KernelLayer(layer.input_norm, layer.post_norm, layer.qkv, layer.o, (), (), moe=moe)
    assert fused.moe is moe
    shared = native_layers.KernelLayer(layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down, moe=moe)
    assert shared.gate_up == layer.gate_up  # a shared expert beside the MoE MLP
    cases = {
        "kind must be one of": lambda: native_layers.KernelMoE(router, gate_up, q8_0, down, q8_0, "argmax", 2),
        "k must be an integer in 1 .. 4": lambda: native_layers.KernelMoE(router, gate_up, q8_0, down, q8_0, "softmax", 5),
        "down must be contiguous ggml blocks of 4 experts' \\[32, 32\\]": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, down[:-1], q8_0, "softmax", 2
        ),
        "down's halves must be 0, or 1 or 2 on a type with integer kernels, got 2 on type 39": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, torch.zeros(4 * 32, 17, dtype=torch.uint8), 39, "softmax", 2, down_halves=2
        ),
        "correction_bias must be a contiguous CPU float32 \\[4\\]": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, down, q8_0, "sigmoid_group", 2, correction_bias=torch.zeros(3)
        ),
        "gate_up and down none beside a MoE MLP without a shared expert": lambda: native_layers.KernelLayer(
            layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, (), moe=moe
        ),
        "a MoE MLP's shared gate needs its shared expert": lambda: native_layers.KernelLayer(
            layer.input_norm, layer.post_norm, layer.qkv, layer.o, (), (),
            moe=native_layers.KernelMoE(router, gate_up, q8_0, down, q8_0, "softmax", 2, shared_gate=torch.zeros(32)),
        ),
        "shared_gate must be a contiguous CPU float32 \\[32\\]": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, down, q8_0, "softmax", 2, shared_gate=torch.zeros(31)
        ),
        "the clamped SwiGLU needs a positive finite \\(alpha, limit\\)": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, down, q8_0, "topk_softmax", 2, activation="clamped_swiglu", swiglu=(1.702, float("inf"))
        ),
        "down_bias must be a contiguous CPU float32 \\[4, 32\\]": lambda: native_layers.KernelMoE(
            router, gate_up, q8_0, down, q8_0, "topk_softmax", 2, down_bias=torch.zeros(4, 64)
        ),
        "activation must be one of silu, gelu_tanh, got 'clamped_swiglu'": lambda: native_layers.KernelLayer(
            layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down, activation="clamped_swiglu"
        ),
        "o_bias must be a contiguous CPU float32 \\[32\\]": lambda: native_layers.KernelLayer(
            layer.input_norm, layer.post_norm, layer.qkv, layer.o, (), (), moe=moe, o_bias=torch.zeros(31)
        ),
        "the MoE MLP's router is \\[experts, 64\\]": lambda: native_layers.KernelLayer(
            layer.input_norm, layer.post_norm, layer.qkv, layer.o, (), (),
            moe=native_layers.KernelMoE(torch.randn(4, 64), torch.zeros(4 * 64, 68, dtype=torch.uint8), q8_0,
                                        torch.zeros(4 * 64, 34, dtype=torch.uint8), q8_0, "softmax", 2),
        ),
    }
    for message, build in cases.items():
        with pytest.raises(ValueError, match=f"decoder_layer: .*{message}"):
            build()


def _two_token_round(pool: torch.Tensor) -> native_layers.DecoderRound:
    """A round of one row of two new tokens over a one-block pool, for the tiny float16 layer."""
    cos, sin = torch.randn(64, 8), torch.randn(64, 8)
    return native_layers.decoder_round(
        positions=torch.tensor([0, 1]), slots=torch.tensor([0, 1]), cos=cos, sin=sin,
        groups=[(0, 1, 2, torch.tensor([[0]]), torch.tensor([0]))], pool=pool,
        heads=2, hidden=32, intermediate=48, eps=1e-5, scratch=torch.empty(10_000),
    )


def test_a_layer_whose_sinks_are_not_one_a_head_of_the_round_is_refused() -> None:
    layer = _float16_layer()  # 2 heads
    keys, values = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 4, 16)
    sunk = dataclasses.replace(layer, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="decoder_layer: the layer's sinks are \\[3\\], the round's 2 heads"):
        native_layers.decoder_layer(torch.randn(2, 32), sunk, keys, values, _two_token_round(keys))
    h = torch.randn(2, 32)
    native_layers.decoder_layer(h, dataclasses.replace(layer, sinks=torch.zeros(2)), keys, values, _two_token_round(keys))
    assert h.isfinite().all()


def test_a_decoder_layer_call_refuses_a_residual_stream_or_pools_unlike_its_round() -> None:
    layer = _float16_layer()
    keys, values = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 4, 16)
    plan = _two_token_round(keys)
    h = torch.randn(2, 32)
    native_layers.decoder_layer(h, layer, keys, values, plan)  # the round as built runs
    assert h.isfinite().all() and keys[0, 0, :2].abs().sum() > 0
    for bad_h, bad_keys in ((torch.randn(3, 32), keys), (h, keys.half()), (h.t().contiguous().t(), keys)):
        with pytest.raises(ValueError, match="decoder_layer: h must be contiguous float32 \\[2, 32\\]"):
            native_layers.decoder_layer(bad_h, layer, bad_keys, values, plan)


def test_a_decoder_round_too_big_for_its_scratch_or_with_groups_that_miss_tokens_is_refused() -> None:
    cos, sin = torch.randn(64, 8), torch.randn(64, 8)
    pool = torch.zeros(1, 4, 4, 16)
    common = dict(positions=torch.tensor([0, 1]), slots=torch.tensor([0, 1]), cos=cos, sin=sin, pool=pool, heads=2, hidden=32, intermediate=48, eps=1e-5)
    with pytest.raises(ValueError, match="scratch must be contiguous float32 of at least"):
        native_layers.decoder_round(groups=[(0, 1, 2, torch.tensor([[0]]), torch.tensor([0]))], scratch=torch.empty(10), **common)
    with pytest.raises(ValueError, match="the groups must cover the round's tokens in order"):
        native_layers.decoder_round(groups=[(0, 1, 1, torch.tensor([[0]]), torch.tensor([0]))], scratch=torch.empty(10_000), **common)


def test_decoder_layers_check_every_layer_before_running_any() -> None:
    layer = _float16_layer()
    keys, values = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 4, 16)
    plan = _two_token_round(keys)
    h = torch.randn(2, 32)
    before = h.clone()
    # The second layer's pools are float16 where the round's are float32: refused, and the first
    # layer has not run (h and its pools untouched).
    with pytest.raises(ValueError, match="decoder_layer: h must be contiguous float32 \\[2, 32\\] and the pools"):
        native_layers.decoder_layers(h, [layer, layer], [keys, keys.half()], [values, values.half()], plan)
    assert torch.equal(h, before) and not keys.any()
    with pytest.raises(ValueError, match="2 layers need as many key and value pools, got 1 and 2"):
        native_layers.decoder_layers(h, [layer, layer], [keys], [values, values], plan)
    native_layers.decoder_layers(h, [layer, layer], [keys, keys.clone()], [values, values.clone()], plan)
    assert not torch.equal(h, before)
