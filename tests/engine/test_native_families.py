"""The CPU kernels' options for the model families (issue 26), each against its torch expression:
the q/k/v bias, per-head q/k RMSNorm and partial rotary of `rope_and_cache`; the sliding window,
soft-cap and scale of `paged_attention`; GELU-tanh in `gated_rows`; and a whole layer with all of
them and the sandwich norms through `decoder_layer`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests import REPOSITORY
from tests.engine.test_native import linear_layouts

from flare.engine import _native, native, native_layers
from flare.engine.layers.rope import apply_rope

HEAD_SHAPES = pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 3, 64), (4, 1, 128)])


def rope_table(rotary_dims: int, theta: float, positions: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, rotary_dims / 2] of position * theta^(-2i / rotary_dims)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the leading 2 * cos.shape[-1] dims of x [..., D] (rotate-half within them), the rest as they are."""
    rotary = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), -1)


def rope_reference(qkv, heads, kv_heads, cos, sin, *, bias=None, q_norm=None, k_norm=None, norm_eps=1e-6):
    """q, k and v [T, heads, D] as Hugging Face's attention makes them: bias, q/k norm, RoPE."""
    tokens, head_dim = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    x = (qkv if bias is None else qkv + bias).view(tokens, heads + 2 * kv_heads, head_dim)
    q, k, v = x.split((heads, kv_heads, kv_heads), 1)
    if q_norm is not None:
        q, k = F.rms_norm(q, (head_dim,), q_norm, norm_eps), F.rms_norm(k, (head_dim,), k_norm, norm_eps)
    return rotate_leading(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate_leading(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


@HEAD_SHAPES
@pytest.mark.parametrize("features", ["bias", "qk_norm", "partial", "all"])
@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_rope_and_cache_adds_the_bias_normalizes_q_and_k_and_rotates_the_leading_dims_like_torch(
    heads, kv_heads, head_dim, features, tokens
) -> None:
    generator = torch.Generator().manual_seed(head_dim + tokens)
    channels = (heads + 2 * kv_heads) * head_dim
    qkv = 2 * torch.randn(tokens, channels, generator=generator)
    options = {}
    if features in ("bias", "all"):
        options["bias"] = torch.randn(channels, generator=generator)
    if features in ("qk_norm", "all"):
        options["q_norm"] = 1 + 0.3 * torch.randn(head_dim, generator=generator)
        options["k_norm"] = 1 + 0.3 * torch.randn(head_dim, generator=generator)
        options["norm_eps"] = 1e-6
    rotary = head_dim // 2 if features in ("partial", "all") else head_dim
    cos, sin = rope_table(rotary, 10000.0)
    positions = torch.randint(0, 256, (tokens,), generator=generator)
    slots = torch.randperm(96, generator=generator)[:tokens]
    q_expected, k_expected, v_expected = rope_reference(qkv, heads, kv_heads, cos[positions], sin[positions], **options)

    for layout, columns in linear_layouts(qkv.t()).items():
        keys, values = torch.zeros(kv_heads, 6, 16, head_dim), torch.zeros(kv_heads, 6, 16, head_dim)
        q = native.rope_and_cache(columns, positions, slots, cos, sin, keys, values, heads, **options)
        torch.testing.assert_close(q, q_expected, atol=2e-5, rtol=1e-5, msg=layout)
        flat_keys, flat_values = keys.view(kv_heads, -1, head_dim), values.view(kv_heads, -1, head_dim)
        torch.testing.assert_close(flat_keys[:, slots], k_expected.transpose(0, 1), atol=2e-5, rtol=1e-5, msg=layout)
        torch.testing.assert_close(flat_values[:, slots], v_expected.transpose(0, 1), atol=1e-6, rtol=0, msg=layout)
        untouched = torch.ones(96, dtype=torch.bool)
        untouched[slots] = False
        assert not flat_keys[:, untouched].any() and not flat_values[:, untouched].any()


def test_rope_and_cache_with_q_k_norm_rounds_into_a_16_bit_pool_as_torch_casts() -> None:
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 5
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    norm = 1 + 0.3 * torch.randn(head_dim, generator=generator)
    bias = torch.randn(qkv.shape[1], generator=generator)
    cos, sin = rope_table(head_dim, 1e6)
    positions, slots = torch.arange(tokens), torch.tensor([4, 0, 31, 9, 17])
    _, k_expected, v_expected = rope_reference(qkv, heads, kv_heads, cos[positions], sin[positions], bias=bias, q_norm=norm, k_norm=norm)
    keys, values = torch.zeros(kv_heads, 4, 8, head_dim, dtype=torch.bfloat16), torch.zeros(kv_heads, 4, 8, head_dim, dtype=torch.bfloat16)
    native.rope_and_cache(qkv.t(), positions, slots, cos, sin, keys, values, heads, bias=bias, q_norm=norm, k_norm=norm)
    # v is bias plus input, one float32 add, then one rounding: torch's bits.
    assert torch.equal(values.view(kv_heads, -1, head_dim)[:, slots], v_expected.transpose(0, 1).to(torch.bfloat16))
    error = (keys.view(kv_heads, -1, head_dim)[:, slots].float() - k_expected.transpose(0, 1)).abs().max()
    assert error <= k_expected.abs().max() * 2**-8


def test_rope_and_cache_refuses_features_that_do_not_fit_the_heads() -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    keys, values = torch.zeros(kv_heads, 4, 8, head_dim), torch.zeros(kv_heads, 4, 8, head_dim)
    qkv, positions, slots = torch.randn(128, 2), torch.tensor([0, 1]), torch.tensor([0, 1])
    cos, sin = rope_table(head_dim, 10000.0)
    wide_cos, wide_sin = rope_table(2 * head_dim, 10000.0)
    cases = [
        ({"bias": torch.zeros(127)}, r"bias must be a contiguous CPU float32 \[128\]"),
        ({"q_norm": torch.ones(16, dtype=torch.float64), "k_norm": torch.ones(16)}, r"q_norm must be a contiguous CPU float32 \[16\]"),
        ({"k_norm": torch.ones(8)}, r"k_norm must be a contiguous CPU float32 \[16\]"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            native.rope_and_cache(qkv, positions, slots, cos, sin, keys, values, heads, **options)
    with pytest.raises(ValueError, match="rotary_dims at most 16"):
        native.rope_and_cache(qkv, positions, slots, wide_cos, wide_sin, keys, values, heads)
    with pytest.raises(ValueError, match="the norms' eps must be positive"):
        native.rope_and_cache(qkv, positions, slots, cos, sin, keys, values, heads, q_norm=torch.ones(16), k_norm=torch.ones(16), norm_eps=0.0)
    assert not keys.any() and not values.any()


def windowed_attention(q, keys, values, block_table, starts, query_len, *, scale=None, window=None, softcap=None) -> torch.Tensor:
    """Per token at position p: softmax over keys p - window < k <= p of (capped) scale * q.k, times v."""
    out = torch.empty_like(q)
    heads, (kv_heads, _, _, head_dim) = q.shape[1], keys.shape
    group = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    for r, start in enumerate(starts.tolist()):
        k = keys[:, block_table[r]].reshape(kv_heads, -1, head_dim).repeat_interleave(group, 0).double()
        v = values[:, block_table[r]].reshape(kv_heads, -1, head_dim).repeat_interleave(group, 0).double()
        for t in range(query_len):
            end = start + t + 1
            first = 0 if window is None else max(0, end - window)
            scores = torch.einsum("hd,hkd->hk", q[r * query_len + t].double(), k[:, first:end]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[r * query_len + t] = torch.einsum("hk,hkd->hd", scores.softmax(-1), v[:, first:end]).float()
    return out


@HEAD_SHAPES
@pytest.mark.parametrize("portable", [False, True], ids=["tiles", "portable"])
@pytest.mark.parametrize(
    ("window", "softcap", "scale"),
    [(5, None, None), (17, None, None), (1000, None, None), (None, 50.0, None), (None, None, 0.05), (9, 50.0, 1 / 12)],
)
@pytest.mark.parametrize(("rows", "query_len"), [(1, 1), (5, 1), (3, 4), (2, 17)])
def test_paged_attention_with_a_window_a_soft_cap_and_a_scale_attends_like_torch(
    heads, kv_heads, head_dim, portable, window, softcap, scale, rows, query_len
) -> None:
    generator = torch.Generator().manual_seed(head_dim * 100 + rows * 10 + query_len)
    blocks, block_size = 8, 16
    keys = torch.randn(kv_heads, rows * blocks + 3, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, rows * blocks + 3, block_size, head_dim, generator=generator)
    block_table = torch.randperm(rows * blocks + 3, generator=generator)[: rows * blocks].view(rows, blocks)
    starts = torch.randint(0, blocks * block_size - query_len + 1, (rows,), generator=generator)
    starts[0] = blocks * block_size - query_len  # the longest row: windows of 5 and 17 leave whole blocks behind
    # Scores of tens, so that a cap of 50 bends them.
    q = 4 * head_dim**0.25 * torch.randn(rows * query_len, heads, head_dim, generator=generator)

    got = native.paged_attention(q, keys, values, block_table, starts, query_len, scale=scale, window=window, softcap=softcap, portable=portable)

    expected = windowed_attention(q, keys, values, block_table, starts, query_len, scale=scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["tiles", "portable"])
@pytest.mark.parametrize(
    ("window", "softcap", "scale"), [(None, None, None), (300, None, None), (100, 50.0, None), (None, 50.0, 1 / 12)]
)
def test_rows_past_a_key_range_attend_like_torch_with_a_window_a_soft_cap_and_a_scale(portable, window, softcap, scale) -> None:
    # Rows reaching over the cuts at R and 2 R (paged_attention.c), windows that reach over a cut
    # or stay within one range.
    key_range = _native.ATTENTION_KEY_RANGE
    generator = torch.Generator().manual_seed(31)
    heads, kv_heads, head_dim, block_size, query_len = 8, 2, 64, 16, 5
    blocks = 3 * key_range // block_size
    keys = torch.randn(kv_heads, 2 * blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, 2 * blocks, block_size, head_dim, generator=generator)
    block_table = torch.randperm(2 * blocks, generator=generator).view(2, blocks)
    starts = torch.tensor([key_range - 2, 2 * key_range + 150])
    q = 4 * head_dim**0.25 * torch.randn(2 * query_len, heads, head_dim, generator=generator)

    got = native.paged_attention(q, keys, values, block_table, starts, query_len, scale=scale, window=window, softcap=softcap, portable=portable)

    expected = windowed_attention(q, keys, values, block_table, starts, query_len, scale=scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_the_soft_cap_changes_the_attention_it_is_given() -> None:
    # The cases above would pass with the cap ignored were the scores too small to bend.
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 4, 16, 64, generator=generator), torch.randn(2, 4, 16, 64, generator=generator)
    q = 30 * torch.randn(1, 4, 64, generator=generator)
    table, starts = torch.tensor([[0, 1, 2, 3]]), torch.tensor([60])
    capped = native.paged_attention(q, keys, values, table, starts, 1, softcap=50.0)
    assert (capped - native.paged_attention(q, keys, values, table, starts, 1)).abs().max() > 0.1


def test_blocks_before_every_window_are_not_read() -> None:
    # A row at position 100 with a window of 20 sees positions 81..100: blocks 0..4 (positions
    # 0..79) are never read, so NaN there (or a freed block's stale data) does not reach the output.
    generator = torch.Generator().manual_seed(4)
    keys, values = torch.randn(1, 8, 16, 64, generator=generator), torch.randn(1, 8, 16, 64, generator=generator)
    keys[:, :5], values[:, :5] = float("nan"), float("nan")
    q = torch.randn(1, 2, 64, generator=generator)
    table, starts = torch.arange(8).view(1, 8), torch.tensor([100])
    for portable in (False, True):
        got = native.paged_attention(q, keys, values, table, starts, 1, window=20, portable=portable)
        assert got.isfinite().all()
        clean_keys, clean_values = keys.nan_to_num(), values.nan_to_num()
        torch.testing.assert_close(got, windowed_attention(q, clean_keys, clean_values, table, starts, 1, window=20), atol=2e-5, rtol=2e-5)


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 16, 32, 64, 72]),
    block_size=st.sampled_from([1, 3, 16]),
    query_len=st.integers(1, 9),
    contexts=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 80)),
    softcap=st.one_of(st.none(), st.floats(0.5, 60.0)),
    seed=st.integers(0, 2**16),
)
def test_any_window_and_cap_on_any_pool_attends_like_torch(kv_heads, group, head_dim, block_size, query_len, contexts, window, softcap, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows = len(contexts)
    max_blocks = -(-(max(contexts) + query_len) // block_size)
    num_blocks = rows * max_blocks + 2
    keys = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    block_table = torch.randperm(num_blocks, generator=generator)[: rows * max_blocks].view(rows, max_blocks)
    q = 3 * torch.randn(rows * query_len, kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor(contexts)
    for portable in (False, True):
        got = native.paged_attention(q, keys, values, block_table, starts, query_len, window=window, softcap=softcap, portable=portable)
        expected = windowed_attention(q, keys, values, block_table, starts, query_len, window=window, softcap=softcap)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window must be a positive integer or None, got 0"),
        ({"softcap": -1.0}, "softcap must be a positive finite number or None, got -1.0"),
        ({"scale": float("inf")}, "scale must be a positive finite number or None"),
    ],
)
def test_paged_attention_refuses_a_window_cap_or_scale_out_of_range(options, message) -> None:
    keys, values = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match=message):
        native.paged_attention(torch.randn(1, 2, 16), keys, values, torch.tensor([[0]]), torch.tensor([0]), 1, **options)


