"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

The forward pass takes one ragged `ForwardBatch` (prompt chunks, decode rows and verify rows
together) and returns logits only for the positions that need them. The layout choices that make
it fast on a CPU, where a round of 32 decode rows is bound by the linear layers:

- q/k/v and gate/up are fused into one matrix each at load time (one GEMM instead of three/two);
- linear layers run on the flat token dimension, with no padding, weights first (see `linear_columns`);
- short rows of the same length share one attention call per layer (see batch.py);
- four steps of a layer run as C kernels on a float32 CPU model where they were built
  (`native.py`): attention of short rows read straight from the pool, RoPE with the KV write,
  SwiGLU, and the residual add with the norm after it. Their torch counterparts here run elsewhere, and for long prompt chunks' attention:
  keys and values are gathered from the pool a whole block at a time; the pool is head-major,
  so the gathered keys of one row and KV head form one contiguous [positions, head dim] matrix
  (SDPA on this CPU reads a strided [positions, head dim] view 1.5-2x slower once out of cache);
  grouped-query attention folds the query heads of a KV group into the query length, so K/V are
  never repeated (measured 10% faster than SDPA's `enable_gqa` here);
- RoPE cos/sin come from a table built once; the torch path gathers them once per round;
- linear layers run in a weight format chosen per CPU (`precision.py`): float16 through the
  engine's kernel on x86 CPUs with AVX2, bfloat16 through oneDNN on AMX CPUs, float32 through
  MKL; the weights are stored and multiplied in it, everything between the GEMMs stays float32;
- on float16 or block weights a round of short rows runs each layer as one kernel call
  (`native.decoder_layer`), the same kernels as the steps of `forward_hidden` without the
  Python between them;
- a package's quantized tensors stay ggml blocks mapped from its file (`quantized.py`): their
  linear layers multiply float32 activations straight from the blocks, the embedding
  dequantizes only the rows it looks up, and a tied LM head is the embedding's blocks. Their
  layers run through `native.decoder_layer` too, each linear layer float16 or blocks or parts of
  both (the q/k/v of a Q4_K_M layer whose v is Q6_K).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.engine import native, precision, quantized
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight
from flare.engine.batch import SHORT_ROW_MAX_TOKENS, AttentionGroup, ForwardBatch
from flare.engine.kv_cache import KVCache
from flare.preparation.blocks import dequantized
from flare.preparation.manifest import ModelConfig
from flare.preparation.package import TORCH_DTYPES, Package, fits_float16, weight_problems


class WeightsError(ValueError):
    """A state dict that does not match the model config (names every problem)."""


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's weights; linear weights are [out, in], as checkpoints store them."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a round (an `AttentionGroup`), with everything its layers share.

    A call of short rows on a model that runs the kernels reads the pool through the group's
    block table and start positions (`native.paged_attention`) and has no gather fields.
    Otherwise it gathers: `gather_index` lists the pool rows (head-major) of its block tables;
    `mask` is the causal mask with the query heads of a KV group folded into the query length;
    the key/value buffers (views of the model's gather workspace) receive the gathered blocks.
    Every layer reuses them, because a fresh multi-megabyte tensor per layer costs more in page
    faults than the gather itself.
    """

    group: AttentionGroup
    gather_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    @property
    def tokens(self) -> slice:
        """The call's flat tokens: `group.rows` x `group.query_len`."""
        return slice(self.group.start, self.group.end)

    @property
    def native(self) -> bool:
        return self.gather_index is None


def _shape(weight: torch.Tensor | QuantizedWeight) -> tuple[int, ...]:
    if isinstance(weight, QuantizedWeight):
        return (weight.out_features, weight.in_features)
    return tuple(weight.shape)


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, torch.Tensor | QuantizedWeight]) -> None:
    """Raise `WeightsError` listing every missing, unexpected or misshapen weight."""
    problems = weight_problems(config, {name: _shape(tensor) for name, tensor in state_dict.items()})
    if problems:
        raise WeightsError("the weights do not match the model config: " + "; ".join(problems))


def rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/d) for every position, [max_positions, head_dim / 2].

    Computed in float32 as Hugging Face does, then cast, so positions match it bit for bit.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


