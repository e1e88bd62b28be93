"""Mixed precision: the ``amp.dtype`` names every config and tool uses, the autocast they mean, and
:class:`Precision`, how a run computes (autocast, memory format, loss scaling) as one object."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .job_config import AmpConfig

__all__ = ["AMP_DTYPES", "amp_dtype", "autocast_for", "Precision"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(name: str) -> torch.dtype:
    if name not in AMP_DTYPES:
        raise ValueError(f"amp dtype must be one of {sorted(AMP_DTYPES)}, got {name!r}")
    return AMP_DTYPES[name]


def autocast_for(device: torch.device | str, enabled: bool, dtype: str | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device`` in ``dtype`` when ``enabled`` (and ``dtype`` given), else a no-op."""
    if not enabled or dtype is None:
        return contextlib.nullcontext()
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return torch.autocast(device_type, dtype=amp_dtype(dtype))


@dataclass(frozen=True)
class Precision:
    """How a run computes on ``device``: autocast in ``dtype`` when ``amp`` is on, channels-last
    inputs and weights when ``channels_last``, and a loss scaler where fp16 needs one (CUDA)."""

    device: torch.device
    amp: bool = False
    dtype: str = "bf16"
    channels_last: bool = False

    @classmethod
    def from_config(cls, amp: AmpConfig, device: torch.device, channels_last: bool = False) -> Precision:
        """From a config's ``amp`` section (:class:`~cat.runtime.schema.AmpConfig`) and its ``channels_last``."""
        return cls(device, amp.enabled, amp.dtype, channels_last)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.device, self.amp, self.dtype)

    def inputs(self, images: Tensor) -> Tensor:
        """A batch of images on the device, in the run's memory format."""
        images = images.to(self.device, non_blocking=True)
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def model(self, model: nn.Module) -> nn.Module:
        """``model`` on the device, in the run's memory format."""
        model = model.to(self.device)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling for fp16 on CUDA; a pass-through scaler otherwise (bf16 and fp32 need none)."""
        enabled = self.amp and self.dtype == "fp16" and self.device.type == "cuda"
        return torch.amp.GradScaler(self.device.type, enabled=enabled)
