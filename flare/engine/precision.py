"""Which format the engine's linear layers multiply in, chosen per device at load.

A package stores its weights once, in `serving.dtype` (float16 by default: `flare export`).
Activations, norms, attention and logits are float32 on the CPU whatever the package stores
(the KV cache too, unless the operator stores it in 16 bits: `flare run --kv-cache-dtype`);
only the linear layers (the LM head included) run in a weight format, the one this machine
multiplies fastest:

- `bfloat16`: oneDNN's GEMM on a CPU with AVX512-BF16 or AMX, weights packed once
  (`linear.pack_weight`), float32 accumulation; faster than MKL's float32 where the CPU
  multiplies bfloat16 natively.
- `float16`: the engine's float16 GEMM on an x86 CPU with AVX2 (every AVX2 CPU has F16C):
  float16 weights packed in blocks of 16 output channels, float32 activations and accumulation
  (`native.float16_linear`; fbgemm's `torch.ops.quantized.linear_dynamic_fp16` where the C
  kernels were not built): half the bytes of float32, which a decode round spends its time
  reading. Elsewhere float16 GEMMs are emulated, far slower than float32.
- `float32`: MKL, weights first (`model.linear_columns`); exact for every stored dtype, since
  every bfloat16 and float16 value is a float32 value.

On a GPU the stored 16-bit dtype is multiplied as it is. A float32 package runs in float32
unless the operator asks for a 16-bit format (`flare run --weight-format`): rounding its
weights is then their choice.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from flare.engine import native
from flare.package.manifest import AUTO_DTYPE, WEIGHT_FORMATS


class WeightFormat(StrEnum):
    """What the linear layers' weights are multiplied as (see the module docstring)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.value)


AUTO = AUTO_DTYPE
FORMAT_CHOICES = WEIGHT_FORMATS

class WeightFormatError(ValueError):
    """A weight format that this device or these weights cannot run (names why)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest gives `dtype` ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


def cpu_flags() -> list[str]:
    """This CPU's vector and matrix extensions that decide the weight formats (AVX2, FMA, F16C,
    AVX-512 and AMX flags of /proc/cpuinfo), for logs and benchmark reports; empty where the
    kernel does not say."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx")))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles) and oneDNN,
    which runs the engine's bfloat16 GEMMs (`linear.pack_weight`), will use it."""
    # Private helpers of torch.cpu (cpuinfo underneath); absent ones count as no. oneDNN's own
    # check also honours ONEDNN_MAX_CPU_ISA, so an operator can turn bfloat16 GEMMs off.
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    instructions = any(getattr(torch.cpu, check, lambda: False)() for check in checks)
    return instructions and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_has_float16_gemm() -> bool:
    """Whether float16 GEMMs run vectorised here: an x86 CPU with AVX2 (and so F16C and FMA),
    and the engine's C kernels built (`native.float16_linear`) or else a torch built with fbgemm.

    The capability is ATen's, which honours ATEN_CPU_CAPABILITY: `ATEN_CPU_CAPABILITY=default`
    stands in for a CPU without AVX2 (the tests force the dispatch that way)."""
    vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return vectorised and (native.available() or "fbgemm" in torch.backends.quantized.supported_engines)


def available_formats(device: torch.device) -> tuple[WeightFormat, ...]:
    """The formats that run natively on `device`, the one `auto` takes first.

    float16 through the engine's kernel comes first wherever it runs, on CPUs that multiply
    bfloat16 natively too: decode rounds read every weight once, which the kernel does fastest,
    on AVX512-BF16 CPUs (0.71x oneDNN's bfloat16 time at 1 and 8 rows) and on AMX ones alike
    (served, 2.8x oneDNN's bfloat16 tokens/s at one stream, 1.2x at 32; AMX computes a long
    prompt 1.6x faster, which `--weight-format bfloat16` buys: docs/benchmarks.md, "Weight
    formats"); and bfloat16 rounds the GEMMs' inputs and outputs, the logits included, to 8 bits
    where float16 keeps float32's. bfloat16 comes first where the C kernels were not built
    (fbgemm's float16 is no faster than oneDNN's bfloat16)."""
    if device.type != "cpu":
        return (WeightFormat.BFLOAT16, WeightFormat.FLOAT16, WeightFormat.FLOAT32)
    formats = []
    float16 = cpu_has_float16_gemm()
    if float16 and native.available():
        formats.append(WeightFormat.FLOAT16)
    if cpu_has_native_bf16():
        formats.append(WeightFormat.BFLOAT16)
    if float16 and WeightFormat.FLOAT16 not in formats:
        formats.append(WeightFormat.FLOAT16)
    return (*formats, WeightFormat.FLOAT32)


def choose_weight_format(
    stored: torch.dtype, device: torch.device, requested: str = AUTO, *, weights_fit_float16: bool = True
) -> WeightFormat:
    """The format the linear layers of weights stored as `stored` run in on `device`.

    `auto`: float32 weights stay float32; 16-bit weights take the fastest 16-bit format that
    runs natively here (on a GPU, the stored dtype itself), else float32. A named format is
    honoured where it runs natively and raises `WeightFormatError` where it does not (an
    emulated 16-bit GEMM is several times slower than float32). `weights_fit_float16` is False
    when a weight lies beyond float16's range: float16 is then never chosen nor allowed.
    """
    if requested not in FORMAT_CHOICES:
        raise WeightFormatError(f"the weight format must be one of {', '.join(FORMAT_CHOICES)}, got {requested!r}")
    available = [f for f in available_formats(device) if weights_fit_float16 or f != WeightFormat.FLOAT16]
    if requested == AUTO:
        if stored == torch.float32:
            return WeightFormat.FLOAT32
        if device.type != "cpu":
            stored_format = WeightFormat(dtype_name(stored))
            return stored_format if stored_format in available else WeightFormat.FLOAT32
        return available[0]
    wanted = WeightFormat(requested)
    if wanted in available:
        return wanted
    if wanted == WeightFormat.FLOAT16 and not weights_fit_float16:
        raise WeightFormatError("weight format float16: a weight of this package lies beyond float16's range (65504)")
    needs = {
        WeightFormat.BFLOAT16: "a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX)",
        WeightFormat.FLOAT16: "an x86 CPU with AVX2 and F16C",
    }
    raise WeightFormatError(
        f"weight format {requested} needs {needs[wanted]}; this CPU runs {', '.join(available)}"
    )
