"""2-D real DFTs as one dense real matrix product each (the ``'matmul'`` FFT backend).

For the small grids of vision models (e.g. 14x14 tokens) a whole 2-D real DFT is a single GEMM
with an (H W) x (2 H (W//2+1)) matrix: one large, efficient matrix product instead of many tiny
FFTs. It runs on matrix units, accepts low precision, and traces into ONNX and torch.compile
without complex dtypes. Its cost grows as N^2 per channel, so it only pays for small grids.

Spectra use ``torch.view_as_real(torch.fft.rfft2(x))``'s layout, flattened: (..., H * (W//2+1) * 2)
with (re, im) pairs innermost. ``rfft2_matmul`` is unnormalised like ``torch.fft.rfft2``;
``irfft2_matmul`` is the inverse of Hermitian spectra (1 / (H W)), like ``torch.fft.irfft2``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["rfft2_matmul", "irfft2_matmul"]


def _phases(hw: tuple[int, int]) -> Tensor:
    """2 pi (k1 n1 / H + k2 n2 / W) for every output (k1, k2 < W//2+1) and input (n1, n2): (N, H*Wf)."""
    H, W = hw
    n1, n2 = torch.meshgrid(torch.arange(H, dtype=torch.float64), torch.arange(W, dtype=torch.float64), indexing="ij")
    k1, k2 = torch.meshgrid(
        torch.arange(H, dtype=torch.float64), torch.arange(W // 2 + 1, dtype=torch.float64), indexing="ij"
    )
    # Reduce modulo the period before scaling so the phases are exact in float64.
    turns = (
        torch.remainder(n1.reshape(-1, 1) * k1.reshape(1, -1), H) / H
        + torch.remainder(n2.reshape(-1, 1) * k2.reshape(1, -1), W) / W
    )
    return 2 * math.pi * turns


# Cached across calls, so built outside inference mode: a tensor made under torch.inference_mode()
# could not be used later by a forward that autograd records.
@lru_cache(maxsize=32)
@torch.inference_mode(False)
def _analysis(hw: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """(N, 2 H Wf): x_flat @ it = view_as_real(rfft2(x)) flattened."""
    theta = _phases(hw)
    return torch.stack((torch.cos(theta), -torch.sin(theta)), dim=-1).flatten(1).to(dtype=dtype, device=device)


@lru_cache(maxsize=32)
@torch.inference_mode(False)
def _synthesis(hw: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """(2 H Wf, N): spectrum_flat @ it = irfft2 of a Hermitian spectrum."""
    H, W = hw
    theta = _phases(hw).T  # (H*Wf, N)
    weight = torch.full((W // 2 + 1,), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if W % 2 == 0:
        weight[-1] = 1.0  # the Nyquist column has no mirror image
    weight = weight.repeat(H)[:, None] / (H * W)
    return (
        torch.stack((weight * torch.cos(theta), -weight * torch.sin(theta)), dim=1)
        .flatten(0, 1)
        .to(dtype=dtype, device=device)
    )


def _matrix(build: Callable[..., Tensor], hw: tuple[int, int], like: Tensor) -> Tensor:
    """``build``'s matrix for the grid ``hw`` in ``like``'s dtype and device: the cached one, except while torch.export
    or torch.compile traces, where it is made in the graph (a cached one would be that trace's fake tensor, and
    every later eager call would get it)."""
    if torch.compiler.is_compiling():
        return inspect.unwrap(build)(hw, like.dtype, like.device)
    return build(hw, like.dtype, like.device)


def rfft2_matmul(x: Tensor) -> Tensor:
    """``view_as_real(rfft2(x))`` over the last two dims of real x, flattened to (..., H*(W//2+1)*2)."""
    H, W = x.shape[-2:]
    return x.flatten(-2) @ _matrix(_analysis, (H, W), x)


def irfft2_matmul(spectrum: Tensor, hw: tuple[int, int]) -> Tensor:
    """``irfft2(s=hw)`` of a (..., H*(W//2+1)*2) flattened (re, im) spectrum; returns (..., H, W)."""
    H, W = hw
    return (spectrum @ _matrix(_synthesis, (H, W), spectrum)).unflatten(-1, (H, W))
