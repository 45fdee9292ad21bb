"""Which format the linear layers run in, for a package's stored dtype on a device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flare.engine import precision
from flare.engine.precision import WeightFormat, WeightFormatError, choose_weight_format
from flare.package.directory import fits_float16

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = WeightFormat.FLOAT32, WeightFormat.BFLOAT16, WeightFormat.FLOAT16
CPU_KINDS = {  # name: (native bfloat16: AVX512-BF16 or AMX tiles, vectorised float16)
    "native-bf16": (True, True),
    "avx2": (False, True),
    "plain": (False, False),
}


@pytest.fixture(params=list(CPU_KINDS))
def cpu_kind(request, monkeypatch) -> str:
    native_bf16, float16 = CPU_KINDS[request.param]
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(precision, "cpu_has_float16_gemm", lambda: float16)
    return request.param


def test_float32_weights_run_in_float32_unless_a_format_is_asked_for(cpu_kind) -> None:
    assert choose_weight_format(torch.float32, CPU) == F32
    assert choose_weight_format(torch.float32, CUDA) == F32
    if cpu_kind != "plain":
        assert choose_weight_format(torch.float32, CPU, "float16") == F16


def test_16_bit_weights_run_in_the_fastest_format_of_the_cpu(cpu_kind) -> None:
    # float16 (the engine's kernel) first wherever it runs, on CPUs with AMX tiles too (precision.py).
    expected = {"native-bf16": F16, "avx2": F16, "plain": F32}[cpu_kind]
    for stored in (torch.float16, torch.bfloat16):
        assert choose_weight_format(stored, CPU) == expected


def test_without_the_c_kernels_a_native_bfloat16_cpu_runs_bfloat16(monkeypatch) -> None:
    # fbgemm's float16 is what would run then, and it is no faster than oneDNN's bfloat16.
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_has_float16_gemm", lambda: True)
    monkeypatch.setattr(precision.native, "available", lambda: False)
    assert choose_weight_format(torch.float16, CPU) == BF16
    assert choose_weight_format(torch.float16, CPU, "float16") == F16


def test_a_gpu_multiplies_the_stored_dtype(cpu_kind) -> None:
    assert choose_weight_format(torch.float16, CUDA) == F16
    assert choose_weight_format(torch.bfloat16, CUDA) == BF16


def test_float32_is_always_available_on_request(cpu_kind) -> None:
    for stored in (torch.float16, torch.bfloat16, torch.float32):
        assert choose_weight_format(stored, CPU, "float32") == F32


def test_a_format_the_cpu_cannot_run_is_refused_naming_what_it_needs(cpu_kind) -> None:
    if cpu_kind in ("avx2", "plain"):
        with pytest.raises(WeightFormatError, match=r"bfloat16 needs a CPU that multiplies bfloat16 natively .*runs"):
            choose_weight_format(torch.float16, CPU, "bfloat16")
    if cpu_kind == "plain":
        with pytest.raises(WeightFormatError, match="float16 needs an x86 CPU with AVX2 and F16C"):
            choose_weight_format(torch.float16, CPU, "float16")
    with pytest.raises(WeightFormatError, match="must be one of auto, float32, bfloat16, float16, got 'int8'"):
        choose_weight_format(torch.float16, CPU, "int8")


def test_weights_beyond_float16_range_never_run_in_float16(cpu_kind) -> None:
    expected = BF16 if cpu_kind == "native-bf16" else F32
    assert choose_weight_format(torch.bfloat16, CPU, weights_fit_float16=False) == expected
    with pytest.raises(WeightFormatError, match="beyond float16's range"):
        choose_weight_format(torch.bfloat16, CPU, "float16", weights_fit_float16=False)


def test_the_command_line_offers_exactly_auto_and_the_weight_formats() -> None:
    # flare run parses --weight-format from the manifest's torch-free list.
    assert precision.FORMAT_CHOICES == ("auto", *(f.value for f in WeightFormat))


def test_fits_float16_is_false_past_65504() -> None:
    assert fits_float16(torch.tensor([-65504.0, 1e-9, 0.0]))
    assert not fits_float16(torch.tensor([0.5, 70000.0]))
    assert not fits_float16(torch.tensor([float("inf")]))


def _in_subprocess(env: dict[str, str], script: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_an_operator_turns_bfloat16_gemms_off_with_onednn_max_cpu_isa() -> None:
    # docs/operations.md: ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN from bfloat16 GEMMs.
    script = "from flare.engine.precision import cpu_has_native_bf16; print(cpu_has_native_bf16())"
    assert _in_subprocess({"ONEDNN_MAX_CPU_ISA": "AVX2"}, script) == "False"


CHOICE_SCRIPT = """
import torch
from flare.engine.precision import choose_weight_format, cpu_has_float16_gemm
print(cpu_has_float16_gemm(), choose_weight_format(torch.float16, torch.device("cpu")))
"""


def test_a_cpu_without_avx2_runs_float16_packages_in_float32() -> None:
    # ATEN_CPU_CAPABILITY=default makes torch dispatch as on a CPU without AVX2.
    assert _in_subprocess({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}, CHOICE_SCRIPT) == "False float32"


@pytest.mark.skipif("avx2" not in precision.cpu_flags(), reason="this CPU has no AVX2")
def test_an_avx2_cpu_runs_float16_packages_in_float16() -> None:
    # On a CPU with AVX-512, ATen and oneDNN are held to AVX2, as on CI's class of CPU.
    assert _in_subprocess({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, CHOICE_SCRIPT) == "True float16"


ISA_SCRIPT = "from flare.engine import native; print(native.LINEAR_ISA)"


@pytest.mark.skipif("avx2" not in precision.cpu_flags(), reason="this CPU has no AVX2")
def test_the_float16_kernel_follows_atens_dispatch_so_avx2_stands_in_for_an_avx2_only_cpu() -> None:
    from flare.engine import native

    assert _in_subprocess({"ATEN_CPU_CAPABILITY": "avx2"}, ISA_SCRIPT) == str(native.ISA_AVX2)
    widest = native.ISA_AVX512 if "avx512f" in precision.cpu_flags() else native.ISA_AVX2
    assert _in_subprocess({"ATEN_CPU_CAPABILITY": ""}, ISA_SCRIPT) == str(widest)
