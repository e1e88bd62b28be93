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
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..policy import gemm_precision, tile_of
from . import backward as backward_module
from . import forward as forward_module
from . import tiles

__all__ = [
    "num_warps_for",
    "kernels",
    "circulant_kernel",
    "circulant_kernel_qkv",
    "projected_kernel",
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
    tiles.gate_of,
    tiles.silu,
    tiles.silu_derivative,
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
    name: str, grid: int, hw: tuple[int, int], head_dim: int, device: torch.device, *args: Any, precision: str,
    gated: bool, gate_bias: bool,
) -> None:  # fmt: skip
    bh, bw = tile_of(hw[0]), tile_of(hw[1])
    kernel = kernels(device.type != "cuda")[name]
    options = _options(bh, bw) if device.type == "cuda" else {}
    kernel[(grid,)](
        *args, BH=bh, BW=bw, HEAD_DIM=head_dim, PRECISION=precision, GATED=gated, GATE_BIAS=gate_bias, **options
    )


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _channels(qkv: Tensor, gated: bool, gate_bias: Tensor | None) -> int:
    """C, from the projection's output (B, N, 3C, or 4C with the gate), its layout checked."""
    parts = 4 if gated else 3
    if qkv.dim() != 3 or qkv.shape[-1] % parts:
        raise ValueError(f"the projection's output must be (B, N, {parts}C); got {tuple(qkv.shape)}")
    C = qkv.shape[-1] // parts
    if gate_bias is not None and (not gated or gate_bias.shape != (C,)):
        raise ValueError(f"a gate bias needs the gate and shape ({C},); got {tuple(gate_bias.shape)}, gated={gated}")
    return C


@torch.library.custom_op("cat::circulant_kernel_forward", mutates_args=())
def kernel_forward(
    qkv: Tensor, gate_bias: Tensor | None, gated: bool, H: int, W: int, head_dim: int, scale: float, precision: str
) -> tuple[Tensor, Tensor]:
    """Circulant attention of the projection's output (B, N, 3C: q, k, v in that order) on an H x W grid, or with
    ``gated`` (B, N, 4C), the gate's pre-activation a last, of the output times SiLU(a + ``gate_bias``) (the token
    post-reweighting): the output (B, N, C) in its dtype and the log-sum-exp (B, heads) in float32."""
    C = _channels(qkv, gated, gate_bias)
    B, N = qkv.shape[:2]
    heads = C // head_dim
    out = torch.empty(B, N, C, dtype=qkv.dtype, device=qkv.device)
    lse = torch.empty(B, heads, dtype=torch.float32, device=qkv.device)
    _launch(
        "circulant_forward_kernel", B * heads, (H, W), head_dim, qkv.device,
        qkv, qkv if gate_bias is None else gate_bias, out, lse, H, W, heads, C, scale, *_strides(qkv), *_strides(out),
        precision=precision, gated=gated, gate_bias=gate_bias is not None,
    )  # fmt: skip
    return out, lse


@kernel_forward.register_fake
def _kernel_forward_shape(qkv, gate_bias, gated, H, W, head_dim, scale, precision):
    C = _channels(qkv, gated, gate_bias)
    return qkv.new_empty(*qkv.shape[:2], C), qkv.new_empty(qkv.shape[0], C // head_dim, dtype=torch.float32)


@torch.library.custom_op("cat::circulant_kernel_backward", mutates_args=())
def kernel_backward(
    g: Tensor, qkv: Tensor, gate_bias: Tensor | None, gated: bool, lse: Tensor, H: int, W: int, head_dim: int,
    scale: float, precision: str,
) -> Tensor:  # fmt: skip
    """The gradient of the projection's output (B, N, 3C or 4C: q, k, v and the gate's pre-activation) given the
    output's ``g``, recomputed from ``qkv``, ``gate_bias`` and ``lse``."""
    C = _channels(qkv, gated, gate_bias)
    heads = C // head_dim
    grad = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _launch(
        "circulant_backward_kernel", qkv.shape[0] * heads, (H, W), head_dim, qkv.device,
        g, qkv, qkv if gate_bias is None else gate_bias, lse, grad, H, W, heads, C, scale,
        *_strides(g), *_strides(qkv), *_strides(grad),
        precision=precision, gated=gated, gate_bias=gate_bias is not None,
    )  # fmt: skip
    return grad


@kernel_backward.register_fake
def _kernel_backward_shape(g, qkv, gate_bias, gated, lse, H, W, head_dim, scale, precision):
    return qkv.new_empty(qkv.shape)


def _setup_context(ctx, inputs, output) -> None:
    qkv, gate_bias, gated, H, W, head_dim, scale, precision = inputs
    ctx.save_for_backward(qkv, gate_bias, output[1])
    ctx.settings = (H, W, head_dim, scale, precision)
    ctx.gated = gated
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient is never used: no tensor of zeros made for it


def _backward(ctx, g_out: Tensor | None, _g_lse: Tensor | None):
    qkv, gate_bias, lse = ctx.saved_tensors
    if g_out is None:
        return (None,) * 8
    grad = kernel_backward(g_out, qkv, gate_bias, ctx.gated, lse, *ctx.settings)
    grad_bias = None
    if gate_bias is not None and ctx.needs_input_grad[1]:
        C = gate_bias.shape[0]
        grad_bias = grad[..., 3 * C :].sum((0, 1), dtype=gate_bias.dtype)
    return grad, grad_bias, None, None, None, None, None, None


kernel_forward.register_autograd(_backward, setup_context=_setup_context)


def circulant_kernel_qkv(
    qkv: Tensor,
    hw: tuple[int, int],
    head_dim: int = 1,
    scale: float | None = None,
    gated: bool = False,
    gate_bias: Tensor | None = None,
) -> Tensor:
    """Circulant attention through the kernels (one each way) of the projection's output (B, N, 3C), q, k and v its
    channels in that order, on the grid ``hw``, in its dtype: logits_d = scale sum_i <q_i, k_{i+d}> over each
    head's channels, w = softmax over the N offsets, out_i = sum_d w_d v_{i+d}; (B, N, C). With ``gated`` the
    projection's output is (B, N, 4C), the gate's pre-activation a its last C channels, and the output is
    out * SiLU(a + ``gate_bias``). ``scale`` None: the released 1 / sqrt(N head_dim)."""
    return kernel_forward(qkv, gate_bias, gated, *_settings(hw, head_dim, scale, qkv))[0]


def _settings(hw: tuple[int, int], head_dim: int, scale: float | None, x: Tensor) -> tuple[int, int, int, float, str]:
    """The kernels' H, W, head dim, scale (None: the released 1 / sqrt(N head_dim)) and GEMM precision for ``x``."""
    H, W = hw
    scale = (H * W * head_dim) ** -0.5 if scale is None else float(scale)
    return H, W, head_dim, scale, gemm_precision(x.dtype, x.device)


class _ProjectedKernel(torch.autograd.Function):
    """The gated kernels of ``x``'s projection, keeping ``x`` and the weights instead of the projection's output: the
    backward computes the (B, N, 4C) projection again (one GEMM) as flash attention recomputes its logits, so a block
    keeps C floats a token for its attention instead of 4C."""

    @staticmethod
    def forward(ctx, x, weight, bias, gate_bias, settings):
        H, W, head_dim, scale, precision = settings
        out, lse = kernel_forward(F.linear(x, weight, bias), gate_bias, True, H, W, head_dim, scale, precision)
        ctx.save_for_backward(x, weight, bias, gate_bias, lse)
        ctx.settings = settings
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out):
        x, weight, bias, gate_bias, lse = ctx.saved_tensors
        qkvg = F.linear(x, weight, bias)
        grad = kernel_backward(g_out, qkvg, gate_bias, True, lse, *ctx.settings)
        rows = grad.flatten(0, 1)
        needs = ctx.needs_input_grad
        grad_x = grad @ weight if needs[0] else None
        grad_weight = rows.t() @ x.flatten(0, 1) if needs[1] else None
        grad_bias = rows.sum(0) if bias is not None and needs[2] else None
        grad_gate_bias = None
        if gate_bias is not None and needs[3]:
            grad_gate_bias = rows[:, 3 * gate_bias.shape[0] :].sum(0, dtype=gate_bias.dtype)
        return grad_x, grad_weight, grad_bias, grad_gate_bias, None


