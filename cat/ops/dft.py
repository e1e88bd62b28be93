"""2-D real DFTs as dense real matrix products (the ``'matmul'`` FFT backend).

For the small grids of vision models (14x14 ... 56x56) a 2-D DFT is two small dense products with
separable cos/sin matrices, one along W (real to half spectrum) and one along H (complex). They run
on matrix units, accept low precision, trace into ONNX and compile without complex dtypes.
Spectra are real/imaginary pairs of tensors shaped (..., H, W // 2 + 1), matching ``torch.fft.rfft2``
(unnormalised) and ``torch.fft.irfft2`` (1 / (H W) on the inverse).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["rfft2_pairs", "irfft2_pairs"]


@lru_cache(maxsize=64)
def _cos_sin(rows: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of 2 pi k m / n for k < rows, m < n (built in float64: exact phases)."""
    k = torch.arange(rows, dtype=torch.float64)[:, None]
    m = torch.arange(n, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * torch.remainder(k * m, n) / n
    return torch.cos(angle).to(dtype=dtype, device=device), torch.sin(angle).to(dtype=dtype, device=device)


@lru_cache(maxsize=64)
def _half_spectrum_synthesis(n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(n//2+1, n) cos/sin matrices of the inverse real DFT, Hermitian weights and 1/n folded in."""
    wf = n // 2 + 1
    weight = torch.full((wf, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0  # the Nyquist bin has no mirror image
    cos, sin = _cos_sin(wf, n, torch.float64, torch.device("cpu"))
    return (weight * cos / n).to(dtype=dtype, device=device), (weight * sin / n).to(dtype=dtype, device=device)


def rfft2_pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """Real and imaginary parts of ``torch.fft.rfft2(x)`` over the last two dims."""
    H, W = x.shape[-2:]
    cos_w, sin_w = _cos_sin(W // 2 + 1, W, x.dtype, x.device)
    a = x @ cos_w.T  # along W: x e^{-i theta} = x cos - i x sin
    b = -(x @ sin_w.T)
    cos_h, sin_h = _cos_sin(H, H, x.dtype, x.device)
    return cos_h @ a + sin_h @ b, cos_h @ b - sin_h @ a  # along H: (cos - i sin)(a + i b)


def irfft2_pairs(re: Tensor, im: Tensor, hw: tuple[int, int]) -> Tensor:
    """``torch.fft.irfft2(re + i im, s=hw)`` over the last two dims."""
    H, W = hw
    cos_h, sin_h = _cos_sin(H, H, re.dtype, re.device)
    yr = (cos_h @ re - sin_h @ im) / H  # along H: (cos + i sin)(re + i im) / H
    yi = (cos_h @ im + sin_h @ re) / H
    cos_w, sin_w = _half_spectrum_synthesis(W, re.dtype, re.device)
    return yr @ cos_w - yi @ sin_w  # along W: the real part of the Hermitian synthesis
