"""Precision: autocast, memory format and loss scaling as one object."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from torch import nn

from cat.runtime import Precision


def test_from_config_and_cpu_behaviour():
    cfg = OmegaConf.create({"amp": {"enabled": True, "dtype": "bf16"}, "channels_last": True})
    precision = Precision.from_config(cfg, torch.device("cpu"))
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
