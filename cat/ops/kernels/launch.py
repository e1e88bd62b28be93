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

from . import backward as backward_module
from . import forward as forward_module
from . import tiles

__all__ = [
    "MIN_TILE",
    "MAX_TILE",
    "tile_of",
    "covers",
    "num_warps_for",
    "kernels",
    "circulant_kernel",
    "compiled_for",
    "gemm_precision",
]

# The smallest tile tl.dot takes, and the largest side the kernels hold on chip (cat.ops.policy routes larger grids
# to the ATen path).
MIN_TILE = 16
MAX_TILE = 64
_HELPERS = (
    tiles.dft_matrices,
    tiles.forward_dft,
    tiles.inverse_dft,
    tiles.map_offsets,
    tiles.tile_sum,
    tiles.tile_max,
    tiles.softmax_of,
)


def tile_of(side: int) -> int:
    """The tile side that holds a grid side: a power of two, at least :data:`MIN_TILE`."""
    return max(MIN_TILE, 1 << max(side - 1, 0).bit_length())


def covers(hw: tuple[int, int]) -> bool:
    """Whether the kernels hold an H x W grid on chip."""
    return max(tile_of(hw[0]), tile_of(hw[1])) <= MAX_TILE


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


def gemm_precision(dtype: torch.dtype, device: torch.device) -> str:
    """The GEMMs' precision: TF32 tensor cores for half-precision inputs (more mantissa than they have) and for
    float32 where the run allows TF32 (``amp.tf32``); exact float32 otherwise."""
    if dtype in (torch.float16, torch.bfloat16):
        return "tf32"
    allowed = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if allowed else "ieee"


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
def kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, H: int, W: int, head_dim: int, scale: float, precision: str
) -> tuple[Tensor, Tensor]:
    """Circulant attention of q, k, v (B, N, C) on an H x W grid: the output (B, N, C) in their dtype and the
    log-sum-exp (B, heads) in float32."""
    B, _, C = q.shape
    heads = C // head_dim
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, heads, dtype=torch.float32, device=q.device)
    _launch(
        "circulant_forward_kernel", B * heads, (H, W), head_dim, q.device,
        q, k, v, out, lse, H, W, heads, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        precision=precision,
    )  # fmt: skip
    return out, lse


@kernel_forward.register_fake
def _kernel_forward_shape(q, k, v, H, W, head_dim, scale, precision):
    return q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[2] // head_dim, dtype=torch.float32)


@torch.library.custom_op("cat::circulant_kernel_backward", mutates_args=())
def kernel_backward(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, H: int, W: int, head_dim: int, scale: float,
    precision: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of q, k and v (B, N, C) given the output's ``g``, recomputed from q, k, v and ``lse``."""
    B, _, C = q.shape
    heads = C // head_dim
    grads = [torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3)]
    _launch(
        "circulant_backward_kernel", B * heads, (H, W), head_dim, q.device,
        g, q, k, v, lse, *grads, H, W, heads, scale,
        *_strides(g), *_strides(q), *_strides(k), *_strides(v), *_strides(grads[0]),
        precision=precision,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


@kernel_backward.register_fake
def _kernel_backward_shape(g, q, k, v, lse, H, W, head_dim, scale, precision):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, H, W, head_dim, scale, precision = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.settings = (H, W, head_dim, scale, precision)


def _backward(ctx, g_out: Tensor, _g_lse: Tensor | None):
    q, k, v, lse = ctx.saved_tensors
    g_q, g_k, g_v = kernel_backward(g_out.contiguous(), q, k, v, lse, *ctx.settings)
    return g_q, g_k, g_v, None, None, None, None, None


kernel_forward.register_autograd(_backward, setup_context=_setup_context)


def circulant_kernel(
    q: Tensor, k: Tensor, v: Tensor, hw: tuple[int, int], head_dim: int = 1, scale: float | None = None
) -> Tensor:
    """Circulant attention of tokens q, k, v (B, N, C) on the grid ``hw`` through the kernels (one each way), in the
    inputs' (common) dtype: logits_d = scale sum_i <q_i, k_{i+d}> over each head's channels, w = softmax over the
    N offsets, out_i = sum_d w_d v_{i+d}. ``scale`` None: the released 1 / sqrt(N head_dim)."""
    H, W = hw
    scale = (H * W * head_dim) ** -0.5 if scale is None else float(scale)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return kernel_forward(q, k, v, H, W, head_dim, scale, gemm_precision(dtype, q.device))[0]


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
    pointers = 5 if name == "circulant_forward_kernel" else 8
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
