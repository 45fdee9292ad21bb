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
- `quantized_linear` and `quantized_rows`: a linear layer multiplied straight from ggml's
  quantized blocks, and rows of such a weight expanded (the embedding lookup), for
  flare/engine/quantized.py;
- `moe_layer`: a round's mixture-of-experts MLP over experts of ggml blocks, the rows grouped
  by expert and each expert's products those of `quantized.quantized_linear`, on float32 or 8-bit
  activations (its torch counterpart `layers/moe.py`'s loop over experts);
- `quantize_q8` and `integer_linear`: activation rows as 8-bit blocks, and the 32-value block
  types multiplied by them with integer dot products (`flare run --activations int8x2|int8`);
  `quantize_q8k_rows` and `integer_kquant_linear` the same for the K types (Q4_K, Q5_K, Q6_K);
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

import os
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
# The widest instructions the quantized kernel uses (quantized_linear.c): what ATen dispatches to,
# so ATEN_CPU_CAPABILITY=avx2 holds it to AVX2 and ATEN_CPU_CAPABILITY=default to the portable
# loop (how tests and benchmarks stand in for other CPUs). Every level gives the same bits.
QUANTIZED_ISA = {"AVX512": ISA_AVX512, "AVX2": ISA_AVX2}.get(torch.backends.cpu.get_cpu_capability(), ISA_PORTABLE)

# The widest integer dot-product instructions of the 8-bit activation products (integer_linear.c,
# integer_dot.h `IDOT_*`): derived from ATen's dispatch as QUANTIZED_ISA is (AVX-512 -> AVX-512
# VNNI, AVX2 -> AVX2), then lowered by FLARE_INTEGER_ISA (portable, avx2, avx_vnni, avx512_vnni),
# read once here, which is how tests and benchmarks stand in for an AVX-VNNI-256 or AVX2 CPU. The
# kernel itself takes the widest of this level the CPU and its OS grant (`integer_dot_isa`).
# Every level gives the same bits. AMX is not among them: this Xeon advertises it, but under its
# hypervisor `ldtilecfg` raises SIGILL.
IDOT_PORTABLE, IDOT_AVX2, IDOT_AVX_VNNI, IDOT_AVX512_VNNI = 0, 1, 2, 3
INTEGER_ISA_NAMES = {"portable": IDOT_PORTABLE, "avx2": IDOT_AVX2, "avx_vnni": IDOT_AVX_VNNI, "avx512_vnni": IDOT_AVX512_VNNI}


def _integer_isa(capability: str, forced: str | None) -> int:
    level = {"AVX512": IDOT_AVX512_VNNI, "AVX2": IDOT_AVX2}.get(capability, IDOT_PORTABLE)
    if not forced:
        return level
    if forced not in INTEGER_ISA_NAMES:
        raise ValueError(f"FLARE_INTEGER_ISA must be one of {', '.join(INTEGER_ISA_NAMES)}, got {forced!r}")
    return min(level, INTEGER_ISA_NAMES[forced])


INTEGER_ISA = _integer_isa(torch.backends.cpu.get_cpu_capability(), os.environ.get("FLARE_INTEGER_ISA"))

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
    denominator and carries no value (gpt-oss; None: no sinks).
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
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.device.type != "cpu" or sinks.shape != (heads,) or not sinks.is_contiguous()):
        problems.append(f"sinks must be a contiguous CPU float32 [{heads}] (one per query head), got {sinks.device} {sinks.dtype} {tuple(sinks.shape)}")
    _check("paged_attention", problems)

    out = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    native.paged_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), out.data_ptr(), block_table.data_ptr(),
        start_positions.data_ptr(), rows, query_len, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks,
        head_dim**-0.5 if scale is None else scale, window or 0, softcap or 0.0, torch.get_num_threads(),
        KV_DTYPE_CODES[keys.dtype], portable, 0 if sinks is None else sinks.data_ptr(),
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

