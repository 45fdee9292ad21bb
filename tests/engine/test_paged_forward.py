"""The paged, ragged, batched forward pass equals a plain dense causal forward."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.linear import CHUNKED_MIN_TOKENS, OUTPUT_CHUNK, linear, linear_columns, pack_weight
from flare.engine.model import DecoderModel, WeightsError
from flare.engine import native, native_layers
from flare.engine.native import Float16Weight
from flare.engine.precision import WeightFormat, cpu_has_float16_gemm

from tests.engine.tiny_llama import random_state_dict, tiny_config

BLOCK_SIZE = 4
TOLERANCE = 1e-4  # float32; the two paths sum in different orders
# With a 16-bit KV cache both sides round k and v, but k's RoPE is computed in a different order,
# so now and then an element rounds to the neighbouring 16-bit value: the bound allows that, and
# is still far below what the rounding itself moves the tiny model's logits (0.011 for float16,
# 0.063 for bfloat16 against a float32 cache).
KV_TOLERANCE = {torch.float32: TOLERANCE, torch.float16: TOLERANCE, torch.bfloat16: 1e-3}
# bfloat16 weights are packed for oneDNN on CPUs it runs bfloat16 on (AVX-512 or newer), plain elsewhere.
PACKING = torch.ops.mkldnn._is_mkldnn_bf16_supported()
BF16_LAYOUTS = pytest.mark.parametrize(
    "packed",
    [False, pytest.param(True, marks=pytest.mark.skipif(not PACKING, reason="oneDNN has no bfloat16 on this CPU"))],
    ids=["plain", "packed"],
)
# float16 weights run vectorised on x86 CPUs with AVX2 (CI's class).
FLOAT16 = pytest.mark.skipif(not cpu_has_float16_gemm(), reason="float16 GEMMs do not run vectorised on this CPU")
# The layer's fused steps run in the native kernels or in their torch counterparts, on linear
# layers that give columns (float32) or rows (float16): every pair must match.
ENGINE_PATHS = pytest.mark.parametrize(
    "native, weight_format",
    [
        (False, WeightFormat.FLOAT32),
        (True, WeightFormat.FLOAT32),
        pytest.param(False, WeightFormat.FLOAT16, marks=FLOAT16),
        pytest.param(True, WeightFormat.FLOAT16, marks=FLOAT16),
    ],
    ids=["torch", "native-kernels", "torch-float16", "native-kernels-float16"],
)


def held_exactly(state: dict[str, torch.Tensor], weight_format: WeightFormat) -> dict[str, torch.Tensor]:
    """`state` rounded to what `weight_format` stores, so a float16 model and the dense float32
    reference multiply the same weights."""
    return {name: tensor.to(weight_format.dtype).float() for name, tensor in state.items()}


def dense_reference(config, state, token_ids: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of the textbook Llama forward over the whole sequence, with
    keys (after RoPE) and values rounded to `kv_dtype`, as a cache of that dtype holds them."""
    d = config.head_dim
    n = len(token_ids)
    group = config.num_heads // config.num_kv_heads

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(n).float(), inv_freq)
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([angles.sin()] * 2, -1)

    def rope(x):  # x [heads, n, d]
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    h = state["model.embed_tokens.weight"][token_ids]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        x = rms(h, state[p + "input_layernorm.weight"])
        q = (x @ state[p + "self_attn.q_proj.weight"].T).view(n, config.num_heads, d).transpose(0, 1)
        k = (x @ state[p + "self_attn.k_proj.weight"].T).view(n, config.num_kv_heads, d).transpose(0, 1)
        v = (x @ state[p + "self_attn.v_proj.weight"].T).view(n, config.num_kv_heads, d).transpose(0, 1)
        q, k = rope(q), rope(k).to(kv_dtype).float()
        v = v.to(kv_dtype).float()
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
        scores = (q @ k.transpose(1, 2)) / d**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attention = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        h = h + attention @ state[p + "self_attn.o_proj.weight"].T
        x = rms(h, state[p + "post_attention_layernorm.weight"])
        gate = x @ state[p + "mlp.gate_proj.weight"].T
        up = x @ state[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    h = rms(h, state["model.norm.weight"])
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    return h @ head.T


def shuffled_allocator(num_blocks: int, seed: int) -> BlockAllocator:
    """An allocator whose free list is in random order, so block tables are not contiguous."""
    allocator = BlockAllocator(num_blocks)
    blocks = allocator.allocate(num_blocks)
    random.Random(seed).shuffle(blocks)
    allocator.free(blocks)
    return allocator


def random_tokens(config, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(config.vocab_size) for _ in range(n)]


def new_cache(config, num_blocks: int = 64, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(
        num_layers=config.num_layers,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )


def blocks_for(position_end: int) -> int:
    return -(-position_end // BLOCK_SIZE)


@pytest.mark.parametrize("tie", [True, False])
def test_one_prompt_in_one_chunk_matches_the_dense_forward(tie: bool) -> None:
    config = tiny_config(tie_word_embeddings=tie)
    state = random_state_dict(config)
    model = DecoderModel(config, state)
    cache = new_cache(config)
    tokens = random_tokens(config, 37, seed=1)
    table = shuffled_allocator(cache.num_blocks, seed=2).allocate(blocks_for(len(tokens)))

    batch = ForwardBatch.build([ForwardRow(tokens, 0, table, num_logits=len(tokens))], BLOCK_SIZE)
    logits = model.forward(batch, cache)

    assert logits.dtype == torch.float32
    assert logits.shape == (len(tokens), config.vocab_size)
    torch.testing.assert_close(logits, dense_reference(config, state, tokens), atol=TOLERANCE, rtol=0)


@ENGINE_PATHS
def test_prompt_split_in_chunks_over_several_calls_matches_the_dense_forward(
    config, state_dict, native, weight_format
) -> None:
    state_dict = held_exactly(state_dict, weight_format)
    model = DecoderModel(config, state_dict, native_kernels=native, weight_format=weight_format)
    # Chunks of mixed sizes: long (own attention call), short (padded call), single tokens.
    assert_chunks_match_the_dense_forward(model, state_dict, (20, 3, 17, 1, 19, 1), seed=3)


def assert_chunks_match_the_dense_forward(model: DecoderModel, state: dict[str, torch.Tensor], sizes: tuple[int, ...], seed: int) -> None:
    """Feed one random prompt of sum(sizes) tokens to `model` chunk after chunk (its blocks
    scattered over the pool), each chunk's logits held to the dense forward's."""
    config = model.config
    cache = new_cache(config)
    tokens = random_tokens(config, sum(sizes), seed=seed)
    table = shuffled_allocator(cache.num_blocks, seed=seed + 1).allocate(blocks_for(len(tokens)))
    reference = dense_reference(config, state, tokens)
    start = 0
    for size in sizes:
        end = start + size
        row = ForwardRow(tokens[start:end], start, table[: blocks_for(end)], num_logits=size)
        logits = model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache)
        torch.testing.assert_close(logits, reference[start:end], atol=TOLERANCE, rtol=0)
        start = end


@ENGINE_PATHS
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["kv32", "kv16", "kvbf16"])
def test_mixed_batch_of_chunks_decode_and_verify_rows_matches_the_dense_forward(
    config, state_dict, native, weight_format, kv_dtype
) -> None:
    state_dict = held_exactly(state_dict, weight_format)
    model = DecoderModel(config, state_dict, native_kernels=native, weight_format=weight_format)
    cache = new_cache(config, num_blocks=128, dtype=kv_dtype)
    allocator = shuffled_allocator(cache.num_blocks, seed=5)

    histories = {name: random_tokens(config, 80, seed=10 + i) for i, name in enumerate("abcdef")}
    tables = {name: allocator.allocate(blocks_for(80)) for name in histories}
    already = {"a": 25, "b": 30, "c": 12, "d": 0, "e": 0, "f": 41}  # positions cached before the mixed round

    # Fill the cache for the requests already underway, in one batch of its own.
    warmup = [
        ForwardRow(histories[n][: already[n]], 0, tables[n], num_logits=0) for n in "abcf"
    ]
    assert model.forward(ForwardBatch.build(warmup, BLOCK_SIZE), cache).shape == (0, config.vocab_size)

    plan = {  # request: (new tokens this round, logits asked)
        "a": (21, 1),  # a continuing long prompt chunk, the prompt's last
        "b": (1, 1),  # a decode row
        "c": (6, 6),  # a verify row: 1 + 5 drafts
        "d": (9, 0),  # a short first prompt chunk, not the last
        "e": (33, 1),  # a long whole prompt
        "f": (6, 6),  # another verify row, with a longer context (same attention call as c)
    }
    order = ["b", "a", "f", "d", "c", "e"]
    rows = [
        ForwardRow(
            histories[n][already[n] : already[n] + plan[n][0]], already[n], tables[n], num_logits=plan[n][1]
        )
        for n in order
    ]
    logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)

    expected = []
    for n in order:
        end = already[n] + plan[n][0]
        expected.append(dense_reference(config, state_dict, histories[n][:end], kv_dtype)[end - plan[n][1] : end])
    torch.testing.assert_close(logits, torch.cat(expected), atol=KV_TOLERANCE[kv_dtype], rtol=0)

    # A following decode round over every request still agrees (the cache was written right).
    rows = []
    expected = []
    for n in order:
        end = already[n] + plan[n][0]
        rows.append(ForwardRow(histories[n][end : end + 1], end, tables[n], num_logits=1))
        expected.append(dense_reference(config, state_dict, histories[n][: end + 1], kv_dtype)[end:])
    logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)
    torch.testing.assert_close(logits, torch.cat(expected), atol=KV_TOLERANCE[kv_dtype], rtol=0)