def test_gated_rows_with_gelu_tanh_equals_torchs_tanh_gelu_of_gate_times_up() -> None:
    generator = torch.Generator().manual_seed(6)
    for intermediate, tokens in ((160, 1), (1536, 32), (100, 70)):
        gate_up = 4 * torch.randn(2 * intermediate, tokens, generator=generator)
        gate_up[0, 0], gate_up[1, 0], gate_up[2, 0], gate_up[3, 0] = 90.0, -90.0, 1e20, -1e20  # far into both tails
        gate, up = gate_up.chunk(2)
        # Against float64: torch's float32 0.5 x (1 + tanh(...)) loses digits where tanh nears -1,
        # which the kernel's x sigmoid(2 u) does not.
        expected = (F.gelu(gate.double(), approximate="tanh") * up.double()).t()
        for layout, columns in linear_layouts(gate_up).items():
            out = native.gated_rows(columns, "gelu_tanh")
            assert out.is_contiguous() and out.shape == (tokens, intermediate)
            torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6, msg=layout)


def test_gated_rows_with_gelu_tanh_keeps_nan_in_place_and_refuses_an_unknown_activation() -> None:
    gate_up = torch.randn(2 * 64, 3)
    gate_up[5, 1] = float("nan")
    out = native.gated_rows(gate_up, "gelu_tanh")
    assert out[1, 5].isnan() and out.isnan().sum() == 1
    with pytest.raises(ValueError, match="activation must be one of silu, gelu_tanh, got 'relu'"):
        native.gated_rows(gate_up, "relu")


