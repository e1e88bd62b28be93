"""The circulant-attention kernels as the operators ``cat::circulant_kernel_forward`` and
``cat::circulant_kernel_backward``: launched with Triton on a GPU, or run by Triton's interpreter on a CPU (the same
code, checked against the ATen path there), registered with torch.library (a fake implementation and an autograd
formula), so torch.compile keeps each as one opaque node and CUDA graphs capture it.

The kernels' bodies are plain functions (:mod:`.forward`, :mod:`.backward`, :mod:`.tiles`), made into each variant
here: ``triton.jit`` functions for a GPU (and for compiling ahead of time, :func:`compiled_for`), or interpreted.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..policy import gemm_precision, tile_of
from . import backward as backward_module
from . import forward as forward_module
from . import tiles

__all__ = [
    "num_warps_for",
    "kernels",
    "circulant_kernel",
    "circulant_kernel_qkv",
    "compiled_for",
]

_HELPERS = (
    tiles.dft_matrices,
    tiles.forward_dft,
    tiles.inverse_dft,
    tiles.map_offsets,
    tiles.head_logits,
    tiles.tile_sum,
    tiles.tile_max,
    tiles.softmax_of,
)


def num_warps_for(bh: int, bw: int) -> int:
    """Warps per program: enough that the tiles a program holds (a dozen of BH x BW floats) fit its registers."""
    return {16 * 16: 4, 32 * 32: 8}.get(bh * bw, 16) if bh * bw <= 32 * 32 else 16


def _options(bh: int, bw: int) -> dict[str, int]:
    """Triton's launch options: the warps, and every register a thread may have (ptxas otherwise settles at 128
    for the forward's exact-float32 GEMMs, and spills)."""
    return {"num_warps": num_warps_for(bh, bw), "maxnreg": 255}


def _rebound(fn: Callable, namespace: dict[str, Any]) -> Callable:
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


