"""Circulant attention on spectra held as real (re, im) pairs: the complex products, the attention itself, and
the packing of a half spectrum into exactly as many reals as the map has.

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

import torch
from torch import Tensor

from .dft import DFTBackend, irfft2, is_unit, rfft2

__all__ = [
    "attend_spectra",
    "circulant_weights",
    "logit_factor",
    "weights_by_offset",
    "cmul",
    "conj_mul",
    "head_sum",
    "per_head",
    "pack_spectrum",
    "unpack_spectrum",
]


def _complex_kernels(*pairs: Tensor) -> bool:
    """Whether products of these pair tensors run as complex kernels: in eager mode, where one complex kernel is one
    launch instead of several real ones, for the dtypes complex tensors have. Traced for a compiler they stay real
    arithmetic, which it fuses (it generates no code for complex tensors)."""
    return not torch.compiler.is_compiling() and all(t.dtype in (torch.float32, torch.float64) for t in pairs)


def _as_complex(pairs: Tensor) -> Tensor:
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)


def cmul(a: Tensor, b: Tensor) -> Tensor:
    """a * b for complex numbers held as real (re, im) pairs (..., 2), broadcasting."""
    if _complex_kernels(a, b):
        return torch.view_as_real(_as_complex(a) * _as_complex(b))
    ar, ai = a.unbind(-1)
    br, bi = b.unbind(-1)
    return torch.stack((ar * br - ai * bi, ar * bi + ai * br), dim=-1)


def conj_mul(a: Tensor, b: Tensor) -> Tensor:
    """conj(a) * b for complex numbers held as real (re, im) pairs (..., 2), broadcasting. Traced for a compiler it
    is one fused kernel with no conjugate copy; eagerly, the complex kernel copies conj(a) first (one pass)."""
    if _complex_kernels(a, b):
        return torch.view_as_real(_as_complex(a).conj() * _as_complex(b))
    ar, ai = a.unbind(-1)
    br, bi = b.unbind(-1)
    return torch.stack((ar * br + ai * bi, ar * bi - ai * br), dim=-1)


def head_sum(channels: Tensor, head_dim: int) -> Tensor:
    """Maps or spectra (C, ...) summed over each head's ``head_dim`` channels: (C // head_dim, ...)."""
    if head_dim == 1:
        return channels
    return channels.reshape(channels.shape[0] // head_dim, head_dim, *channels.shape[1:]).sum(1)


def per_head(heads: Tensor, channels: Tensor, head_dim: int, conj: bool = False) -> Tensor:
    """Spectra (heads, ..., 2) times spectra (C, ..., 2), each head's applied to each of its channels (``conj``: the
    heads' conjugates)."""
    product = conj_mul if conj else cmul
    if head_dim == 1:
        return product(heads, channels)
    grouped = channels.reshape(channels.shape[0] // head_dim, head_dim, *channels.shape[1:])
    return product(heads.unsqueeze(1), grouped).reshape(channels.shape)


def logit_factor(hw: tuple[int, int], head_dim: int, scale: float | None) -> float:
    """What the logits are multiplied by beyond the orthonormal transforms: ``scale`` * sqrt(N); for ``scale`` None,
    the released 1 / sqrt(N * head_dim), 1 / sqrt(head_dim) (1 at head_dim 1, which the transforms then apply at no
    cost, with no arithmetic on N, which torch.export keeps symbolic)."""
    if scale is None:
        return head_dim**-0.5
    return scale * (hw[0] * hw[1]) ** 0.5


def circulant_weights(
    q_f: Tensor, k_f: Tensor, hw: tuple[int, int], head_dim: int, scale: float | None, backend: DFTBackend = "fft"
) -> Tensor:
    """Softmax weights (heads, B, H, W) of circulant attention from the orthonormal spectra (C, B, H, W//2+1, 2) of q
    and k (``rfft2(..., norm="ortho")``), by the offset taken backwards: omega[e] is the weight of the key at offset -e
    from each query (e on the torus).

    Backwards because then no conjugate is needed after the softmax: with l[e] = sum_i <q_i, k_{i-e}> (a correlation
    of k with q, spectrum conj(F k) F q), out_i = sum_e omega[e] v_{i-e} is a convolution, spectrum F(omega) F(v).
    :func:`weights_by_offset` turns them round. The orthonormal inverse makes the logits scale * l for the released
    scale 1/sqrt(N) (:func:`logit_factor`)."""
    logits = irfft2(head_sum(conj_mul(k_f, q_f), head_dim), hw, backend, logits=True, norm="ortho").flatten(-2)
    factor = logit_factor(hw, head_dim, scale)
    if not is_unit(factor):
        logits = logits * factor
    return logits.softmax(dim=-1).unflatten(-1, hw)


def weights_by_offset(omega: Tensor) -> Tensor:
    """:func:`circulant_weights`' omega (..., H, W) as w[d] = omega[-d]: the weight of the key at offset d."""
    return torch.roll(omega.flip(-2, -1), shifts=(1, 1), dims=(-2, -1))


def attend_spectra(
    q_f: Tensor,
    k_f: Tensor,
    v_f: Tensor,
    hw: tuple[int, int],
    head_dim: int,
    scale: float | None,
    backend: DFTBackend = "fft",
) -> tuple[Tensor, Tensor, Tensor]:
    """Circulant attention given the orthonormal rfft2 spectra (``norm="ortho"``) of q, k and v as real pairs, channels
    outermost, (C, B, H, W//2+1, 2): the real output (C, B, H, W), the weights omega (heads, B, H, W) by backward
    offset (:func:`circulant_weights`; :func:`weights_by_offset` gives them by offset) and their unnormalised spectrum.
    Channels form heads of ``head_dim`` channels; the transforms are ``backend``'s (:mod:`cat.ops.dft`), which also
    sets their dtypes. ``scale`` None is the released 1 / sqrt(N * head_dim)."""
    omega = circulant_weights(q_f, k_f, hw, head_dim, scale, backend)
    omega_f = rfft2(omega, backend)
    return irfft2(per_head(omega_f, v_f, head_dim), hw, backend, norm="ortho"), omega, omega_f


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