# A whole layer of each family's features through decoder_layer, against a dense torch layer.

HIDDEN, INTERMEDIATE, BLOCK_SIZE, NUM_BLOCKS = 48, 80, 8, 24
FAMILY_LAYERS = {
    # Each: the KernelLayer options, with the tables named by (rotary fraction, theta) for own ones.
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "phi3": {"rotary": 0.5},
    "mistral": {"window": 6},
    "gemma2": {"window": 6, "softcap": 1.5, "scale": 0.2, "sandwich": True, "activation": "gelu_tanh"},
    "gemma3": {"window": 6, "qk_norm": True, "sandwich": True, "activation": "gelu_tanh", "own_tables": 10000.0},
    "everything": {"qkv_bias": True, "qk_norm": True, "rotary": 0.5, "window": 6, "softcap": 1.5, "scale": 0.2, "sandwich": True,
                   "activation": "gelu_tanh", "own_tables": 10000.0},
}


def float16_exact(*shape: int, generator: torch.Generator, spread: float = 0.15) -> torch.Tensor:
    return (spread * torch.randn(*shape, generator=generator)).half().float()


def family_layer(name: str, heads: int, kv_heads: int, head_dim: int, seed: int, round_rotary: int) -> tuple[native_layers.KernelLayer, dict]:
    """A KernelLayer of family `name` and its weights as plain tensors (the torch reference's)."""
    features = FAMILY_LAYERS[name]
    generator = torch.Generator().manual_seed(seed)
    channels = (heads + 2 * kv_heads) * head_dim
    w = {
        "input_norm": 1 + 0.2 * torch.randn(HIDDEN, generator=generator),
        "post_norm": 1 + 0.2 * torch.randn(HIDDEN, generator=generator),
        "qkv": float16_exact(channels, HIDDEN, generator=generator),
        "o": float16_exact(HIDDEN, heads * head_dim, generator=generator),
        "gate_up": float16_exact(2 * INTERMEDIATE, HIDDEN, generator=generator),
        "down": float16_exact(HIDDEN, INTERMEDIATE, generator=generator),
    }
    options: dict = {"window": features.get("window"), "softcap": features.get("softcap"), "scale": features.get("scale"),
                     "activation": features.get("activation", "silu")}
    if features.get("qkv_bias"):
        options["qkv_bias"] = torch.randn(channels, generator=generator)
    if features.get("qk_norm"):
        options["q_norm"] = 1 + 0.3 * torch.randn(head_dim, generator=generator)
        options["k_norm"] = 1 + 0.3 * torch.randn(head_dim, generator=generator)
    if features.get("sandwich"):
        options["attention_output_norm"] = 1 + 0.2 * torch.randn(HIDDEN, generator=generator)
        options["mlp_output_norm"] = 1 + 0.2 * torch.randn(HIDDEN, generator=generator)
    rotary = int(head_dim * features.get("rotary", 1.0))
    if "own_tables" in features or rotary != round_rotary:
        options["cos"], options["sin"] = rope_table(rotary, features.get("own_tables", 1e6))
    parts = {k: (native_layers.LinearPart.float16(native.Float16Weight.pack(w[k])),) for k in ("qkv", "o", "gate_up", "down")}
    layer = native_layers.KernelLayer(input_norm=w["input_norm"], post_norm=w["post_norm"], **parts, **options)
    return layer, {**w, **options, "cos": options.get("cos"), "sin": options.get("sin")}


