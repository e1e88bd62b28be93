"""Mixed precision: the ``amp.dtype`` names every config and tool uses, and the autocast they mean."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["AMP_DTYPES", "amp_dtype", "autocast_for"]

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
