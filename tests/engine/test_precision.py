"""Which dtype the linear layers run in for a package's weights on a device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flare.engine import precision
from flare.engine.precision import gemm_dtype, preferred_package_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(params=[True, False], ids=["native-bf16-cpu", "other-cpu"])
def native_bf16(request, monkeypatch) -> bool:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: request.param)
    return request.param


def test_float32_weights_always_run_in_float32(native_bf16) -> None:
    assert gemm_dtype(torch.float32, CPU) == torch.float32
    assert gemm_dtype(torch.float32, CUDA) == torch.float32


def test_bfloat16_weights_run_in_bfloat16_only_where_the_cpu_multiplies_it_natively(native_bf16) -> None:
    assert gemm_dtype(torch.bfloat16, CPU) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert preferred_package_dtype(CPU) == ("bfloat16" if native_bf16 else "float32")


def test_float16_weights_are_widened_on_a_cpu_and_kept_on_a_gpu(native_bf16) -> None:
    assert gemm_dtype(torch.float16, CPU) == torch.float32
    assert gemm_dtype(torch.float16, CUDA) == torch.float16
    assert gemm_dtype(torch.bfloat16, CUDA) == torch.bfloat16
    assert preferred_package_dtype(CUDA) == "bfloat16"


def test_an_operator_turns_bfloat16_gemms_off_with_onednn_max_cpu_isa() -> None:
    # docs/operations.md: ONEDNN_MAX_CPU_ISA=AVX2 keeps a bfloat16 package on float32 GEMMs.
    script = "from flare.engine.precision import cpu_has_native_bf16; print(cpu_has_native_bf16())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