def reference_layer(h: torch.Tensor, w: dict, heads: int, kv_heads: int, head_dim: int, round_tables, eps: float) -> torch.Tensor:
    """The layer on a whole sequence h [n, hidden] (positions 0 .. n-1), in float64, as
    transformers' Gemma 2 / Qwen3 / Phi-3 layers compute it."""
    n = h.shape[0]
    h = h.double()
    rms = lambda x, weight: F.rms_norm(x, (x.shape[-1],), weight.double(), eps)
    x = rms(h, w["input_norm"])
    qkv = x @ w["qkv"].double().T
    if w.get("qkv_bias") is not None:
        qkv = qkv + w["qkv_bias"].double()
    q, k, v = qkv.view(n, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), 1)
    if w.get("q_norm") is not None:
        q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
    cos, sin = round_tables if w["cos"] is None else (w["cos"], w["sin"])
    cos, sin = cos[:n].double().unsqueeze(1), sin[:n].double().unsqueeze(1)
    q, k = rotate_leading(q, cos, sin), rotate_leading(k, cos, sin)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (head_dim**-0.5 if w["scale"] is None else w["scale"])
    if w["softcap"] is not None:
        scores = w["softcap"] * torch.tanh(scores / w["softcap"])
    position = torch.arange(n)
    visible = position.view(1, -1) <= position.view(-1, 1)
    if w["window"] is not None:
        visible &= position.view(1, -1) > position.view(-1, 1) - w["window"]
    attended = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v).reshape(n, -1)
    out = attended @ w["o"].double().T
    if w.get("attention_output_norm") is not None:
        out = rms(out, w["attention_output_norm"])
    h = h + out
    gate, up = (rms(h, w["post_norm"]) @ w["gate_up"].double().T).chunk(2, -1)
    act = F.gelu(gate, approximate="tanh") if w["activation"] == "gelu_tanh" else F.silu(gate)
    out = (act * up) @ w["down"].double().T
    if w.get("mlp_output_norm") is not None:
        out = rms(out, w["mlp_output_norm"])
    return h + out


