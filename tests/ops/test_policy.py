"""What circulant attention's auto settings take per device and dtype (cat.ops.policy), and the line that says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cat.ops import describe
from cat.ops.policy import AUTO_DEPTH, BUDGET_SHARE, backend_for, budget_bytes, default_budget_bytes, lean_for

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        (CUDA, torch.bfloat16, "separable"),  # cuFFT has no bf16 for these grids: the GEMMs on the tensor cores
        (CUDA, torch.float16, "separable"),
        (CUDA, torch.float32, "fft"),
        (CPU, torch.bfloat16, "fft"),  # GEMM DFTs measured slower on CPUs
        (CPU, torch.float32, "fft"),
    ],
)
def test_auto_dft_backend_by_device_and_dtype(device, dtype, expected):
    assert backend_for("auto", device, dtype) == expected
    assert backend_for("matmul", device, dtype) == "matmul"  # a backend set is taken as set


def test_auto_keeps_the_spectra_while_a_deep_model_fits_the_budget():
    assert lean_for("auto", 10, 10 * AUTO_DEPTH) is False
    assert lean_for("auto", 11, 10 * AUTO_DEPTH) is True
    assert lean_for(True, 1, 2**40) is True and lean_for(False, 2**40, 1) is False


def test_the_budget_is_a_share_of_free_memory_unless_set():
    free_share = default_budget_bytes("cpu")
    assert free_share > 0 and default_budget_bytes("cpu") == free_share  # read once
    meminfo = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    assert free_share <= BUDGET_SHARE * meminfo["MemTotal"] * 1024
    assert budget_bytes(None, CPU) == free_share and budget_bytes(3, CPU) == 3 * 2**20


def test_the_start_line_says_what_is_taken_and_why():
    line = describe(CPU, torch.float32, "auto", "auto", 512)
    assert line.startswith("circulant attention on cpu in float32: stored spectra while a 24-block model's")
    assert "0.5 GiB, 512 MiB" in line and "fft DFTs (torch.fft in float32; GEMM DFTs were measured slower" in line
    gpu = describe(CUDA, torch.bfloat16, True, "auto", 1024)
    assert "the lean function (lean_attention=true)" in gpu and "separable DFTs (GEMMs on the tensor cores" in gpu
