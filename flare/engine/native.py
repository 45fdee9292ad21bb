"""The engine's CPU kernels (flare/engine/csrc/), checked and called on tensors.

Each kernel fuses one step of a layer that torch's CPU operators run as several passes over
memory, and each has a torch counterpart in `model.py` that runs where the extension was not
built (no C compiler at install time) and that the tests hold it equal to:

- `paged_attention`: attention of short rows read straight from the paged KV pool, instead of
  gathering each row's blocks into a copy for SDPA;
- `rope_and_cache`: RoPE on q and k and the write of k and v into the pool, straight from the
  q/k/v layer's output (columns or rows, read through its strides), instead of a transposing
  copy, five elementwise passes and two index copies;
- `gated_rows`: silu(gate) * up (or GELU-tanh's, Gemma's GeGLU) from the gate/up layer's output
  into the rows the down projection reads, instead of two passes and a transposing copy;
  `clamped_swiglu_rows` the same for gpt-oss's clamped SwiGLU (its torch counterpart
  `layers/mlp.py`'s `clamped_swiglu`);
- `add_rms_norm`: the residual add and the RMSNorm after it, instead of seven passes;
- `moe_route`: a mixture-of-experts layer's route (its router's float64 logits, the choice and
  the weights) in one call, instead of a dozen small operators that run cold after a token's
  weights have streamed (its torch counterpart `layers/routing.py`'s `route`);
- the products of weights of ggml blocks (quantized linear layers, the mixture-of-experts
  layer, 8-bit activations and their integer products) and their instruction levels: in
  `native_quantized.py`, on this module's checks;
- `float16_linear`: a linear layer of float16 weights (packed once, `Float16Weight`) on float32
  rows, at the memory's speed for the one to few rows of a decode round, where fbgemm's float16
  GEMM (its torch counterpart) is slower;
- a whole decoder layer of a round of short rows, the kernels above in one call: in
  `native_layers.py` (`KernelLayer`, `decoder_round`, `LayerStack`).

The sampler's kernels are the kernels' own (flare/sampler/native_sampler.py).

The kernels trust the addresses they are given, so every function here first checks the
tensors behind them (device, dtype, shape, strides); the C side checks every index into the
pool and the RoPE tables. Kernels release the GIL and run on `torch.get_num_threads()` threads.

The families' features ride along as options that default to Llama's layer (issue 26;
`ModelConfig`'s docstring): a q/k/v bias, per-head q/k RMSNorm and partial rotary in
`rope_and_cache`, a sliding window, a soft-cap, an explicit scale and attention sinks
(gpt-oss; torch counterpart `layers/attention.py`'s `scores_to_output`) in `paged_attention`,
GELU-tanh in `gated_rows`, all of them and the sandwich norms per layer in `KernelLayer`. Unset,
each kernel runs the loops and gives the bits it did before them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

try:
    from flare.engine import _native
except ImportError:  # built without a C compiler: the torch path runs
    _native = None


def available() -> bool:
    """Whether the kernels were built and import."""
    return _native is not None


def _module():
    if _native is None:
        raise RuntimeError("the engine's CPU kernels were not built; the torch path must be used")
    return _native


def _check(function: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{function}: " + "; ".join(problems))


# The widest instructions the float16 linear layers use (kernels.h, `ISA_*`); the kernel takes
# the widest of them the CPU has. AVX-512 only where ATen dispatches to it too, so that
# ATEN_CPU_CAPABILITY=avx2 holds the whole engine to AVX2 (how the tests and benchmarks stand in
# for an AVX2-only CPU). AVX-512's tiles pay off from a few rows on; one decode row is bound by
# reading the weights either way (docs/kernels.md, "Engine: the float16 kernel").
ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = 0, 1, 2
LINEAR_ISA = ISA_AVX512 if torch.backends.cpu.get_cpu_capability() == "AVX512" else ISA_AVX2
# What ATen dispatches to, as those levels: ATEN_CPU_CAPABILITY=avx2 holds a kernel that takes it
# to AVX2 and ATEN_CPU_CAPABILITY=default to its portable loop (how tests and benchmarks stand in
# for other CPUs). Every level of such a kernel gives the same bits.
ATEN_ISA = {"AVX512": ISA_AVX512, "AVX2": ISA_AVX2}.get(torch.backends.cpu.get_cpu_capability(), ISA_PORTABLE)

# The KV pool's dtypes the kernels read and write (kernels.h, `KvDtype`): everything is computed
# in float32, 16-bit elements are widened when read and rounded to nearest even when written.
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pool_problems(keys: torch.Tensor, values: torch.Tensor) -> list[str]:
    """What is wrong with a pair of KV pools the kernels would read or write."""
    if keys.device.type != "cpu" or keys.dtype not in KV_DTYPE_CODES or values.dtype != keys.dtype:
        names = ", ".join(str(d).removeprefix("torch.") for d in KV_DTYPE_CODES)
        return [f"keys and values must be CPU pools of one dtype of {names}, got {keys.device} {keys.dtype} and {values.dtype}"]
    return []


def _dtype_problems(**tensors: tuple[torch.Tensor, torch.dtype]) -> list[str]:
    return [
        f"{name} must be a CPU {dtype} tensor, got {tensor.device} {tensor.dtype}"
        for name, (tensor, dtype) in tensors.items()
        if tensor.device.type != "cpu" or tensor.dtype != dtype
    ]


def paged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    start_positions: torch.Tensor,
    query_len: int,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    portable: bool = False,
    value_dim: int | None = None,
) -> torch.Tensor:
    """Causal attention of `rows` rows of `query_len` new tokens each over their cached keys.

    q [rows * query_len, heads, D] (row after row; its heads and dims contiguous, tokens may be
    further apart), keys and values the pools [kv_heads, num_blocks, block_size, D] (float32,
    float16 or bfloat16),
    block_table [rows, max_blocks] int64, start_positions [rows] int64 (the position of each
    row's first new token; token t of a row attends to positions up to start + t). Returns
    [rows * query_len, heads, D].

    `scale`: the factor on q . k (None: D ** -0.5). `window`: a sliding window, the token at
    position p attends to positions p - window < k <= p only (None: all). `softcap`: scores
    become softcap * tanh(score / softcap) after the scale, before the softmax (None: not capped).
    `sinks`: float32 [heads], each head's learned sink logit, which joins its softmax's
    denominator and carries no value (gpt-oss; None: no sinks). `value_dim`: each value is the
    first value_dim numbers of its pool row, and the result [rows * query_len, heads, value_dim]
    (latent attention's absorbed form passes its one pool as keys and values; None: D).
    """
    native = _module()
    tokens, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, pool_head_dim = keys.shape
    rows, max_blocks = block_table.shape
    problems = _dtype_problems(
        q=(q, torch.float32),
        block_table=(block_table, torch.int64),
        start_positions=(start_positions, torch.int64),
    ) + _pool_problems(keys, values)
    if values.shape != keys.shape or not keys.is_contiguous() or not values.is_contiguous():
        problems.append(f"keys and values must be contiguous pools of one shape, got {keys.shape} and {values.shape}")
    if pool_head_dim != head_dim or heads % kv_heads:
        problems.append(f"q has {heads} heads of {head_dim}, the pool {kv_heads} KV heads of {pool_head_dim}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        problems.append(f"q's heads and dims must be contiguous, got strides {q.stride()}")
    if tokens != rows * query_len or start_positions.shape != (rows,):
        problems.append(
            f"{tokens} query tokens, {rows} block-table rows of {query_len} tokens, "
            f"start_positions {tuple(start_positions.shape)}"
        )
    if not block_table.is_contiguous() or not start_positions.is_contiguous():
        problems.append("block_table and start_positions must be contiguous")
    problems += _attention_option_problems(scale, window, softcap)
    if value_dim is not None and (isinstance(value_dim, bool) or not isinstance(value_dim, int) or not 1 <= value_dim <= head_dim):
        problems.append(f"value_dim must be an integer in 1 .. {head_dim}, got {value_dim!r}")
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.device.type != "cpu" or sinks.shape != (heads,) or not sinks.is_contiguous()):
        problems.append(f"sinks must be a contiguous CPU float32 [{heads}] (one per query head), got {sinks.device} {sinks.dtype} {tuple(sinks.shape)}")
    _check("paged_attention", problems)

    out = torch.empty(tokens, heads, value_dim or head_dim, dtype=torch.float32)
    native.paged_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), out.data_ptr(), block_table.data_ptr(),
        start_positions.data_ptr(), rows, query_len, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks,
        head_dim**-0.5 if scale is None else scale, window or 0, softcap or 0.0, torch.get_num_threads(),
        KV_DTYPE_CODES[keys.dtype], portable, 0 if sinks is None else sinks.data_ptr(), value_dim or 0,
    )
    return out


def _attention_option_problems(scale: float | None, window: int | None, softcap: float | None) -> list[str]:
    problems = []
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        problems.append(f"window must be a positive integer or None, got {window!r}")
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0 and value != float("inf")):
            problems.append(f"{name} must be a positive finite number or None, got {value!r}")
    return problems


def rope_and_cache(
    qkv_columns: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: int,
    *,
    bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Rotate q and k of every token, write k and v into the pools, return q [T, heads, D].

    qkv_columns [(heads + 2 kv_heads) * D, T] (the q/k/v layer's output as columns: contiguous,
    or the transposed view of its rows; any strides are read as they are), positions and slots
    [T] int64 (slot = block * block_size + offset), cos and sin [max_positions, R / 2], keys and
    values the pools [kv_heads, num_blocks, block_size, D] (float32, or float16 / bfloat16, into
    which k and v are rounded to nearest even as torch's cast rounds).

    The tables' width says how many leading dims of each head rotate: R = D (all), or fewer
    (partial rotary: rotate-half within the first R, the rest copied). `bias` [(heads + 2
    kv_heads) * D] is added to q, k and v first; `q_norm` and `k_norm` [D] RMS-normalize each q
    (k) head (eps `norm_eps`) after the bias and before RoPE.
    """
    native = _module()
    kv_heads, num_blocks, block_size, head_dim = keys.shape
    channels, tokens = qkv_columns.shape
    problems = _dtype_problems(
        qkv_columns=(qkv_columns, torch.float32),
        positions=(positions, torch.int64),
        slots=(slots, torch.int64),
        cos=(cos, torch.float32),
        sin=(sin, torch.float32),
    ) + _pool_problems(keys, values)
    if channels != (heads + 2 * kv_heads) * head_dim:
        problems.append(f"{channels} channels, expected ({heads} + 2 x {kv_heads}) heads of {head_dim}")
    if positions.shape != (tokens,) or slots.shape != (tokens,):
        problems.append(f"positions and slots must be [{tokens}], got {tuple(positions.shape)} and {tuple(slots.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or not 1 <= cos.shape[1] <= head_dim // 2:
        problems.append(
            f"cos and sin must be [positions, rotary_dims / 2] with rotary_dims at most {head_dim}, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if values.shape != keys.shape:
        problems.append(f"keys and values must be pools of one shape, got {keys.shape} and {values.shape}")
    problems += _vector_problems(bias=(bias, channels), q_norm=(q_norm, head_dim), k_norm=(k_norm, head_dim))
    tensors = (positions, slots, cos, sin, keys, values)
    if not all(t.is_contiguous() for t in tensors):
        problems.append("every tensor but qkv_columns must be contiguous")
    _check("rope_and_cache", problems)

    q = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    native.rope_and_cache(
        qkv_columns.data_ptr(), qkv_columns.stride(0), qkv_columns.stride(1), positions.data_ptr(), slots.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), cos.shape[0], q.data_ptr(), keys.data_ptr(), values.data_ptr(), tokens, heads,
        kv_heads, head_dim, num_blocks * block_size, torch.get_num_threads(), KV_DTYPE_CODES[keys.dtype],
        _address(bias), _address(q_norm), _address(k_norm), norm_eps, 2 * cos.shape[1],
    )
    return q


def _address(tensor: torch.Tensor | None) -> int:
    """A checked optional tensor's address as the kernels take it: 0 for none."""
    return 0 if tensor is None else tensor.data_ptr()


def _vector_problems(**vectors: tuple[torch.Tensor | None, int]) -> list[str]:
    """What is wrong with optional float32 vectors (a bias, a norm's weights) of given lengths."""
    return [
        f"{name} must be a contiguous CPU float32 [{length}], got {vector.device} {vector.dtype} {tuple(vector.shape)}"
        for name, (vector, length) in vectors.items()
        if vector is not None
        and (vector.device.type != "cpu" or vector.dtype != torch.float32 or vector.shape != (length,) or not vector.is_contiguous())
    ]


# The widest head the features of `rope_and_cache` take (module.c: it keeps one on the stack).
FEATURES_MAX_HEAD_DIM = 1024

# The gated MLP's activations (model_config.HIDDEN_ACTIVATIONS) as kernels.h codes them.
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}
# A MoE layer's experts' (moe_layer.c): those, and gpt-oss's clamped SwiGLU with its alpha and limit.
EXPERT_ACTIVATION_CODES = {**ACTIVATION_CODES, "clamped_swiglu": 2}


def gated_rows(gate_up_columns: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up as rows [T, I], from the gate/up layer's output as columns [2 I, T] (gate
    first; contiguous, or the transposed view of its rows): act is silu (SwiGLU) or gelu_tanh,
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (GeGLU)."""
    native = _module()
    channels, tokens = gate_up_columns.shape
    problems = _dtype_problems(gate_up_columns=(gate_up_columns, torch.float32))
    if channels % 2:
        problems.append(f"gate_up_columns must have an even number of channels, got {channels}")
    if activation not in ACTIVATION_CODES:
        problems.append(f"activation must be one of {', '.join(ACTIVATION_CODES)}, got {activation!r}")
    _check("gated_rows", problems)

    out = torch.empty(tokens, channels // 2, dtype=torch.float32)
    native.gated_rows(
        gate_up_columns.data_ptr(), gate_up_columns.stride(0), gate_up_columns.stride(1), out.data_ptr(), channels // 2,
        tokens, ACTIVATION_CODES[activation], torch.get_num_threads(),
    )
    return out


def clamped_swiglu_rows(gate_up_columns: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU as rows [T, I], from the gate/up output as `gated_rows` takes it
    (columns [2 I, T], gate first): g' sigmoid(alpha g') (u' + 1), g' = min(g, limit),
    u' = clamp(u, -limit, limit)."""
    native = _module()
    channels, tokens = gate_up_columns.shape
    problems = _dtype_problems(gate_up_columns=(gate_up_columns, torch.float32))
    if channels % 2:
        problems.append(f"gate_up_columns must have an even number of channels, got {channels}")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            problems.append(f"{name} must be a positive finite number, got {value!r}")
    _check("clamped_swiglu_rows", problems)

    out = torch.empty(tokens, channels // 2, dtype=torch.float32)
    native.clamped_swiglu_rows(
        gate_up_columns.data_ptr(), gate_up_columns.stride(0), gate_up_columns.stride(1), out.data_ptr(), channels // 2,
        tokens, float(alpha), float(limit), torch.get_num_threads(),
    )
    return out


# How a router's logits become routes (model_config.ROUTINGS) as kernels.h's RoutingKind codes them.
ROUTING_CODES = {"softmax": 0, "softmax_group_max": 1, "sigmoid_group": 2, "topk_softmax": 3}


def route_problems(
    experts: int,
    kind: str,
    k: int,
    router_bias: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> list[str]:
    """What is wrong with a route's options over `experts` experts (`moe_route`, and a decoder
    layer's MoE MLP, `native_layers.KernelMoE`)."""
    problems = _vector_problems(router_bias=(router_bias, experts), correction_bias=(correction_bias, experts))
    if kind not in ROUTING_CODES:
        problems.append(f"kind must be one of {', '.join(ROUTING_CODES)}, got {kind!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        problems.append(f"k must be an integer in 1 .. {experts}, got {k!r}")
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
        problems.append(f"n_group must divide the {experts} experts and topk_group lie in 1 .. n_group, got {n_group} and {topk_group}")
    if not math.isfinite(scaling):
        problems.append(f"scaling must be finite, got {scaling!r}")
    return problems


def expert_problems(
    experts: int,
    hidden: int,
    intermediate: int,
    activation: str,
    swiglu: tuple[float, float] | None,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> list[str]:
    """What is wrong with a MoE layer's experts' options (`native_quantized.moe_layer`, and a decoder
    layer's MoE MLP, `native_layers.KernelMoE`): a known activation, the clamped SwiGLU with
    `swiglu` (alpha, limit) positive and finite, and the expert biases, where given, contiguous
    float32 [experts, 2 intermediate] (gate/up's) and [experts, hidden] (down's)."""
    problems = []
    if activation not in EXPERT_ACTIVATION_CODES:
        problems.append(f"activation must be one of {', '.join(EXPERT_ACTIVATION_CODES)}, got {activation!r}")
    if activation == "clamped_swiglu" and not (
        swiglu is not None and all(isinstance(v, (int, float)) and 0 < v < math.inf for v in swiglu)
    ):
        problems.append(f"the clamped SwiGLU needs a positive finite (alpha, limit), got {swiglu!r}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (experts, 2 * intermediate)), ("down_bias", down_bias, (experts, hidden))):
        if bias is not None and (
            bias.device.type != "cpu" or bias.dtype != torch.float32 or tuple(bias.shape) != shape or not bias.is_contiguous()
        ):
            problems.append(f"{name} must be a contiguous CPU float32 {list(shape)}, got {bias.device} {bias.dtype} {tuple(bias.shape)}")
    return problems


def moe_route(
    x: torch.Tensor,
    router: torch.Tensor,
    kind: str,
    k: int,
    *,
    router_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = False,
    scaling: float = 1.0,
    isa: int | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The route of each row of x [T, hidden] through a router [E, hidden] (moe_route.c): its k
    experts, int64 [T, k] ascending, and their weights, float32 [T, k], under routing kind `kind`
    (routing.py, whose functions these equal but at ties, which go to the lower index here):
    logits summed in float64 and rounded once, weights in float64 rounded once; the logits' loop
    at `isa` (default ATEN_ISA), the same bits at every level. Third, with a shared expert's gate
    `shared_gate` float32 [hidden] (Qwen2-MoE): sigmoid(shared_gate . x) float32 [T], its logit
    summed as the router's, else None."""
    native = _module()
    problems = _dtype_problems(x=(x, torch.float32), router=(router, torch.float32))
    _check("moe_route", problems)
    if x.dim() != 2 or not x.is_contiguous():
        problems.append(f"x must be a contiguous [tokens, hidden], got {tuple(x.shape)} strides {x.stride()}")
    if router.dim() != 2 or not router.is_contiguous() or (x.dim() == 2 and router.shape[1] != x.shape[1]):
        problems.append(f"router must be a contiguous [experts, {x.shape[-1]}], got {tuple(router.shape)}")
    _check("moe_route", problems)
    experts = router.shape[0]
    _check("moe_route", route_problems(experts, kind, k, router_bias, correction_bias, n_group, topk_group, scaling))
    tokens, hidden = x.shape
    _check("moe_route", _vector_problems(shared_gate=(shared_gate, hidden)))
    expert_ids = torch.empty(tokens, k, dtype=torch.int64)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    shared_scale = None if shared_gate is None else torch.empty(tokens, dtype=torch.float32)
    native.moe_route(
        x.data_ptr(), router.data_ptr(), _address(router_bias), _address(correction_bias), ROUTING_CODES[kind], float(scaling),
        int(normalize), tokens, hidden, experts, k, n_group, topk_group, expert_ids.data_ptr(), weights.data_ptr(),
        torch.get_num_threads(), ATEN_ISA if isa is None else isa, _address(shared_gate), _address(shared_scale),
    )
    return expert_ids, weights, shared_scale


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += delta` in place (when delta is given), then RMSNorm of h: returns [T, hidden].

    h [T, hidden] contiguous (the residual stream), delta [T, hidden] with any strides (a linear
    layer's rows, or its columns' transposed view), weight [hidden].
    """
    native = _module()
    tokens, hidden = h.shape
    tensors = {"h": (h, torch.float32), "weight": (weight, torch.float32)}
    if delta is not None:
        tensors["delta"] = (delta, torch.float32)
    problems = _dtype_problems(**tensors)
    if not h.is_contiguous() or not weight.is_contiguous() or weight.shape != (hidden,):
        problems.append(f"h must be contiguous and weight [{hidden}] contiguous, got {tuple(weight.shape)}")
    if delta is not None and delta.shape != h.shape:
        problems.append(f"delta must be shaped like h {tuple(h.shape)}, got {tuple(delta.shape)}")
    _check("add_rms_norm", problems)

    out = torch.empty_like(h)
    if tokens:
        native.add_rms_norm(
            h.data_ptr(), _address(delta), 0 if delta is None else delta.stride(0), 0 if delta is None else delta.stride(1),
            weight.data_ptr(), out.data_ptr(), tokens, hidden, eps, torch.get_num_threads(),
        )
    return out



@dataclass(frozen=True)
class Float16Weight:
    """A linear layer's weight [out, in] as `float16_linear` reads it (float16_linear.c): float16
    (rounded to nearest even) in blocks of BLOCK output channels, `blocks` [ceil(out / BLOCK),
    in, BLOCK], the channels past `out_features` zero."""

    BLOCK: ClassVar[int] = 16

    blocks: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Float16Weight:
        out_features, in_features = weight.shape
        count = -(-out_features // cls.BLOCK)
        padded = torch.zeros(count * cls.BLOCK, in_features, dtype=torch.float16)
        padded[:out_features] = weight
        return cls(padded.view(count, cls.BLOCK, in_features).transpose(1, 2).contiguous(), out_features)

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1]


def float16_linear(x: torch.Tensor, weight: Float16Weight, *, isa: int | None = None) -> torch.Tensor:
    """x [T, in] float32 (each row contiguous) through a packed float16 weight: [T, out] float32,
    accumulated in float32 over the inputs in order (so a row's result does not depend on the
    other rows). `isa` caps the instructions (`ISA_PORTABLE`, `ISA_AVX2`, `ISA_AVX512`; default
    `LINEAR_ISA`): every level gives the same sums in the same order, the narrower ones slower."""
    native = _module()
    tokens, in_features = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or in_features != weight.in_features or x.stride(1) != 1:
        raise ValueError(
            f"float16_linear: x must be a CPU float32 [tokens, {weight.in_features}] with contiguous rows, "
            f"got {x.device} {x.dtype} {tuple(x.shape)} strides {x.stride()}"
        )
    y = torch.empty(tokens, weight.out_features, dtype=torch.float32)
    if tokens:
        native.float16_linear(
            x.data_ptr(), max(x.stride(0), in_features), weight.blocks.data_ptr(), y.data_ptr(), tokens, in_features,
            weight.out_features, torch.get_num_threads(), LINEAR_ISA if isa is None else isa,
        )
    return y