def projected_kernel(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gate_bias: Tensor | None,
    hw: tuple[int, int],
    head_dim: int = 1,
    scale: float | None = None,
) -> Tensor:
    """The gated :func:`circulant_kernel_qkv` of ``F.linear(x, weight, bias)`` (``weight`` (4C, C): q, k, v and the
    gate), the projection made again in the backward instead of kept. Under autocast ``x``, ``weight`` and ``bias``
    are cast as ``F.linear`` would cast them, before the function (the backward then makes the projection in the
    forward's dtype; autograd casts the gradients back)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    C = x.shape[-1]
    if x.dim() != 3 or weight.shape != (4 * C, C):
        raise ValueError(f"x (B, N, C) and weight (4C, C) needed; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if gate_bias is not None and gate_bias.shape != (C,):
        raise ValueError(f"the gate's bias must have shape ({C},); got {tuple(gate_bias.shape)}")
    return _ProjectedKernel.apply(x, weight, bias, gate_bias, _settings(hw, head_dim, scale, x))


def circulant_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hw: tuple[int, int],
    head_dim: int = 1,
    scale: float | None = None,
    gate: Tensor | None = None,
) -> Tensor:
    """:func:`circulant_kernel_qkv` of separate q, k, v (B, N, C), and the gate's pre-activation if given, joined
    first (one copy)."""
    parts = [q, k, v] if gate is None else [q, k, v, gate]
    return circulant_kernel_qkv(torch.cat(parts, dim=-1), hw, head_dim, scale, gated=gate is not None)


def compiled_for(
    name: str,
    hw: tuple[int, int],
    dtype: torch.dtype,
    capability: int,
    precision: str = "tf32",
    head_dim: int = 1,
    gated: bool = True,
) -> Any:
    """``name``'s kernel compiled ahead of time for a CUDA card of compute ``capability`` (80, 90), for inputs of
    ``dtype`` on the grid ``hw`` (with the gate and its bias in its epilogue, as the models run it, or neither), with
    no GPU present (Triton's compiler and
    the ptxas it ships)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    element = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    kernel = kernels(interpreted=False)[name]
    pointers = 4 if name == "circulant_forward_kernel" else 5
    signature: dict[str, str] = {}
    for position, argument in enumerate(kernel.arg_names):
        if argument in ("BH", "BW", "HEAD_DIM", "PRECISION", "GATED", "GATE_BIAS"):
            signature[argument] = "constexpr"
        elif position < pointers:
            signature[argument] = "*fp32" if argument in ("lse_ptr", "gate_bias_ptr") else f"*{element}"
        elif argument == "scale":
            signature[argument] = "fp32"
        else:
            signature[argument] = "i32"
    bh, bw = tile_of(hw[0]), tile_of(hw[1])
    constants = {
        "BH": bh, "BW": bw, "HEAD_DIM": head_dim, "PRECISION": precision, "GATED": gated, "GATE_BIAS": gated,
    }  # fmt: skip
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=_options(bh, bw))