def test_weights_that_do_not_match_the_config_are_named(config, state_dict) -> None:
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    state_dict["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    state_dict["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(WeightsError) as error:
        DecoderModel(config, state_dict)
    message = str(error.value)
    assert "model.layers.1.mlp.up_proj.weight is missing" in message
    assert "model.extra.weight is not part of" in message
    assert "model.layers.0.self_attn.q_proj.weight has shape [3, 3]" in message


@pytest.mark.parametrize("context", [None, 40])
def test_a_position_past_the_context_served_is_refused(config, state_dict, context) -> None:
    model = DecoderModel(config, state_dict, context=context)
    cache = new_cache(config, num_blocks=200)
    last = config.max_position_embeddings if context is None else context
    row = ForwardRow([5], last, list(range(blocks_for(last + 1))), num_logits=1)
    with pytest.raises(ValueError, match=f"past the context served, {last} positions"):
        model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache)


def test_a_cache_of_another_dtype_is_refused(config, state_dict) -> None:
    model = DecoderModel(config, state_dict)
    cache = KVCache.for_budget(config, 1 << 20, BLOCK_SIZE, dtype=torch.float64)
    with pytest.raises(ValueError, match="create the cache in the model's dtype, float16 or bfloat16"):
        model.forward(ForwardBatch.build([ForwardRow([5], 0, [0], num_logits=1)], BLOCK_SIZE), cache)


