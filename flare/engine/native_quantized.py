"""The engine's CPU kernels over ggml blocks (flare/engine/csrc/), checked and called on tensors:
the products of quantized weights that flare/engine/quantized.py and the mixture-of-experts layer
run, and the instruction levels they dispatch to.

- `quantized_linear` and `quantized_rows`: a linear layer multiplied straight from ggml's
  quantized blocks, and rows of such a weight expanded (the embedding lookup);
- `moe_layer`: a round's mixture-of-experts MLP over experts of ggml blocks, the rows grouped
  by expert and each expert's products those of `quantized.quantized_linear`, on float32 or 8-bit
  activations (its torch counterpart `layers/moe.py`'s loop over experts);
- `quantize_q8` and `integer_linear`: activation rows as 8-bit blocks, and the 32-value block
  types multiplied by them with integer dot products (`flare run --activations int8x2|int8`);
  `quantize_q8k_rows` and `integer_kquant_linear` the same for the K types (Q4_K, Q5_K, Q6_K);
- `quantize_kquant_rows`: float32 weights as Q4_K or Q6_K blocks, llama-quantize's bytes
  (`flare export --quantize q4_k_m`, through preparation/kquants.py);
- `QUANTIZED_ISA`, `INTEGER_ISA` (`FLARE_INTEGER_ISA`) and `integer_dot_isa`: which instructions
  they run; every level gives the same bits.

The checks and the extension are native.py's (`available()` says whether it was built), which
the float kernels share; as there, every function checks the tensors behind the addresses first.
"""

from __future__ import annotations

import os

import torch

from flare.engine.native import (
    ATEN_ISA,
    EXPERT_ACTIVATION_CODES,
    _address,
    _check,
    _dtype_problems,
    _module,
    available,
    expert_problems,
)


# The widest instructions the quantized kernel uses (quantized_linear.c): what ATen dispatches to
# (`native.ATEN_ISA`). Every level gives the same bits.
QUANTIZED_ISA = ATEN_ISA

# The widest integer dot-product instructions of the 8-bit activation products (integer_linear.c,
# integer_dot.h `IDOT_*`): derived from ATen's dispatch as QUANTIZED_ISA is (AVX-512 -> AMX, which
# the kernel lowers to AVX-512 VNNI unless granted; AVX2 -> AVX-VNNI, which it lowers to AVX2 where
# the CPU has no AVX-VNNI: ATen has no AVX-VNNI level, and an Alder Lake or a Sierra Forest Xeon,
# AVX-VNNI without AVX-512, dispatches as AVX2), then lowered by FLARE_INTEGER_ISA (portable, avx2,
# avx_vnni, avx512_vnni, amx), read once here, which is how tests and benchmarks stand in for an
# AVX-VNNI-256 or AVX2 CPU (ATEN_CPU_CAPABILITY=avx2 alone leaves AVX-VNNI to a CPU that has it).
# The kernel itself takes the widest of this level the CPU and its OS grant (`integer_dot_isa`).
# AMX is granted only where the CPU advertises amx-tile and amx-int8, Linux lets this process use
# the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once per process: without it the first tile
# instruction raises SIGILL) and a forked child runs tile instructions cleanly (integer_dot.c).
# Every level gives the same bits.
IDOT_PORTABLE, IDOT_AVX2, IDOT_AVX_VNNI, IDOT_AVX512_VNNI, IDOT_AMX = 0, 1, 2, 3, 4
INTEGER_ISA_NAMES = {
    "portable": IDOT_PORTABLE,
    "avx2": IDOT_AVX2,
    "avx_vnni": IDOT_AVX_VNNI,
    "avx512_vnni": IDOT_AVX512_VNNI,
    "amx": IDOT_AMX,
}


def _integer_isa(capability: str, forced: str | None) -> int:
    level = {"AVX512": IDOT_AMX, "AVX2": IDOT_AVX_VNNI}.get(capability, IDOT_PORTABLE)
    if not forced:
        return level
    if forced not in INTEGER_ISA_NAMES:
        raise ValueError(f"FLARE_INTEGER_ISA must be one of {', '.join(INTEGER_ISA_NAMES)}, got {forced!r}")
    return min(level, INTEGER_ISA_NAMES[forced])


INTEGER_ISA = _integer_isa(torch.backends.cpu.get_cpu_capability(), os.environ.get("FLARE_INTEGER_ISA"))

