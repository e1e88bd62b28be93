"""The dtypes circulant attention's transforms run in, and autocast around them."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["fft_dtype", "fft_itemsize", "no_autocast", "autocast_state"]


def fft_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype FFTs run in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fft_itemsize(dtype: torch.dtype) -> int:
    """Bytes per real of the spectra of inputs of ``dtype`` (:func:`fft_dtype`)."""
    return torch.finfo(fft_dtype(dtype)).bits // 8


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` (a no-op where autocast does not exist, e.g. the meta device, or is off already: an
    autocast context costs the host about 10 us, a few per block)."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device`` and its dtype ((False, None) where autocast does not exist)."""
    if not torch.amp.is_autocast_available(device.type):
        return False, None
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