def test_a_tall_weight_applied_in_output_slices_equals_one_product() -> None:
    # The LM head's shape class: more than two slices of output rows, a round of 16+ tokens.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * OUTPUT_CHUNK + 100, 24, generator=generator)
    for tokens in (1, CHUNKED_MIN_TOKENS - 1, CHUNKED_MIN_TOKENS, 40):
        x = torch.randn(tokens, 24, generator=generator)
        torch.testing.assert_close(linear_columns(x, weight), weight @ x.T, atol=1e-5, rtol=1e-5)


@BF16_LAYOUTS
def test_bfloat16_linear_layers_equal_float32_products_of_the_rounded_operands(packed: bool) -> None:
    # A bfloat16 weight takes its input rounded to bfloat16, accumulates in float32 and rounds
    # the product to bfloat16 (8 significant bits), which is widened back to the input's dtype.
    generator = torch.Generator().manual_seed(0)
    for rows, columns in ((40, 24), (2 * OUTPUT_CHUNK + 100, 24)):
        weight = torch.randn(rows, columns, generator=generator).bfloat16()
        applied = pack_weight(weight, WeightFormat.BFLOAT16) if packed else weight
        for tokens in (1, 3, CHUNKED_MIN_TOKENS, 40):
            x = torch.randn(tokens, columns, generator=generator)
            exact = x.bfloat16().float() @ weight.float().T
            scale = exact.abs().amax()
            as_rows = linear(x, applied)
            as_columns = linear_columns(x, applied)
            assert as_rows.dtype == as_columns.dtype == torch.float32
            assert as_rows.shape == (tokens, rows) and as_columns.shape == (rows, tokens)
            torch.testing.assert_close(as_rows, exact, atol=scale * 2**-8, rtol=2**-8)
            torch.testing.assert_close(as_columns, exact.T, atol=scale * 2**-8, rtol=2**-8)


