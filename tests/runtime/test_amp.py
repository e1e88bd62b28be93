"""Precision: autocast, memory format and loss scaling as one object."""

from __future__ import annotations

import torch
from torch import nn

from cat.runtime import Precision
from cat.runtime.job_config import AmpConfig


def test_from_config_and_cpu_behaviour():
    precision = Precision.from_config(AmpConfig(enabled=True, dtype="bf16"), torch.device("cpu"), channels_last=True)
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