def run_family_layers(names: list[str], heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype = torch.float32) -> float:
    """Two sequences through the layers of `names` (back to back, one decoder_layers call a
    round) in rounds of prompts, decodes and verify rows, every round's new tokens against the
    dense reference layers on the whole sequence so far: the largest error, relative to the
    reference's largest value."""
    eps = 1e-6
    round_tables = rope_table(head_dim, 1e6)
    layers, weights = zip(*(family_layer(name, heads, kv_heads, head_dim, seed, head_dim) for seed, name in enumerate(names)))
    keys = [torch.zeros(kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, dtype=kv_dtype) for _ in layers]
    values = [torch.zeros_like(pool) for pool in keys]
    tables = [torch.tensor([[3, 0, 7, 5, 11, 2]]), torch.tensor([[9, 4, 1, 13, 6, 8]])]
    generator = torch.Generator().manual_seed(head_dim)
    sequences: list[list[torch.Tensor]] = [[], []]
    worst = 0.0
    # (new tokens of sequence 0, of sequence 1): prompts in two groups, then decode, then verify rows.
    for lengths in ((13, 9), (1, 1), (3, 3), (1, 1), (11, 2)):
        starts = [len(s) for s in sequences]
        new = [torch.randn(n, HIDDEN, generator=generator) for n in lengths]
        if lengths[0] == lengths[1]:
            groups = [(0, 2, lengths[0], torch.cat(tables), torch.tensor(starts))]
        else:
            groups = [(0, 1, lengths[0], tables[0], torch.tensor(starts[:1])), (lengths[0], 1, lengths[1], tables[1], torch.tensor(starts[1:]))]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        slots = torch.cat([table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for table, p in zip(tables, positions.split(lengths))])
        plan = native_layers.decoder_round(
            positions=positions, slots=slots, cos=round_tables[0], sin=round_tables[1], groups=groups, pool=keys[0],
            heads=heads, hidden=HIDDEN, intermediate=INTERMEDIATE, eps=eps, scratch=torch.empty(sum(lengths) * 4000),
        )
        h = torch.cat(new)
        native_layers.decoder_layers(h, list(layers), keys, values, plan)
        for index, (got, fresh) in enumerate(zip(h.split(lengths), new)):
            sequences[index] += list(fresh)
            expected = torch.stack(sequences[index])
            for w in weights:
                expected = reference_layer(expected, w, heads, kv_heads, head_dim, round_tables, eps)
            expected = expected[-lengths[index]:]
            worst = max(worst, ((got.double() - expected).abs().max() / expected.abs().max()).item())
    return worst