@FLOAT16
@pytest.mark.parametrize("kernel", ["native", "fbgemm"])
def test_float16_linear_layers_equal_float32_products_of_the_rounded_weights(kernel: str) -> None:
    # Only the weights are rounded to float16 (11 significant bits); activations stay float32
    # and products accumulate in float32, so the result is a float32 product of the rounded
    # weights up to summation order. fbgemm multiplies where the C kernels were not built.
    generator = torch.Generator().manual_seed(0)
    for rows, columns in ((40, 24), (2 * OUTPUT_CHUNK + 100, 576)):
        weight = torch.randn(rows, columns, generator=generator)
        if kernel == "native":
            packed = pack_weight(weight, WeightFormat.FLOAT16)
            assert isinstance(packed, Float16Weight)
        else:
            packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        for tokens in (1, 3, CHUNKED_MIN_TOKENS, 40):
            x = torch.randn(tokens, columns, generator=generator)
            exact = (x.double() @ weight.half().double().T).float()
            as_rows, as_columns = linear(x, packed), linear_columns(x, packed)
            assert as_rows.dtype == as_columns.dtype == torch.float32
            assert as_rows.shape == (tokens, rows) and as_columns.shape == (rows, tokens)
            assert as_columns.stride() == (1, rows)  # the rows, read transposed: no copy
            tolerance = 2e-6 * columns**0.5 * exact.abs().max()
            torch.testing.assert_close(as_rows, exact, atol=tolerance, rtol=1e-5)
            torch.testing.assert_close(as_columns, exact.T, atol=tolerance, rtol=1e-5)
            # Against float32 weights, only the weights' rounding (2^-11 relative) shows.
            unrounded = x @ weight.T
            assert (as_rows - unrounded).abs().max() < 2**-10 * (x.abs() @ weight.abs().T).max()


