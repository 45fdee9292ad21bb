"""A round's decoder layers on the engine's CPU kernels in one call (decoder_layer.c): each layer's
weights as the C side reads them (`KernelLayer`, its linear layers `LinearPart`s of packed
float16 or ggml blocks, a mixture-of-experts MLP of blocks `KernelMoE`: its route and experts in
the same call), what a round's layers share, checked once (`decoder_round`), and a
model's layers with their KV pools as one table (`LayerStack`), so that a decode or verify round
runs all its layers without Python between them.

The kernels trust the addresses they are given: every layer is checked when it is built, its
pools when the stack is, and a round's inputs once per round (native.py's checks, which the
single kernels share).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import gguf
import torch

from flare.engine.native import (
    ACTIVATION_CODES,
    EXPERT_ACTIVATION_CODES,
    KV_DTYPE_CODES,
    LINEAR_ISA,
    ROUTING_CODES,
    Float16Weight,
    _address,
    _attention_option_problems,
    _check,
    _dtype_problems,
    _module,
    _pool_problems,
    _vector_problems,
    expert_problems,
    route_problems,
)
from flare.engine.native_quantized import INTEGER_ISA, QUANTIZED_ISA
from flare.package.manifest import INTEGER_ACTIVATION_TYPES

# A LinearPart's type for packed float16 weights (kernels.h, LINEAR_PACKED_FLOAT16: ggml's type 0,
# F32, is never a part's); a part of ggml blocks has its ggml type id, one quantized_linear reads.
PACKED_FLOAT16 = 0
QUANTIZED_TYPE_IDS = frozenset({2, 3, 6, 7, 8, 12, 13, 14, 39})  # kernels.h GGML_* (39: MXFP4)
# Added to a part's type in the part table, times its halves: it multiplies that many 8-bit activation
# blocks per 32 inputs (kernels.h, LINEAR_INTEGER_ACTIVATIONS), quantized once per layer input and
# shared by the parts.
INTEGER_ACTIVATIONS = 256
# The most parts a layer's linear layer may have (kernels.h, LAYER_LINEAR_PARTS).
LAYER_LINEAR_PARTS = 3


@dataclass(frozen=True)
class LinearPart:
    """A run of output rows of a layer's linear weight as `decoder_layer` multiplies them: packed
    float16 (`Float16Weight.blocks`, type PACKED_FLOAT16) or ggml blocks (uint8 [out, row bytes],
    contiguous, of a type in QUANTIZED_TYPE_IDS; flare/engine/quantized.py has checked the bytes
    against the type and shape). `halves`: a block part multiplied with integer dot products by that
