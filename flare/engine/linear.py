"""Linear layers in every weight format the engine multiplies: plain, packed for this CPU's GEMM
(`pack_weight`), ggml blocks, or several of these stacked on the output dimension.

Weights are [out, in], as checkpoints store them; `linear` gives rows [T, out] and
`linear_columns` columns [out, T], weights first (the layout a round's few rows run fastest in).
"""

from __future__ import annotations

import torch

from flare.engine import native, quantized
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight

# A very tall weight (the LM head) is applied in slices of this many output rows once a round
# has CHUNKED_MIN_TOKENS tokens: MKL splits one tall product less well than it runs layer-sized
# ones, and below that many tokens slicing gains nothing.
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
    return QuantizedWeight.from_blocks(first.ggml_type, data, rows, first.in_features, first.activations)



def pack_weight(weight: torch.Tensor, weight_format: WeightFormat) -> Weight:
    """A linear layer's weight [out, in] in `weight_format`, packed once where the CPU's GEMM
    for that format wants its own layout; `linear` and `linear_columns` read every kind.

    - bfloat16 on a CPU with oneDNN's bfloat16: oneDNN's blocked layout, which oneDNN would
      otherwise build again on every product.
    - float16 on a CPU: the engine's own kernel's `native.Float16Weight`, or, where the C
      kernels were not built, fbgemm's packed matrix (a `torch.ScriptObject`).
    - otherwise the plain tensor in the format's dtype.

    The oneDNN and fbgemm ops are torch's private ones; torch is pinned, and
    tests/engine/test_paged_forward.py holds every kind to float32 products of the same operands.
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
        # The parts with integer kernels share one quantization of x (q, k and v of a layer).
        halves = {part.halves for part in weight if isinstance(part, QuantizedWeight)} - {0}
        shared = {h: quantized.quantize_activations(x.float(), h) for h in halves}
        return torch.cat(
            [
                quantized.quantized_linear(x.float().contiguous(), part, activations=shared.get(part.halves))
                if isinstance(part, QuantizedWeight)
                else linear(x, part).float()
                for part in weight
            ],
            dim=1,
        )
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
    kernels read either layout through its strides, so no copy into columns).

    A plain weight is computed weights first, as `weight @ x.T`: a round's few rows become the
    GEMM's narrow side and the weights are read once, in their stored order, so a verify row of
    a few drafts costs about what a decode row does. A single row is doubled because MKL's GEMV
    on this layout is slower than its two-column GEMM, and x is made row-major because MKL
    takes a column-major one down a slow path.
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