def float32_and_rounded_logits(model: DecoderModel, state: dict[str, torch.Tensor], config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(float32 model's, `model`'s) logits of a 30-token prompt and of one decode step after it."""
    exact = DecoderModel(config, state)
    caches = new_cache(config), new_cache(config)
    tokens = random_tokens(config, 30, seed=7)
    table = list(range(blocks_for(len(tokens) + 1)))
    prompt = ForwardBatch.build([ForwardRow(tokens, 0, table, num_logits=len(tokens))], BLOCK_SIZE)
    decode = ForwardBatch.build([ForwardRow([tokens[0]], len(tokens), table, num_logits=1)], BLOCK_SIZE)
    pairs = [(exact.forward(batch, caches[0]), model.forward(batch, caches[1])) for batch in (prompt, decode)]
    for reference, logits in pairs:
        assert logits.dtype == torch.float32 and logits.shape == reference.shape
    return pairs


@FLOAT16
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("built", [True, False], ids=["c-kernels", "no-c-kernels"])
def test_a_model_with_float16_gemms_tracks_the_float32_model_on_the_same_weights(monkeypatch, tie: bool, built: bool) -> None:
    # Without the C kernels (no compiler at install) float16 runs through fbgemm, step by step.
    monkeypatch.setattr(native, "available", lambda: built)
    config = tiny_config(tie_word_embeddings=tie)
    # Weights that float16 holds exactly, so the two models differ only in how they multiply.
    state = {name: tensor.half().float() for name, tensor in random_state_dict(config).items()}
    fast = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    assert fast.weight_format == WeightFormat.FLOAT16 and fast.dtype == torch.float32
    assert fast.embed.dtype == torch.float16
    assert isinstance(fast.lm_head, Float16Weight if built else torch.ScriptObject)
    assert (fast.kernel_layers is not None) == built and fast.native_kernels == built
    for reference, logits in float32_and_rounded_logits(fast, state, config):
        # Only the summation order differs: float32 accumulation on both sides.
        torch.testing.assert_close(logits, reference, atol=1e-4 * reference.abs().max(), rtol=1e-4)
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("tie", [True, False])
def test_a_model_with_bfloat16_gemms_tracks_the_float32_model_on_the_same_weights(tie: bool) -> None:
    config = tiny_config(tie_word_embeddings=tie)
    # Weights that bfloat16 holds exactly, so the two models differ only in how they multiply.
    state = {name: tensor.bfloat16().float() for name, tensor in random_state_dict(config).items()}
    rounded = DecoderModel(config, state, weight_format=WeightFormat.BFLOAT16)
    packed = isinstance(rounded.lm_head, torch.Tensor) and rounded.lm_head.is_mkldnn
    assert packed == PACKING and rounded.dtype == torch.float32
    for reference, logits in float32_and_rounded_logits(rounded, state, config):
        # Two layers of bfloat16 rounding (2^-8 relative per product) on logits of about +-3.
        assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
        assert agree >= 0.9


@FLOAT16
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_round_of_short_rows_on_float16_weights_runs_each_layer_in_one_call_with_the_steps_bits(monkeypatch, kv_dtype) -> None:
    # native_layers.decoder_layer runs the same kernels in the same order as the step-by-step path, so
    # logits and the cache must be the same bits; a round with a row too long for the attention
    # kernel runs step by step.
    config = tiny_config()
    state = held_exactly(random_state_dict(config), WeightFormat.FLOAT16)
    fused = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    steps = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    assert fused.kernel_layers is not None
    steps.kernel_layers = None
    layer_calls = []
    run = native_layers.LayerStack.run
    monkeypatch.setattr(native_layers.LayerStack, "run", lambda stack, *args: layer_calls.extend(stack.layers) or run(stack, *args))
    caches = new_cache(config, dtype=kv_dtype), new_cache(config, dtype=kv_dtype)
    first, second, long = random_tokens(config, 9, 1), random_tokens(config, 5, 2), random_tokens(config, 30, 3)
    rounds = [
        # Two prompts short enough for the kernel: one call per layer.
        [ForwardRow(first, 0, [0, 1, 2], num_logits=1), ForwardRow(second, 0, [3, 4], num_logits=1)],
        # A decode row and a verify row of 3 tokens.
        [ForwardRow([7], 9, [0, 1, 2], num_logits=1), ForwardRow([8, 9, 10], 5, [3, 4], num_logits=3)],
        # A long prompt chunk beside a decode row: step by step.
        [ForwardRow([11], 10, [0, 1, 2], num_logits=1), ForwardRow(long, 0, list(range(5, 5 + blocks_for(30))), num_logits=2)],
    ]
    for rows, expected_calls in zip(rounds, (config.num_layers, 2 * config.num_layers, 2 * config.num_layers)):
        batch = ForwardBatch.build(rows, BLOCK_SIZE)
        assert torch.equal(fused.forward(batch, caches[0]), steps.forward(batch, caches[1]))
        assert len(layer_calls) == expected_calls
    for fused_pool, steps_pool in zip((*caches[0].keys, *caches[0].values), (*caches[1].keys, *caches[1].values)):
        assert torch.equal(fused_pool, steps_pool)


@FLOAT16
def test_a_fused_round_refuses_block_ids_and_slots_outside_the_pool_before_any_layer_runs() -> None:
    config = tiny_config()
    model = DecoderModel(config, random_state_dict(config), weight_format=WeightFormat.FLOAT16)
    cache = new_cache(config, num_blocks=8)
    cases = [
        (ForwardRow(random_tokens(config, 6, 4), 0, [0, 99], num_logits=1), "a slot lies outside the KV pool"),
        (ForwardRow(random_tokens(config, 6, 4), 0, [0, -1], num_logits=1), "a slot lies outside the KV pool"),
        # The new token's slot is in block 1; the cached positions before it are in block 99.
        (ForwardRow([5], 6, [99, 1], num_logits=1), "a block id lies outside the KV pool"),
    ]
    for row, message in cases:
        batch = ForwardBatch.build([row], BLOCK_SIZE)
        before = [pool.clone() for pool in cache.keys]
        with pytest.raises(ValueError, match=message):
            model.forward(batch, cache)
        assert all(torch.equal(pool, kept) for pool, kept in zip(cache.keys, before))


@FLOAT16
def test_one_call_layers_with_wide_heads_match_the_dense_forward_chunk_by_chunk(monkeypatch) -> None:
    # Heads of 64 take the attention kernel's AVX2 tiles (3 query heads a KV head: the 3-query
    # tile, and 2 and 1 for the remainders of a verify row's queries) inside native_layers.decoder_layer.
    config = replace(tiny_config(), num_heads=6, num_kv_heads=2, head_dim=64)
    state = held_exactly(random_state_dict(config), WeightFormat.FLOAT16)
    model = DecoderModel(config, state, weight_format=WeightFormat.FLOAT16)
    layer_calls = []
    run = native_layers.LayerStack.run
    monkeypatch.setattr(native_layers.LayerStack, "run", lambda stack, *args: layer_calls.extend(stack.layers) or run(stack, *args))
    assert_chunks_match_the_dense_forward(model, state, (17, 1, 5, 16, 1, 5), seed=6)
    assert len(layer_calls) == 6 * config.num_layers