many 8-bit activation blocks per 32 (K types: 256) inputs (QuantizedWeight.halves), 0 by float32 activations."""

    type: int
    data: torch.Tensor
    out_features: int
    in_features: int
    halves: int = 0

    @classmethod
    def float16(cls, weight: Float16Weight) -> LinearPart:
        return cls(PACKED_FLOAT16, weight.blocks, weight.out_features, weight.in_features)

    def problems(self) -> list[str]:
        data = self.data
        if self.type == PACKED_FLOAT16:
            shape = (-(-self.out_features // Float16Weight.BLOCK), self.in_features, Float16Weight.BLOCK)
            fits = data.dtype == torch.float16 and tuple(data.shape) == shape
        else:
            fits = self.type in QUANTIZED_TYPE_IDS and data.dtype == torch.uint8 and data.dim() == 2 and data.shape[0] == self.out_features
        if fits and data.device.type == "cpu" and data.is_contiguous() and self.out_features > 0:
            return []
        return [f"a linear part of type {self.type} [{self.out_features}, {self.in_features}] has {data.device} {data.dtype} {tuple(data.shape)} data"]


# The block types whose products take 8-bit activations (halves 1 or 2).
_INTEGER_TYPE_IDS = frozenset(int(gguf.GGMLQuantizationType[name]) for name in INTEGER_ACTIVATION_TYPES)

# A MoE layer's table as module.c reads it (MOE_*): router, router bias, correction bias, routing
# code, normalize, the scaling factor's float64 bits, experts, k, n_group, topk_group,
# intermediate, gate_up address, type, halves, down address, type, halves, activation code, the
# clamped SwiGLU's alpha and limit as float64 bits, the gate_up and down biases' addresses, the
# shared expert's gate's address.
_MOE_FIELDS = 23


def _float64_bits(value: float) -> int:
    (bits,) = struct.unpack("<q", struct.pack("<d", float(value)))
    return bits


@dataclass(frozen=True)
class KernelMoE:
    """A decoder layer's mixture-of-experts MLP as `decoder_layer` runs it in place of the gated
    MLP: its route (`native.moe_route`) and its experts (`native_quantized.moe_layer`), the kernels
    moe.py's steps call, at the same levels, so the same bits. The router is float32 [E, hidden]
    (with its bias and DeepSeek-V3's correction bias, float32 [E], where the model has them);
    `routing` a kind of native.ROUTING_CODES with its k, groups, normalization and scaling; the
    experts' stacked blocks are uint8 [E * 2 I, row bytes] (gate_up) and [E * hidden, row bytes]
    (down) of ggml types `gate_up_type` and `down_type`, each multiplied by float32 activations
    (halves 0) or that many 8-bit activation blocks (QuantizedWeight.halves). gpt-oss's experts:
    `activation` clamped_swiglu with `swiglu` (alpha, limit), and their biases float32 [E, 2 I]
    and [E, hidden]. A shared expert is the layer's own gate_up and down (`KernelLayer`), scaled
    by sigmoid(`shared_gate` . x) where it has a gate, float32 [hidden] (Qwen2-MoE)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    gate_up_type: int
    down: torch.Tensor
    down_type: int
    routing: str
    k: int
    router_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling: float = 1.0
    gate_up_halves: int = 0
    down_halves: int = 0
    activation: str = "silu"
    swiglu: tuple[float, float] | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    table: torch.Tensor = field(init=False, repr=False)  # int64 [_MOE_FIELDS]

    def __post_init__(self) -> None:
        problems = _dtype_problems(router=(self.router, torch.float32), gate_up=(self.gate_up, torch.uint8), down=(self.down, torch.uint8))
        _check("decoder_layer", problems)
        experts, hidden = self.router.shape if self.router.dim() == 2 else (0, 0)
        if not self.router.is_contiguous() or experts < 1:
            problems.append(f"a MoE layer's router must be a contiguous [experts, hidden], got {tuple(self.router.shape)}")
        _check("decoder_layer", problems)
        problems += route_problems(
            experts, self.routing, self.k, self.router_bias, self.correction_bias, self.n_group, self.topk_group, self.scaling
        )
        intermediate = self.gate_up.shape[0] // (2 * experts) if self.gate_up.dim() == 2 else 0
        problems += expert_problems(experts, hidden, intermediate, self.activation, self.swiglu, self.gate_up_bias, self.down_bias)
        problems += _vector_problems(shared_gate=(self.shared_gate, hidden))
        for name, blocks, ggml_type, halves, rows, columns in (
            ("gate_up", self.gate_up, self.gate_up_type, self.gate_up_halves, 2 * intermediate, hidden),
            ("down", self.down, self.down_type, self.down_halves, hidden, intermediate),
        ):
            block, type_size = gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType(ggml_type), (0, 0)) if ggml_type in QUANTIZED_TYPE_IDS else (0, 0)
            if not block or columns < 1 or columns % block or tuple(blocks.shape) != (experts * rows, columns // block * type_size) or not blocks.is_contiguous():
                problems.append(f"{name} must be contiguous ggml blocks of {experts} experts' [{rows}, {columns}], got type {ggml_type} {tuple(blocks.shape)}")
            if halves not in (0, 1, 2) or (halves and ggml_type not in _INTEGER_TYPE_IDS):
                problems.append(f"{name}'s halves must be 0, or 1 or 2 on a type with integer kernels, got {halves!r} on type {ggml_type}")
        _check("decoder_layer", problems)
        alpha, limit = self.swiglu if self.activation == "clamped_swiglu" and self.swiglu is not None else (0.0, 0.0)
        table = torch.tensor(
            [
                self.router.data_ptr(), _address(self.router_bias), _address(self.correction_bias), ROUTING_CODES[self.routing],
                int(self.normalize), _float64_bits(self.scaling), experts, self.k, self.n_group, self.topk_group, intermediate,
                self.gate_up.data_ptr(), self.gate_up_type, self.gate_up_halves, self.down.data_ptr(), self.down_type,
                self.down_halves, EXPERT_ACTIVATION_CODES[self.activation], _float64_bits(alpha), _float64_bits(limit),
                _address(self.gate_up_bias), _address(self.down_bias), _address(self.shared_gate),
            ],
            dtype=torch.int64,
        )
        object.__setattr__(self, "table", table)

    @property
    def hidden(self) -> int:
        return self.router.shape[1]


def _stacked_features(parts: tuple[LinearPart, ...]) -> tuple[int, int]:
    """(in, out) of parts stacked on the output; in is -1 where the parts disagree."""
    ins = {part.in_features for part in parts}
    return (ins.pop() if len(ins) == 1 else -1), sum(part.out_features for part in parts)


@dataclass(frozen=True)
class KernelLayer:
    """A decoder layer's weights as `decoder_layer` reads them: float32 norms and linear layers
    of one to LAYER_LINEAR_PARTS parts each (packed float16 or ggml blocks, stacked on the
    output), their shapes checked against each other once, when the model is loaded.

    The family features (`ModelConfig`) default to Llama's layer: `qkv_bias` added to the q/k/v
    output; `q_norm`, `k_norm` per-head RMSNorm weights of q and k before RoPE;
    `attention_output_norm`, `mlp_output_norm` the sandwich norms of each sublayer's output
    before the residual add; `cos`, `sin` the layer's own RoPE tables [positions, rotary_dims /
    2] (None: the round's); `window`, `softcap`, `scale` of its attention (`paged_attention`);
    `activation` of its gated MLP (`gated_rows`; a MoE layer's is its experts'); `sinks` [heads]
    of its attention and `o_bias` [hidden] added to the o projection's output (gpt-oss)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: tuple[LinearPart, ...]  # [(heads + 2 kv_heads) head_dim, hidden]
    o: tuple[LinearPart, ...]  # [hidden, heads head_dim]
    gate_up: tuple[LinearPart, ...]  # [2 intermediate, hidden]
    down: tuple[LinearPart, ...]  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 kv_heads) head_dim]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    attention_output_norm: torch.Tensor | None = None  # [hidden]
    mlp_output_norm: torch.Tensor | None = None  # [hidden]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    activation: str = "silu"
    sinks: torch.Tensor | None = None  # [heads]
    o_bias: torch.Tensor | None = None  # [hidden]
    # The mixture-of-experts MLP in place of the gated MLP, or None; beside it gate_up and down are
    # its shared expert (of its own width), or empty.
    moe: KernelMoE | None = None
    # int64 [4, LAYER_LINEAR_PARTS, 3]: (type, address, out rows) of each part of qkv, o,
    # gate_up and down, unused parts zero (module.c reads it); addresses of `data` kept alive here.
    part_table: torch.Tensor = field(init=False, repr=False)
    # (in, out) of qkv, o, gate_up and down, computed once: a round checks them against its shapes.
    linear_features: dict[str, tuple[int, int]] = field(init=False, repr=False)
    # The features as LayerStack's table holds them (module.c, LAYER_*): the addresses of
    # qkv_bias, q_norm, k_norm, attention_output_norm, mlp_output_norm, then window, softcap,
    # activation code, the addresses of sinks and o_bias.
    feature_args: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        hidden = self.input_norm.shape[0]
        linears = (self.qkv, self.o, self.gate_up, self.down)
        problems = [p for parts in linears for part in parts for p in part.problems()]
        # Beside a MoE MLP gate_up and down are its shared expert, or have no parts.
        parted = linears if self.moe is None or self.gate_up or self.down else linears[:2]
        if not all(1 <= len(parts) <= LAYER_LINEAR_PARTS for parts in parted):
            problems.append(
                f"each linear layer must have 1 to {LAYER_LINEAR_PARTS} parts (gate_up and down none beside a MoE MLP "
                f"without a shared expert), got {[len(p) for p in linears]}"
            )
        if self.moe is not None and self.moe.shared_gate is not None and not self.gate_up:
            problems.append("a MoE MLP's shared gate needs its shared expert, gate_up and down")
        if self.moe is not None and self.moe.hidden != hidden:
            problems.append(f"the MoE MLP's router is [experts, {self.moe.hidden}], the layer's hidden size {hidden}")
        problems += self._feature_problems(hidden)
        _check("decoder_layer", problems)
        norms_fit = all(
            n.dtype == torch.float32 and n.device.type == "cpu" and n.shape == (hidden,) and n.is_contiguous()
            for n in (self.input_norm, self.post_norm)
        )
        features = dict(zip(("qkv", "o", "gate_up", "down"), map(_stacked_features, linears)))
        (qkv_in, qkv_out), (o_in, o_out), (gate_up_in, gate_up_out), (down_in, down_out) = features.values()
        mlp_fits = (self.moe is not None and not self.gate_up) or (gate_up_in == down_out == hidden and gate_up_out == 2 * down_in)
        layers_fit = qkv_in == o_out == hidden and mlp_fits
        if not (norms_fit and layers_fit):
            raise ValueError(
                f"decoder_layer: a layer's norms must be contiguous float32 [{hidden}] and its linear layers chain "
                f"hidden -> qkv, o -> hidden, hidden -> gate_up -> down -> hidden; got qkv {qkv_in}->{qkv_out}, "
                f"o {o_in}->{o_out}, gate_up {gate_up_in}->{gate_up_out}, down {down_in}->{down_out}"
            )
        table = torch.zeros(len(linears), LAYER_LINEAR_PARTS, 3, dtype=torch.int64)
        for row, parts in zip(table, linears):
            for slot, part in zip(row, parts):
                slot[0] = part.type + (INTEGER_ACTIVATIONS * part.halves if part.type != PACKED_FLOAT16 else 0)
                slot[1], slot[2] = part.data.data_ptr(), part.out_features
        object.__setattr__(self, "part_table", table)
        object.__setattr__(self, "linear_features", features)
        feature_args = (
            *map(_address, (self.qkv_bias, self.q_norm, self.k_norm, self.attention_output_norm, self.mlp_output_norm)),
            self.window or 0,
            self.softcap or 0.0,
            EXPERT_ACTIVATION_CODES[self.activation],
            _address(self.sinks),
            _address(self.o_bias),
        )
        object.__setattr__(self, "feature_args", feature_args)

    def _feature_problems(self, hidden: int) -> list[str]:
        qkv_out = sum(part.out_features for part in self.qkv)
        head_dim = -1 if self.q_norm is None else self.q_norm.shape[0]
        problems = _vector_problems(
            qkv_bias=(self.qkv_bias, qkv_out),
            q_norm=(self.q_norm, head_dim),
            k_norm=(self.k_norm, head_dim),
            attention_output_norm=(self.attention_output_norm, hidden),
            mlp_output_norm=(self.mlp_output_norm, hidden),
            o_bias=(self.o_bias, hidden),
            sinks=(self.sinks, -1 if self.sinks is None or self.sinks.dim() != 1 else self.sinks.shape[0]),
        )
        if (self.q_norm is None) != (self.k_norm is None):
            problems.append("q_norm and k_norm come together")
        if (self.cos is None) != (self.sin is None):
            problems.append("a layer's own RoPE tables are cos and sin together")
        elif self.cos is not None:
            problems += _dtype_problems(cos=(self.cos, torch.float32), sin=(self.sin, torch.float32))
            if self.cos.shape != self.sin.shape or self.cos.dim() != 2 or not (self.cos.is_contiguous() and self.sin.is_contiguous()):
                problems.append(f"the layer's cos and sin must be contiguous [positions, rotary_dims / 2], got {tuple(self.cos.shape)}")
        problems += _attention_option_problems(self.scale, self.window, self.softcap)
        # A gated MLP's activation (a shared expert's too); the clamped SwiGLU's parameters come
        # only with a MoE MLP's experts.
        activations = ACTIVATION_CODES if self.moe is None or self.gate_up else EXPERT_ACTIVATION_CODES
        if self.activation not in activations:
            problems.append(f"activation must be one of {', '.join(activations)}, got {self.activation!r}")
        return problems

    @property
    def hidden(self) -> int:
        return self.input_norm.shape[0]

    def features(self, linear: str) -> tuple[int, int]:
        """(in, out) of linear layer `linear` (qkv, o, gate_up or down)."""
        return self.linear_features[linear]


# An attention group of a DecoderRound as the C side reads it (kernels.h, AttentionGroupPlan):
# start, rows, query_len, max_blocks, longest (filled by the check), block table and start
# positions addresses.
_PLAN_FIELDS = 7


@dataclass(frozen=True)
class DecoderRound:
    """What every layer of one round shares in `decoder_layer`, checked once when built
    (`decoder_round`): the round's positions and slots, the RoPE tables, the attention groups
    and the scratch memory the layer's steps pass their results through."""

    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_position: int  # the round's furthest position: a layer's own RoPE tables must reach it
    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    plans: torch.Tensor  # [groups, _PLAN_FIELDS] int64
    pool_shape: tuple[int, ...]
    pool_dtype: torch.dtype
    scratch: torch.Tensor
    # The tensors whose addresses `plans` holds, kept alive with it.
    tables: tuple[torch.Tensor, ...]


def decoder_round(
    *,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: list[tuple[int, int, int, torch.Tensor, torch.Tensor]],
    pool: torch.Tensor,
    heads: int,
    hidden: int,
    intermediate: int,
    eps: float,
    scratch: torch.Tensor,
) -> DecoderRound:
    """The shared part of a round's `decoder_layer` calls. `groups`: (first flat token, rows,
    query_len, block_table [rows, max_blocks], start_positions [rows]) of each attention group,
    in token order; `pool`: one layer's key pool [kv_heads, num_blocks, block_size, head_dim];
    `scratch`: float32 memory of at least `DecoderRound.scratch_floats` elements (the model's
    workspace, reused round after round). Raises ValueError naming what does not fit."""
    native = _module()
    kv_heads, num_blocks, block_size, head_dim = pool.shape
    tokens = positions.shape[0]
    problems = _dtype_problems(
        positions=(positions, torch.int64), slots=(slots, torch.int64), cos=(cos, torch.float32), sin=(sin, torch.float32)
    ) + _pool_problems(pool, pool)
    if slots.shape != (tokens,) or not positions.is_contiguous() or not slots.is_contiguous():
        problems.append(f"positions and slots must be contiguous [{tokens}], got {tuple(slots.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or not 1 <= cos.shape[1] <= head_dim // 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        problems.append(f"cos and sin must be contiguous [positions, rotary_dims / 2] with rotary_dims at most {head_dim}, got {tuple(cos.shape)}")
    for _, rows, _, table, starts in groups:
        problems += _dtype_problems(block_table=(table, torch.int64), start_positions=(starts, torch.int64))
        if table.dim() != 2 or table.shape[0] != rows or starts.shape != (rows,) or not (table.is_contiguous() and starts.is_contiguous()):
            problems.append(f"a group of {rows} rows needs a contiguous [rows, blocks] table and [rows] starts")
    needed = tokens * (2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 3 * intermediate)
    if scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < needed:
        problems.append(f"scratch must be contiguous float32 of at least {needed} elements")
    _check("decoder_layer", problems)

    plans = torch.tensor(
        [[start, rows, query_len, table.shape[1], 0, table.data_ptr(), starts.data_ptr()] for start, rows, query_len, table, starts in groups],
        dtype=torch.int64,
    ).view(len(groups), _PLAN_FIELDS)
    max_position = native.check_decoder_round(
        positions.data_ptr(), slots.data_ptr(), tokens, cos.shape[0], num_blocks * block_size, plans.data_ptr(), len(groups),
        num_blocks, block_size, heads, kv_heads,
    )
    tables = tuple(t for _, _, _, table, starts in groups for t in (table, starts))
    return DecoderRound(
        tokens, heads, kv_heads, head_dim, intermediate, eps, max_position, positions, slots, cos, sin, plans, tuple(pool.shape),
        pool.dtype, scratch, tables,
    )


def decoder_layer(
    h: torch.Tensor, layer: KernelLayer, keys: torch.Tensor, values: torch.Tensor, plan: DecoderRound
) -> None:
    """One decoder layer on the residual stream h [tokens, hidden] (float32, contiguous), in
    place: its norms, linear layers (float16 at LINEAR_ISA, blocks at QUANTIZED_ISA), RoPE and
    KV write into this layer's pools, and the attention of the round's groups (decoder_layer.c;
    the same kernels and bits as the steps model.py runs one by one)."""
    decoder_layers(h, [layer], [keys], [values], plan)


def decoder_layers(
    h: torch.Tensor, layers: list[KernelLayer], keys: list[torch.Tensor], values: list[torch.Tensor], plan: DecoderRound
) -> None:
    """`decoder_layer` of each layer in turn, with its pools: every layer and pool is checked
    first, then the layers run back to back in one call (LayerStack, which a model keeps)."""
    LayerStack(tuple(layers), tuple(keys), tuple(values)).run(h, plan)


# A layer's row of LayerStack.table (module.c, LAYER_*): input_norm, post_norm, part table, keys,
# values, own cos and sin (0: the round's), their rows and rotary dims, qkv_bias, q_norm, k_norm,
# attention_output_norm, mlp_output_norm, window, activation, MoE table (0: the gated MLP), sinks,
# o_bias; of LayerStack.scalars: scale, softcap.
_LAYER_FIELDS, _LAYER_SCALARS = 19, 2


@dataclass(frozen=True)
class LayerStack:
    """A model's kernel layers with their KV pools, as one `decoder_layers` call runs them: the
    addresses of every layer's weights and pools in one table, built once, and what a round must
    agree with, so a round checks its residual stream and its shapes once rather than paying
    every layer's checks and argument lists in Python."""

    layers: tuple[KernelLayer, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    table: torch.Tensor = field(init=False, repr=False)  # int64 [layers, _LAYER_FIELDS]
    scalars: torch.Tensor = field(init=False, repr=False)  # float32 [layers, _LAYER_SCALARS]
    # What a round must match: the pools' shape and dtype (None where the layers' pools differ),
    # each layer's (qkv out, o in, down in) and q/k norm width, the shortest own RoPE table.
    pool: tuple[tuple[int, ...], torch.dtype] | None = field(init=False, repr=False)
    shapes: frozenset[tuple[int, int, int, int | None, int | None, int | None]] = field(init=False, repr=False)
    own_table_rows: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.layers) or len(self.values) != len(self.layers):
            raise ValueError(
                f"decoder_layer: {len(self.layers)} layers need as many key and value pools, got {len(self.keys)} and {len(self.values)}"
            )
        pools = {(tuple(p.shape), p.dtype) for p in (*self.keys, *self.values)}
        uniform = len(pools) == 1 and all(p.is_contiguous() and p.device.type == "cpu" for p in (*self.keys, *self.values))
        object.__setattr__(self, "pool", next(iter(pools)) if uniform else None)
        head_dim = self.keys[0].shape[-1] if self.keys else 1
        rows, scalars = [], []
        for layer, layer_keys, layer_values in zip(self.layers, self.keys, self.values):
            own = layer.cos is not None
            *norms_and_bias, window, softcap, activation, sinks, o_bias = layer.feature_args
            rows.append([
                layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), layer.part_table.data_ptr(),
                layer_keys.data_ptr(), layer_values.data_ptr(), _address(layer.cos), _address(layer.sin),
                layer.cos.shape[0] if own else 0, 2 * layer.cos.shape[1] if own else 0,
                *norms_and_bias, window, activation, 0 if layer.moe is None else layer.moe.table.data_ptr(), sinks, o_bias,
            ])
            scalars.append([head_dim**-0.5 if layer.scale is None else layer.scale, softcap])
        object.__setattr__(self, "table", torch.tensor(rows, dtype=torch.int64).view(len(rows), _LAYER_FIELDS))
        object.__setattr__(self, "scalars", torch.tensor(scalars, dtype=torch.float32).view(len(rows), _LAYER_SCALARS))
        # A MoE layer's MLP has no intermediate width of the round's (its experts' is its own): None.
        object.__setattr__(self, "shapes", frozenset(
            (layer.hidden, layer.features("qkv")[1], layer.features("o")[0], None if layer.moe else layer.features("down")[0],
             None if layer.q_norm is None else layer.q_norm.shape[0], None if layer.sinks is None else layer.sinks.shape[0])
            for layer in self.layers
        ))
        # A table wider than the heads rotate counts as 0 rows: no round fits it, and the round's
        # check then names the layer.
        own = [layer.cos for layer in self.layers if layer.cos is not None]
        rows_of = [cos.shape[0] if 1 <= cos.shape[1] <= head_dim // 2 else 0 for cos in own]
        object.__setattr__(self, "own_table_rows", min(rows_of) if own else None)

    def serves(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether these are the pools the table holds (the same tensors)."""
        return len(keys) == len(self.keys) and all(a is b for a, b in zip(keys, self.keys)) and all(
            a is b for a, b in zip(values, self.values)
        )

    def run(self, h: torch.Tensor, plan: DecoderRound) -> None:
        """Every layer on h [tokens, hidden] in place, over `plan` (see decoder_layers)."""
        hidden = h.shape[-1]
        qkv_out, attended = (plan.heads + 2 * plan.kv_heads) * plan.head_dim, plan.heads * plan.head_dim
        fits = (
            h.dtype == torch.float32 and h.is_contiguous() and h.shape == (plan.tokens, hidden)
            and self.pool == (plan.pool_shape, plan.pool_dtype)
            and self.shapes
            <= {(hidden, qkv_out, attended, i, q, s) for i in (None, plan.intermediate) for q in (None, plan.head_dim) for s in (None, plan.heads)}
            and (self.own_table_rows is None or self.own_table_rows > plan.max_position)
        )
        if not fits:
            # The layer that does not fit, named as it always was; one that passes them all
            # cannot get here.
            for layer, layer_keys, layer_values in zip(self.layers, self.keys, self.values):
                _check_layer(h, layer, layer_keys, layer_values, plan)
            raise ValueError("decoder_layer: the layers do not fit the round")
        if not self.layers:
            return
        _module().decoder_layers(
            h.data_ptr(), plan.tokens, hidden, plan.heads, plan.kv_heads, plan.head_dim, plan.intermediate, plan.eps,
            plan.positions.data_ptr(), plan.slots.data_ptr(), plan.cos.data_ptr(), plan.sin.data_ptr(), plan.cos.shape[0],
            2 * plan.cos.shape[1], KV_DTYPE_CODES[plan.pool_dtype], plan.pool_shape[1], plan.pool_shape[2],
            plan.plans.data_ptr(), plan.plans.shape[0], plan.scratch.data_ptr(), torch.get_num_threads(), LINEAR_ISA,
            QUANTIZED_ISA, INTEGER_ISA, self.table.data_ptr(), self.scalars.data_ptr(), len(self.layers),
        )


def _check_layer(h: torch.Tensor, layer: KernelLayer, keys: torch.Tensor, values: torch.Tensor, plan: DecoderRound) -> None:
    if (
        h.dtype != torch.float32 or not h.is_contiguous() or h.shape != (plan.tokens, layer.hidden)
        or tuple(keys.shape) != plan.pool_shape or tuple(values.shape) != plan.pool_shape
        or keys.dtype != plan.pool_dtype or values.dtype != plan.pool_dtype
        or not (keys.is_contiguous() and values.is_contiguous())
        or layer.features("qkv")[1] != (plan.heads + 2 * plan.kv_heads) * plan.head_dim
        or layer.features("o")[0] != plan.heads * plan.head_dim
        or (layer.moe is None and layer.features("down")[0] != plan.intermediate)
    ):
        raise ValueError(
            f"decoder_layer: h must be contiguous float32 [{plan.tokens}, {layer.hidden}] and the pools "
            f"{plan.pool_dtype} {plan.pool_shape}, the layer's shapes those of the round; got h {h.dtype} "
            f"{tuple(h.shape)}, pools {keys.dtype} {tuple(keys.shape)} and {values.dtype} {tuple(values.shape)}"
        )
    if layer.sinks is not None and layer.sinks.shape[0] != plan.heads:
        raise ValueError(f"decoder_layer: the layer's sinks are [{layer.sinks.shape[0]}], the round's {plan.heads} heads")
    if layer.q_norm is not None and layer.q_norm.shape[0] != plan.head_dim:
        raise ValueError(f"decoder_layer: the layer's q/k norms are [{layer.q_norm.shape[0]}], the round's heads of {plan.head_dim}")
    if layer.cos is not None and (layer.cos.shape[0] <= plan.max_position or not 1 <= layer.cos.shape[1] <= plan.head_dim // 2):
        raise ValueError(
            f"decoder_layer: the layer's RoPE tables {tuple(layer.cos.shape)} must reach position {plan.max_position} "
            f"and rotate at most {plan.head_dim} dims"
        )
