"""The kernels' check on their first use in a process: before ``auto`` hands a card's training to them, they compute
a small circulant attention, forward and backward, beside the ATen path. An error (a Triton or driver that cannot
build them, a card they do not fit) or a result off by more than :data:`TOLERANCE` turns them off for the process
with one log line naming the card and the reason: an unmeasured kernel can cost speed, never a run."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..dft import rfft2
from ..policy import KernelPolicy, kernel_for
from ..spectral import attend_spectra

__all__ = ["TOLERANCE", "kernels_work", "compare_with_aten", "use_kernels"]

# Relative error (float32, exact GEMMs) past which the kernels are not used: a correct kernel is near 1e-6.
TOLERANCE = 1e-3
_verdicts: dict[str, bool] = {}


def _aten(q: Tensor, k: Tensor, v: Tensor, hw: tuple[int, int], head_dim: int) -> Tensor:
    """The ATen path on tokens (B, N, C): orthonormal spectra of q, k, v, then :func:`cat.ops.spectral.attend_spectra`
    (what :func:`cat.ops.circulant_attention` computes)."""
    maps = [t.permute(2, 0, 1).unflatten(-1, hw) for t in (q, k, v)]
    q_f, k_f, v_f = (rfft2(m, "fft", logits=m is not maps[2], norm="ortho") for m in maps)
    return attend_spectra(q_f, k_f, v_f, hw, head_dim, None, "fft")[0].flatten(-2).permute(1, 2, 0)


def compare_with_aten(device: torch.device) -> float:
    """The largest relative error of the kernels' output and input gradients against the ATen path's, on a small
    random input (two images, a 7 x 10 grid, four channels in heads of two, gated as the models gate) on ``device``."""
    from .launch import circulant_kernel

    generator = torch.Generator().manual_seed(0)
    q, k, v, gate = (torch.randn(2, 70, 4, generator=generator).to(device).requires_grad_() for _ in range(4))
    g = torch.randn(2, 70, 4, generator=generator).to(device)
    errors = []
    results = []
    for attend in (
        lambda a, b, c: circulant_kernel(a, b, c, (7, 10), 2, gate=gate),
        lambda a, b, c: _aten(a, b, c, (7, 10), 2) * torch.nn.functional.silu(gate),
    ):
        out = attend(q, k, v)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v, gate), g)))
    for mine, reference in zip(*results, strict=True):
        errors.append(((mine - reference).norm() / reference.norm().clamp(min=1e-30)).item())
    return max(errors)


# Run once per card, and as a constant by torch.compile (it runs kernels: nothing to trace).
@torch.compiler.assume_constant_result
def kernels_work(device: str) -> bool:
    """Whether the kernels passed their check on ``device`` (run on the first call, then remembered)."""
    if device not in _verdicts:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device
        tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = False  # the check holds exact float32 GEMMs to float32's error
            with unset_fake_temporarily(), torch.enable_grad():
                error = compare_with_aten(torch.device(device))
            reason = None if error <= TOLERANCE else f"relative error {error:.1e} against ATen (> {TOLERANCE:.0e})"
        except Exception as failure:  # noqa: BLE001  (whatever stops the kernels stops only them)
            reason = f"{type(failure).__name__}: {str(failure).strip().splitlines()[0][:200] if str(failure) else ''}"
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        _verdicts[device] = reason is None
        if reason is not None:
            logging.getLogger("cat").warning(
                "circulant attention's Triton kernels are off on %s (%s): the ATen path runs instead", card, reason
            )
    return _verdicts[device]


def use_kernels(kernel: KernelPolicy, device: torch.device, hw: tuple[int, int], training: bool, dtype) -> bool:
    """Whether circulant attention runs through the kernels: :func:`cat.ops.policy.kernel_for`'s rule, and for 'auto'
    their first-use check on the device (:func:`kernels_work`)."""
    if not kernel_for(kernel, device, hw, training, dtype):
        return False
    return kernel != "auto" or kernels_work(str(device))