@HEAD_SHAPES
@pytest.mark.parametrize("family", sorted(FAMILY_LAYERS))
def test_a_family_layer_through_decoder_layer_equals_its_torch_layer(heads, kv_heads, head_dim, family) -> None:
    assert run_family_layers([family], heads, kv_heads, head_dim) < 2e-5


def test_a_gemma_style_stack_of_sliding_and_global_layers_runs_in_one_call() -> None:
    # Gemma 3's local layers with their own RoPE base beside a global one on the round's tables.
    assert run_family_layers(["gemma3", "gemma2", "gemma3", "qwen3"], 4, 2, 64) < 2e-5


def test_a_family_layer_over_a_bfloat16_pool_stays_within_the_pools_rounding() -> None:
    assert run_family_layers(["everything"], 4, 2, 64, kv_dtype=torch.bfloat16) < 2e-2


FORCED_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.engine.test_native_families import run_family_layers
from flare.engine import native
print(native.LINEAR_ISA, max(run_family_layers(["everything"], heads, kv, d) for heads, kv, d in ((4, 2, 16), (6, 3, 64))))
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_a_family_layer_is_held_to_torch_under_forced_avx2_and_portable_dispatch(capability: str) -> None:
    # ATEN_CPU_CAPABILITY caps the linear layers' instructions (native.LINEAR_ISA, QUANTIZED_ISA),
    # as test_quantized_linear does: how older CPUs are stood in for, each in its own process.
    script = FORCED_SCRIPT.format(root=REPOSITORY)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    result = subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, capture_output=True, text=True)
    isa, error = result.stdout.split()
    assert int(isa) == native.ISA_AVX2 and float(error) < 2e-5


