"""2-D real DFTs between real maps and their half spectra as real (re, im) pairs.

Every backend maps real maps (..., H, W) to their unnormalised half spectrum (..., H, W//2+1, 2), the layout of
``torch.view_as_real(torch.fft.rfft2(x))``, and back (the inverse of Hermitian spectra, 1 / (H W), like
``torch.fft.irfft2``). No complex tensor leaves this module: what circulant attention does between its transforms
is real arithmetic, which a compiler fuses (Inductor generates no code for complex tensors).

Backends:
  fft        ``torch.fft`` in float32 (float64 for float64 maps) with autocast off: cuFFT takes half precision
             only for power-of-two grids. O(N log N) per map.
  separable  two GEMMs per transform, one along H and one along W: 2N(H + W) multiply-adds per map, in autocast's
             dtype where autocast is on, so half precision reaches the tensor cores (accumulated in float32).
  matmul     one GEMM per transform with a dense N x 2H(W//2+1) matrix: N^2 per map; pays only for small grids,
             and exports to ONNX without DFT operators.

The matrix backends return their spectra in float32 (float64 for float64 maps) whatever the GEMM ran in: the
softmax logits need the range.

``norm`` scales a transform as ``torch.fft``'s does: ``"backward"`` (the forward unscaled, the inverse by 1/N),
``"ortho"`` (both by 1/sqrt(N)) or ``"forward"`` (the forward by 1/N, the inverse unscaled). The matrix backends fold
the factor into a cached matrix, so a scaled transform costs no operator more than an unscaled one.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from .precision import autocast_state, fft_dtype, no_autocast

__all__ = ["DFTBackend", "DFT_BACKENDS", "Norm", "check_dft_backend", "is_unit", "rfft2", "irfft2"]

DFTBackend = Literal["fft", "separable", "matmul"]
Norm = Literal["backward", "ortho", "forward"]
DFT_BACKENDS: tuple[DFTBackend, ...] = ("fft", "separable", "matmul")


def check_dft_backend(backend: object) -> DFTBackend:
    """``backend`` if it is one cat has."""
    if backend in DFT_BACKENDS:
        return backend
    raise ValueError(f"fft_backend must be one of {', '.join(map(repr, DFT_BACKENDS))}; got {backend!r}")


def _turns(n: int, m: int, period: int, device: torch.device | None = None) -> Tensor:
    """(n, m) phases 2 pi (i j mod period) / period in float64, reduced before scaling so they are exact."""
    i = torch.arange(n, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(m, dtype=torch.float64, device=device)[None, :]
    return 2 * math.pi * torch.remainder(i * j, period) / period


def half_spectrum_weights(width: int, device: torch.device | None = None) -> Tensor:
    """(width//2+1,) float64: how often each stored column kx of a half spectrum counts in the full one: twice,
    except kx = 0 and (even W) kx = W/2, which have no mirror image."""
    weight = torch.full((width // 2 + 1,), 2.0, dtype=torch.float64, device=device)
    weight[0] = 1.0
    if width % 2 == 0:
        weight[-1] = 1.0
    return weight


def _interleave(re: Tensor, im: Tensor, dim: int) -> Tensor:
    """``re`` and ``im`` alternating along ``dim`` (0 or 1): re_0, im_0, re_1, im_1, ..."""
    return torch.stack((re, im), dim=dim + 1).flatten(dim, dim + 1)


def _build(
    kind: str, hw: tuple[int, int], orthonormal: bool, factor: float, device: torch.device | None = None
) -> Tensor:
    """The float64 matrix ``kind`` of the grid ``hw`` (the layouts are those :func:`rfft2` and :func:`irfft2` use),
    times ``factor``; ``orthonormal``: scaled by 1/sqrt(n) for a forward transform along an axis of n, sqrt(n) for an
    inverse one."""
    matrix = _unscaled(kind, hw, device) * factor
    if orthonormal:
        n = {"rows": hw[0], "inverse_rows": hw[0], "columns": hw[1], "inverse_columns": hw[1]}.get(kind, hw[0] * hw[1])
        matrix = matrix * (n**0.5 if kind.startswith("inverse") else n**-0.5)
    return matrix


def _unscaled(kind: str, hw: tuple[int, int], device: torch.device | None) -> Tensor:
    H, W = hw
    Wf = W // 2 + 1
    if kind == "rows":  # (2H, H) @ (H, W): row 2k = cos, 2k+1 = -sin of 2 pi k n / H: the full DFT along H
        phase = _turns(H, H, H, device)
        return _interleave(torch.cos(phase), -torch.sin(phase), 0)
    if kind == "columns":  # (H, 2W) @ (2W, 2 Wf): [P_re | P_im] to (re, im) pairs of the half DFT along W
        phase = _turns(W, Wf, W, device)
        cos, sin = torch.cos(phase), torch.sin(phase)
        return torch.cat([_interleave(cos, -sin, 1), _interleave(sin, cos, 1)], dim=0)
    if kind == "inverse_columns":  # (H, 2 Wf) @ (2 Wf, 2W): (re, im) pairs to [T1 | T2], weighted by column
        phase = _turns(Wf, W, W, device)
        weight = half_spectrum_weights(W, device)[:, None] / W
        cos, sin = weight * torch.cos(phase), weight * torch.sin(phase)
        return torch.cat([_interleave(cos, -sin, 0), _interleave(sin, cos, 0)], dim=1)
    if kind == "inverse_rows":  # (H, 2H) @ (2H, W): cos T1 - sin T2 over ky, 1 / H
        phase = _turns(H, H, H, device)
        return _interleave(torch.cos(phase), -torch.sin(phase), 1) / H
    if kind == "dense":  # (N, 2 H Wf): x_flat @ it = the flattened pairs of rfft2(x)
        rows, columns = _turns(H, H, H, device), _turns(W, Wf, W, device)
        phase = (rows.reshape(H, 1, H, 1) + columns.reshape(1, W, 1, Wf)).reshape(H * W, H * Wf)
        return _interleave(torch.cos(phase), -torch.sin(phase), 1)
    if kind == "inverse_dense":  # (2 H Wf, N): pairs_flat @ it = irfft2 of a Hermitian spectrum
        rows, columns = _turns(H, H, H, device), _turns(Wf, W, W, device)
        phase = (rows.reshape(H, 1, H, 1) + columns.reshape(1, Wf, 1, W)).reshape(H * Wf, H * W)
        weight = half_spectrum_weights(W, device).repeat(H)[:, None] / (H * W)
        return _interleave(weight * torch.cos(phase), -weight * torch.sin(phase), 0)
    raise AssertionError(kind)


# Made once per key (the most recent 128 kept), outside inference mode: a tensor made under torch.inference_mode()
# could not be used later by a forward that autograd records.
_constants: OrderedDict[tuple, Tensor] = OrderedDict()
_KEPT = 128


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def constant(build: Callable[..., Tensor], key: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``build(*key, device=device)`` (a float64 tensor made on ``device``) in ``dtype``, made once per key. While
    torch.export or torch.compile traces, it is made in the graph (a cached one would be that trace's fake tensor, and
    every later eager call would get it), on the device it meets, so a graph traced for a GPU holds no host tensor and
    no copy to the device (each copy would make the host wait for the GPU). Under a fake-tensor mode (a forward that
    only reads sizes) a cached one is used; a new one is made real on the host, and made in the mode, not kept, on
    another device."""
    if torch.compiler.is_compiling():
        return build(*key, device=device).to(dtype)
    entry = (build, key, dtype, device)
    made = _constants.get(entry)
    if made is not None:
        _constants.move_to_end(entry)
        return made
    if _fake_mode_active() and device.type != "cpu":
        return build(*key, device=device).to(dtype)  # a device this process may not have: made in the mode, not kept
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # On the host a real one is made even under a fake mode (and kept), as the first real call would have made it.
    with unset_fake_temporarily(), torch.inference_mode(False):
        made = build(*key, device=device).to(dtype)
    _constants[entry] = made
    if len(_constants) > _KEPT:
        _constants.popitem(last=False)
    return made


def _matrix(kind: str, hw: tuple[int, int], dtype: torch.dtype, device: torch.device, factor: float = 1.0) -> Tensor:
    return constant(_build, (kind, hw, _orthonormal(dtype), factor), dtype, device)


def is_unit(factor: float) -> bool:
    """Whether a factor is 1 but for rounding (sqrt(n) / sqrt(n) need not be exactly 1.0): no product is needed. A
    symbolic factor (torch.export's sizes) is taken as not 1: comparing it would guard the program on the size."""
    return isinstance(factor, (int, float)) and math.isclose(factor, 1.0, rel_tol=1e-12)


def _norm_factor(norm: Norm, n: int, inverse: bool) -> float:
    """What ``norm`` multiplies a transform of ``n`` points by, beside the unnormalised forward and the 1/n inverse
    (the matrices' own scales)."""
    if norm == "backward":
        return 1.0
    if norm == "ortho":
        return n**0.5 if inverse else n**-0.5
    if norm == "forward":
        return float(n) if inverse else 1.0 / n
    raise ValueError(f"norm must be 'backward', 'ortho' or 'forward'; got {norm!r}")


def _orthonormal(dtype: torch.dtype) -> bool:
    """Whether GEMMs in ``dtype`` transform orthonormally (values grow by sqrt(N), not N): float16, whose range ends
    at 65504, which an unnormalised spectrum of a 96 x 96 map of values near 5 would pass."""
    return dtype == torch.float16


def _gemm_dtype(x: Tensor, logits: bool) -> torch.dtype:
    """The dtype a matrix backend's GEMMs run in: autocast's where autocast is on, except for the transforms that
    make the softmax logits (``logits``), which stay in float32 (float64); else the spectra's."""
    work = fft_dtype(x.dtype)
    enabled, dtype = autocast_state(x.device)
    return dtype if work == torch.float32 and enabled and dtype is not None and not logits else work


def rfft2(x: Tensor, backend: DFTBackend = "fft", logits: bool = False, norm: Norm = "backward") -> Tensor:
    """The half spectrum of real maps x (..., H, W) as real pairs (..., H, W//2+1, 2), scaled as ``norm`` says, in
    float32 (float64 for float64 maps). ``logits``: the spectrum goes into softmax logits, which half precision would
    blur (bf16 keeps 8 bits): its GEMMs, if any, run in float32 under autocast too."""
    H, W = x.shape[-2:]
    work = fft_dtype(x.dtype)
    if backend == "fft":  # autocast leaves torch.fft's operators alone (CUDA's runs them in float32)
        return torch.view_as_real(torch.fft.rfft2(x.to(work), norm=norm))
    dtype = _gemm_dtype(x, logits)
    factor = _norm_factor(norm, H * W, inverse=False)
    with no_autocast(x.device):  # the dtypes are set here
        # float16's orthonormal matrices leave the rest of the factor to a float32 product; others carry all of it.
        orthonormal = _orthonormal(dtype)
        rest, carried = (factor * (H * W) ** 0.5, 1.0) if orthonormal else (1.0, factor)
        xs = x.to(dtype)
        if backend == "matmul":
            pairs = xs.flatten(-2) @ _matrix("dense", (H, W), dtype, x.device, carried)
        else:  # along H (full: the map is real), then along W (half), each a GEMM over the other's output as it lies
            full = torch.matmul(_matrix("rows", (H, W), dtype, x.device), xs)  # (..., 2H, W): rows (k, re | im)
            pairs = full.reshape(*x.shape[:-2], H, 2 * W) @ _matrix("columns", (H, W), dtype, x.device, carried)
        pairs = pairs.to(work) if is_unit(rest) else pairs.to(work) * rest
        return pairs.unflatten(-1, (-1, 2)).reshape(*x.shape[:-2], H, W // 2 + 1, 2)


def irfft2(
    spectrum: Tensor, hw: tuple[int, int], backend: DFTBackend = "fft", logits: bool = False, norm: Norm = "backward"
) -> Tensor:
    """The real maps (..., H, W) whose half spectrum is the Hermitian ``spectrum`` (..., H, W//2+1, 2) of pairs,
    scaled as ``norm`` says (``logits``: as :func:`rfft2`'s)."""
    H, W = hw
    device = spectrum.device
    work = fft_dtype(spectrum.dtype)
    if backend == "fft":  # autocast leaves torch.fft's operators alone (CUDA's runs them in float32)
        return torch.fft.irfft2(torch.view_as_complex(spectrum.to(work).contiguous()), s=hw, norm=norm)
    dtype = _gemm_dtype(spectrum, logits)
    factor = _norm_factor(norm, H * W, inverse=True)
    with no_autocast(device):  # the dtypes are set here
        # float16's orthonormal matrices take a spectrum scaled down first (in float32); others carry the factor.
        orthonormal = _orthonormal(dtype)
        rest, carried = (factor * (H * W) ** -0.5, 1.0) if orthonormal else (1.0, factor)
        if not is_unit(rest):
            spectrum = spectrum * rest
        pairs = spectrum.to(dtype).flatten(-3)  # (..., 2 H Wf)
        if backend == "matmul":
            return (pairs @ _matrix("inverse_dense", hw, dtype, device, carried)).to(work).unflatten(-1, (H, W))
        # Along W first, into the two real maps T1, T2 per frequency row, then along H: cos T1 - sin T2.
        halves = pairs.unflatten(-1, (H, -1)) @ _matrix("inverse_columns", hw, dtype, device)  # (..., H, 2W)
        rows = _matrix("inverse_rows", hw, dtype, device, carried)
        return torch.matmul(rows, halves.reshape(*halves.shape[:-2], 2 * H, W)).to(work)