@functools.cache
def kernels(interpreted: bool) -> dict[str, Any]:
    """The forward and backward kernels, ``triton.jit`` (``interpreted`` False) or run by Triton's interpreter."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    helpers = dict(vars(tiles))
    for helper in _HELPERS:
        rebound = _rebound(helper, helpers)
        helpers[helper.__name__] = rebound if interpreted else triton.jit(rebound)
    made = {}
    for module, name in ((forward_module, "circulant_forward_kernel"), (backward_module, "circulant_backward_kernel")):
        namespace = dict(vars(module))
        namespace.update({helper.__name__: helpers[helper.__name__] for helper in _HELPERS})
        body = _rebound(getattr(module, name), namespace)
        made[name] = InterpretedFunction(body) if interpreted else triton.jit(body)
    return made


def _launch(
    name: str, grid: int, hw: tuple[int, int], head_dim: int, device: torch.device, *args: Any, precision: str
) -> None:
    bh, bw = tile_of(hw[0]), tile_of(hw[1])
    kernel = kernels(device.type != "cuda")[name]
    options = _options(bh, bw) if device.type == "cuda" else {}
    kernel[(grid,)](*args, BH=bh, BW=bw, HEAD_DIM=head_dim, PRECISION=precision, **options)


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


@torch.library.custom_op("cat::circulant_kernel_forward", mutates_args=())
def kernel_forward(qkv: Tensor, H: int, W: int, head_dim: int, scale: float, precision: str) -> tuple[Tensor, Tensor]:
    """Circulant attention of the qkv projection's output (B, N, 3C: q, k, v in that order) on an H x W grid: the
    output (B, N, C) in its dtype and the log-sum-exp (B, heads) in float32."""
    B, N, C3 = qkv.shape
    C = C3 // 3
    heads = C // head_dim
    out = torch.empty(B, N, C, dtype=qkv.dtype, device=qkv.device)
    lse = torch.empty(B, heads, dtype=torch.float32, device=qkv.device)
    _launch(
        "circulant_forward_kernel", B * heads, (H, W), head_dim, qkv.device,
        qkv, out, lse, H, W, heads, C, scale, *_strides(qkv), *_strides(out),
        precision=precision,
    )  # fmt: skip
    return out, lse


@kernel_forward.register_fake
def _kernel_forward_shape(qkv, H, W, head_dim, scale, precision):
    B, N, C3 = qkv.shape
    return qkv.new_empty(B, N, C3 // 3), qkv.new_empty(B, C3 // 3 // head_dim, dtype=torch.float32)


@torch.library.custom_op("cat::circulant_kernel_backward", mutates_args=())
def kernel_backward(
    g: Tensor, qkv: Tensor, lse: Tensor, H: int, W: int, head_dim: int, scale: float, precision: str
) -> Tensor:
    """The gradient of the qkv projection's output (B, N, 3C) given the attention output's ``g``, recomputed from
    ``qkv`` and ``lse``."""
    B, N, C3 = qkv.shape
    heads = C3 // 3 // head_dim
    grad = torch.empty(B, N, C3, dtype=qkv.dtype, device=qkv.device)
    _launch(
        "circulant_backward_kernel", B * heads, (H, W), head_dim, qkv.device,
        g, qkv, lse, grad, H, W, heads, C3 // 3, scale, *_strides(g), *_strides(qkv), *_strides(grad),
        precision=precision,
    )  # fmt: skip
    return grad


@kernel_backward.register_fake
def _kernel_backward_shape(g, qkv, lse, H, W, head_dim, scale, precision):
    return qkv.new_empty(qkv.shape)


def _setup_context(ctx, inputs, output) -> None:
    qkv, H, W, head_dim, scale, precision = inputs
    ctx.save_for_backward(qkv, output[1])
    ctx.settings = (H, W, head_dim, scale, precision)


def _backward(ctx, g_out: Tensor, _g_lse: Tensor | None):
    qkv, lse = ctx.saved_tensors
    return kernel_backward(g_out, qkv, lse, *ctx.settings), None, None, None, None, None


kernel_forward.register_autograd(_backward, setup_context=_setup_context)


def circulant_kernel_qkv(qkv: Tensor, hw: tuple[int, int], head_dim: int = 1, scale: float | None = None) -> Tensor:
    """Circulant attention through the kernels (one each way) of the qkv projection's output (B, N, 3C), q, k and v
    its channels in that order, on the grid ``hw``, in its dtype: logits_d = scale sum_i <q_i, k_{i+d}> over each
    head's channels, w = softmax over the N offsets, out_i = sum_d w_d v_{i+d}; (B, N, C). ``scale`` None: the
    released 1 / sqrt(N head_dim)."""
    H, W = hw
    scale = (H * W * head_dim) ** -0.5 if scale is None else float(scale)
    return kernel_forward(qkv, H, W, head_dim, scale, gemm_precision(qkv.dtype, qkv.device))[0]


def circulant_kernel(
    q: Tensor, k: Tensor, v: Tensor, hw: tuple[int, int], head_dim: int = 1, scale: float | None = None
) -> Tensor:
    """:func:`circulant_kernel_qkv` of separate q, k, v (B, N, C), joined first (one copy)."""
    return circulant_kernel_qkv(torch.cat([q, k, v], dim=-1), hw, head_dim, scale)


def compiled_for(
    name: str, hw: tuple[int, int], dtype: torch.dtype, capability: int, precision: str = "tf32", head_dim: int = 1
) -> Any:
    """``name``'s kernel compiled ahead of time for a CUDA card of compute ``capability`` (80, 90), for inputs of
    ``dtype`` on the grid ``hw``, with no GPU present (Triton's compiler and the ptxas it ships)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    element = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    kernel = kernels(interpreted=False)[name]
    pointers = 3 if name == "circulant_forward_kernel" else 4
    signature: dict[str, str] = {}
    for position, argument in enumerate(kernel.arg_names):
        if argument in ("BH", "BW", "HEAD_DIM", "PRECISION"):
            signature[argument] = "constexpr"
        elif position < pointers:
            signature[argument] = "*fp32" if argument == "lse_ptr" else f"*{element}"
        elif argument == "scale":
            signature[argument] = "fp32"
        else:
            signature[argument] = "i32"
    bh, bw = tile_of(hw[0]), tile_of(hw[1])
    constants = {"BH": bh, "BW": bw, "HEAD_DIM": head_dim, "PRECISION": precision}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=_options(bh, bw))
