"""Spectra of real 2-D maps: the dtype and autocast rules of the transforms, and the packing of a
half spectrum into exactly as many reals as the map has.

``rfft2`` of a real H x W map returns H x (W//2+1) complex numbers, 2*H*(W//2+1) reals, although
the map has only N = H*W degrees of freedom: the columns kx = 0 and (W even) kx = W/2 are
Hermitian along ky (c[ky] = conj(c[-ky])), so half of their reals repeat the other half.
:func:`pack_spectrum` keeps the N independent reals, as an (H, W) real array laid out as

    column 0           the Hermitian column kx = 0: Re c[ky] for ky <= H//2, Im c[ky] above
    column 1 (W even)  the Hermitian column kx = W/2, packed the same way
    the other columns  (re, im) pairs of kx = 1 .. (W-1)//2

and :func:`unpack_spectrum` rebuilds the half spectrum from it. Both are linear and act on each
map alone, so a channel-mixing matrix commutes with them: ``unpack(M @ pack(X)) == M @ X`` for
real M, which lets a projection of the spectrum run on N rows instead of 2*H*(W//2+1).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = [
    "fft_dtype",
    "no_autocast",
    "attend_spectra",
    "circulant_weights",
    "head_sum",
    "per_head",
    "pack_spectrum",
    "unpack_spectrum",
]


def fft_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype FFTs run in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` (a no-op where autocast does not exist, e.g. the meta device)."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device`` and its dtype ((False, None) where autocast does not exist)."""
    if not torch.amp.is_autocast_available(device.type):
        return False, None
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def head_sum(channels: Tensor, head_dim: int) -> Tensor:
    """(B, C, ...) summed over each head's ``head_dim`` channels: (B, C // head_dim, ...)."""
    if head_dim == 1:
        return channels
    B, C = channels.shape[:2]
    return channels.view(B, C // head_dim, head_dim, *channels.shape[2:]).sum(2)


def per_head(heads: Tensor, channels: Tensor, head_dim: int) -> Tensor:
    """(B, heads, ...) times (B, C, ...), each head's map applied to each of its channels."""
    if head_dim == 1:
        return heads * channels
    B, C = channels.shape[:2]
    grouped = channels.view(B, C // head_dim, head_dim, *channels.shape[2:])
    return (heads.unsqueeze(2) * grouped).view(channels.shape)


def circulant_weights(q_f: Tensor, k_f: Tensor, hw: tuple[int, int], head_dim: int, scale: float) -> Tensor:
    """Softmax weights (B, heads, H, W) of circulant attention from the rfft2 spectra of q and k."""
    B = q_f.shape[0]
    # Cross-correlation theorem: F(sum_i q_i k_{i+d}) = conj(F q) * F k; summing the products of
    # a head's channels in the frequency domain gives the head's logits with one inverse FFT.
    logits = torch.fft.irfft2(head_sum(torch.conj(q_f) * k_f, head_dim), s=hw)
    heads = logits.shape[1]
    return (logits.view(B, heads, -1) * scale).softmax(dim=-1).view(B, heads, *hw)


def attend_spectra(
    q_f: Tensor,
    k_f: Tensor,
    v_f: Tensor,
    hw: tuple[int, int],
    head_dim: int,
    scale: float,
    return_weights: bool = False,
    out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Circulant attention given the rfft2 spectra of q, k and v, channels first.

    ``q_f``, ``k_f``, ``v_f``: (B, C, H, W//2+1) complex, the unnormalised ``rfft2`` over the last two
    dims. Returns the real output (B, C, H, W) and, with ``return_weights``, the attention weights
    (B, heads, H, W): weights[..., dy, dx] is the weight of the key at offset (dy, dx) from every
    query. Channels form heads of ``head_dim`` channels; the caller handles dtypes and autocast.
    ``out``: a (B, C, H, W) tensor to write the output into.
    """
    weights = circulant_weights(q_f, k_f, hw, head_dim, scale)
    # out_i = sum_d w[d] v_{i+d} is again a cross-correlation, of the weights with v.
    y = torch.fft.irfft2(per_head(torch.conj(torch.fft.rfft2(weights)), v_f, head_dim), s=hw)
    # Copied, not irfft2's out=: torch.compile cannot trace that into a strided slice (the lean function's channel
    # groups), and broke the graph in a loop, which ran the whole frame eagerly.
    out = y if out is None else out.copy_(y)
    return (out, weights) if return_weights else out


def _hermitian_columns(width: int) -> list[int]:
    """The half-spectrum columns that are Hermitian along ky: kx = 0, and kx = W/2 for even W."""
    return [0, width // 2] if width % 2 == 0 else [0]


def pack_spectrum(spectrum: Tensor, width: int) -> Tensor:
    """The N = H*W independent reals of the ``rfft2`` half spectrum (..., H, W//2+1) of real
    H x ``width`` maps, as a real (..., H, W) tensor (layout in the module docstring)."""
    half = spectrum.shape[-2] // 2
    hermitian = [
        torch.cat([spectrum[..., : half + 1, kx].real, spectrum[..., half + 1 :, kx].imag], dim=-1)
        for kx in _hermitian_columns(width)
    ]
    interior = torch.view_as_real(spectrum[..., 1 : (width + 1) // 2]).flatten(-2)
    return torch.cat([torch.stack(hermitian, dim=-1), interior], dim=-1)


def unpack_spectrum(packed: Tensor, width: int) -> Tensor:
    """The complex half spectrum (..., H, W//2+1) that :func:`pack_spectrum` packed into ``packed``."""
    height = packed.shape[-2]
    columns = _hermitian_columns(width)
    out = torch.empty(
        *packed.shape[:-1],
        width // 2 + 1,
        dtype=torch.promote_types(packed.dtype, torch.complex64),
        device=packed.device,
    )
    pairs = torch.view_as_real(out)
    pairs[..., 1 : (width + 1) // 2, :] = packed[..., len(columns) :].unflatten(-1, (-1, 2))
    half = height // 2
    for j, kx in enumerate(columns):
        # Column j holds Re c[ky] for ky <= H//2 and Im c[ky] above; the rest mirrors by c[-ky] = conj(c[ky]).
        column, real, imag = packed[..., j], pairs[..., kx, 0], pairs[..., kx, 1]
        real[..., : half + 1] = column[..., : half + 1]
        real[..., half + 1 :] = column[..., 1 : height - half].flip(-1)
        imag[..., half + 1 :] = column[..., half + 1 :]
        imag[..., 1 : height - half] = -column[..., half + 1 :].flip(-1)
        imag[..., 0] = 0.0  # c[0] is real, and so is c[H/2] for even H
        if height % 2 == 0:
            imag[..., half] = 0.0
    return out


def parseval_weights(hw: tuple[int, int], packed: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Weights (R,) with sum_i a_i b_i = sum_r w_r A_r B_r for real H x W maps a, b and their rows
    A, B (:func:`cat.ops.fused.spectrum_rows`: (re, im) pairs, or
    with ``packed`` the layout of :func:`pack_spectrum`): Parseval's theorem on the half spectrum. Columns whose mirror
    -kx is not stored count twice, and 1/N undoes the unnormalised transform."""
    H, W = hw
    kx = torch.arange(W // 2 + 1, device=device)
    column = torch.where((kx == 0) | (2 * kx == W), 1.0, 2.0).to(dtype) / (H * W)
    if not packed:  # (H, W//2+1, 2): every (re, im) pair weighs its column's weight
        return column.view(1, -1, 1).expand(H, -1, 2).reshape(-1)
    # Packed Hermitian columns hold Re c[ky] (ky <= H/2) and Im c[ky] (ky > H/2); each stands for
    # itself and its mirror -ky, except ky = 0 and ky = H/2, their own mirrors.
    ky = torch.arange(H, device=device)
    hermitian = torch.where((ky == 0) | (2 * ky == H), 1.0, 2.0).to(dtype) / (H * W)
    special = len(_hermitian_columns(W))
    interior = column[1 : (W + 1) // 2].view(1, -1, 1).expand(H, -1, 2).reshape(H, -1)
    return torch.cat([hermitian.view(H, 1).expand(H, special), interior], dim=1).reshape(-1)
