"""Peak dense tensor throughput of common GPUs (vendor datasheets, TFLOP/s without sparsity), for the model FLOPs
utilisation (MFU) a training run reports. A device not listed has no peak: its MFU is null, never a guess."""

from __future__ import annotations

import re

import torch

__all__ = ["PEAK_TFLOPS", "peak_tflops", "peak_of_device_name", "compute_dtype"]

# (pattern on torch.cuda.get_device_name, {compute dtype: TFLOP/s}); the first match wins.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100 80GB HBM3|H100 SXM|H200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    # GeForce cards: half precision with float32 accumulation (what torch's GEMMs ask for) runs at half their rate.
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"V100-SXM2", {"fp32": 15.7, "fp16": 125.0}),
    (r"V100-PCIE", {"fp32": 14.0, "fp16": 112.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
)


def compute_dtype(device: torch.device, amp_dtype: str | None) -> str:
    """The dtype a run's matrix products run in: the autocast dtype, else fp32 (tf32 where CUDA allows it)."""
    if amp_dtype is not None:
        return amp_dtype
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The listed peak of ``device`` for ``dtype`` (:func:`compute_dtype`); None on a CPU or an unlisted GPU."""
    return peak_of_device_name(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None


def peak_of_device_name(name: str, dtype: str) -> float | None:
    """The listed peak of the GPU called ``name`` (as CUDA names it) for ``dtype``; None if not listed."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks.get(dtype)
    return None
