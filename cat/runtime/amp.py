"""Mixed precision: the ``amp.dtype`` names every config and tool uses, the autocast they mean, and
:class:`Precision`, how a run computes (autocast, memory format, loss scaling) as one object."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .job_config import AmpConfig

__all__ = ["AMP_DTYPES", "amp_dtype", "autocast_for", "resolve_amp", "set_tf32", "describe_precision", "Precision"]

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


# The first compute capability with bf16 arithmetic (Ampere): below it CUDA emulates bf16 at float32 speed (and
# torch.cuda.is_bf16_supported() still says yes), and Inductor does not compile bf16.
BF16_CAPABILITY = (8, 0)


def _bf16_reason(device: torch.device) -> tuple[bool, str]:
    """Whether autocast on ``device`` computes in bf16 by default, and why."""
    if device.type != "cuda":  # CPU autocast takes bfloat16 on every CPU torch runs on
        return True, f"bf16 on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= BF16_CAPABILITY:
        return True, f"bf16: compute capability {major}.{minor} has bf16 arithmetic"
    return False, (
        f"fp16: compute capability {major}.{minor} has no bf16 arithmetic (from "
        f"{BF16_CAPABILITY[0]}.{BF16_CAPABILITY[1]}: bf16 would be emulated at float32 speed)"
    )


def resolve_amp(amp: AmpConfig, device: torch.device) -> tuple[bool, str, str]:
    """Whether a run on ``device`` computes under autocast, in which dtype (``"bf16"``/``"fp16"``), and why, from
    ``amp.enabled`` and ``amp.dtype`` (either may be ``"auto"``): auto is autocast on CUDA, as the released recipes
    train (``--amp``), and float32 on a CPU, whose autocast is slower than its float32 for these models; the dtype
    auto is bf16 where the device computes in it (a GPU of compute capability 8.0 or more, a CPU), else fp16, with
    a gradient scaler."""
    if amp.enabled == "auto":
        enabled = device.type == "cuda"
        why = f"amp.enabled=auto on {device.type}"
    else:
        enabled, why = bool(amp.enabled), f"amp.enabled={str(amp.enabled).lower()}"
    dtype = amp.dtype
    if dtype == "auto":
        bf16, reason = _bf16_reason(device)
        dtype = "bf16" if bf16 else "fp16"
        if enabled:
            why += f", amp.dtype=auto: {reason}"
    return enabled, dtype, why


def set_tf32(amp: AmpConfig, device: torch.device) -> None:
    """``amp.tf32`` for this process's float32 matmuls and convolutions, on CUDA (nothing elsewhere)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = amp.tf32
        torch.backends.cudnn.allow_tf32 = amp.tf32


def describe_precision(amp: AmpConfig, device: torch.device) -> str:
    """The log line that says how a run on ``device`` computes, and why (:func:`resolve_amp`)."""
    enabled, dtype, why = resolve_amp(amp, device)
    if enabled:
        scaler = ", with a gradient scaler" if dtype == "fp16" and device.type == "cuda" else ""
        text = f"precision: {dtype} autocast{scaler} ({why})"
    else:
        text = f"precision: float32 ({why})"
    if device.type == "cuda":
        text += f"; float32 matmuls {'in TF32' if amp.tf32 else 'in full float32'} (amp.tf32={str(amp.tf32).lower()})"
    return text


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
        """From a config's ``amp`` section (:class:`~cat.runtime.schema.AmpConfig`, its ``auto`` values resolved
        by :func:`resolve_amp`) and its ``channels_last``; ``amp.tf32`` is set for the process on CUDA."""
        enabled, dtype, _ = resolve_amp(amp, device)
        set_tf32(amp, device)
        return cls(device, enabled, dtype, channels_last)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Autocast's dtype, or None where the run computes in its parameters' dtype."""
        return amp_dtype(self.dtype) if self.amp else None

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