# A very tall weight (the LM head: 49152 x 576) is applied in slices of this many output rows
# once a round has CHUNKED_MIN_TOKENS tokens: MKL splits one tall product less well than it runs
# layer-sized ones. LM head alone, 2 threads: 16 tokens 14.9 -> 11.7 ms, 32 tokens 19.7 -> 16.3,
# 64 tokens 29.6 -> 25.2; 8 tokens or fewer gain nothing.
OUTPUT_CHUNK = 4096
CHUNKED_MIN_TOKENS = 16


# Plain [out, in], packed by `pack_weight`, ggml blocks, or several of these stacked on `out`
# (`stack_weights`: the q/k/v of a quantized layer whose tensors do not share one type).
Weight = torch.Tensor | native.Float16Weight | torch.ScriptObject | QuantizedWeight | tuple


def stack_weights(parts: list[torch.Tensor | QuantizedWeight], weight_format: WeightFormat) -> Weight:
    """The [out, in] weights `parts` stacked on `out`, as one weight where they share a kind.

    Float parts are concatenated and packed (`pack_weight`). Blocks of one type that lie next to
    each other in the package's mapped file (the blocks file is written in this order) become
    one weight over the joint bytes, without a copy; blocks elsewhere are concatenated. Parts of
    different kinds (a Q6_K v beside Q4_K q and k, as llama.cpp's Q4_K_M mixes them) stay a
    tuple, multiplied one by one and their outputs concatenated (`linear`)."""
    runs: list[list[torch.Tensor | QuantizedWeight]] = []
    for part in parts:
        if runs and _kind(runs[-1][-1]) == _kind(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    stacked = [
        _join_blocks(run) if isinstance(run[0], QuantizedWeight) else pack_weight(torch.cat(run), weight_format)  # type: ignore[arg-type]
        for run in runs
    ]
    return stacked[0] if len(stacked) == 1 else tuple(stacked)


def _kind(part: torch.Tensor | QuantizedWeight) -> tuple:
    return (part.ggml_type, part.in_features) if isinstance(part, QuantizedWeight) else ("float",)


def _join_blocks(run: list[QuantizedWeight]) -> QuantizedWeight:
    first = run[0]
    if len(run) == 1:
        return first
    rows = sum(part.out_features for part in run)
    storage = first.data.untyped_storage()
    adjacent = all(
        b.data.untyped_storage().data_ptr() == storage.data_ptr() and a.data.data_ptr() + a.nbytes == b.data.data_ptr()
        for a, b in zip(run, run[1:])
    )
    if adjacent:
        width = first.data.shape[1]
        data = torch.empty(0, dtype=torch.uint8).set_(storage, first.data.storage_offset(), (rows, width), (width, 1))
    else:
        data = torch.cat([part.data for part in run])
    return QuantizedWeight.from_blocks(first.ggml_type, data, rows, first.in_features)


def _linear_parts(weight: Weight) -> tuple[native.LinearPart, ...] | None:
    """A linear layer's weight as `native.decoder_layer` multiplies it, or None for a kind it
    does not (plain, oneDNN or fbgemm weights)."""
    if isinstance(weight, native.Float16Weight):
        return (native.LinearPart.float16(weight),)
    if isinstance(weight, QuantizedWeight):
        return (native.LinearPart(int(weight.ggml_type), weight.data, weight.out_features, weight.in_features),)
    if isinstance(weight, tuple):
        parts = [_linear_parts(part) for part in weight]
        if all(p is not None for p in parts) and sum(len(p) for p in parts) <= native.LAYER_LINEAR_PARTS:  # type: ignore[arg-type]
            return tuple(part for p in parts for part in p)  # type: ignore[union-attr]
    return None


def _kernel_layers(layers: list[DecoderLayer]) -> list[native.KernelLayer] | None:
    """The layers as `native.decoder_layer` reads them, where every linear layer of every layer
    is float16 or ggml blocks; None otherwise (the layers then run step by step)."""
    kernel_layers = []
    for layer in layers:
        linears = [_linear_parts(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(parts is None for parts in linears):
            return None
        kernel_layers.append(native.KernelLayer(layer.input_norm, layer.post_norm, *linears))  # type: ignore[arg-type]
    return kernel_layers


def pack_weight(weight: torch.Tensor, weight_format: WeightFormat) -> Weight:
    """A linear layer's weight [out, in] in `weight_format`, packed once where the CPU's GEMM
    for that format wants its own layout. `linear` and `linear_columns` read every kind.

    - bfloat16 on a CPU with oneDNN's bfloat16: reordered into oneDNN's blocked layout (an
      opaque tensor). oneDNN reorders a plain bfloat16 weight on every product otherwise: the 30
      layers' GEMMs of one decode token (weights not in cache) took 20.4 ms plain against
      12.4 ms packed (float32: 14.9 ms), and of 32 tokens 32.1 against 24 ms (float32: 63 ms),
      on an AVX512-BF16 CPU.
    - float16 on a CPU: blocks of 16 output channels for the engine's own kernel
      (`native.Float16Weight`), which takes float32 rows and accumulates in float32. Against
      fbgemm's float16 GEMM (`torch.ops.quantized.linear_dynamic_fp16`, what runs where the C
      kernels were not built, on its own packed matrix, a `torch.ScriptObject`), the 30 layers'
      products of the default model took 0.87 of its time for one row, 0.91 for two, 0.93 for
      three, and 0.98-1.06 from 4 to 32 rows (AVX2 dispatch on a Zen 4 EPYC, 2 threads).
    - otherwise the plain tensor in the format's dtype (float32 on a CPU; 16-bit on a GPU).

    `mkldnn._reorder_linear_weight` / `_linear_pointwise` are torch's private ops (its
    compiler's CPU backend uses them for frozen linear layers) and the fbgemm ops are those of
    torch's dynamic float16 quantization; torch is pinned in pyproject.toml and
    tests/engine/test_paged_forward.py holds every kind to float32 products of the same
    rounded operands.
    """
    if not packs(weight_format, weight.device):
        return weight.to(weight_format.dtype).contiguous()
    if weight_format == WeightFormat.FLOAT16 and native.available():
        return native.Float16Weight.pack(weight)
    if weight_format == WeightFormat.FLOAT16:
        # fbgemm rounds the float32 values to float16 itself: exact for float16-stored weights.
        return torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous())


def packs(weight_format: WeightFormat, device: torch.device) -> bool:
    """Whether `pack_weight` gives `weight_format`'s weights on `device` a layout of their own
    (otherwise they stay plain tensors in the format's dtype)."""
    if device.type != "cpu":
        return False
    if weight_format == WeightFormat.FLOAT16:
        return True
    return weight_format == WeightFormat.BFLOAT16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_rows(x: torch.Tensor, weight: Weight) -> torch.Tensor | None:
    """x [T, in] through a packed weight: rows [T, out] (bfloat16 from oneDNN, float32 from
    the float16 kernels, all accumulated in float32); None for a plain weight."""
    if isinstance(weight, QuantizedWeight):
        return quantized.quantized_linear(x.float().contiguous(), weight)
    if isinstance(weight, tuple):
        return torch.cat([linear(x, part).float() for part in weight], dim=1)
    if isinstance(weight, native.Float16Weight):
        return native.float16_linear(x.float(), weight)
    if isinstance(weight, torch.ScriptObject):
        return torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), weight)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), weight, None, "none", [None], "")
    return None