def weights_of(layer: native_layers.KernelLayer) -> dict:
    """A KernelLayer's norms and linear layers, without its features."""
    return {name: getattr(layer, name) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")}


def test_a_layer_whose_features_do_not_fit_is_refused_naming_them() -> None:
    layer, _ = family_layer("everything", 4, 2, 16, 0, 16)
    base = weights_of(layer)
    cases = [
        ({"qkv_bias": torch.zeros(12)}, r"qkv_bias must be a contiguous CPU float32 \[128\]"),
        ({"q_norm": torch.ones(16)}, "q_norm and k_norm come together"),
        ({"cos": torch.ones(8, 4)}, "cos and sin together"),
        ({"mlp_output_norm": torch.ones(47)}, r"mlp_output_norm must be a contiguous CPU float32 \[48\]"),
        ({"window": -3}, "window must be a positive integer"),
        ({"softcap": 0.0}, "softcap must be a positive finite number"),
        ({"activation": "relu"}, "activation must be one of silu, gelu_tanh"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            native_layers.KernelLayer(**base, **options)


def test_a_layer_whose_norms_or_tables_do_not_fit_the_round_is_refused_before_any_layer_runs() -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    good, _ = family_layer("qwen2", heads, kv_heads, head_dim, 0, head_dim)
    base = weights_of(good)
    short_cos, short_sin = rope_table(head_dim, 1e4, positions=4)
    cos, sin = rope_table(head_dim, 1e6)
    pool = torch.zeros(kv_heads, 4, BLOCK_SIZE, head_dim)
    plan = native_layers.decoder_round(
        positions=torch.tensor([5, 6]), slots=torch.tensor([5, 6]), cos=cos, sin=sin, groups=[(0, 1, 2, torch.tensor([[0]]), torch.tensor([5]))],
        pool=pool, heads=heads, hidden=HIDDEN, intermediate=INTERMEDIATE, eps=1e-6, scratch=torch.empty(10_000),
    )
    assert plan.max_position == 6
    h = torch.randn(2, HIDDEN)
    before = h.clone()
    for bad, message in (
        (native_layers.KernelLayer(**base, cos=short_cos, sin=short_sin), r"RoPE tables \(4, 8\) must reach position 6"),
        (native_layers.KernelLayer(**base, q_norm=torch.ones(8), k_norm=torch.ones(8)), r"q/k norms are \[8\], the round's heads of 16"),
    ):
        with pytest.raises(ValueError, match=message):
            native_layers.decoder_layers(h, [good, bad], [pool, pool.clone()], [pool.clone(), pool.clone()], plan)
    assert torch.equal(h, before) and not pool.any()