# AMX's grant is asked for on import, once per process (each tensor-parallel worker imports this
# too): the permission must be this process's before its first tile instruction, and the trial
# child is forked while the process is small, before a model's weights are mapped.
if available():
    _module().integer_dot_isa(INTEGER_ISA, -1)


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
    swiglu: tuple[float, float] | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A round's mixture-of-experts MLP over experts of ggml blocks (moe_layer.c): x [T, hidden]
    float32, each row's k experts `expert_ids` [T, k] int64 and their weights `expert_weights`
    [T, k] float32, the stacked experts' blocks `gate_up` uint8 [E * 2 I, row bytes] and `down`
    uint8 [E * hidden, row bytes] (contiguous, of ggml types `gate_up_type` and `down_type`):
    [T, hidden] float32, sum over slots s of weight * down(act(gate(x)) * up(x)) in slot order,
    each expert's products those of `quantized.quantized_linear`: float32 activations at `isa`
    (default QUANTIZED_ISA) where a projection's halves are 0, else (`QuantizedWeight.halves`, 1
    or 2) its input's 8-bit blocks by integer dot products at `integer_isa` (default INTEGER_ISA),
    each row of x quantized once for every expert's gate/up. gpt-oss's experts: `activation`
    clamped_swiglu with `swiglu` (alpha, limit), and the biases `gate_up_bias` float32 [E, 2 I]
    and `down_bias` [E, hidden] added to each expert's gate/up and down outputs."""
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
    _check("moe_layer", expert_problems(num_experts, hidden, intermediate, activation, swiglu, gate_up_bias, down_bias))
    alpha, limit = swiglu if activation == "clamped_swiglu" and swiglu is not None else (0.0, 0.0)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if tokens and expert_ids.shape[1]:
        # The C side checks the types' block sizes against these shapes and every expert id.
        native.moe_layer(
            x.data_ptr(), expert_ids.data_ptr(), expert_weights.data_ptr(), gate_up.data_ptr(), int(gate_up_type),
            2 * intermediate * gate_up.shape[1], down.data_ptr(), int(down_type), hidden * down.shape[1],
            EXPERT_ACTIVATION_CODES[activation], out.data_ptr(), tokens, expert_ids.shape[1], num_experts, hidden, intermediate,
            torch.get_num_threads(), gate_up_halves, down_halves, QUANTIZED_ISA if isa is None else isa,
            INTEGER_ISA if integer_isa is None else integer_isa, float(alpha), float(limit), _address(gate_up_bias),
            _address(down_bias),
        )
    else:
        out.zero_()
    return out


# ---- integer K-quant products (integer_kquants.c), for tests and benchmarks --------------------------

# The K-quant products' default level (IDOT_*): the served one, INTEGER_ISA (torch's dispatch,
# lowered by FLARE_INTEGER_ISA).
KQUANT_ISA = INTEGER_ISA


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
    block_bytes = KQUANT_BLOCK_BYTES.get(int(ggml_type))
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


# The bytes of a 256-value super-block of each K type, by ggml type id (Q4_K, Q5_K, Q6_K).
KQUANT_BLOCK_BYTES = {12: 144, 13: 176, 14: 210}

# The bytes of one 8-bit activation block of 32 values (integer_dot.h, Q8Block: d, s, sum, 32 qs).
Q8_BLOCK_BYTES = 48


def quantize_q8(x: torch.Tensor, halves: int = 1, isa: int | None = None) -> torch.Tensor:
    """Rows of x [T, in] (float32, each row contiguous, in a multiple of 32) as 8-bit activation
    blocks: uint8 [T, halves * in / 32 * Q8_BLOCK_BYTES], each block d = max |x| / 127, qs = x / d
    rounded to nearest even, their sum and d * sum (integer_linear.c, quantize_row_q8); with
    halves 2, each block followed by one of its residual x - d qs. At level `isa` (INTEGER_ISA by
    default), the same bits at every level."""
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
        x.data_ptr(),
        max(x.stride(0), in_features),
        tokens,
        in_features,
        out.data_ptr(),
        halves,
        torch.get_num_threads(),
        INTEGER_ISA if isa is None else isa,
    )
    return out


def quantize_kquant_rows(values: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [rows, width] (width whole 256-value super-blocks) as Q4_K (ggml type 12) or Q6_K
    (14) blocks, uint8 [rows, width / 256 * 144 or 210]: llama-quantize's reference quantizers
    in the same float32 operations (kquant_quantizers.c), the rows' super-blocks on every thread."""
    native = _module()
    if values.dtype != torch.float32 or values.device.type != "cpu" or values.dim() != 2 or not values.is_contiguous():
        raise ValueError(f"quantize_kquant_rows: values must be a contiguous CPU float32 matrix, got {values.dtype} {tuple(values.shape)}")
    rows, width = values.shape
    block_bytes = KQUANT_BLOCK_BYTES[ggml_type] if ggml_type in (12, 14) else None  # Q4_K and Q6_K: no Q5_K quantizer
    if block_bytes is None or width < 256 or width % 256:
        raise ValueError(f"quantize_kquant_rows: type Q4_K (12) or Q6_K (14) of a width of whole 256-value super-blocks, got type {ggml_type} width {width}")
    out = torch.empty(rows, width // 256 * block_bytes, dtype=torch.uint8)
    if rows:
        native.quantize_kquant_rows(ggml_type, values.data_ptr(), rows, width, out.data_ptr(), torch.get_num_threads())
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
IDOT_GRANTS_AVX2, IDOT_GRANTS_AVX_VNNI, IDOT_GRANTS_AVX512_VNNI, IDOT_GRANTS_AMX = 1, 2, 4, 8


def integer_dot_isa(isa: int, granted: int | None = None) -> int:
    """The IDOT_* level the integer kernels run at for `isa`: the widest of it that this CPU and
    its OS grant, or that `granted` (IDOT_GRANTS_* bits) would, standing in for another CPU."""
    return _module().integer_dot_isa(isa, -1 if granted is None else granted)


def integer_level_name() -> str:
    """The name (as FLARE_INTEGER_ISA spells it) of the level the integer kernels run at here:
    INTEGER_ISA, lowered to what this CPU and its OS grant."""
    level = integer_dot_isa(INTEGER_ISA)
    return next(name for name, value in INTEGER_ISA_NAMES.items() if value == level)


def integer_dot_amx_trial(fault: bool = False) -> bool:
    """Whether a forked child ran AMX tile instructions and exited cleanly (AMX's last check,
    integer_dot.c); `fault` makes the child execute an undefined instruction first, so it dies of
    SIGILL and this is False, standing in for a CPU or OS that refuses the tiles."""
    return bool(_module().integer_dot_amx_trial(fault))