def linear_columns(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, in] through a linear layer of weight [out, in], returned as columns: [out, T].

    In x's dtype. A weight of another dtype takes x rounded to it, and its product is widened
    back; a packed weight (`pack_weight`) gives rows, returned as their transposed view (the C
    kernels read either layout through its strides; a copy into columns cost 7% of a 32-row
    round in float16).

    A plain weight is computed weights first, as `weight @ x.T` with x.T passed to BLAS as a
    transposed operand: a round's few rows become the GEMM's narrow N side and the weights are
    read once, in their stored order. Against `x @ weight.T` with weights stored [in, out],
    whole engine rounds on this CPU (`benchmarks/engine_decode.py`, MKL, 2 threads) went for
    one row of 2 tokens from 78 to 43 ms and of 5 tokens from 73 to 60 (1 token: 49 to 42), and
    for 8 and 32 decode rows from 93 to 75 and 173 to 149 ms: a verify row of a few drafts now
    costs about what a plain decode row does. One row is doubled: MKL's GEMV on this layout was
    a third slower than its two-column GEMM (41 against 31 ms for the 30 layers' GEMMs timed
    alone).

    x must be row-major for this: MKL takes the plain [in, T] operand that a column-major x
    would give down a path three times slower, so such an x is copied first.
    """
    dtype = x.dtype
    rows = _packed_rows(x, weight)
    if rows is not None:
        return rows.to(dtype).t()
    x = x.to(weight.dtype).contiguous()
    if x.shape[0] == 1:
        return torch.mm(weight, torch.cat((x, x)).t())[:, :1].to(dtype)
    if weight.shape[0] <= 2 * OUTPUT_CHUNK or x.shape[0] < CHUNKED_MIN_TOKENS:
        return torch.mm(weight, x.t()).to(dtype)
    out = torch.empty(weight.shape[0], x.shape[0], dtype=weight.dtype, device=x.device)
    for first in range(0, weight.shape[0], OUTPUT_CHUNK):
        torch.mm(weight[first : first + OUTPUT_CHUNK], x.t(), out=out[first : first + OUTPUT_CHUNK])
    return out.to(dtype)


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, in] through a linear layer of weight [out, in]: [T, out] in x's dtype; for a plain
    weight a transposed view of `linear_columns` (residual adds read it as it is; a reshape
    copies it once)."""
    rows = _packed_rows(x, weight)
    if rows is not None:
        return rows.to(x.dtype)
    return linear_columns(x, weight).t()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout): x [T, heads, D], cos/sin [T, 1, D/2].

    With x = (x1, x2) split in halves: (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel:
    """The weights of a Llama-family model and its forward pass over a paged KV cache.

    Linear weights are kept [out, in] in the model's `weight_format` and applied by `linear`,
    the LM head too (for tied weights it is the embedding itself, shared, not copied, unless
    the weights are packed).
    """

    def __init__(
        self,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor | QuantizedWeight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_format: WeightFormat | None = None,
        native_kernels: bool | None = None,
    ) -> None:
        """`dtype`: activations and norms, and what attention computes in (the KV cache holds
        `dtype`, or float16 / bfloat16 widened when read). `weight_format`: what the linear layers'
        weights (the embedding too, which is the tied LM head) are stored and multiplied as
        (`precision.py`); `dtype`'s own format if None.
        `native_kernels`: run attention of short rows, RoPE with the cache write, and SwiGLU
        with the CPU kernels of `native` (True), with their torch counterparts (False), or with
        the kernels where they were built and apply (None)."""
        check_state_dict(config, state_dict)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_format = weight_format or WeightFormat(precision.dtype_name(dtype))
        # The kernels are float32 and CPU only.
        applies = self.device.type == "cpu" and dtype == torch.float32
        if native_kernels and not (applies and native.available()):
            raise ValueError(
                "the native CPU kernels need a float32 model on the CPU and the built extension "
                f"(model: {dtype} on {self.device}; extension built: {native.available()})"
            )
        self.native_kernels = applies and native.available() if native_kernels is None else native_kernels
        weights_dtype = self.weight_format.dtype

        if any(isinstance(w, QuantizedWeight) for w in state_dict.values()) and self.device.type != "cpu":
            raise ValueError(f"quantized blocks are multiplied on the CPU only, not on {self.device}")

        def weight(name: str, as_dtype: torch.dtype) -> torch.Tensor:
            tensor = state_dict[name]
            assert isinstance(tensor, torch.Tensor), f"{name} is a vector and is never kept as blocks"
            return tensor.to(device=self.device, dtype=as_dtype).contiguous()

        def linear_weight(*names: str) -> Weight:
            """The [out, in] weights of `names` stacked on `out` (one GEMM instead of several)."""
            parts = [state_dict[n] for n in names]
            return stack_weights([p if isinstance(p, QuantizedWeight) else p.to(self.device) for p in parts], self.weight_format)

        # The embedding is looked up by row, which a packed weight cannot be: a tied LM head is
        # then a packed copy of it (56 MB more for the default model in a 16-bit format). Blocks
        # are looked up and multiplied as they are: a tied LM head is the embedding's blocks.
        embedding = state_dict["model.embed_tokens.weight"]
        self.embed: torch.Tensor | QuantizedWeight = (
            embedding if isinstance(embedding, QuantizedWeight) else weight("model.embed_tokens.weight", weights_dtype)
        )
        if not config.tie_word_embeddings:
            self.lm_head = linear_weight("lm_head.weight")
        elif isinstance(self.embed, QuantizedWeight):
            self.lm_head = self.embed
        elif packs(self.weight_format, self.device):
            self.lm_head = linear_weight("model.embed_tokens.weight")
        else:
            self.lm_head = self.embed
        self.norm = weight("model.norm.weight", dtype)
        self.layers = [
            DecoderLayer(
                input_norm=weight(f"model.layers.{i}.input_layernorm.weight", dtype),
                qkv=linear_weight(*(f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv")),
                o=linear_weight(f"model.layers.{i}.self_attn.o_proj.weight"),
                post_norm=weight(f"model.layers.{i}.post_attention_layernorm.weight", dtype),
                gate_up=linear_weight(f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"),
                down=linear_weight(f"model.layers.{i}.mlp.down_proj.weight"),
            )
            for i in range(config.num_layers)
        ]
        # A round of short rows on float16 or block weights runs each layer as one kernel call
        # (`native.decoder_layer`): the same kernels as the steps below, without the Python
        # between them.
        self.kernel_layers = _kernel_layers(self.layers) if self.native_kernels else None
        self._layer_scratch = torch.empty(0, dtype=torch.float32, device=self.device)
        self.rope_cos, self.rope_sin = rope_tables(config, dtype, self.device)
        # Grow-only scratch memory for the gathered keys and values of a round: allocating
        # tens of megabytes afresh every round costs page faults on every round. It holds one
        # layer's K/V of the running rows (plus padding to each group's longest context), so it
        # stays around the size of one layer's share of the KV cache.
        self._gather_workspace = torch.empty(0, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one round: write every new token's K/V into the cache and return float32 logits
        [batch.num_logits, vocab] for the rows' last `num_logits` positions, in row order."""
        return self.forward_hidden(batch, kv_cache)[0]

    @torch.inference_mode()
    def forward_hidden(
        self, batch: ForwardBatch, kv_cache: KVCache, inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the residual stream after the last layer (before the final
        norm) of every token, [batch.num_tokens, hidden] in the batch's flat order: what a draft
        head reads. `inputs` [num_tokens, hidden] replaces the token embeddings (a draft head's
        block is fed its projection of hidden state and embedding, `drafters/mtp.py`)."""
        if kv_cache.block_size != batch.block_size:
            raise ValueError(
                f"the batch was built for blocks of {batch.block_size} tokens, the cache has {kv_cache.block_size}"
            )
        if kv_cache.dtype not in (self.dtype, torch.float16, torch.bfloat16):
            raise ValueError(
                f"the KV cache holds {kv_cache.dtype}, the model computes in {self.dtype}: "
                "create the cache in the model's dtype, float16 or bfloat16"
            )
        if batch.max_position >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {batch.max_position} is past the model's context of {self.config.max_position_embeddings}"
            )
        h = self.embed_rows(batch.token_ids).to(self.dtype) if inputs is None else inputs.to(self.dtype, copy=True).contiguous()
        rope = None if self.native_kernels else self._rope(batch)
        calls = self._plan_attention(batch, kv_cache)
        if self.kernel_layers is not None and all(call.native for call in calls):
            native.decoder_layers(h, self.kernel_layers, kv_cache.keys, kv_cache.values, self._decoder_round(batch, calls, kv_cache))
        else:
            # Each sublayer's output is added to the residual stream h by the norm that reads it next.
            delta = None
            for index, layer in enumerate(self.layers):
                x = self._add_norm(h, delta, layer.input_norm)
                keys, values = kv_cache.keys[index], kv_cache.values[index]
                q = self._rope_and_cache(linear_columns(x, layer.qkv), batch, rope, keys, values)
                delta = linear(self._attention(q, keys, values, calls), layer.o)
                x = self._add_norm(h, delta, layer.post_norm)
                delta = linear(self._swiglu(linear_columns(x, layer.gate_up)), layer.down)
            if delta is not None:
                h += delta
        x = self._add_norm(h[batch.logit_indices], None, self.norm)
        return linear(x, self.lm_head).contiguous().float(), h

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `token_ids` (any shape), [*shape, hidden], in the stored dtype
        (float32 from blocks: only the looked-up rows are dequantized)."""
        if isinstance(self.embed, QuantizedWeight):
            return quantized.dequantize_rows(self.embed, token_ids)
        return F.embedding(token_ids, self.embed)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] of residual-stream rows h [T, hidden]: final norm, LM head."""
        return linear(self._add_norm(h.contiguous(), None, self.norm), self.lm_head).contiguous().float()

    def _decoder_round(self, batch: ForwardBatch, calls: list[AttentionCall], kv_cache: KVCache) -> native.DecoderRound:
        """What every `native.decoder_layer` call of the round shares, checked once."""
        config = self.config
        qkv_channels = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        needed = batch.num_tokens * (
            2 * config.hidden_size + qkv_channels + 2 * config.num_heads * config.head_dim + 3 * config.intermediate_size
        )
        if self._layer_scratch.numel() < needed:
            self._layer_scratch = torch.empty(needed, dtype=torch.float32, device=self.device)
        return native.decoder_round(
            positions=batch.positions,
            slots=batch.slot_mapping,
            cos=self.rope_cos,
            sin=self.rope_sin,
            groups=[(c.group.start, c.group.rows, c.group.query_len, c.group.block_table, c.group.start_positions) for c in calls],
            pool=kv_cache.keys[0],
            heads=config.num_heads,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            scratch=self._layer_scratch,
        )

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """`h += delta` (a sublayer's output, when given), then RMSNorm of h (the torch
        counterpart of `native.add_rms_norm`)."""
        eps = self.config.rms_norm_eps
        if self.native_kernels:
            return native.add_rms_norm(h, delta, weight, eps)
        if delta is not None:
            h += delta
        return F.rms_norm(h, (self.config.hidden_size,), weight, eps)

    def _rope(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] of the round's positions, gathered once for every layer."""
        return self.rope_cos[batch.positions].unsqueeze(1), self.rope_sin[batch.positions].unsqueeze(1)

    def _rope_and_cache(
        self,
        qkv_columns: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """From the q/k/v layer's columns: rotate q and k, write k and v into the round's slots
        of the pools, return q [T, heads, D] (the torch counterpart of `native.rope_and_cache`)."""
        heads, kv_heads, head_dim = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        if self.native_kernels:
            return native.rope_and_cache(
                qkv_columns, batch.positions, batch.slot_mapping, self.rope_cos, self.rope_sin, keys, values, heads
            )
        assert rope is not None, "the torch path needs the round's cos and sin (`_rope`)"
        qkv = qkv_columns.t().contiguous().view(batch.num_tokens, heads + 2 * kv_heads, head_dim)
        # q and k are rotated together: one pass over both.
        qk = apply_rope(qkv[:, : heads + kv_heads], *rope)
        # The pools are [kv_heads, blocks * block_size, D] viewed flat over positions, in the
        # cache's dtype (a 16-bit pool takes k and v rounded to nearest even).
        k, v = qk[:, heads:].transpose(0, 1), qkv[:, heads + kv_heads :].transpose(0, 1)
        keys.view(kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, k.to(keys.dtype))
        values.view(kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, v.to(values.dtype))
        return qk[:, :heads]

    def _swiglu(self, gate_up_columns: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, intermediate] from the gate/up layer's columns (the torch
        counterpart of `native.gated_rows`)."""
        if self.native_kernels:
            return native.gated_rows(gate_up_columns)
        # On the columns, where gate and up are contiguous halves: on the transposed view the
        # elementwise ops are strided (2 ms a round slower at 32 rows).
        gate, up = gate_up_columns.chunk(2)
        return (F.silu(gate) * up).t()

    def _plan_attention(self, batch: ForwardBatch, kv_cache: KVCache) -> list[AttentionCall]:
        """The round's attention calls, one per attention group, built once for every layer."""
        in_kernel = [self.native_kernels and g.query_len <= SHORT_ROW_MAX_TOKENS for g in batch.groups]
        group_size = self.config.num_heads // self.config.num_kv_heads
        head_offsets = torch.arange(self.config.num_kv_heads, device=self.device).view(1, -1, 1) * kv_cache.num_blocks
        block_numel = kv_cache.block_size * self.config.head_dim
        # Block b of KV head h is row h * num_blocks + b of the pool viewed [heads * blocks, ...].
        gather_indices = [
            None if n else (g.block_table.unsqueeze(1) + head_offsets).flatten() for g, n in zip(batch.groups, in_kernel)
        ]
        needed = 2 * sum(index.numel() for index in gather_indices if index is not None) * block_numel
        if self._gather_workspace.numel() < needed or self._gather_workspace.dtype != kv_cache.dtype:
            self._gather_workspace = torch.empty(needed, dtype=kv_cache.dtype, device=self.device)
        # Two buffers (keys, values) per gathering call, carved one after another out of the workspace.
        sizes = [index.numel() * block_numel for index in gather_indices if index is not None for _ in range(2)]
        buffers = iter(self._gather_workspace[:needed].split(sizes))
        calls = []
        for group, gather_index in zip(batch.groups, gather_indices):
            if gather_index is None:
                calls.append(AttentionCall(group))
                continue
            buffer_shape = (gather_index.numel(), kv_cache.block_size, self.config.head_dim)
            calls.append(
                AttentionCall(
                    group=group,
                    gather_index=gather_index,
                    # Row j * query_len + q of a folded KV group attends as query q does.
                    mask=group.mask.repeat(1, 1, group_size, 1),
                    key_buffer=next(buffers).view(buffer_shape),
                    value_buffer=next(buffers).view(buffer_shape),
                )
            )
        return calls

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, calls: list[AttentionCall]
    ) -> torch.Tensor:
        """Causal attention of every new token over its request's cached positions: [T, heads * D].

        Short rows go to `native.paged_attention` where the model runs the kernels. The
        torch path gathers each row's blocks and runs SDPA, with grouped-query attention done
        without repeating K/V: the `group` query heads that share a KV head are folded into the
        query length, q [rows, kv_heads, group * Q, D] against k, v [rows, kv_heads, L, D],
        whose [L, D] matrices the head-major pool gathers contiguous.
        """
        kv_heads, _, block_size, head_dim = keys.shape
        heads = q.shape[1]
        group = heads // kv_heads
        key_rows = keys.view(-1, block_size, head_dim)
        value_rows = values.view(-1, block_size, head_dim)
        outputs = []
        for call in calls:
            rows, length = call.group.rows, call.group.query_len
            if call.native:
                out = native.paged_attention(
                    q[call.tokens], keys, values, call.group.block_table, call.group.start_positions, length
                )
                outputs.append(out.view(rows * length, heads * head_dim))
                continue
            q_call = q[call.tokens].view(rows, length, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
            q_call = q_call.reshape(rows, kv_heads, group * length, head_dim)
            torch.index_select(key_rows, 0, call.gather_index, out=call.key_buffer)
            torch.index_select(value_rows, 0, call.gather_index, out=call.value_buffer)
            # A 16-bit pool's keys and values are widened to the queries' dtype for SDPA.
            k = call.key_buffer.view(rows, kv_heads, -1, head_dim).to(q.dtype)
            v = call.value_buffer.view(rows, kv_heads, -1, head_dim).to(q.dtype)
            out = F.scaled_dot_product_attention(q_call, k, v, attn_mask=call.mask)
            out = out.view(rows, kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
            outputs.append(out.reshape(rows * length, heads * head_dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def load_model(package: Package, device: torch.device | str = "cpu", weight_format: str = precision.AUTO) -> LlamaModel:
    """The model of a prepared package on `device`: float32, with the linear layers in
    `weight_format` (`auto`: the fastest this device runs for the stored dtype,
    `precision.choose_weight_format`, which raises `WeightFormatError` for a format that does
    not run here)."""
    device = torch.device(device)
    stored = TORCH_DTYPES[package.manifest.serving.dtype]
    floats, blocks = package.load_weights()
    # Stored float16 fits by construction; other weights are scanned only where float16 may run.
    float16_may_run = weight_format == WeightFormat.FLOAT16 or (weight_format == precision.AUTO and stored != torch.float32)
    fits = stored == torch.float16 or not float16_may_run or all(fits_float16(t) for t in floats.values())
    chosen = precision.choose_weight_format(stored, device, weight_format, weights_fit_float16=fits)
    state_dict: dict[str, torch.Tensor | QuantizedWeight] = dict(floats)
    for name, tensor in blocks.items():
        # The package's types are the kernels' (`map_blocks` refuses others). Without the C
        # kernels each call would expand a whole matrix again: its values are expanded once here.
        if native.available():
            state_dict[name] = QuantizedWeight.from_blocks(tensor.ggml_type, tensor.data, *tensor.shape)
        else:
            state_dict[name] = dequantized(tensor)
    return LlamaModel(package.manifest.model, state_dict, device=device, weight_format=chosen)
