"""Which dtype the engine's GEMMs run in, given the package's weights and the device.

A package stores its weights in `serving.dtype`. Activations, norms, attention, the KV cache and
logits are float32 on the CPU whatever the package says; only the linear layers (the LM head
included) run in the weights' dtype, and only where the hardware multiplies that dtype
natively. bfloat16 on a CPU with AVX512-BF16 or AMX: the products are accumulated in float32
by oneDNN, inputs are rounded to bfloat16 on the way in and outputs on the way out. On this
kind of CPU (AMD EPYC, AVX512-BF16, 2 threads) a 32 x 576 by 576 x 1536 product ran 2.3x
faster than in float32, and the weights read per round halve.

Elsewhere bfloat16 and float16 GEMMs are emulated (float16 ran at a quarter of float32's speed
here, bfloat16 at a sixth on an AVX2 CPU), so such weights are widened to float32 at load. That
is exact: every bfloat16 and float16 value is a float32 value.
"""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest gives `dtype` ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles) and oneDNN,
    which runs the engine's bfloat16 GEMMs (`model.pack_weight`), will use it."""
    # Private helpers of torch.cpu (cpuinfo underneath); absent ones count as no. oneDNN's own
    # check also honours ONEDNN_MAX_CPU_ISA, so an operator can turn bfloat16 GEMMs off.
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    instructions = any(getattr(torch.cpu, check, lambda: False)() for check in checks)
    return instructions and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def gemm_dtype(weights: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the linear layers run in for weights stored as `weights` on `device`."""
    if weights == torch.float32:
        return torch.float32
    if device.type == "cuda":
        return weights
    if weights == torch.bfloat16 and device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def preferred_package_dtype(device: torch.device) -> str:
    """The serving dtype `--dtype auto` exports: bfloat16 where its GEMMs are native, else float32."""
    return dtype_name(gemm_dtype(torch.bfloat16, device))