# The gated MLP's activations (manifest.HIDDEN_ACTIVATIONS) as kernels.h codes them.
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


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


def quantized_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int, isa: int) -> torch.Tensor:
    """x [T, in] float32 (each row contiguous) times a weight of ggml blocks (uint8 [out, row
    bytes], contiguous; quantized_linear.c): [T, out] float32, each output's 16 lanes summed over
    the inputs in order and then by a fixed tree, the same bits at every `isa` and batch size.
    The caller (flare/engine/quantized.py) has checked `blocks` against the type and shape."""
    native = _module()
    tokens = x.shape[0]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != in_features or x.stride(1) != 1:
        raise ValueError(
            f"quantized_linear: x must be a CPU float32 [tokens, {in_features}] with contiguous rows, "
            f"got {x.device} {x.dtype} {tuple(x.shape)} strides {x.stride()}"
        )
    y = torch.empty(tokens, out_features, dtype=torch.float32)
    if tokens:
        native.quantized_linear(
            x.data_ptr(), max(x.stride(0), in_features), blocks.data_ptr(), int(ggml_type), y.data_ptr(), tokens,
            in_features, out_features, torch.get_num_threads(), isa,
        )
    return y


def moe_layer(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_type: int,
    down: torch.Tensor,
    down_type: int,
    num_experts: int,
    activation: str = "silu",
    isa: int | None = None,
    *,
    gate_up_halves: int = 0,
    down_halves: int = 0,
    integer_isa: int | None = None,
) -> torch.Tensor:
    """A round's mixture-of-experts MLP over experts of ggml blocks (moe_layer.c): x [T, hidden]
    float32, each row's k experts `expert_ids` [T, k] int64 and their weights `expert_weights`
    [T, k] float32, the stacked experts' blocks `gate_up` uint8 [E * 2 I, row bytes] and `down`
    uint8 [E * hidden, row bytes] (contiguous, of ggml types `gate_up_type` and `down_type`):
    [T, hidden] float32, sum over slots s of weight * down(act(gate(x)) * up(x)) in slot order,
    each expert's products those of `quantized.quantized_linear`: float32 activations at `isa`
    (default QUANTIZED_ISA) where a projection's halves are 0, else (`QuantizedWeight.halves`, 1
    or 2) its input's 8-bit blocks by integer dot products at `integer_isa` (default INTEGER_ISA),
    each row of x quantized once for every expert's gate/up."""
    native = _module()
    problems = _dtype_problems(
        x=(x, torch.float32), expert_ids=(expert_ids, torch.int64), expert_weights=(expert_weights, torch.float32),
        gate_up=(gate_up, torch.uint8), down=(down, torch.uint8),
    )
    _check("moe_layer", problems)
    if x.dim() != 2 or not x.is_contiguous():
        problems.append(f"x must be a contiguous [tokens, hidden], got {tuple(x.shape)} strides {x.stride()}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or not expert_ids.is_contiguous():
        problems.append(f"expert_ids must be a contiguous [{x.shape[0]}, k], got {tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape or not expert_weights.is_contiguous():
        problems.append(f"expert_weights must be a contiguous {tuple(expert_ids.shape)}, got {tuple(expert_weights.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        problems.append(f"num_experts must be a positive integer, got {num_experts!r}")
    for name, blocks in (("gate_up", gate_up), ("down", down)):
        if blocks.dim() != 2 or not blocks.is_contiguous() or (isinstance(num_experts, int) and num_experts > 0 and blocks.shape[0] % num_experts):
            problems.append(f"{name} must be contiguous blocks of {num_experts} experts' rows, got {tuple(blocks.shape)}")
    if activation not in ACTIVATION_CODES:
        problems.append(f"activation must be one of {', '.join(ACTIVATION_CODES)}, got {activation!r}")
    for name, halves in (("gate_up_halves", gate_up_halves), ("down_halves", down_halves)):
        if halves not in (0, 1, 2) or isinstance(halves, bool):
            problems.append(f"{name} must be 0 (float32 activations), 1 or 2, got {halves!r}")
    _check("moe_layer", problems)
    tokens, hidden = x.shape
    if down.shape[0] != num_experts * hidden or (gate_up.shape[0] // num_experts) % 2:
        problems.append(
            f"down must hold {num_experts} x {hidden} rows and gate_up an even number per expert, "
            f"got {tuple(down.shape)} and {tuple(gate_up.shape)}"
        )
    _check("moe_layer", problems)
    intermediate = gate_up.shape[0] // num_experts // 2
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if tokens and expert_ids.shape[1]:
        # The C side checks the types' block sizes against these shapes and every expert id.
        native.moe_layer(
            x.data_ptr(), expert_ids.data_ptr(), expert_weights.data_ptr(), gate_up.data_ptr(), int(gate_up_type),
            2 * intermediate * gate_up.shape[1], down.data_ptr(), int(down_type), hidden * down.shape[1],
            ACTIVATION_CODES[activation], out.data_ptr(), tokens, expert_ids.shape[1], num_experts, hidden, intermediate,
            torch.get_num_threads(), gate_up_halves, down_halves, QUANTIZED_ISA if isa is None else isa,
            INTEGER_ISA if integer_isa is None else integer_isa,
        )
    else:
        out.zero_()
    return out


# ---- integer K-quant products (integer_kquants.c), for tests and benchmarks --------------------------

# The integer kernels' levels (integer_dot.h): each caps the instructions; a level the CPU lacks falls
# back to the widest it has. The default follows torch's dispatch, as QUANTIZED_ISA does.
IDOT_PORTABLE, IDOT_AVX2, IDOT_AVX_VNNI, IDOT_AVX512_VNNI = 0, 1, 2, 3
KQUANT_ISA = {ISA_AVX512: IDOT_AVX512_VNNI, ISA_AVX2: IDOT_AVX2}.get(QUANTIZED_ISA, IDOT_PORTABLE)


def _kquant_rows_problems(x: torch.Tensor, in_features: int) -> list[str]:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != in_features or not x.is_contiguous():
        return [f"x must be a contiguous CPU float32 [rows, {in_features}], got {x.device} {x.dtype} {tuple(x.shape)}"]
    if in_features < 256 or in_features % 256:
        return [f"in_features must be a positive multiple of 256, got {in_features}"]
    return []


# The bytes of one Q8_K activation block of 256 values (integer_dot.h, Q8KBlock: d, 256 qs, 16 bsums).
Q8K_BLOCK_BYTES = 4 + 256 + 32


def quantize_q8k_rows(x: torch.Tensor, halves: int = 1, isa: int | None = None) -> torch.Tensor:
    """Rows of x [T, in] (float32, rows contiguous, in a multiple of 256) as the Q8_K blocks every
    K-quant product of that input reads: uint8 [T, halves * in / 256 * Q8K_BLOCK_BYTES]; with
    halves 2, each row's blocks followed by those of its residual x - d qs (integer_kquants.c,
    quantize_row_q8k_halves; the same bits at every `isa`)."""
    native = _module()
    tokens, in_features = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or in_features < 256 or in_features % 256:
        raise ValueError(f"quantize_q8k_rows: x must be CPU float32 [tokens, a multiple of 256], rows contiguous, got {x.dtype} {tuple(x.shape)}")
    if halves not in (1, 2):
        raise ValueError(f"quantize_q8k_rows: halves must be 1 or 2, got {halves!r}")
    out = torch.empty(tokens, halves * (in_features // 256) * Q8K_BLOCK_BYTES, dtype=torch.uint8)
    if tokens:
        native.quantize_q8k_rows(
            x.data_ptr(), max(x.stride(0), in_features), tokens, in_features, out.data_ptr(), halves, torch.get_num_threads(),
            KQUANT_ISA if isa is None else isa,
        )
    return out


def integer_kquant_linear(xq: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int, isa: int) -> torch.Tensor:
    """Rows quantized by `quantize_q8k_rows` (uint8 [T, halves * in / 256 * Q8K_BLOCK_BYTES]) times a
    Q4_K / Q5_K / Q6_K weight (uint8 [out, row bytes], contiguous) by integer dot products: [T, out]
    float32, the same bits at every `isa` (IDOT_*) and whatever rows share the call."""
    width = in_features // 256 * Q8K_BLOCK_BYTES
    if xq.dtype != torch.uint8 or xq.dim() != 2 or not xq.is_contiguous() or xq.shape[1] not in (width, 2 * width):
        raise ValueError(
            f"integer_kquant_linear: xq must be contiguous CPU uint8 [tokens, {width} or {2 * width}] (quantize_q8k_rows of x), "
            f"got {xq.dtype} {tuple(xq.shape)}"
        )
    block_bytes = {12: 144, 13: 176, 14: 210}.get(int(ggml_type))
    if block_bytes is None:
        raise ValueError(f"integer_kquant_linear: ggml_type must be Q4_K (12), Q5_K (13) or Q6_K (14), got {ggml_type}")
    expected = (out_features, in_features // 256 * block_bytes)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected or not blocks.is_contiguous():
        raise ValueError(f"integer_kquant_linear: blocks must be contiguous uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")
    y = torch.empty(xq.shape[0], out_features, dtype=torch.float32)
    if xq.shape[0]:
        _module().integer_kquant_linear(
            xq.data_ptr(), xq.shape[1] // width, blocks.data_ptr(), int(ggml_type), y.data_ptr(), xq.shape[0], in_features,
            out_features, torch.get_num_threads(), isa,
        )
    return y


def kquant_product(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    out_features: int,
    in_features: int,
    isa: int | None = None,
    halves: int = 1,
) -> torch.Tensor:
    """x [rows, in] float32 quantized to Q8_K times a Q4_K / Q5_K / Q6_K weight by integer dot
    products (`quantize_q8k_rows`, then `integer_kquant_linear`): [rows, out] float32, the same bits
    at every `isa` (IDOT_*; default KQUANT_ISA) and whatever rows share the call. halves 2: x and
    its residual x - d qs each quantized to Q8_K, their products added (about 15 bits of x)."""
    _check("kquant_product", _kquant_rows_problems(x, in_features))
    level = KQUANT_ISA if isa is None else isa
    return integer_kquant_linear(quantize_q8k_rows(x, halves, level), blocks, ggml_type, out_features, in_features, level)


def quantize_q8k(x: torch.Tensor, isa: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 as the Q8_K blocks the integer products read: d [rows, in / 256]
    float32, qs [rows, in] int8 (x ~ d qs) and bsums [rows, in / 16] int16 (sums of 16 qs)."""
    native = _module()
    _check("quantize_q8k", _kquant_rows_problems(x, x.shape[-1] if x.dim() == 2 else 0))
    rows, in_features = x.shape
    d = torch.empty(rows, in_features // 256, dtype=torch.float32)
    qs = torch.empty(rows, in_features, dtype=torch.int8)
    bsums = torch.empty(rows, in_features // 16, dtype=torch.int16)
    native.quantize_q8k(
        x.data_ptr(), rows, in_features, d.data_ptr(), qs.data_ptr(), bsums.data_ptr(), KQUANT_ISA if isa is None else isa
    )
    return d, qs, bsums


def quantized_first_nonfinite_scale(blocks: torch.Tensor, ggml_type: int, type_size: int) -> int:
    """The first block (in storage order) of contiguous ggml blocks whose float16 scale is NaN or
    infinite, or -1: one pass over the bytes (a package's weights are checked at load)."""
    return _module().quantized_first_nonfinite_scale(int(ggml_type), blocks.data_ptr(), blocks.numel() // type_size)


def quantized_rows(blocks: torch.Tensor, ggml_type: int, in_features: int, rows: torch.Tensor, isa: int) -> torch.Tensor:
    """Rows `rows` (contiguous int64 [N]) of a weight of ggml blocks expanded: [N, in] float32,
    gguf-py's values. Row ids outside the weight are refused before anything is read."""
    native = _module()
    out = torch.empty(rows.shape[0], in_features, dtype=torch.float32)
    native.quantized_rows(
        int(ggml_type), blocks.data_ptr(), blocks.shape[0], in_features, rows.data_ptr(), rows.shape[0], out.data_ptr(),
        torch.get_num_threads(), isa,
    )
    return out


# The bytes of one 8-bit activation block of 32 values (integer_dot.h, Q8Block: d, s, sum, 32 qs).
Q8_BLOCK_BYTES = 48


def quantize_q8(x: torch.Tensor, halves: int = 1) -> torch.Tensor:
    """Rows of x [T, in] (float32, each row contiguous, in a multiple of 32) as 8-bit activation
    blocks: uint8 [T, halves * in / 32 * Q8_BLOCK_BYTES], each block d = max |x| / 127, qs = x / d
    rounded to nearest even, their sum and d * sum (integer_linear.c, quantize_row_q8); with
    halves 2, each block followed by one of its residual x - d qs."""
    native = _module()
    tokens, in_features = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or in_features % 32 or in_features < 32 or x.stride(1) != 1:
        raise ValueError(
            f"quantize_q8: x must be a CPU float32 [tokens, in] with contiguous rows and in a multiple of 32, "
            f"got {x.device} {x.dtype} {tuple(x.shape)} strides {x.stride()}"
        )
    if halves not in (1, 2):
        raise ValueError(f"quantize_q8: halves must be 1 or 2, got {halves!r}")
    out = torch.empty(tokens, halves * (in_features // 32) * Q8_BLOCK_BYTES, dtype=torch.uint8)
    native.quantize_q8(
        x.data_ptr(), max(x.stride(0), in_features), tokens, in_features, out.data_ptr(), halves, torch.get_num_threads()
    )
    return out


def integer_linear(xq: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int, isa: int) -> torch.Tensor:
    """8-bit activation blocks xq (`quantize_q8` of x [T, in]) times a weight of 32-value ggml
    blocks (uint8 [out, row bytes], contiguous; integer_linear.c): [T, out] float32, each block's
    products an exact integer sum, the blocks combined in one fixed order, the same bits at every
    `isa` (an IDOT_* level) and batch size. The caller has checked `blocks` against the type and shape."""
    native = _module()
    tokens = xq.shape[0]
    width = in_features // 32 * Q8_BLOCK_BYTES
    if xq.dtype != torch.uint8 or xq.device.type != "cpu" or xq.dim() != 2 or xq.shape[1] not in (width, 2 * width) or not xq.is_contiguous():
        raise ValueError(
            f"integer_linear: xq must be contiguous CPU uint8 [tokens, {width} or {2 * width}] (quantize_q8 of x), "
            f"got {xq.device} {xq.dtype} {tuple(xq.shape)}"
        )
    halves = xq.shape[1] // width
    y = torch.empty(tokens, out_features, dtype=torch.float32)
    if tokens:
        native.integer_linear(
            xq.data_ptr(), halves * (in_features // 32), halves, blocks.data_ptr(), int(ggml_type), y.data_ptr(), tokens, in_features,
            out_features, torch.get_num_threads(), isa,
        )
    return y


# What a CPU and its OS grant the integer kernels (integer_dot.h, IDOT_GRANTS_*), as bits.
IDOT_GRANTS_AVX2, IDOT_GRANTS_AVX_VNNI, IDOT_GRANTS_AVX512_VNNI = 1, 2, 4


def integer_dot_isa(isa: int, granted: int | None = None) -> int:
    """The IDOT_* level the integer kernels run at for `isa`: the widest of it that this CPU and
    its OS grant, or that `granted` (IDOT_GRANTS_* bits) would, standing in for another CPU."""
    return _module().integer_dot_isa(isa, -1 if granted is None else granted)
