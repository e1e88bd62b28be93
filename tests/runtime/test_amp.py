"""Precision: autocast, memory format and loss scaling as one object."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cat.runtime import Precision, describe_precision, resolve_amp
from cat.runtime.job_config import AmpConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_from_config_and_cpu_behaviour():
    precision = Precision.from_config(AmpConfig(enabled=True, dtype="bf16", tf32=True), CPU, channels_last=True)
    assert precision == Precision(torch.device("cpu"), True, "bf16", True)
    images = precision.inputs(torch.randn(2, 3, 8, 8))
    assert images.is_contiguous(memory_format=torch.channels_last)
    conv = precision.model(nn.Conv2d(3, 4, 3))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    with precision.autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    assert not precision.grad_scaler().is_enabled()


def test_fp16_scaling_only_where_it_is_needed():
    assert not Precision(torch.device("cpu"), True, "fp16").grad_scaler().is_enabled()  # no CUDA here
    assert not Precision(torch.device("cpu")).grad_scaler().is_enabled()
    with Precision(torch.device("cpu")).autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize(
    "enabled, dtype, device, expected",
    [
        ("auto", "auto", CUDA, True),  # as the authors train: --amp on GPUs
        ("auto", "auto", CPU, False),  # a CPU trains these models faster in float32
        (True, "fp16", CPU, True),
        (False, "bf16", CUDA, False),
    ],
)
def test_amp_auto_is_autocast_on_cuda_and_float32_on_a_cpu(enabled, dtype, device, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on, name, why = resolve_amp(AmpConfig(enabled=enabled, dtype=dtype, tf32=True), device)
    assert on is expected and name == ("bf16" if dtype == "auto" else dtype)
    assert why.startswith(f"amp.enabled={str(enabled).lower()}" + (f" on {device.type}" if enabled == "auto" else ""))


@pytest.mark.parametrize(
    "capability, dtype, reason",
    [
        ((7, 0), "fp16", "compute capability 7.0 has no bf16 arithmetic"),  # V100
        ((7, 5), "fp16", "compute capability 7.5 has no bf16 arithmetic"),  # T4, RTX 20xx
        ((8, 0), "bf16", "compute capability 8.0 has bf16 arithmetic"),  # A100
        ((9, 0), "bf16", "compute capability 9.0 has bf16 arithmetic"),  # H100, H200
    ],
)
def test_amp_dtype_auto_is_bf16_only_where_the_card_computes_in_it(capability, dtype, reason, monkeypatch):
    """Faked cards: bf16 from compute capability 8.0; below it fp16 with a gradient scaler, although torch says bf16
    is supported there (emulated, at float32 speed); the line says which and why."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)  # emulation counts for torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    amp = AmpConfig(enabled="auto", dtype="auto", tf32=False)
    assert resolve_amp(amp, CUDA)[:2] == (True, dtype)
    scaler = ", with a gradient scaler" if dtype == "fp16" else ""
    assert describe_precision(amp, CUDA) == (
        f"precision: {dtype} autocast{scaler} (amp.enabled=auto on cuda, amp.dtype=auto: {dtype}: {reason}"
        + (" (from 8.0: bf16 would be emulated at float32 speed)" if dtype == "fp16" else "")
        + "); float32 matmuls in full float32 (amp.tf32=false)"
    )


def test_a_cpu_computes_in_float32_unless_asked_and_then_in_bf16():
    amp = AmpConfig(enabled="auto", dtype="auto", tf32=False)
    assert describe_precision(amp, CPU) == "precision: float32 (amp.enabled=auto on cpu)"
    assert describe_precision(AmpConfig(enabled=True, dtype="auto", tf32=True), CPU) == (
        "precision: bf16 autocast (amp.enabled=true, amp.dtype=auto: bf16 on cpu)"
    )
